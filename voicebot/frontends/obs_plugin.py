"""/obs/audio: the wire format of the obs-audio-to-websocket OBS plugin, run as a channel's speaker.

The plugin (github.com/bryanveloso/obs-audio-to-websocket) streams one OBS audio source to a
WebSocket URL and ignores whatever the server sends back. Its messages, read from its source:
- text `{"type": "start", "timestamp": <µs>}` when it connects, `{"type": "stop", ...}` before it
  disconnects;
- binary, one per OBS audio tick (1024 frames, ~21 ms at 48 kHz): a little-endian header
  (timestamp u64 ns, sample rate u32, channels u32, bit depth u32, source-id length u32,
  source-name length u32), the two UTF-8 strings, then interleaved s16le PCM.

`ObsFrontEnd` translates such a connection for `run_session`: it opens the session with
`SessionStart {channel, echo_cancellation: true}` at 16 kHz (OBS may mix the bot's reply back into
the source it streams, and nothing on that path cancels it), turns each audio message into an
AudioChunk of 16 kHz mono PCM (downmix here, resampling in voicebot.audio.resample), `stop` into
EndInput, and drops what the session sends (the plugin would discard it; the channel's listeners,
e.g. the overlay, get it). `translate` is the whole translation in, with no I/O. A message that
cannot be used is counted (voicebot_obs_bad_chunks_total{reason}), logged once per reason per
connection, and skipped; like a start, it never reaches the session.
"""

from __future__ import annotations

import logging
import struct
from dataclasses import dataclass

import numpy as np
from voicebot.audio.rates import LISTEN_RATE
from voicebot.audio.resample import StreamResampler, float_to_pcm16
from voicebot.metrics import Metrics
from voicebot.protocol import EndInput, ProtocolError, SessionStart, load_json
from voicebot.session import Session
from voicebot.session.commands import AudioChunk, Command
from voicebot.session.events import Outbound
from voicebot.transport import Wire

log = logging.getLogger("voicebot.obs")

HEADER = struct.Struct("<QIIIII")  # timestamp, sample rate, channels, bit depth, id length, name length
# Limits on what a header may declare. OBS runs at 44.1 or 48 kHz with up to 8 channels (7.1).
MIN_RATE, MAX_RATE = 8000, 192000
MAX_CHANNELS = 8
MAX_NAME_BYTES = 1024
MAX_CHUNK_SECONDS = 1.0  # the plugin sends ~21 ms; a chunk over 1 s is not from it


class BadChunk(ValueError):
    """A message that cannot be used; `reason` is a stable label for metrics."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


@dataclass(frozen=True)
class ObsChunk:
    timestamp_ns: int
    sample_rate: int
    channels: int
    source_id: str
    source_name: str
    pcm: bytes  # interleaved s16le, `channels` samples per frame


def parse_chunk(data: bytes) -> ObsChunk:
    """Parse one binary message of the plugin; raise BadChunk if it is not one."""
    if len(data) < HEADER.size:
        raise BadChunk("truncated_header", f"{len(data)} bytes, shorter than the {HEADER.size}-byte header")
    timestamp, rate, channels, bits, id_len, name_len = HEADER.unpack_from(data)
    if not MIN_RATE <= rate <= MAX_RATE:
        raise BadChunk("bad_sample_rate", f"sample rate {rate} outside {MIN_RATE}-{MAX_RATE} Hz")
    if not 1 <= channels <= MAX_CHANNELS:
        raise BadChunk("bad_channels", f"{channels} channels; expected 1-{MAX_CHANNELS}")
    if bits != 16:
        raise BadChunk("bad_bit_depth", f"bit depth {bits}; the plugin sends 16-bit PCM")
    if id_len > MAX_NAME_BYTES or name_len > MAX_NAME_BYTES:
        raise BadChunk("bad_names", f"source id/name lengths {id_len}/{name_len} over {MAX_NAME_BYTES} bytes")
    pcm_start = HEADER.size + id_len + name_len
    if len(data) < pcm_start:
        raise BadChunk("truncated_names", f"{len(data)} bytes, shorter than header plus names ({pcm_start})")
    pcm = data[pcm_start:]
    frame_bytes = 2 * channels
    if len(pcm) % frame_bytes:
        raise BadChunk("partial_frame", f"{len(pcm)} PCM bytes is not a whole number of {channels}-channel frames")
    if len(pcm) > MAX_CHUNK_SECONDS * rate * frame_bytes:
        raise BadChunk("chunk_too_large", f"{len(pcm) // frame_bytes} frames is over {MAX_CHUNK_SECONDS:g} s at {rate} Hz")
    source_id = data[HEADER.size : HEADER.size + id_len].decode("utf-8", "replace")
    source_name = data[HEADER.size + id_len : pcm_start].decode("utf-8", "replace")
    return ObsChunk(timestamp, rate, channels, source_id, source_name, pcm)


class ObsAudio:
    """Downmixes and resamples one connection's chunks to 16 kHz mono s16le."""

    def __init__(self) -> None:
        self._resampler: StreamResampler | None = None

    def convert(self, chunk: ObsChunk) -> bytes:
        frames = np.frombuffer(chunk.pcm, dtype="<i2").reshape(-1, chunk.channels)
        mono = frames.mean(axis=1, dtype=np.float32) / 32768.0
        if self._resampler is None or self._resampler.in_rate != chunk.sample_rate:
            # OBS's rate changes only when its audio settings change (which restarts its audio).
            self._resampler = StreamResampler(chunk.sample_rate, LISTEN_RATE)
        return float_to_pcm16(self._resampler.process(mono))


class ObsFrontEnd:
    """One obs-audio-to-websocket connection, as a channel's speaking session (see module doc)."""

    def __init__(self, channel: str, metrics: Metrics) -> None:
        self._channel = channel
        self._metrics = metrics
        self._audio = ObsAudio()
        self._bad: dict[str, int] = {}  # reason -> count, for this connection
        self.source: str | None = None

    async def start(self, session: Session) -> None:
        await session.handle(SessionStart(type="session.start", sample_rate=LISTEN_RATE, channel=self._channel,
                                          echo_cancellation=True))

    async def on_message(self, session: Session, message: Wire) -> None:
        command = self.translate(message)
        if command is not None and session.arrived(len(command.pcm) if isinstance(command, AudioChunk) else 0):
            await session.handle(command)

    async def deliver(self, message: Outbound) -> None:
        """Dropped: the plugin ignores what the server sends (listeners on the channel get it)."""

    def ended(self) -> None:
        if self._bad:
            log.warning("obs plugin on channel %r disconnected; messages skipped: %s", self._channel, self._bad)

    def translate(self, message: Wire) -> Command | None:
        """One plugin message as the command it stands for; None to skip it."""
        try:
            if isinstance(message, str):
                return self._control(message)
            pcm = self._audio.convert(self._chunk(message))
            return AudioChunk(pcm) if pcm else None  # a resampler still filling gives nothing yet
        except BadChunk as exc:
            self._count_bad(exc)
        return None

    def _control(self, text: str) -> Command | None:
        try:
            message = load_json(text)  # the input policy of every route (voicebot.protocol)
        except ProtocolError as exc:
            raise BadChunk("bad_control", f"text message refused ({exc.code}): {exc.message}") from None
        if not isinstance(message, dict):
            raise BadChunk("bad_control", f"text message is not a JSON object: {text[:80]!r}")
        kind = message.get("type")
        if kind == "stop":
            # Whatever was being said when the streamer pressed stop still gets transcribed.
            return EndInput(type="input.end")
        if kind != "start":
            raise BadChunk("bad_control", f"unknown control message type {str(kind)[:80]!r}")
        return None

    def _chunk(self, data: bytes) -> ObsChunk:
        chunk = parse_chunk(data)
        if self.source is None:
            self.source = chunk.source_name or chunk.source_id
            log.info("obs plugin on channel %r: source %r, %d Hz, %d channels", self._channel, self.source, chunk.sample_rate, chunk.channels)
        return chunk

    def _count_bad(self, exc: BadChunk) -> None:
        self._metrics.obs_bad_chunks.labels(exc.reason).inc()
        self._bad[exc.reason] = self._bad.get(exc.reason, 0) + 1
        if self._bad[exc.reason] == 1:  # once per reason: a broken sender repeats ~47 times a second
            log.warning("obs plugin on channel %r: skipped a message (%s): %s", self._channel, exc.reason, exc)


