"""What goes on air, measured: the real server (output.loudness_lufs -18, output.true_peak_dbtp -1.5,
not the defaults, to show they are what holds) speaks a line in its espeak voice on a channel, and
the frames the channel's listener (the OBS overlay) receives are at -18 LUFS within 1 LU (ITU-R
BS.1770, pyloudnorm) with their true peak under -1.5 dBTP. As synthesized, the same line is at
-21.3 LUFS: without the output stage this fails."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pyloudnorm
import pytest
import soxr
import websockets

from tests.conftest import VoiceClient, make_settings, running_server
from voicebot.audio.rates import SPEAK_RATE

TARGET_LUFS, CEILING_DBTP = -18.0, -1.5
LINE = "Welcome back to the show. Tonight we talk about the weather, the games, and what time the show starts tomorrow."


@pytest.fixture(scope="module")
def server():
    with running_server(make_settings(output={"loudness_lufs": TARGET_LUFS, "true_peak_dbtp": CEILING_DBTP})) as s:
        yield s


async def on_air(ws_url: str, line: str) -> np.ndarray:
    """The reply audio a channel listener receives for `line`, said by the channel's speaker."""
    async with VoiceClient.connect(ws_url, channel="show") as speaker:
        async with websockets.connect(f"{ws_url}?role=listener&channel=show", max_size=None) as listener:
            assert json.loads(await listener.recv())["type"] == "listener.ready"
            await speaker.send({"type": "say", "text": line})
            frames = []
            while True:
                message = await asyncio.wait_for(listener.recv(), 30)
                if isinstance(message, bytes):
                    frames.append(message)
                elif json.loads(message)["type"] == "audio.end":
                    break
    return np.frombuffer(b"".join(frames), np.int16).astype(np.float64) / 32768


def test_a_reply_on_air_is_at_the_configured_loudness_under_the_true_peak_ceiling(server):
    audio = asyncio.run(on_air(server.ws_url, LINE))
    assert len(audio) > 3 * SPEAK_RATE
    loudness = pyloudnorm.Meter(SPEAK_RATE).integrated_loudness(audio)
    true_peak = 20 * np.log10(np.abs(soxr.resample(audio, SPEAK_RATE, 4 * SPEAK_RATE, "VHQ")).max())
    assert abs(loudness - TARGET_LUFS) <= 1.0, f"{loudness:.2f} LUFS"
    assert true_peak <= CEILING_DBTP + 0.1, f"{true_peak:.2f} dBTP"  # +0.1: soxr's interpolation is not the limiter's
