"""The operator console in headless Chromium, against a real server with a token and a session that speaks.

The session is the test's own client (espeak speech through the real recognizer, the echo responder
repeating it); the console sees its turn as it happens, and each control acts on it through the
session's typed door. A page without the token, or with a wrong one, sees nothing and commands nothing.
"""

from __future__ import annotations

import asyncio
import json
import queue
import threading
import time

import httpx
import pytest
import websockets

from tests.browser.conftest import FIRST
from tests.conftest import TEST_PHRASES
from tests.browser.support import speech
from tests.audio import to_pcm16
from tests.conftest import VoiceClient, make_settings, running_server

pytestmark = pytest.mark.browser

TOKEN = "console-show-token"
CHANNEL = "stage"
SECOND = TEST_PHRASES[2]
# The user's second turn starts once the reply to the first has played (turn end under 0.9 s, a
# 2.5 s reply): heard while it plays, it would cut it (barge-in).
PAUSE_S = 5.0
LINE = "good evening and welcome to the show"
# Said and then dropped: long enough to be still playing when the test clicks (about 9 s of speech).
LONG_LINE = " ".join(["this is a very long announcement that goes on and on"] * 5)


@pytest.fixture(scope="module")
def live_server():
    """This module's server (the conftest's browser fixture starts Chromium after it): with a token,
    set after running_server's warm-up, which connects without one; the app reads it on every request."""
    # A second persona to switch to: the OpenAI-compatible responder is offered once it has a URL and
    # a model (nothing listens there: no reply in this test asks it).
    with running_server(make_settings(reply={"openai": {"base_url": "http://127.0.0.1:9/v1", "model": "show-persona"}})) as server:
        server.settings.server.token = TOKEN
        yield server


@pytest.fixture
def stop():
    """Set as the test ends, passed or failed: what ends its clients, which run_async's teardown
    waits for (so a failing test is reported, not left waiting on them)."""
    event = threading.Event()
    yield event
    event.set()


def open_console(page, live_server, token: str | None = TOKEN) -> None:
    page.goto(f"{live_server.http_url}/static/console.html" + (f"?token={token}" if token else ""))


async def speaking_session(url: str, clients: queue.Queue, stop: threading.Event, *phrases: str) -> None:
    """A session on CHANNEL whose user says `phrases` (a turn each), then stays until the server
    closes it (the console's End) or `stop` is set."""
    async with VoiceClient.connect(f"{url}?token={TOKEN}", channel=CHANNEL) as client:
        clients.put(client)
        await client.stream(to_pcm16(speech(0.3, *[part for phrase in phrases for part in (phrase, PAUSE_S)])))
        while client.ws.close_code is None and not stop.is_set():
            await asyncio.sleep(0.05)


async def listen(url: str, frames: list, events: list, stop: threading.Event) -> None:
    """A listener on CHANNEL (the overlay's place): what reaches the air, until `stop` is set."""
    async with websockets.connect(f"{url}?role=listener&channel={CHANNEL}&token={TOKEN}") as ws:
        while not stop.is_set():
            try:
                message = await asyncio.wait_for(ws.recv(), 0.1)
            except TimeoutError:
                continue
            (frames if isinstance(message, bytes) else events).append(message if isinstance(message, bytes) else json.loads(message))


def event(client: VoiceClient, kind: str, timeout_s: float = 30, **fields) -> dict:
    """The first event of this type (and fields) the client got, waiting for it (it reads on its own loop)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for e in list(client.events):
            if e["type"] == kind and all(e.get(k) == v for k, v in fields.items()):
                return e
        time.sleep(0.05)
    raise AssertionError(f"no {kind} {fields} in {timeout_s} s; got {[e['type'] for e in client.events]}")


def wait_for(page, condition: str, timeout_ms: int = 20_000) -> None:
    page.wait_for_function(f"(() => {{ const c = window.voicebotConsole; return {condition}; }})()", timeout=timeout_ms)


def card(page, session_id: str):
    return page.locator(f"article[data-session='{session_id}']")


def test_the_console_follows_a_session_and_each_control_acts_on_it(page, browser, live_server, run_async, tmp_path, stop):
    feed: list[str] = []  # what the page's feed WebSocket receives, as it arrives

    def on_websocket(ws) -> None:
        if ws.url.split("?")[0].endswith("/v1/console"):
            ws.on("framereceived", lambda payload: feed.append(payload))

    page.on("websocket", on_websocket)
    open_console(page, live_server)
    wait_for(page, "c.connected")
    clients: queue.Queue = queue.Queue()
    session_done = run_async(speaking_session(live_server.ws_url, clients, stop, FIRST, SECOND))
    client: VoiceClient = clients.get(timeout=20)
    sid = client.events[0]["session_id"]
    turns = f"(c.sessions[{sid!r}]?.turns ?? [])"

    # The user's turns, the replies and their latency, as they happen; the channel it speaks on.
    wait_for(page, f"c.sessions[{sid!r}]?.userSpeaking === true")
    wait_for(page, f"{turns}.some(t => t.user === {FIRST!r} && t.reply === {FIRST!r} && t.latencyMs > 0)")
    wait_for(page, f"c.sessions[{sid!r}].botSpeaking === false && c.latencies.length === 1")
    wait_for(page, f"{turns}.some(t => t.user === {SECOND!r} && t.reply === {SECOND!r} && t.latencyMs > 0)")
    wait_for(page, f"c.sessions[{sid!r}].channel === {CHANNEL!r} && c.latencies.length === 2")
    assert card(page, sid).locator(".reply-text").nth(1).inner_text() == SECOND
    event(client, "audio.end", reply_id=event(client, "reply.done", text=SECOND)["reply_id"])
    assert page.locator("#channels tr[data-channel='stage']").inner_text().startswith("#stage")

    # Say a line in the show's voice: the session speaks it (its client hears it), the console shows it.
    card(page, sid).locator("input[name=line]").fill(LINE)
    card(page, sid).locator("button[name=say]").click()
    said = event(client, "reply.done", text=LINE)
    event(client, "audio.end", reply_id=said["reply_id"])
    assert client.reply_frames(said["reply_id"])
    wait_for(page, f"{turns}.some(t => t.user === null && t.reply === {LINE!r})")

    # Mute the bot on its channel: the listeners get the reply's events but none of its audio.
    frames, events = [], []
    listener = run_async(listen(live_server.ws_url, frames, events, stop))
    page.locator("#channels tr[data-channel='stage'] button").click()
    wait_for(page, "c.channels.stage?.muted === true")
    muted_before = live_server.metric("voicebot_channel_muted_frames_total")
    card(page, sid).locator("input[name=line]").fill("quiet please")
    card(page, sid).locator("button[name=say]").click()
    quiet = event(client, "audio.end", reply_id=event(client, "reply.done", text="quiet please")["reply_id"])
    time.sleep(0.5)
    assert any(e.get("type") == "audio.end" and e.get("reply_id") == quiet["reply_id"] for e in events)
    assert frames == [] and client.reply_frames(quiet["reply_id"])
    assert live_server.metric("voicebot_channel_muted_frames_total") >= muted_before + len(client.reply_frames(quiet["reply_id"]))
    page.locator("#channels tr[data-channel='stage'] button").click()  # unmute
    wait_for(page, "c.channels.stage?.muted === false")

    # Drop the reply now playing: a long line, cut once it plays.
    card(page, sid).locator("input[name=line]").fill(LONG_LINE)
    card(page, sid).locator("button[name=say]").click()
    long_reply = event(client, "reply.done", text=LONG_LINE)["reply_id"]
    event(client, "audio.start", reply_id=long_reply)
    wait_for(page, f"c.sessions[{sid!r}].botSpeaking")
    card(page, sid).locator("button[name=interrupt]").click()
    cut = event(client, "audio.interrupted", reply_id=long_reply, timeout_s=10)
    assert cut["reason"] == "client"
    assert frames, "unmuted, the listener hears the bot again"
    wait_for(page, f"{turns}.some(t => t.interrupted === 'client') && !c.sessions[{sid!r}].botSpeaking")

    # Switch the voice, and the persona.
    card(page, sid).locator("select[name=voice]").select_option("zh")
    assert event(client, "session.updated")["voice"] == "zh"
    wait_for(page, f"c.sessions[{sid!r}].voice === 'zh'")
    card(page, sid).locator("select[name=responder]").select_option("openai")
    assert event(client, "session.updated", responder="openai")["voice"] == "zh"
    wait_for(page, f"c.sessions[{sid!r}].responder === 'openai'")
    card(page, sid).locator("select[name=responder]").select_option("echo")
    wait_for(page, f"c.sessions[{sid!r}].responder === 'echo'")  # from the session's third session.updated
    assert [e["responder"] for e in client.events if e["type"] == "session.updated"] == ["echo", "openai", "echo"]
    assert [c["status"] for c in page.evaluate("window.voicebotConsole.commands")] == [202] * 9

    page.locator("body").screenshot(path=tmp_path / "console.png")  # docs/images/console.png is one of these

    # A console opened mid-show finds the session's turns so far (the server's history of it).
    late = browser.new_page()
    open_console(late, live_server)
    wait_for(late, f"{turns}.map(t => t.user).join('|') === {'|'.join([FIRST, SECOND])!r} + '|||'")
    assert late.evaluate(f"window.voicebotConsole.sessions[{sid!r}].turns.map(t => [t.reply, t.interrupted])") == [
        [FIRST, None], [SECOND, None], [LINE, None], ["quiet please", None], [LONG_LINE, "client"]]
    late.close()

    # End the session: the server closes it (1000, after ended_by_operator) and the console shows it ended.
    card(page, sid).locator("button[name=end]").click()
    session_done.result(30)
    assert client.events[-1]["code"] == "ended_by_operator" and client.ws.close_code == 1000
    wait_for(page, f"c.sessions[{sid!r}].ended")
    stop.set()
    listener.result(10)

    # The feed had the session's session.ready (voice, responder), but never its resume token.
    token = client.events[0]["resume_token"]
    sent = [m for message in map(json.loads, feed) for m in (message.get("history", []) if message["type"] == "snapshot"
                                                             else [message])]
    readies = [m for m in sent if m["type"] == "event" and m["event"]["type"] == "session.ready"]
    assert [m["session"] for m in readies] == [sid] and readies[0]["event"]["voice"]
    assert not any(token in message for message in feed)


@pytest.mark.parametrize("token", [None, "wrong-token"])
def test_a_page_without_the_token_sees_nothing_and_commands_nothing(page, live_server, run_async, token, stop):
    clients: queue.Queue = queue.Queue()
    session_done = run_async(speaking_session(live_server.ws_url, clients, stop))
    client: VoiceClient = clients.get(timeout=20)
    sid = client.events[0]["session_id"]
    open_console(page, live_server, token)
    wait_for(page, "c.status.startsWith('refused')", 10_000)
    assert page.evaluate("Object.keys(window.voicebotConsole.sessions)") == []
    # Every control, from the page itself (its own fetch, with its token or none): 401, nothing applied.
    statuses = page.evaluate("""async ([sid, token]) => {
        const headers = { "Content-Type": "application/json", ...(token ? { Authorization: `Bearer ${token}` } : {}) };
        const post = (path, body) => fetch(path, { method: "POST", headers, body: JSON.stringify(body) }).then(r => r.status);
        return Promise.all([
            post(`/v1/console/sessions/${sid}/say`, { text: "you have been hacked" }),
            post(`/v1/console/sessions/${sid}/interrupt`, {}),
            post(`/v1/console/sessions/${sid}/session.update`, { voice: "zh" }),
            post(`/v1/console/sessions/${sid}/end`, {}),
            post(`/v1/console/channels/stage/mute`, { muted: true }),
        ]);
    }""", [sid, token])
    assert statuses == [401] * 5
    # The right token from a page of another site: refused too (what stops a page the operator visits).
    other_site = httpx.post(f"{live_server.http_url}/v1/console/sessions/{sid}/say", json={"text": "you have been hacked"},
                            headers={"Authorization": f"Bearer {TOKEN}", "Origin": "http://evil.example"}, timeout=10)
    assert other_site.status_code == 403
    time.sleep(1.0)
    assert not [e for e in client.events if e["type"] in ("reply.done", "session.updated", "error")]
    assert live_server.on_loop(lambda: live_server.runtime.channels.describe().get(CHANNEL, {}).get("muted")) is False
    assert not session_done.done()
    stop.set()
    session_done.result(15)


def test_commands_are_checked_by_the_protocols_own_models(live_server, run_async, stop):
    clients: queue.Queue = queue.Queue()
    session_done = run_async(speaking_session(live_server.ws_url, clients, stop))
    client: VoiceClient = clients.get(timeout=20)
    sid = client.events[0]["session_id"]
    base = f"{live_server.http_url}/v1/console"

    def post(path: str, **kwargs) -> httpx.Response:
        return httpx.post(base + path, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10, **kwargs)

    refused = {
        "say without text": (post(f"/sessions/{sid}/say", json={}), 400, "invalid_message"),
        "say too long": (post(f"/sessions/{sid}/say", json={"text": "x" * 2001}), 400, "invalid_message"),
        "say with a stray field": (post(f"/sessions/{sid}/say", json={"text": "hi", "speed": 2}), 400, "invalid_message"),
        "not JSON": (post(f"/sessions/{sid}/say", content=b"{nope"), 400, "invalid_json"),
        "too big": (post(f"/sessions/{sid}/say", content=b"x" * 9000), 413, "frame_too_large"),
        "unknown command": (post(f"/sessions/{sid}/session.start", json={}), 404, "unknown_command"),
        "unknown session": (post("/sessions/nobody/interrupt", json={}), 404, "unknown_session"),
        "mute without muted": (post("/channels/stage/mute", json={}), 400, "invalid_message"),
        "bad channel name": (post("/channels/no%20spaces/mute", json={"muted": True}), 400, "invalid_message"),
    }
    for name, (answer, status, code) in refused.items():
        assert (answer.status_code, answer.json()["code"]) == (status, code), name
    time.sleep(0.5)
    assert [e["type"] for e in client.events] == ["session.ready"]  # none of them reached the session
    # A name the session does not have is the session's to refuse, as from its own client.
    assert post(f"/sessions/{sid}/session.update", json={"voice": "klingon"}).status_code == 202
    assert event(client, "error")["code"] == "unknown_voice"
    stop.set()
    session_done.result(15)
