"""A local chat-completions server for tests: streams server-sent events exactly like the API.

Each request takes the next `Behaviour` from `plan` (or `default` when the plan is empty) and
records its JSON body and headers. `stream_closed` is set when a stream ends for any reason,
with `sent` counting the content chunks written so far: a test compares it with what the client
had when it went away. `cancelled` counts the streams the client closed before their end. Runs uvicorn in a thread on 127.0.0.1 and a free port.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse


@dataclass
class Behaviour:
    chunks: list[str] = field(default_factory=lambda: ["Hello", " there", "!"])
    first_delay_s: float = 0.0  # before the first content chunk
    interval_s: float = 0.0  # between content chunks
    status: int = 200
    drop_after: int | None = None  # break the connection after this many content chunks
    malformed_at: int | None = None  # send a chunk that is not JSON at this index instead
    done: bool = True  # end with finish_reason and [DONE]


def _event(payload: dict | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n".encode()


def _chunk(delta: dict, finish: str | None = None) -> dict:
    return {"id": "c1", "object": "chat.completion.chunk", "model": "test",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


class SSEServer:
    def __init__(self) -> None:
        self.plan: deque[Behaviour] = deque()
        self.default = Behaviour()
        self.requests: list[dict] = []
        self.sent = 0
        self.cancelled = 0
        self.stream_closed = threading.Event()
        self.app = self._build()
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        self._server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", lifespan="off"))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True)

    def start(self) -> "SSEServer":
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("the SSE test server did not start")
            time.sleep(0.01)
        return self

    def close_unstarted(self) -> None:
        """Give back the port of a server never started: a connection to `base_url` is refused."""
        self._sock.close()

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(5)

    def reset(self, *plan: Behaviour, default: Behaviour | None = None) -> None:
        self.plan = deque(plan)
        self.default = default or Behaviour()
        self.requests.clear()
        self.sent = 0
        self.cancelled = 0
        self.stream_closed.clear()

    def _build(self) -> FastAPI:
        app = FastAPI()

        @app.post("/v1/chat/completions")
        async def completions(request: Request):
            self.requests.append({"body": await request.json(), "headers": dict(request.headers)})
            b = self.plan.popleft() if self.plan else self.default
            if b.status != 200:
                return JSONResponse({"error": {"message": f"test failure {b.status}"}}, status_code=b.status)
            return StreamingResponse(self._stream(b), media_type="text/event-stream")

        return app

    async def _stream(self, b: Behaviour):
        self.sent = 0
        try:
            yield b": keep-alive comment\n\n"
            yield _event(_chunk({"role": "assistant", "content": ""}))
            yield _event(_chunk({"reasoning_content": "thinking..."}))  # vLLM reasoning parsers add these
            await asyncio.sleep(b.first_delay_s)
            for i, text in enumerate(b.chunks):
                if i == b.drop_after:
                    raise ConnectionAbortedError("dropping the connection, as planned")
                if i:
                    await asyncio.sleep(b.interval_s)
                yield _event("{not json" if i == b.malformed_at else _chunk({"content": text}))
                self.sent += 1
            if b.done:
                yield _event(_chunk({}, "stop"))
                yield _event({"id": "c1", "choices": [], "usage": {"completion_tokens": len(b.chunks)}})
                yield _event("[DONE]")
        except (asyncio.CancelledError, GeneratorExit):
            self.cancelled += 1  # the client closed the stream before its end
            raise
        finally:
            self.stream_closed.set()
