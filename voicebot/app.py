"""The FastAPI app: pages, the /v1/voice WebSocket, health, readiness and metrics.

`create_app(settings)` builds an app; the module-level `app` reads its settings from the file named
by VOICEBOT_CONFIG (default configs/default.yaml), so `uvicorn voicebot.app:app` works as is.
Engines load once, at start-up, off the event loop; /readyz answers 200 only when all have loaded.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request, WebSocket
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from voicebot import __version__, auth, console, limits, memory, protocol
from voicebot.channels import run_listener
from voicebot.config import Settings, load_settings
from voicebot.frontends import openai_audio
from voicebot.frontends.funasr_ws import RefusingInFunasrShape, funasr_segmenter, serve_funasr
from voicebot.loop_watch import LoopWatch
from voicebot.frontends.run import run_session
from voicebot.frontends.voice import VoiceFrontEnd
from voicebot.frontends.obs_plugin import ObsFrontEnd
from voicebot.protocol import CloseCode, ErrorCode
from voicebot.frontends.realtime import RealtimeFrontEnd, RefusingInOpenAIShape
from voicebot.frontends.realtime_events import RealtimeTranslator
from voicebot.runtime import Runtime
from voicebot.transport import one_line_for_invalid_utf8

log = logging.getLogger("voicebot")


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or load_settings()
    auth.check_exposure(settings.server)
    auth.hide_tokens_in_logs()
    one_line_for_invalid_utf8()
    memory.limit_heap_arenas()  # before the engines start their threads
    rt = Runtime(settings)
    funasr_open = [0]  # /funasr connections: they count toward max_sessions like sessions do

    audio_requests = openai_audio.AudioRequests()  # /v1/audio/* requests count toward max_sessions too

    def occupied() -> int:
        return len(rt.sessions) + funasr_open[0] + audio_requests.running

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        rt.loop = asyncio.get_running_loop()
        await asyncio.to_thread(rt.load)
        await rt.start_cluster()
        lag = asyncio.create_task(LoopWatch(rt.metrics).run())
        load = asyncio.create_task(rt.admission.watch(occupied, lambda: _report_load(rt)))
        trim = asyncio.create_task(memory.trim_periodically())
        _drain_on_sigterm(rt)
        log.info("voicebot %s ready on %s:%s", __version__, settings.server.host, settings.server.port)
        try:
            yield
        finally:
            lag.cancel()
            load.cancel()
            trim.cancel()
            await rt.close()

    app = FastAPI(title="voicebot", version=__version__, lifespan=lifespan)
    app.state.runtime = rt
    client_limits = limits.install(app, settings.server)  # connections and sessions per client address
    auth.install(app, settings.server)  # the Host header, and the token on HTTP routes
    app.state.audio_requests, app.state.occupied, app.state.client_limits = audio_requests, occupied, client_limits
    app.include_router(openai_audio.router)  # /v1/audio/speech, /v1/audio/transcriptions
    console.install(app, rt)  # /v1/console (the operator console's feed) and its commands, /v1/console/*

    @app.get("/healthz")
    async def healthz() -> dict:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz(request: Request) -> JSONResponse:
        engines = [e.info() for e in (rt.recognizer, rt.synthesizer, *rt.responders.values()) if e is not None] if rt.ready else []
        # At its session limit, or one more session would be refused by admit(): it would overload a
        # thread pool (serving/capacity.py), slow the synthesizer's speaking sessions below real time,
        # or need a recognizer's decoder built where streams are speaking (pocketsphinx).
        full = (occupied() >= settings.server.max_sessions or bool(rt.admission and rt.admission.refuse(occupied()))
                or (rt.ready and (rt.synthesizer.full() is not None or rt.recognizer.full() is not None)))
        body = {
            # Load balancers and Kubernetes send new connections only where this is true.
            "ready": rt.ready and not rt.draining and not full,
            "draining": rt.draining,
            "full": full,
            "engines": [e.__dict__ for e in engines],
            # What ends a turn; `problem` says why smart turn is not in use when it was configured.
            "turn": {"mode": rt.turn_mode, "configured": settings.endpoint.turn, "problem": rt.turn_problem},
            # Where echo is cancelled (/obs/audio, or asked in session.start): why the recognizer would lose words.
            "echo": {"problem": rt.echo_problem},
            "active_sessions": len(rt.sessions),
            "max_sessions": settings.server.max_sessions,
            "capacity": rt.admission.report() if rt.admission else {},
            # Each pool's input lag over the last 5 s (p50, p95) and deadline misses since start.
            "input_lag": rt.input_lag.report() if rt.input_lag else {},
            # Numbers of sessions connected the input was late at (s since): admission stops short of them.
            "input_late_at_sessions": rt.admission.late_levels.report() if rt.admission else {},
            # The input lag p95 one more session would bring, and the p95 learnt per number of sessions.
            "input_lag_forecast": rt.admission.lag_report(occupied()) if rt.admission else {},
            "input_clock": rt.input_clock.stats(),  # ticks, sessions' jobs per tick, faults
            "vad": rt.vad.stats(),  # the VAD batcher: requests waiting, rows per call
            "uptime_s": round(time.monotonic() - rt.started_at, 1),
            "cluster": None if rt.cluster is None else {"redis_up": rt.cluster.link.up},
        }
        if settings.server.token is not None and not auth.token_matches(auth.presented_token(request), settings.server.token):
            body = {key: body[key] for key in ("ready", "draining", "full")}  # public: a probe needs no more
        return JSONResponse(body, status_code=200 if body["ready"] else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        # Off the loop: rendering every family is ~30 ms of Python on a loaded 2-core box; on a
        # thread the loop gets the GIL back every switch interval instead of waiting all of it.
        exposition = await asyncio.to_thread(generate_latest, rt.metrics.registry)
        return Response(exposition, media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/voices")
    async def voices() -> dict:
        return {"voices": [v.__dict__ for v in rt.synthesizer.voices()], "default": settings.tts.voice}

    async def admit(ws: WebSocket, listener: bool = False, channel: str | None = None, funasr: bool = False) -> bool:
        """Accept a connection if its token is right, its channel name valid and there is room,
        for it and for its client address; a session counts for its address until it closes."""
        token = auth.required_token(settings.server, ws, funasr)
        if not await auth.accept(ws, token, rt.metrics, settings.server.allowed_origins):
            return False
        if rt.draining or not rt.ready:
            await _refuse(ws, rt, ErrorCode.SHUTTING_DOWN, "the server is shutting down", CloseCode.GOING_AWAY, "shutting down")
            return False
        if channel is not None and not protocol.CHANNEL_NAME.fullmatch(channel):
            await _refuse(ws, rt, ErrorCode.INVALID_MESSAGE, f"channel {channel!r}: use 1-64 letters, digits, _ . or -",
                          CloseCode.POLICY, "bad channel")
            return False
        if too_many := client_limits.refusal(ws.scope, session=not listener):
            await _refuse(ws, rt, ErrorCode.BUSY, too_many, CloseCode.TRY_AGAIN_LATER, "busy", refusal="per_client", retry_after_s=5,
                          limit="per_client")
            return False
        if not listener and occupied() >= settings.server.max_sessions:
            await _refuse(ws, rt, ErrorCode.BUSY, f"the server is at its limit of {settings.server.max_sessions} sessions",
                          CloseCode.TRY_AGAIN_LATER, "busy", refusal="max_sessions", retry_after_s=5)
            return False
        if not listener and (full := rt.admission.refuse(occupied())):
            await _refuse(ws, rt, ErrorCode.BUSY, f"the server is at capacity: {full.message}", CloseCode.TRY_AGAIN_LATER, "busy",
                          refusal=full.reason, retry_after_s=full.retry_after_s, overloaded=full.pool, cause=full.reason)
            return False
        if not listener and (retry_after := rt.recognizer.full()) is not None:
            await _refuse(ws, rt, ErrorCode.BUSY, f"the server is at capacity: a new stream would need a {rt.recognizer.name} "
                          "decoder built, holding a decoding process that streams are speaking on", CloseCode.TRY_AGAIN_LATER,
                          "busy", refusal="decoders", retry_after_s=retry_after, overloaded=rt.recognizer.name, cause="decoders")
            return False
        if not listener and (retry_after := rt.synthesizer.admit()) is not None:
            await _refuse(ws, rt, ErrorCode.BUSY, f"the server is at capacity: one more session would slow {rt.synthesizer.name}'s "
                          "speaking sessions below real time", CloseCode.TRY_AGAIN_LATER, "busy", refusal="synthesizer",
                          retry_after_s=retry_after, overloaded=rt.synthesizer.name)
            return False
        if not listener:
            client_limits.hold_session(ws.scope)
            rt.admission.admitted()
        return True

    @app.websocket("/v1/voice")
    async def voice(ws: WebSocket) -> None:
        if ws.query_params.get("role") == "listener":
            channel = ws.query_params.get("channel", "")
            if await admit(ws, listener=True, channel=channel):
                await run_listener(ws, rt.channels, channel)
        elif await admit(ws):
            await run_session(ws, VoiceFrontEnd(ws), rt)

    @app.websocket("/funasr")
    @app.websocket("/")  # the runtime's C++/Java/Python clients connect to ws://host:port/ only
    async def funasr(ws: WebSocket) -> None:
        """The FunASR runtime's 2-pass protocol (docs/funasr.md), on the same recognizer and VAD."""
        if await admit(RefusingInFunasrShape(ws), funasr=True):
            funasr_open[0] += 1
            try:
                segmenter = funasr_segmenter(rt.recognizer, settings.endpoint, rt.vad)
                await serve_funasr(ws, rt.recognizer, segmenter, settings, rt.metrics, rt.input_lag)
            finally:
                funasr_open[0] -= 1

    @app.websocket("/obs/audio")
    async def obs_audio(ws: WebSocket) -> None:
        """The obs-audio-to-websocket plugin, as the speaking session of ?channel= (default main)."""
        channel = ws.query_params.get("channel", "main")
        if await admit(ws, channel=channel):
            await run_session(ws, ObsFrontEnd(channel, rt.metrics), rt)

    @app.websocket("/v1/realtime")
    async def realtime(ws: WebSocket) -> None:
        """The OpenAI Realtime protocol (docs/realtime.md), over the same session pipeline."""
        translator = RealtimeTranslator(ws.query_params.get("model", "voicebot"), [v.name for v in rt.synthesizer.voices()])
        if await admit(RefusingInOpenAIShape(ws, translator)):
            await run_session(ws, RealtimeFrontEnd(ws, translator, rt.metrics), rt)

    # The FunASR C++ server answers on any path (its HTML5 client suggests /wss/): every WebSocket
    # path not served above is the FunASR runtime too. Registered last, so it shadows nothing.
    app.add_api_websocket_route("/{path:path}", funasr)

    if settings.server.record_input_s:

        @app.get("/debug/input/{session_id}.wav")
        async def recorded_input(session_id: str) -> Response:
            wav = rt.input_recorder.wav(session_id)
            if wav is None:
                return JSONResponse({"error": f"no recording for session {session_id}"}, status_code=404)
            return Response(wav, media_type="audio/wav")

    @app.get("/")
    async def index() -> FileResponse:
        return FileResponse(settings.server.static_dir / "index.html")

    app.mount("/static", StaticFiles(directory=settings.server.static_dir), name="static")
    return app


async def _refuse(ws: WebSocket, rt: Runtime, code: str, message: str, close_code: int, reason: str, refusal: str | None = None,
                  **extra) -> None:
    """Refuse a connection, counted in voicebot_sessions_refused_total by `refusal` (what was full:
    max_sessions, per_client, input_lag, input_lag_forecast, pool_load, cold_start, decoders, synthesizer), else by
    the error code."""
    rt.metrics.sessions_refused.labels(refusal or code).inc()
    log.info("refused a connection (%s): %s", refusal or code, message)
    rt.metrics.errors.labels(code).inc()
    with contextlib.suppress(Exception):
        await ws.send_json(protocol.error(code, message, **extra))
        await ws.close(close_code, reason)


def _report_load(rt: Runtime) -> None:
    for pool in rt.admission.pools:
        rt.metrics.worker_load.labels(pool.worker.name).set(pool.load())


def _drain_on_sigterm(rt: Runtime) -> None:
    """On SIGTERM: refuse new sessions, let replies in progress finish (bounded), then let the
    server's own handler (uvicorn's) stop it. Works for run_server.py and plain uvicorn alike."""
    loop = asyncio.get_running_loop()
    previous = signal.getsignal(signal.SIGTERM)

    async def drain() -> None:
        rt.draining = True
        await rt.wait_until(lambda: not rt.replies_in_progress(), rt.settings.server.shutdown_timeout_s)
        log.info("drained: %d replies still in progress", rt.replies_in_progress())
        # Closed here with 1001 and an error event, as documented; uvicorn's own stop would use 1012.
        for session in list(rt.sessions.values()):
            session.request_close(CloseCode.GOING_AWAY, ErrorCode.SHUTTING_DOWN, "the server is shutting down")
        await rt.wait_until(lambda: not rt.sessions, 2)
        loop.remove_signal_handler(signal.SIGTERM)
        if callable(previous):
            previous(signal.SIGTERM, None)
        else:
            signal.raise_signal(signal.SIGTERM)

    # Not available off the main thread (a server run in a test thread) or on Windows.
    with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
        loop.add_signal_handler(signal.SIGTERM, lambda: asyncio.ensure_future(drain()))


def _module_app() -> FastAPI:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    return create_app()


app = _module_app()
