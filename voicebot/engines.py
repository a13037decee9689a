"""Build the engines a config selects. Imports are lazy: an engine's libraries load only if chosen.

The three engine interfaces live beside their engines, each in its package's base.py:
voicebot/asr/base.py (Recognizer, RecognizerStream), voicebot/reply/base.py (Responder) and
voicebot/tts/base.py (Synthesizer, SynthesisContext); what all three report (ResetReport,
EngineInfo) is in voicebot/engine_reports.py. Where each model's weights come from: voicebot/models.py.
"""

from __future__ import annotations

from voicebot.asr.base import Recognizer
from voicebot.config import Settings
from voicebot.reply.base import Responder
from voicebot.tts.base import Synthesizer


def build_recognizer(settings: Settings) -> Recognizer:
    engine = settings.asr.engine
    if engine == "pocketsphinx":
        from voicebot.asr.pocketsphinx import PocketsphinxRecognizer

        return PocketsphinxRecognizer(settings.asr.pocketsphinx)
    if engine == "paraformer":
        from voicebot.asr.paraformer import ParaformerRecognizer

        return ParaformerRecognizer(settings.asr.paraformer, settings.endpoint)
    if engine == "paraformer-batched":
        from voicebot.asr.paraformer import BatchedParaformerRecognizer

        return BatchedParaformerRecognizer(settings.asr.paraformer, settings.endpoint)
    raise ValueError(f"asr.engine: unknown engine {engine!r}")


def build_synthesizer(settings: Settings) -> Synthesizer:
    engine = settings.tts.engine
    if engine == "espeak":
        from voicebot.tts.espeak import EspeakSynthesizer

        return EspeakSynthesizer(settings.tts.espeak, settings.tts.voice)
    if engine == "cosyvoice2":
        from voicebot.tts.cosyvoice2.synthesizer import CosyVoice2Synthesizer

        return CosyVoice2Synthesizer(settings.tts.cosyvoice2, settings.tts.voice)
    raise ValueError(f"tts.engine: unknown engine {engine!r}")


def build_responders(settings: Settings) -> dict[str, Responder]:
    """Every responder a session may pick; `reply.engine` names the default. "openai" is offered
    whenever reply.openai has a base_url and a model, even while echo is the default."""
    from voicebot.reply.repeat import RepeatResponder

    responders: dict[str, Responder] = {RepeatResponder.name: RepeatResponder()}
    reply = settings.reply
    if reply.openai.base_url and reply.openai.model:
        from voicebot.reply.openai_compat import OpenAICompatResponder
        from voicebot.reply.persona import Personas

        responders["openai"] = OpenAICompatResponder(reply.openai, Personas(reply.persona, reply.voice_personas))
    return responders
