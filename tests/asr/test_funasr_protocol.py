"""The FunASR 2-pass protocol logic, without sockets: a scripted endpointer and the tiny model.

The expected shapes are the C++ 2-pass server's (runtime/websocket/bin/websocket-server-2pass.cpp):
results labelled 2pass-online / 2pass-offline in every mode, one is_final at the end, and a
refused stream ended by a final result whose text says why.
"""

from __future__ import annotations

import asyncio
import io
import json

import numpy as np
import pytest
import soundfile

from tests.asr.tiny_models import synthetic_speech
from voicebot.audio.endpoint import EventKind, VadEvent
from voicebot.audio.resample import float_to_pcm16
from voicebot.frontends.funasr_protocol import EngineFailed, FunasrSession
from voicebot.metrics import Metrics
from voicebot.serving.vad import VadOverloaded

FRAME = 1920  # bytes: the 60 ms frames FunASR clients send


class ScriptedSegmenter:
    """Speech from the first frame; the utterance ends every `utterance_samples` and at force_end."""

    def __init__(self, utterance_samples: int = 10**9) -> None:
        self.utterance_samples = utterance_samples
        self.in_speech = 0

    async def process(self, audio: np.ndarray) -> list[VadEvent]:
        events = []
        if len(audio):
            events.append(VadEvent(EventKind.START if self.in_speech == 0 else EventKind.AUDIO, audio))
            self.in_speech += len(audio)
        if self.in_speech >= self.utterance_samples:
            events += await self.force_end()
        return events

    async def force_end(self) -> list[VadEvent]:
        if not self.in_speech:
            return []
        self.in_speech = 0
        return [VadEvent(EventKind.END, np.zeros(0, np.float32))]


def converse(recognizer, mode: str, pcm: bytes, frame: int = FRAME, segmenter=None, **fields) -> list[dict]:
    async def run():
        session = FunasrSession(recognizer, segmenter or ScriptedSegmenter(), Metrics())
        init = {"mode": mode, "chunk_size": [5, 10, 5], "chunk_interval": 10, "wav_name": "clip",
                "wav_format": "pcm", "audio_fs": 16000, "is_speaking": True, "hotwords": "", "itn": True} | fields
        replies = await session.on_text(json.dumps(init))
        for start in range(0, len(pcm), frame):
            replies += await session.on_audio(pcm[start : start + frame])
        replies += await session.on_text(json.dumps({"is_speaking": False}))
        await session.close()
        return replies

    return asyncio.run(run())


PCM = float_to_pcm16(synthetic_speech(4.0, seed=40))


def one_shot(recognizer) -> str:
    return recognizer.streaming.decode_blocking(synthetic_speech(4.0, seed=40)).text


def test_2pass_deltas_then_final(recognizer):
    replies = converse(recognizer, "2pass", PCM)
    online = [r for r in replies if r["mode"] == "2pass-online"]
    offline = [r for r in replies if r["mode"] == "2pass-offline"]
    assert len(online) >= 3 and len(offline) == 1
    # The online deltas are the beginning of the final text; only the last message is final.
    assert offline[0]["text"].startswith("".join(r["text"] for r in online))
    assert offline[0]["text"] == one_shot(recognizer)
    assert [r["is_final"] for r in replies] == [False] * (len(replies) - 1) + [True]
    assert replies[-1] is offline[0] and replies[-1]["asr_model"] == "asr.paraformer.model"
    assert 0 < replies[-1]["confidence"] <= 1 and replies[-1]["fallback"] is None
    assert all(r["wav_name"] == "clip" and "timestamp" not in r for r in replies)


def test_online_deltas_concatenate_and_each_utterance_ends_in_2pass_offline(recognizer):
    # As the C++ server: 2pass-online deltas, then the utterance's streamed text as 2pass-offline
    # (funasr-client merges only 2pass-offline: with "online" labels its merged text was empty).
    replies = converse(recognizer, "online", PCM)
    online = [r for r in replies if r["mode"] == "2pass-online"]
    assert [r["mode"] for r in replies] == ["2pass-online"] * len(online) + ["2pass-offline"]
    assert "".join(r["text"] for r in online) == replies[-1]["text"] == one_shot(recognizer)
    assert replies[-1]["is_final"] and not any(r["is_final"] for r in replies[:-1])
    assert 0 < replies[-1]["confidence"] <= 1


def test_offline_one_result_per_utterance(recognizer):
    # Three utterances cut by the endpointer, then the client's end (nothing left: empty final).
    replies = converse(recognizer, "offline", PCM, segmenter=ScriptedSegmenter(utterance_samples=16000 * 4 // 3))
    assert [r["mode"] for r in replies] == ["2pass-offline"] * len(replies)
    assert len([r for r in replies if r["text"]]) == 3
    assert replies[-1]["is_final"] and not any(r["is_final"] for r in replies[:-1])


@pytest.mark.parametrize("wav_format", ["PCM", "Pcm"])
def test_wav_format_pcm_in_any_case(recognizer, wav_format):
    # The HTML5 client's file mode sends "PCM" for a .wav file; the C++ server takes it.
    replies = converse(recognizer, "offline", PCM, wav_format=wav_format)
    assert replies[-1]["text"] == one_shot(recognizer) and "error" not in replies[-1]


def test_audio_fs_as_a_string(recognizer):
    replies = converse(recognizer, "offline", PCM, audio_fs="16000")
    assert replies[-1]["text"] == one_shot(recognizer) and "error" not in replies[-1]


def test_frames_splitting_samples_and_8k_input(recognizer):
    # Odd-sized frames split samples across frames: the text must not change.
    assert converse(recognizer, "offline", PCM, frame=1001)[-1]["text"] == one_shot(recognizer)
    pcm_8k = float_to_pcm16(synthetic_speech(2.0, seed=41, sample_rate=8000))

    async def run():
        session = FunasrSession(recognizer, ScriptedSegmenter(), Metrics())
        await session.on_text(json.dumps({"mode": "offline", "audio_fs": 8000}))
        await session.on_audio(pcm_8k)
        return await session.on_text(json.dumps({"is_speaking": False}))

    assert asyncio.run(run())[-1]["is_final"]


def test_is_end_is_acknowledged(recognizer):
    async def run():
        session = FunasrSession(recognizer, ScriptedSegmenter(), Metrics())
        await session.on_text(json.dumps({"mode": "2pass"}))
        await session.on_audio(PCM[:32000])
        return await session.on_text(json.dumps({"is_speaking": False, "is_end": True}))

    last = asyncio.run(run())[-1]
    assert last["is_final"] and last["is_end"] and last["mode"] == "2pass-offline"


def _encoded(audio: np.ndarray, wav_format: str) -> bytes:
    buffer = io.BytesIO()
    soundfile.write(buffer, audio, 16000, format=wav_format.upper())
    return buffer.getvalue()


@pytest.mark.parametrize("wav_format", ["wav", "flac"])
def test_offline_file_is_decoded_losslessly(recognizer, wav_format):
    # The file's header is read, not recognised as samples; frames split it anywhere.
    data = _encoded(synthetic_speech(4.0, seed=40), wav_format)
    replies = converse(recognizer, "offline", data, frame=1001, wav_format=wav_format)
    assert replies[-1]["text"] == one_shot(recognizer) and replies[-1]["is_final"]
    assert all("error" not in r for r in replies)


def test_offline_mp3_is_decoded(recognizer):
    speech = synthetic_speech(4.0, seed=40)
    replies = converse(recognizer, "offline", _encoded(speech, "mp3"), wav_format="mp3")
    # Lossy, so not the same samples; what matters is that the header is not taken for PCM.
    assert replies[-1]["text"] and replies[-1]["is_final"] and "error" not in replies[-1]
    raw = converse(recognizer, "offline", _encoded(speech, "mp3"), wav_format="pcm")
    assert raw[-1]["text"] != replies[-1]["text"]


def test_undecodable_file_ends_the_stream_with_an_error(recognizer):
    replies = converse(recognizer, "offline", b"ID3 not really an mp3" * 100, wav_format="mp3")
    assert replies[-1]["is_final"] and replies[-1]["text"].startswith("ERROR.") and "mp3" in replies[-1]["error"]


@pytest.mark.parametrize("mode", ["offline", "2pass", "online"])
@pytest.mark.parametrize("wav_format", ["others", "mp3", "wav"])
def test_a_file_is_decoded_by_its_bytes_whatever_its_label_and_mode(recognizer, mode, wav_format):
    # The runtime's clients label every file but .wav/.pcm "others" (in their default 2pass mode);
    # a label that names another format (FLAC bytes called mp3 or wav) is not believed either.
    data = _encoded(synthetic_speech(4.0, seed=40), "flac")
    replies = converse(recognizer, mode, data, frame=19200, wav_format=wav_format, is_end=True)
    assert all("error" not in r for r in replies)
    offline = [r["text"] for r in replies if r["mode"] == "2pass-offline"]
    assert "".join(offline) == one_shot(recognizer)
    assert replies[-1]["is_final"] and sum(r["is_final"] for r in replies) == 1


def _ended(recognizer, first: dict, audio: bytes, end: dict) -> list[dict]:
    """The replies to a first message, audio, and the client's end (as the runtime's Python client sends them)."""
    async def run():
        session = FunasrSession(recognizer, ScriptedSegmenter(), Metrics())
        replies = await session.on_text(json.dumps({"wav_name": "w", "is_speaking": True} | first))
        for start in range(0, len(audio), 19200):
            replies += await session.on_audio(audio[start : start + 19200])
        return replies + await session.on_text(json.dumps(end))

    return asyncio.run(run())


END = {"is_speaking": False, "is_end": True}


@pytest.mark.parametrize("first, audio, complaint", [
    ({"mode": "2pass", "wav_format": "others"}, b"ID3 not really an mp3" * 1000, "wav_format 'others'"),  # at the end
    ({"mode": "3pass"}, PCM[:FRAME * 3], "mode must be"),  # at the first message
    ({"mode": "offline", "audio_fs": "fast"}, b"", "audio_fs"),  # and no audio after it
])
def test_the_clients_is_end_is_echoed_by_an_error_final_too(recognizer, first, audio, complaint):
    # funasr_wss_client.py waits (300 s) for a message with is_end: true, then reads is_final and
    # error; the one answer to its end must carry it, an error too, and nothing after it.
    replies = _ended(recognizer, first, audio, END)
    ends = [r for r in replies if r.get("is_end")]
    assert len(ends) == 1 and ends[0] is replies[-1]
    assert ends[0]["is_final"] and complaint in ends[0]["error"] and ends[0]["text"].startswith("ERROR.")


@pytest.mark.parametrize("fields, complaint", [
    ({"mode": "3pass"}, "mode must be"),
    ({"audio_fs": 96000}, "audio_fs"),
    ({"audio_fs": "fast"}, "audio_fs"),
])
def test_refused_first_message_ends_the_stream_with_an_error_result(recognizer, fields, complaint):
    # As the C++ server ends a stream it cannot decode: a final result whose text says why, with
    # the client's wav_name; the audio that follows is dropped, counted and reported.
    async def run():
        session = FunasrSession(recognizer, ScriptedSegmenter(), Metrics())
        first = await session.on_text(json.dumps({"wav_name": "mine.wav", "is_speaking": True} | fields))
        dropped = await session.on_audio(PCM[:FRAME])
        end = await session.on_text(json.dumps({"is_speaking": False}))
        return first, dropped, end, session.dropped_bytes

    first, dropped, end, dropped_bytes = asyncio.run(run())
    (error,) = first
    assert error["mode"] == "2pass-offline" and error["wav_name"] == "mine.wav" and error["is_final"]
    assert error["text"] == f"ERROR. {error['error']}" and complaint in error["error"]
    assert dropped == [] and dropped_bytes == FRAME
    assert f"{FRAME} bytes" in end[0]["error"] and end[0]["is_final"]


@pytest.mark.parametrize("message, complaint", [("{not json", "not JSON"), ('["a list"]', "JSON object")])
def test_unreadable_message_ends_the_stream(recognizer, message, complaint):
    session = FunasrSession(recognizer, ScriptedSegmenter(), Metrics())
    (error,) = asyncio.run(session.on_text(message))
    assert error["is_final"] and complaint in error["error"] and error["text"].startswith("ERROR.")


def test_refusal_mid_stream_keeps_what_was_said_then_a_new_stream_starts(recognizer):
    async def run():
        session = FunasrSession(recognizer, ScriptedSegmenter(), Metrics())
        await session.on_text(json.dumps({"mode": "2pass", "wav_name": "a"}))
        for start in range(0, len(PCM), FRAME):
            await session.on_audio(PCM[start : start + FRAME])
        refused = await session.on_text(json.dumps({"mode": "3pass"}))
        await session.on_text(json.dumps({"mode": "offline", "wav_name": "b", "is_speaking": True}))
        await session.on_audio(PCM)
        again = await session.on_text(json.dumps({"is_speaking": False}))
        return refused, again, session.dropped_bytes

    refused, again, dropped_bytes = asyncio.run(run())
    assert refused[-2]["mode"] == "2pass-offline" and refused[-2]["text"] == one_shot(recognizer)
    assert refused[-1]["is_final"] and "mode must be" in refused[-1]["error"]
    assert again[-1]["wav_name"] == "b" and again[-1]["text"] == one_shot(recognizer) and dropped_bytes == 0


# ---- an overloaded VAD, and engines that fail ---------------------------------------------------

class OverloadedAt(ScriptedSegmenter):
    """The VAD batcher full at the `at`-th process call (0-based): that piece is never judged."""

    def __init__(self, at: int, utterance_samples: int = 10**9) -> None:
        super().__init__(utterance_samples)
        self.at, self.calls = at, 0

    async def process(self, audio: np.ndarray) -> list[VadEvent]:
        self.calls += 1
        if self.calls - 1 == self.at:
            raise VadOverloaded("1024 VAD requests waiting (bound 1024)")
        return await super().process(audio)


def overloaded(metrics: Metrics) -> tuple[float, float, float]:
    """(overloads, seconds dropped for overload, busy results sent) so far."""
    sample = metrics.registry.get_sample_value
    return (sample("voicebot_engine_overloads_total", {"engine": "vad"}),
            sample("voicebot_input_dropped_seconds_total", {"reason": "overload"}) or 0.0,
            sample("voicebot_errors_total", {"code": "busy"}) or 0.0)


def stream_frames(recognizer, segmenter, mode: str = "2pass") -> tuple[list[dict], Metrics]:
    metrics = Metrics()

    async def run():
        session = FunasrSession(recognizer, segmenter, metrics)
        replies = await session.on_text(json.dumps({"mode": mode, "wav_name": "clip"}))
        for start in range(0, len(PCM), FRAME):
            replies += await session.on_audio(PCM[start : start + FRAME])
        replies += await session.on_text(json.dumps({"is_speaking": False}))
        await session.close()
        return replies

    return asyncio.run(run()), metrics


FRAME_SAMPLES = FRAME // 2
UTTERANCE = 16000 * 2  # the scripted endpointer's utterances: 2 s of the audio it judged


@pytest.mark.parametrize("mode", ["2pass", "online"])
def test_an_overload_mid_utterance_loses_that_utterance_and_the_stream_goes_on(recognizer, mode):
    replies, metrics = stream_frames(recognizer, OverloadedAt(10, utterance_samples=UTTERANCE), mode)
    (busy,) = [r for r in replies if "error" in r]
    at = replies.index(busy)
    # Told at once, as the lost utterance's end: no text (clients concatenate it), not final.
    assert busy["mode"] == "2pass-offline" and busy["text"] == "" and not busy["is_final"] and busy["wav_name"] == "clip"
    assert busy["code"] == "busy" and busy["retry_after_s"] > 0 and busy["overloaded"] == "vad"
    assert "capacity" in busy["error"] and "utterance" in busy["error"]
    assert 0 < at and all(r["mode"] == "2pass-online" for r in replies[:at])  # partials of the lost one only
    # Nothing more of it: the next results are the second utterance's, recognised afresh.
    first_frames = -(-UTTERANCE // FRAME_SAMPLES) + 1  # the scripted VAD's first utterance, the lost piece included
    second = synthetic_speech(4.0, seed=40)[first_frames * FRAME_SAMPLES :]
    finals = [r for r in replies[at + 1 :] if r["mode"] == "2pass-offline"]
    assert [r["text"] for r in finals] == [recognizer.streaming.decode_blocking(second).text]
    assert finals[-1] is replies[-1] and replies[-1]["is_final"] and sum(r["is_final"] for r in replies) == 1
    # Every sample of the lost utterance counted: what was heard, the piece, the rest as it came.
    assert overloaded(metrics) == (1, pytest.approx(first_frames * FRAME_SAMPLES / 16000), 1)
    assert busy["dropped_s"] == pytest.approx(11 * FRAME_SAMPLES / 16000, abs=1e-3)  # at the notice: heard + the piece


def test_an_overload_between_utterances_drops_only_that_piece(recognizer):
    # The first piece, before the endpointer has started anything: nothing else is lost.
    replies, metrics = stream_frames(recognizer, OverloadedAt(0), "offline")
    busy, final = replies
    assert busy["code"] == "busy" and "utterance" not in busy["error"] and not busy["is_final"]
    assert busy["dropped_s"] == pytest.approx(FRAME_SAMPLES / 16000, abs=1e-3)
    rest = synthetic_speech(4.0, seed=40)[FRAME_SAMPLES:]
    assert final["is_final"] and "error" not in final and final["text"] == recognizer.streaming.decode_blocking(rest).text
    assert overloaded(metrics) == (1, pytest.approx(FRAME_SAMPLES / 16000), 1)


def test_an_overload_at_the_clients_end_is_followed_by_a_clean_final(recognizer):
    # The tail flushed at is_speaking=false finds the VAD full: the notice, then the final result.
    async def run():
        session = FunasrSession(recognizer, OverloadedAt(1), Metrics())
        await session.on_text(json.dumps({"mode": "2pass", "audio_fs": 8000}))  # a resampler tail to flush
        await session.on_audio(float_to_pcm16(synthetic_speech(1.0, seed=41, sample_rate=8000)))
        return await session.on_text(json.dumps({"is_speaking": False}))

    *_, busy, final = asyncio.run(run())
    assert busy["code"] == "busy" and not busy["is_final"]
    assert final["is_final"] and final["text"] == "" and "error" not in final


class BrokenSegmenter(ScriptedSegmenter):
    async def process(self, audio: np.ndarray) -> list[VadEvent]:
        raise RuntimeError("onnxruntime broke")


class BrokenAt:
    """The recognizer, its streams raising at `method` (accept or finish)."""

    def __init__(self, real, method: str) -> None:
        self.real, self.method = real, method

    def open(self, language=None):
        stream = self.real.open(language)

        async def broken(*args):
            raise RuntimeError(f"{self.method} broke")

        setattr(stream, self.method, broken)
        return stream


@pytest.mark.parametrize("broken, engine, stage, lost_samples", [
    (lambda r: (r, BrokenSegmenter()), "vad", "chunk", FRAME_SAMPLES),  # the piece never judged
    (lambda r: (BrokenAt(r, "accept"), ScriptedSegmenter()), "asr", "feed", FRAME_SAMPLES),  # the piece not taken
    # the utterance the scripted endpointer ended after 1 s, with no transcript
    (lambda r: (BrokenAt(r, "finish"), ScriptedSegmenter(utterance_samples=16000)), "asr", "finish", -(-16000 // FRAME_SAMPLES) * FRAME_SAMPLES),
])
def test_an_engine_failure_names_the_engine_and_stage_that_failed(recognizer, broken, engine, stage, lost_samples):
    engines, segmenter = broken(recognizer)
    metrics = Metrics()

    async def run():
        session = FunasrSession(engines, segmenter, metrics)
        await session.on_text(json.dumps({"mode": "2pass"}))
        for start in range(0, len(PCM), FRAME):
            await session.on_audio(PCM[start : start + FRAME])

    with pytest.raises(EngineFailed) as failed:
        asyncio.run(run())
    assert (failed.value.engine, failed.value.stage) == (engine, stage)
    assert "broke" in str(failed.value) and isinstance(failed.value.__cause__, RuntimeError)
    lost = metrics.registry.get_sample_value("voicebot_input_dropped_seconds_total", {"reason": "engine_error"})
    assert lost == pytest.approx(lost_samples / 16000)
