"""Faults a long show meets, injected into a real server over a real WebSocket.

Each test wraps one engine on the running server's runtime (the recognizer, a responder, the
synthesizer, a worker's thread) so that it fails once, mid-utterance or mid-reply, then asserts
what the client gets (an `error` with a stable code; a reply already sounding ends with
`audio.end`, every frame counted), what the conversation keeps (nothing that was never heard),
that the failure is counted, and that the next turn works.
"""

from __future__ import annotations

import asyncio
import time
import contextlib
import ctypes
import json
import threading

import pytest
import websockets

from tests.audio import espeak_speech
from tests.conftest import (
    TEST_PHRASES,
    RunningServer,
    VoiceClient,
    make_settings,
    running_server,
    speech_pcm,
)
from tests.reply.sse_server import Behaviour, SSEServer
from voicebot.protocol import CloseCode
from voicebot.serving import input_clock as clock_module
from voicebot.serving import vad as vad_module

FIRST, SECOND = TEST_PHRASES[1], TEST_PHRASES[2]
FIRST_SPEECH_S = len(espeak_speech(FIRST)) / 16000  # the voiced part of speech_pcm(FIRST)


def dropped(server: RunningServer, reason: str) -> float:
    return server.metric("voicebot_input_dropped_seconds_total", f'reason="{reason}"')


class Once:
    """Fires at the `at`-th call (0-based) it is asked about, and never again."""

    def __init__(self, at: int) -> None:
        self.at = at
        self.calls = 0
        self.fired = False

    def due(self) -> bool:
        self.calls += 1
        if not self.fired and self.calls > self.at:
            self.fired = True
            return True
        return False


class EngineFault(RuntimeError):
    pass


# ---- engine wrappers (the real engine, failing once) ---------------------------------------------

class FlakyRecognizer:
    """The server's recognizer, whose streams fail once at `method` (accept or finish)."""

    def __init__(self, real, method: str, trigger: Once, fault=None) -> None:
        self.real, self.method, self.trigger = real, method, trigger
        self.fault = fault or self._raise

    @staticmethod
    async def _raise():
        raise EngineFault("injected recognizer failure")

    def open(self, language=None):
        return FlakyStream(self, self.real.open(language))

    def __getattr__(self, name):
        return getattr(self.real, name)


class FlakyStream:
    def __init__(self, owner: FlakyRecognizer, real) -> None:
        self.owner, self.real = owner, real

    async def _maybe_fail(self, method: str) -> None:
        if method == self.owner.method and self.owner.trigger.due():
            await self.owner.fault()  # before the real call: the stream is left mid-utterance

    async def accept(self, pcm):
        await self._maybe_fail("accept")
        return await self.real.accept(pcm)

    async def finish(self):
        await self._maybe_fail("finish")
        return await self.real.finish()

    def __getattr__(self, name):
        return getattr(self.real, name)


class FlakyResponder:
    """The echo responder, raising once after `after` deltas."""

    def __init__(self, real, trigger: Once, after: int) -> None:
        self.real, self.trigger, self.after = real, trigger, after

    async def reply(self, history, text, voice=None):
        fail = self.trigger.due()
        sent = 0
        async for delta in self.real.reply(history, text, voice=voice):
            if fail and sent == self.after:
                raise EngineFault("injected responder failure")
            sent += 1
            yield delta

    def __getattr__(self, name):
        return getattr(self.real, name)


class Scripted:
    """A responder that says these deltas."""

    name = "echo"

    def __init__(self, deltas: list[str]) -> None:
        self.deltas = deltas

    async def reply(self, history, text, voice=None):
        for delta in self.deltas:
            yield delta


class FlakySynthesizer:
    """The server's synthesizer, whose contexts fail once, at chunk `chunk` of sentence `segment`."""

    def __init__(self, real, trigger: Once, segment: int, chunk: int) -> None:
        self.real, self.trigger, self.segment, self.chunk = real, trigger, segment, chunk

    def open(self, voice=None):
        return FlakyContext(self, self.real.open(voice))

    def __getattr__(self, name):
        return getattr(self.real, name)


class FlakyContext:
    def __init__(self, owner: FlakySynthesizer, real) -> None:
        self.owner, self.real = owner, real

    async def stream(self, text):
        fail = self.owner.trigger.due()
        async with contextlib.aclosing(self.real.stream(text)) as chunks:
            in_segment = 0
            async for chunk in chunks:
                in_segment = in_segment + 1 if chunk.segment == self.owner.segment else 0
                if fail and chunk.segment == self.owner.segment and in_segment > self.owner.chunk:
                    raise EngineFault("injected synthesis failure")
                yield chunk

    def __getattr__(self, name):
        return getattr(self.real, name)


@contextlib.contextmanager
def swapped(server: RunningServer, **engines):
    """Replace runtime attributes (recognizer=..., synthesizer=...) for one test."""
    rt = server.runtime
    before = {name: getattr(rt, name) for name in engines}
    server.on_loop(lambda: [setattr(rt, name, engine) for name, engine in engines.items()])
    try:
        yield
    finally:
        server.on_loop(lambda: [setattr(rt, name, engine) for name, engine in before.items()])


@contextlib.contextmanager
def swapped_responder(server: RunningServer, name: str, responder):
    responders = server.runtime.responders
    real = responders[name]
    server.on_loop(lambda: responders.__setitem__(name, responder))
    try:
        yield
    finally:
        server.on_loop(lambda: responders.__setitem__(name, real))


# ---- the conversation ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def voice():
    with running_server(make_settings(endpoint={"turn": "silence"})) as server:
        yield server


def history(server: RunningServer, client: VoiceClient) -> list[dict]:
    session_id = client.of_type("session.ready")[0]["session_id"]
    return server.on_loop(lambda: server.runtime.sessions[session_id].conversation.messages())


def failures(server: RunningServer, engine: str, stage: str) -> float:
    return server.metric("voicebot_engine_failures_total", f'engine="{engine}",stage="{stage}"')


async def say_and_wait(client: VoiceClient, phrase: str, event: str, count: int = 1) -> dict:
    await client.stream(speech_pcm(phrase), speed=4)
    return await client.wait_for(event, count=count)


async def next_turn_works(client: VoiceClient, ends_before: int) -> dict:
    """The turn after the fault: heard, answered and played to its end."""
    end = await say_and_wait(client, SECOND, "audio.end", count=ends_before + 1)
    assert client.of_type("asr.final")[-1]["text"] == SECOND
    assert len(client.reply_frames(end["reply_id"])) == end["frames"] > 0
    return end


def assert_reply_ended_properly(client: VoiceClient, reply_id: str) -> None:
    """Every frame the client got of this reply is accounted for by its audio.end."""
    ends = [e for e in client.of_type("audio.end") if e["reply_id"] == reply_id]
    frames = client.reply_frames(reply_id)
    if frames:
        assert len(ends) == 1 and ends[0]["frames"] == len(frames)
    else:
        assert not ends and not [e for e in client.of_type("audio.start") if e["reply_id"] == reply_id]


@pytest.mark.parametrize("method, at", [("accept", 2), ("finish", 0)], ids=["feed", "finish"])
def test_a_recognizer_failing_mid_utterance_loses_only_that_utterance(voice, method, at):
    flaky = FlakyRecognizer(voice.runtime.recognizer, method, Once(at))
    counted = failures(voice, "asr", "feed" if method == "accept" else "finish")
    dropped_before = dropped(voice, "engine_error")

    async def scenario():
        async with VoiceClient.connect(voice.ws_url) as c:
            error = await say_and_wait(c, FIRST, "error")
            await asyncio.sleep(1.5)  # the rest of that utterance, and whatever it would cause
            lost = (list(c.events), history(voice, c))
            await next_turn_works(c, ends_before=0)
            return error, lost, history(voice, c)

    with swapped(voice, recognizer=flaky):
        error, (events_after_fault, history_after_fault), messages = asyncio.run(scenario())
    assert flaky.trigger.fired
    assert error["code"] == "engine_error" and error["engine"] == "asr"
    # The failed utterance is lost, and said to be: no transcript, no reply, nothing in the history.
    assert not [e for e in events_after_fault if e["type"] in ("asr.final", "turn.end", "reply.delta", "audio.start")]
    assert history_after_fault == []
    assert messages == [{"role": "user", "content": SECOND}, {"role": "assistant", "content": SECOND}]
    assert failures(voice, "asr", "feed" if method == "accept" else "finish") == counted + 1
    # All of the lost utterance is dropped input: what was heard before the failure and the rest of it.
    assert dropped(voice, "engine_error") >= dropped_before + 0.9 * FIRST_SPEECH_S


def test_a_responder_failing_mid_reply_keeps_what_was_heard(voice):
    flaky = FlakyResponder(voice.runtime.responders["echo"], Once(0), after=3)
    counted = failures(voice, "responder", "stream")

    async def scenario():
        async with VoiceClient.connect(voice.ws_url) as c:
            end = await say_and_wait(c, FIRST, "audio.end")
            await next_turn_works(c, ends_before=1)
            return c, end, history(voice, c)

    with swapped_responder(voice, "echo", flaky):
        c, end, messages = asyncio.run(scenario())
    error = c.of_type("error")[0]
    assert error["code"] == "reply_failed" and error["failure"] == "internal" and error["reply_id"] == end["reply_id"]
    said = " ".join(FIRST.split()[:3])
    assert c.of_type("reply.done")[0]["text"] == said
    assert_reply_ended_properly(c, end["reply_id"])
    assert messages[:2] == [{"role": "user", "content": FIRST}, {"role": "assistant", "content": said}]
    assert failures(voice, "responder", "stream") == counted + 1


REPLY = ["Hello there.", " How are you doing on this fine day?", " Goodbye."]


@pytest.mark.parametrize("segment, chunk", [(0, 0), (1, 3)], ids=["before_any_audio", "mid_reply"])
def test_a_synthesizer_failing_mid_reply_ends_the_reply_and_keeps_only_what_was_heard(voice, segment, chunk):
    flaky = FlakySynthesizer(voice.runtime.synthesizer, Once(0), segment, chunk)
    counted = failures(voice, "tts", "synthesis")

    async def scenario():
        async with VoiceClient.connect(voice.ws_url) as c:
            with swapped_responder(voice, "echo", Scripted(REPLY)):
                error = await say_and_wait(c, FIRST, "error")
                await asyncio.sleep(1.0)  # the frames sent before the failure play out
            first_reply = (list(c.events), history(voice, c))
            await next_turn_works(c, ends_before=len(c.of_type("audio.end")))
            return c, error, first_reply

    with swapped(voice, synthesizer=flaky):
        c, error, (events, messages) = asyncio.run(scenario())
    assert error["code"] == "engine_error" and error["engine"] == "tts"
    reply_id = error["reply_id"]
    assert_reply_ended_properly(c, reply_id)
    if segment == 0:
        assert not c.reply_frames(reply_id)
        assert messages == [{"role": "user", "content": FIRST}]  # nothing of the reply was heard
    else:
        end = next(e for e in events if e["type"] == "audio.end" and e["reply_id"] == reply_id)
        assert end["frames"] == len(c.reply_frames(reply_id)) > 0
        # The first sentence was heard whole; of the second, cut in the middle, nothing is kept.
        assert messages == [{"role": "user", "content": FIRST}, {"role": "assistant", "content": REPLY[0]}]
    assert failures(voice, "tts", "synthesis") == counted + 1


def test_a_job_that_raises_systemexit_on_a_worker_does_not_stop_the_server(voice):
    worker = voice.runtime.synthesizer.workers()[0]  # a Worker every session uses (espeak-ng's)

    def exits():
        raise SystemExit("a library called exit()")

    async def fault():
        await worker.run(exits)

    flaky = FlakyRecognizer(voice.runtime.recognizer, "accept", Once(2), fault)

    async def scenario():
        async with VoiceClient.connect(voice.ws_url) as c:
            error = await say_and_wait(c, FIRST, "error")
            await next_turn_works(c, ends_before=0)
            return error

    with swapped(voice, recognizer=flaky):
        error = asyncio.run(scenario())
    assert error["code"] == "engine_error" and error["engine"] == "asr" and "SystemExit" in error["message"]
    assert voice.thread.is_alive() and voice.get("/healthz").status_code == 200


def _kill(thread: threading.Thread) -> None:
    """Raise SystemExit in `thread` (at its next Python instruction): a worker thread gone."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(SystemExit))


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the thread killed on purpose
def test_a_worker_thread_that_dies_is_replaced_and_no_call_hangs(voice):
    worker = voice.runtime.synthesizer.workers()[0]
    name = worker.name
    # This worker's own threads: an earlier test's server in this process has workers of the same name.
    threads = [t for t in worker._live if t.is_alive()]
    assert threads  # espeak ran for the warm-up
    lost_before = voice.metric("voicebot_worker_threads_lost_total", f'worker="{name}"')
    for thread in threads:
        _kill(thread)  # idle: it dies as it takes its next call

    async def scenario():
        async with VoiceClient.connect(voice.ws_url) as c:
            await c.send({"type": "say", "text": "The first line after the fault."})
            await c.wait_for("audio.end", timeout=20)
            await c.send({"type": "say", "text": "And the next one."})
            await c.wait_for("audio.end", count=2, timeout=20)
            return c

    c = asyncio.run(scenario())
    assert not c.of_type("error")  # the call in hand went to the replacement thread
    assert all(not t.is_alive() for t in threads)
    assert voice.metric("voicebot_worker_threads_lost_total", f'worker="{name}"') == lost_before + len(threads)


# ---- a responder that hangs mid-reply --------------------------------------------------------------

@pytest.fixture(scope="module")
def sse():
    server = SSEServer().start()
    yield server
    server.stop()


def test_a_responder_that_stops_sending_is_cut_off_and_the_next_turn_works(sse):
    settings = make_settings(
        endpoint={"turn": "silence"},
        reply={"engine": "openai", "fallback_line": "Sorry?",
               "openai": {"base_url": sse.base_url, "model": "test", "first_token_timeout_s": 5, "idle_timeout_s": 1.0,
                          "total_timeout_s": 60, "retries": 0}},
    )
    with running_server(settings) as voice:
        if sse.requests:
            sse.stream_closed.wait(5)  # the warm-up utterance's reply
        sse.reset(Behaviour(chunks=["Hello there.", " And then"], interval_s=30), Behaviour(chunks=["Fine."]))

        async def scenario():
            async with VoiceClient.connect(voice.ws_url) as c:
                end = await say_and_wait(c, FIRST, "audio.end")
                closed = await asyncio.to_thread(sse.stream_closed.wait, 5)
                await next_turn_works(c, ends_before=1)
                return c, end, closed, history(voice, c)

        c, end, closed, messages = asyncio.run(scenario())
        idle_failures = voice.metric("voicebot_reply_errors_total", 'kind="idle_timeout"')
    error = c.of_type("error")[0]
    assert error["code"] == "reply_failed" and error["failure"] == "idle_timeout"
    assert closed and sse.cancelled >= 1 and sse.sent == 1  # the HTTP stream was closed during the pause
    assert_reply_ended_properly(c, end["reply_id"])
    assert messages[:2] == [{"role": "user", "content": FIRST}, {"role": "assistant", "content": "Hello there."}]
    assert messages[2:] == [{"role": "user", "content": SECOND}, {"role": "assistant", "content": "Fine."}]
    assert idle_failures == 1


class Hanging:
    """A responder (not the OpenAI one) that says `deltas`, then waits for ever; counts its cancellations."""

    name = "echo"

    def __init__(self, deltas: list[str]) -> None:
        self.deltas = deltas
        self.cancelled = 0

    async def reply(self, history, text, voice=None):
        for delta in self.deltas:
            yield delta
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise


@pytest.mark.parametrize("said, failure", [(["Hello there."], "idle_timeout"), ([], "total_timeout")],
                         ids=["mid-reply", "before-any-text"])
def test_any_responder_that_hangs_is_cut_off_by_the_reply_deadline_and_the_next_turn_works(said, failure):
    settings = make_settings(endpoint={"turn": "silence"}, reply={"fallback_line": "Sorry?",
                                                                  "openai": {"idle_timeout_s": 1.0, "total_timeout_s": 3.0}})
    hanging = Hanging(said)
    with running_server(settings) as voice:
        counted = voice.metric("voicebot_reply_errors_total", f'kind="{failure}"')

        async def scenario():
            async with VoiceClient.connect(voice.ws_url) as c:
                with swapped_responder(voice, "echo", hanging):
                    end = await say_and_wait(c, FIRST, "audio.end")
                await next_turn_works(c, ends_before=1)
                return c, end, history(voice, c)

        c, end, messages = asyncio.run(scenario())
        counted_after = voice.metric("voicebot_reply_errors_total", f'kind="{failure}"')
    error = c.of_type("error")[0]
    assert error["code"] == "reply_failed" and error["failure"] == failure and error["reply_id"] == end["reply_id"]
    assert hanging.cancelled == 1  # the responder's stream was closed, not left waiting
    assert_reply_ended_properly(c, end["reply_id"])
    heard = said[0] if said else "Sorry?"  # nothing said: the fallback line is spoken instead
    assert messages[:2] == [{"role": "user", "content": FIRST}, {"role": "assistant", "content": heard}]
    assert messages[2:] == [{"role": "user", "content": SECOND}, {"role": "assistant", "content": SECOND}]
    assert counted_after == counted + 1


# ---- the VAD batcher's step raising mid-utterance ------------------------------------------------

class FailingStep:
    """A silero_step (the input clock's or the VAD batcher's), raising `fault` at its first call once armed (from the test)."""

    def __init__(self, real, fault: type[BaseException]) -> None:
        self.real, self.fault = real, fault
        self.armed = threading.Event()
        self.fired = threading.Event()

    def __call__(self, vads, windows):
        if self.armed.is_set() and not self.fired.is_set():
            self.fired.set()
            raise self.fault("injected VAD failure")
        return self.real(vads, windows)


@pytest.fixture(params=[EngineFault, SystemExit], ids=["exception", "systemexit"])  # SystemExit: failed as InputClockFault
def failing_vad_step(request, monkeypatch):
    """A live session's (the input clock's thread looks silero_step up at each step)."""
    step = FailingStep(clock_module.silero_step, request.param)
    monkeypatch.setattr(clock_module, "silero_step", step)
    return step


@pytest.fixture(params=[EngineFault, SystemExit], ids=["exception", "systemexit"])  # SystemExit: failed as JobAborted
def failing_batcher_step(request, monkeypatch):
    """A /funasr stream's (the VAD batcher's thread looks silero_step up at each step)."""
    step = FailingStep(vad_module.silero_step, request.param)
    monkeypatch.setattr(vad_module, "silero_step", step)
    return step


def _fault_mid_utterance(voice, fault):
    """FIRST spoken with `fault` (a context manager) entered at its speech start until the session's
    error; then the next turn. Returns speech.started, the error, (the events and the history once that
    utterance is over), and the history after the next turn."""

    async def scenario():
        async with VoiceClient.connect(voice.ws_url) as c:
            streaming = asyncio.create_task(c.stream(speech_pcm(FIRST), speed=4))
            started = await c.wait_for("speech.started")
            with fault():
                error = await c.wait_for("error")
            await streaming
            await asyncio.sleep(1.5)  # the rest of that utterance, and whatever it would cause
            lost = (list(c.events), history(voice, c))
            await next_turn_works(c, ends_before=0)
            return started, error, lost, history(voice, c)

    return asyncio.run(scenario())


def test_a_vad_step_failing_mid_utterance_loses_that_utterance_and_the_next_turn_works(voice, failing_vad_step):
    counted = failures(voice, "vad", "chunk")
    dropped_before, overloaded_before = dropped(voice, "engine_error"), dropped(voice, "overload")

    @contextlib.contextmanager
    def armed():
        failing_vad_step.armed.set()  # the next step is mid-utterance
        yield

    started, error, (events_after_fault, history_after_fault), messages = _fault_mid_utterance(voice, armed)
    assert failing_vad_step.fired.is_set()
    assert error["code"] == "engine_error" and error["engine"] == "vad" and error["stage"] == "chunk"
    assert error["utterance_id"] == started["utterance_id"]
    assert not [e for e in events_after_fault if e["type"] in ("asr.final", "turn.end", "reply.delta", "audio.start")]
    assert history_after_fault == []
    assert messages == [{"role": "user", "content": SECOND}, {"role": "assistant", "content": SECOND}]
    assert failures(voice, "vad", "chunk") == counted + 1
    # The chunk, what was heard of the utterance before it and the rest of it after.
    assert dropped(voice, "engine_error") >= dropped_before + 0.9 * FIRST_SPEECH_S
    assert dropped(voice, "overload") == overloaded_before


def test_a_full_input_clock_answers_busy_and_loses_that_utterance_and_the_next_turn_works(voice):
    """Overload is not a broken engine: `busy` with a retry-after, counted apart from failures."""
    batcher = voice.runtime.input_clock
    counted, overloads = failures(voice, "vad", "chunk"), voice.metric("voicebot_engine_overloads_total", 'engine="vad"')
    engine_errors, dropped_before = dropped(voice, "engine_error"), dropped(voice, "overload")

    @contextlib.contextmanager
    def full():
        bound, batcher.max_pending = batcher.max_pending, 0  # the real bound, reached by the next chunk
        try:
            yield
        finally:
            batcher.max_pending = bound

    started, error, (events_after_fault, history_after_fault), messages = _fault_mid_utterance(voice, full)
    assert error["code"] == "busy" and error["engine"] == "vad" and error["overloaded"] == "input"
    assert error["retry_after_s"] > 0 and error["utterance_id"] == started["utterance_id"]
    assert not [e for e in events_after_fault if e["type"] in ("asr.final", "turn.end", "reply.delta", "audio.start")]
    assert history_after_fault == []
    assert messages == [{"role": "user", "content": SECOND}, {"role": "assistant", "content": SECOND}]
    assert voice.metric("voicebot_engine_overloads_total", 'engine="vad"') >= overloads + 1
    assert failures(voice, "vad", "chunk") == counted and dropped(voice, "engine_error") == engine_errors
    assert dropped(voice, "overload") >= dropped_before + 0.9 * FIRST_SPEECH_S


FUNASR_CHUNK = 3200  # bytes: 100 ms of 16 kHz s16le, as the runtime's clients send


async def funasr_stream(url: str, pcm: bytes, arm: threading.Event | None = None) -> tuple[list[dict], int | None]:
    """One 2pass /funasr stream sent at 4x real time (`arm` set halfway, in the speech); its results
    up to the final one, and the close code if the server closed."""
    results = []
    async with websockets.connect(url, open_timeout=10) as ws:
        await ws.send(json.dumps({"mode": "2pass", "wav_name": "w", "wav_format": "pcm", "audio_fs": 16000,
                                  "is_speaking": True}))
        with contextlib.suppress(websockets.ConnectionClosed):
            for start in range(0, len(pcm), FUNASR_CHUNK):
                if arm is not None and start >= len(pcm) // 2:
                    arm.set()
                await ws.send(pcm[start : start + FUNASR_CHUNK])
                await asyncio.sleep(0.025)
            await ws.send(json.dumps({"is_speaking": False}))
        with contextlib.suppress(websockets.ConnectionClosed):
            while not results or not results[-1]["is_final"]:
                results.append(json.loads(await asyncio.wait_for(ws.recv(), 30)))
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(ws.recv(), 2)  # the close, if the server ends the connection
    return results, ws.close_code


def test_a_vad_step_failing_on_funasr_ends_the_stream_with_an_error_result_and_the_next_stream_works(voice, failing_batcher_step):
    url = voice.ws_url.replace("/v1/voice", "/funasr")
    counted = failures(voice, "vad", "chunk")
    errors = voice.metric("voicebot_errors_total", 'code="engine_error"')
    results, code = asyncio.run(funasr_stream(url, speech_pcm(FIRST), arm=failing_batcher_step.armed))
    assert failing_batcher_step.fired.is_set()
    final = results[-1]
    assert final["is_final"] and final["mode"] == "2pass-offline" and final["wav_name"] == "w"
    assert final["text"].startswith("ERROR. an engine failed") and final["error"]
    assert final["engine"] == "vad" and final["stage"] == "chunk"  # the engine that failed, as /v1/voice names it
    assert code == CloseCode.INTERNAL_ERROR
    assert failures(voice, "vad", "chunk") == counted + 1
    assert voice.metric("voicebot_errors_total", 'code="engine_error"') == errors + 1

    results, code = asyncio.run(funasr_stream(url, speech_pcm(SECOND)))
    assert not [r for r in results if "error" in r]
    assert results[-1]["is_final"] and code != CloseCode.INTERNAL_ERROR
    assert " ".join(r["text"] for r in results if r["mode"] == "2pass-offline" and r["text"]) == SECOND


# ---- the end-of-turn model's worker ----------------------------------------------------------------

@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the thread killed on purpose
def test_the_end_of_turn_models_lost_threads_are_exported():
    with running_server(make_settings(endpoint={"turn": "smart"})) as server:
        assert server.runtime.smart_turn is not None
        assert 'voicebot_worker_threads_lost_total{worker="smart-turn"} 0.0' in server.get("/metrics").text
        worker = server.runtime.smart_turn.worker
        worker.submit(lambda: None).result(timeout=10)  # its thread started
        threads = [t for t in worker._live if t.is_alive()]
        for thread in threads:
            _kill(thread)  # idle: it dies as it takes its next call
        for _ in range(50):  # calls until each killed thread has taken one (the worker has two threads)
            if not any(thread.is_alive() for thread in threads):
                break
            worker.submit(lambda: None).result(timeout=10)  # taken by a live thread, a killed one's call too
            time.sleep(0.01)
        for thread in threads:
            thread.join(timeout=10)
            assert not thread.is_alive()
        assert server.metric("voicebot_worker_threads_lost_total", 'worker="smart-turn"') == len(threads) > 0
