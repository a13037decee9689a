"""Headless Chromium with a fake microphone, and a real server for it to talk to.

Chromium is Debian's (/usr/bin/chromium, installed by the set-up script), driven by the `playwright`
package; `playwright install` is never needed. The flags are those measured in
shared/specs/offline-engines.md: `--headless=new` in the arguments with headless=False so that
Playwright adds no --mute-audio, and a wav file as the microphone, played once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from pathlib import Path

import pytest

from tests.browser.support import WireLog, speech, write_wav
from tests.conftest import TEST_PHRASES, make_settings, running_server

CHROMIUM = Path("/usr/bin/chromium")
FLAGS = [
    "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream", "--autoplay-policy=no-user-gesture-required",
]
# What the fake microphone says: a sentence, a pause long enough to end its turn, then a second
# sentence that starts while the reply to the first is still playing (barge-in), then silence for
# the second reply to play out. The first 2 s are silent because Chrome's fake capture sometimes
# slips one 10 ms buffer within its first 1.5 s (measured, more often on a loaded machine); in
# silence that changes nothing. Half of espeak_speech's level: Chrome's auto gain then does not clip.
FIRST, BARGE_IN = TEST_PHRASES[1], TEST_PHRASES[2]
# The pause ends the first turn whatever the CPU gives the server. The turn is Smart Turn's to end
# (the default `endpoint.turn`), and a user who speaks again before its answer goes on with the
# same turn (voicebot/session/turn_taking.py). Its answer took 190-300 ms on an idle 2-core box and
# 400-780 ms beside two busy processes (as beside the suite's other xdist worker): an 0.8 s pause was
# then over before it, the two sentences made one turn and there was no reply to interrupt. So the
# test server's turn ends at TURN_LIMIT_MS of silence at the latest, counted in audio, not on the
# clock: the pause is 0.9 s of silence to the endpointer (offline), 400 ms beyond the limit. On the
# other side, the reply (1.9 s) must still be being sent when the barge-in's 300 ms of speech are
# heard: its last frame goes 1.4 s in (pacing.lead_ms ahead), and the barge-in came 0.8 s in when
# the model answered at once (idle box; a slower answer starts the reply later, so the barge-in
# comes sooner into it). The default 1.5 s limit would need a pause longer than the reply.
TURN_LIMIT_MS = 500  # the silence rule's wait (endpoint_silence_ms): Smart Turn may end a turn sooner, never later
PAUSE_S = 0.9
MIC_SCRIPT = (2.0, FIRST, PAUSE_S, BARGE_IN, 4.0)
MIC_LEVEL = 0.5


@pytest.fixture(scope="session")
def live_server():
    # record_input_s: the test of what the server received reads /debug/input/{session}.wav.
    settings = make_settings(server={"record_input_s": 30}, endpoint={"smart_limit_ms": TURN_LIMIT_MS})
    with running_server(settings) as server:
        yield server


@pytest.fixture(scope="session")
def mic_wav(tmp_path_factory) -> Path:
    return write_wav(tmp_path_factory.mktemp("mic") / "conversation.wav", speech(*MIC_SCRIPT) * MIC_LEVEL)


@pytest.fixture(scope="module")
def browser(mic_wav, live_server):
    # After live_server: its warm-up runs asyncio.run, which Playwright's loop would forbid. Per
    # module, not per session: while Playwright's sync API is up, no later test can use asyncio.run.
    if not CHROMIUM.exists():
        pytest.fail("browser tests need Debian's chromium at /usr/bin/chromium (apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=str(CHROMIUM), headless=False, args=[*FLAGS, f"--use-file-for-fake-audio-capture={mic_wav}%noloop"]
        )
        yield browser
        browser.close()


WIRE_LOG = pytest.StashKey[WireLog]()


@pytest.fixture
def page(browser, request):
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    page = context.new_page()
    request.node.stash[WIRE_LOG] = WireLog(page)
    yield page
    context.close()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed browser test's report ends with what its page's WebSockets carried."""
    report = (yield).get_result()
    if report.when == "call" and report.failed and WIRE_LOG in item.stash:
        report.sections.append(("the page's WebSocket messages", item.stash[WIRE_LOG].text()))


@pytest.fixture
def run_async():
    """Run a coroutine to completion on its own thread (Playwright's sync API owns this one)."""
    pool = concurrent.futures.ThreadPoolExecutor(2)

    def start(coro) -> concurrent.futures.Future:
        return pool.submit(asyncio.run, coro)

    yield start
    pool.shutdown(wait=True)
