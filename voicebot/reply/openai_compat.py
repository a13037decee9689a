"""Replies streamed from any OpenAI-compatible chat-completions endpoint.

vLLM, Ollama, LM Studio, DashScope's compatible mode and OpenAI all take
`POST {base_url}/chat/completions` with `"stream": true` and answer with server-sent events:
`data: {"choices": [{"delta": {"content": "..."}}]}` lines, ended by `data: [DONE]`.

httpx, not the openai SDK: httpx is already a dependency, and a voice reply needs control the SDK
does not give: a first-token deadline, an idle one between deltas and a total one (the SDK has
per-read timeouts), retries only until the first delta (after it, the listener has heard words,
so a retry would repeat them), a bounded line buffer, and tolerance of what compatible servers add (keep-alive
comments, `reasoning_content` deltas, an `error` object in mid-stream). Closing the generator
(barge-in cancels the reply) closes the HTTP response at once, so the server stops generating.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from typing import AsyncIterator

import httpx

from voicebot.config.engines import OpenAICompatConfig
from voicebot.engine_reports import EngineInfo
from voicebot.reply.base import Message, Responder, ResponderError
from voicebot.reply.persona import Personas

log = logging.getLogger("voicebot.reply.openai")

MAX_LINE_BYTES = 64 * 1024  # an SSE line longer than this is not a chat chunk
MAX_ERROR_BODY = 500  # bytes of an error response quoted in the error event
RETRY_STATUS = frozenset({408, 409, 425, 429, 500, 502, 503, 504})


class _AttemptFailed(ResponderError):
    def __init__(self, kind: str, message: str, retryable: bool = True) -> None:
        super().__init__(kind, message)
        self.retryable = retryable


class OpenAICompatResponder(Responder):
    name = "openai"

    def __init__(self, config: OpenAICompatConfig, personas: Personas) -> None:
        self.config = config
        self.personas = personas
        self.url = config.base_url.rstrip("/") + "/chat/completions"
        self._headers = {"Accept": "text/event-stream"}
        self._client: httpx.AsyncClient | None = None

    def load(self) -> None:
        self.personas.load()
        # Made here, not on the first reply: building its TLS context takes ~100 ms. It is kept,
        # so later replies reuse the connection (a few ms to the first token instead of a connect).
        c = self.config.connect_timeout_s
        # Reads have no httpx timeout: the first-token and total deadlines bound them.
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(connect=c, read=None, write=c, pool=c))
        if self.config.api_key_env:
            key = os.environ.get(self.config.api_key_env)
            if not key:
                raise ValueError(
                    f"reply.openai.api_key_env names {self.config.api_key_env}, which is not set in the environment"
                )
            self._headers["Authorization"] = f"Bearer {key}"

    def info(self) -> EngineInfo:
        return EngineInfo("reply", self.name, "remote", True, {"url": self.url, "model": self.config.model})

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def reply(self, history: list[Message], text: str, voice: str | None = None) -> AsyncIterator[str]:
        c = self.config
        payload = {
            **c.extra_body,
            "model": c.model,
            "messages": chat_messages(self.personas.system_prompt(voice), history, text),
            "stream": True,
            "temperature": c.temperature,
            "max_tokens": c.max_tokens,
        }
        loop = asyncio.get_running_loop()
        deadline = loop.time() + c.total_timeout_s
        attempt = 0
        while True:
            spoke = False
            try:
                # Closed explicitly, so a consumer that stops closes the HTTP response now.
                async with contextlib.aclosing(self._attempt(payload, deadline)) as deltas:
                    async for delta in deltas:
                        spoke = True
                        yield delta
                return
            except _AttemptFailed as exc:
                delay = c.retry_backoff_s * 2**attempt
                if spoke or not exc.retryable or attempt >= c.retries or loop.time() + delay >= deadline:
                    raise
                attempt += 1
                log.warning("reply attempt %d failed (%s: %s); retrying in %.2f s", attempt, exc.kind, exc, delay)
                await asyncio.sleep(delay)

    async def _attempt(self, payload: dict, deadline: float) -> AsyncIterator[str]:
        """One request: its content deltas. Raises _AttemptFailed."""
        loop = asyncio.get_running_loop()
        first_by = min(deadline, loop.time() + self.config.first_token_timeout_s)
        spoke = False

        async def before_deadline(awaitable):
            c = self.config
            if spoke:  # a stream that stalls after its first words: no retry, the listener heard them
                limit, kind, message = loop.time() + c.idle_timeout_s, "idle_timeout", f"no more reply text for {c.idle_timeout_s:g} s"
            else:
                limit, kind, message = first_by, "first_token_timeout", f"no reply text within {c.first_token_timeout_s:g} s"
            if limit >= deadline:
                limit, kind, message = deadline, "total_timeout", f"no complete reply within {c.total_timeout_s:g} s"
            try:
                return await asyncio.wait_for(awaitable, max(0.0, limit - loop.time()))
            except asyncio.TimeoutError:
                raise _AttemptFailed(kind, message, retryable=kind == "first_token_timeout") from None

        client = self._client
        request = client.build_request("POST", self.url, json=payload, headers=self._headers)
        try:
            response = await before_deadline(client.send(request, stream=True))
        except httpx.TransportError as exc:
            raise _AttemptFailed("connect", f"cannot reach {self.url}: {exc!r}") from None
        try:
            if response.status_code >= 400:
                body = await before_deadline(_head(response))
                raise _AttemptFailed(
                    "status", f"{self.url} answered {response.status_code}: {body}", response.status_code in RETRY_STATUS
                )
            finished = False
            thoughts = _ThinkFilter()
            async with contextlib.aclosing(_sse_data(response.aiter_bytes())) as lines:
                while (data := await before_deadline(anext(lines, None))) not in (None, "[DONE]"):
                    content, done = _content(data)
                    finished = finished or done
                    if speech := thoughts.push(content):
                        spoke = True
                        yield speech
            if not (finished or data == "[DONE]"):
                raise _AttemptFailed("dropped", "the stream ended before the reply was complete")
            if speech := thoughts.finish():
                yield speech
        except httpx.TransportError as exc:  # the connection broke in mid-stream
            raise _AttemptFailed("dropped", f"the stream broke off: {exc!r}") from None
        finally:
            await response.aclose()


class _ThinkFilter:
    """Drops a reply's leading <think>...</think> block: Qwen3 and DeepSeek-R1 served without a
    reasoning parser think aloud in `content`, and a show must not speak that. Holds back at most
    the length of the closing tag while thinking."""

    OPEN, CLOSE = "<think>", "</think>"

    def __init__(self) -> None:
        self._state = "start"  # start -> (think ->) speak
        self._held = ""

    def push(self, text: str) -> str:
        if self._state == "speak":
            return text
        self._held += text
        if self._state == "start":
            head = self._held.lstrip()
            if self.OPEN.startswith(head):
                return ""  # "", "<", "<thi": cannot tell yet
            if not head.startswith(self.OPEN):
                self._state, out, self._held = "speak", self._held, ""
                return out
            self._state, self._held = "think", head[len(self.OPEN) :]
        end = self._held.find(self.CLOSE)
        if end < 0:
            self._held = self._held[-len(self.CLOSE) :]
            return ""
        self._state, out, self._held = "speak", self._held[end + len(self.CLOSE) :].lstrip(), ""
        return out

    def finish(self) -> str:
        """What was held back when the reply ends ("<thi" was text after all)."""
        out, self._held = (self._held if self._state == "start" else ""), ""
        return out


def chat_messages(system: str | None, history: list[Message], text: str) -> list[Message]:
    """System prompt, history and the new user text, with consecutive same-role messages merged:
    a reply interrupted before anything was heard leaves two user turns in a row, and strict chat
    templates (Gemma, Mistral) reject roles that do not alternate. A system message heading the
    history (a client's own instructions, voicebot/frontends/realtime.py) takes the persona's place."""
    if history and history[0]["role"] == "system":
        system, history = history[0]["content"], history[1:]
    messages: list[Message] = [{"role": "system", "content": system}] if system else []
    for message in [*history, {"role": "user", "content": text}]:
        if messages and messages[-1]["role"] == message["role"]:
            messages[-1] = {"role": message["role"], "content": messages[-1]["content"] + "\n" + message["content"]}
        else:
            messages.append({"role": message["role"], "content": message["content"]})
    return messages


async def _head(response: httpx.Response) -> str:
    """The start of an error response's body, for the message."""
    body = b""
    async for chunk in response.aiter_bytes():
        body += chunk
        if len(body) >= MAX_ERROR_BODY:
            break
    return body[:MAX_ERROR_BODY].decode("utf-8", errors="replace")


async def _sse_data(chunks: AsyncIterator[bytes]) -> AsyncIterator[str]:
    """The `data:` payloads of a server-sent event stream (comments and other fields skipped)."""
    buffer = b""
    async for chunk in chunks:
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        if len(buffer) > MAX_LINE_BYTES:
            raise _AttemptFailed("malformed", f"an event line longer than {MAX_LINE_BYTES} bytes")
        for line in lines:
            if line.startswith(b"data:"):
                yield line[5:].strip().decode("utf-8", errors="replace")


def _content(data: str) -> tuple[str, bool]:
    """(text of the delta, whether the choice finished) of one chunk."""
    try:
        chunk = json.loads(data)
    except json.JSONDecodeError:
        raise _AttemptFailed("malformed", f"a chunk that is not JSON: {data[:200]!r}") from None
    if not isinstance(chunk, dict):
        raise _AttemptFailed("malformed", f"a chunk that is not an object: {data[:200]!r}")
    if "error" in chunk:  # vLLM and OpenAI report failures after the 200 this way
        error = chunk["error"]
        message = error.get("message", error) if isinstance(error, dict) else error
        raise _AttemptFailed("server_error", f"the server reported an error: {message}")
    choices = chunk.get("choices") or []  # a usage-only chunk has none
    if not choices:
        return "", False
    choice = choices[0] if isinstance(choices, list) else None
    delta = (choice.get("delta") or {}) if isinstance(choice, dict) else None
    content = delta.get("content") if isinstance(delta, dict) else None
    if not isinstance(delta, dict) or not isinstance(content, (str, type(None))):
        raise _AttemptFailed("malformed", f"a chunk without a text delta: {data[:200]!r}")
    return content or "", choice.get("finish_reason") is not None
