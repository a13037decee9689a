"""The OBS overlay follows a channel: driven by the reference client, and by the OBS plugin's wire format."""

from __future__ import annotations

import asyncio
import json
import time

import numpy as np
import pytest
import websockets

from tests.audio import to_pcm16
from tests.browser.conftest import BARGE_IN, FIRST
from tests.browser.support import obs_audio_message, speech
from voicebot.client import converse, wav_chunks

pytestmark = pytest.mark.browser

OBS_BLOCK = 1024  # frames per message, as OBS's audio callback delivers them


def open_overlay(page, live_server, channel: str) -> None:
    page.goto(f"{live_server.http_url}/static/obs.html?channel={channel}&hold=30")
    page.wait_for_function("window.voicebotOverlay.connected", timeout=10_000)


def wait_for_captions(page, text: str) -> None:
    """Both captions: the viewer's words and the character's reply (the echo responder repeats them)."""
    page.wait_for_function(
        f"window.voicebotOverlay.userCaptions.includes({text!r}) && window.voicebotOverlay.botCaptions.includes({text!r})",
        timeout=20_000,
    )


def test_overlay_follows_the_reference_client_across_reconnects(page, live_server, run_async, tmp_path):
    open_overlay(page, live_server, "show")
    url = live_server.ws_url
    # Two connections one after the other: a speaking client that reconnected.
    for phrase in (FIRST, BARGE_IN):
        pcm = to_pcm16(speech(0.3, phrase, 1.0))
        result = run_async(converse(url, wav_chunks(pcm, 16000), 16000, channel="show", linger_s=1.0)).result(timeout=30)
        assert [e["text"] for e in result.events if e["type"] == "asr.final"] == [phrase]
        wait_for_captions(page, phrase)
    overlay = page.evaluate("window.voicebotOverlay")
    assert overlay["speakerChanges"] >= 3  # joined, left, joined (and left, if already seen)
    assert page.evaluate("window.voicebotOverlay.stats().framesPlayed") > 0
    assert page.evaluate("getComputedStyle(document.body).backgroundColor") == "rgba(0, 0, 0, 0)"
    page.screenshot(path=tmp_path / "overlay.png")


def test_obs_plugin_messages_drive_a_channel(page, live_server, run_async):
    open_overlay(page, live_server, "studio")
    bad_before = live_server.metric("voicebot_obs_bad_chunks_total", 'reason="truncated_header"')
    mono = speech(0.3, FIRST, 3.5, rate=48000)
    stereo = np.stack([mono, 0.8 * mono], axis=1)
    run_async(emulate_obs_plugin(live_server.ws_url.replace("/v1/voice", "/obs/audio?channel=studio"), stereo)).result(timeout=30)
    wait_for_captions(page, FIRST)
    assert live_server.metric("voicebot_obs_bad_chunks_total", 'reason="truncated_header"') == bad_before + 1


async def emulate_obs_plugin(url: str, stereo: np.ndarray) -> None:
    """What obs-audio-to-websocket sends: start, 48 kHz stereo messages in real time, stop."""
    async with websockets.connect(url) as ws:
        await ws.send(json.dumps({"type": "start", "timestamp": time.time_ns() // 1000}))
        await ws.send(b"\x00" * 10)  # a truncated header: counted and skipped, the session goes on
        start = time.monotonic()
        for i, offset in enumerate(range(0, len(stereo), OBS_BLOCK)):
            await asyncio.sleep(max(0.0, start + i * OBS_BLOCK / 48000 - time.monotonic()))
            await ws.send(obs_audio_message(stereo[offset : offset + OBS_BLOCK], timestamp_ns=offset * 10**9 // 48000))
        await ws.send(json.dumps({"type": "stop", "timestamp": time.time_ns() // 1000}))


@pytest.mark.parametrize("labels", ["", "&userlabel=Viewer&botlabel=Mo"])
def test_captions_sit_centred_on_the_page(page, live_server, labels):
    # Without labels (the default) an empty label must not keep its margin: the text would sit
    # off-centre by half of it. With labels, the label and text together are centred.
    page.goto(f"{live_server.http_url}/static/obs.html?channel=centred{labels}")
    page.wait_for_function("window.voicebotOverlay.connected", timeout=10_000)
    offsets = page.evaluate("""() => ['user', 'bot'].map(id => {
        const caption = document.getElementById(id);
        caption.querySelector('.text').textContent = 'hello there';
        caption.classList.add('shown');
        const box = caption.getBoundingClientRect();
        const content = [...caption.children].filter(c => c.textContent).map(c => c.getBoundingClientRect());
        const left = Math.min(...content.map(r => r.left)), right = Math.max(...content.map(r => r.right));
        return {page: (box.left + box.right) / 2 - window.innerWidth / 2,
                inside: (left - box.left) - (box.right - right)};
    })""")
    for offset in offsets:
        assert abs(offset["page"]) < 1 and abs(offset["inside"]) < 1, offsets
