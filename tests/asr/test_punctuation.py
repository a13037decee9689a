"""asr.paraformer.punc_model: FunASR's CT-Transformer, random weights of the real class in the real
layout, loaded by the real loader; its marks reach the finals and the turn-taking policy."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import soundfile

from tests.asr.server import serve
from tests.asr.test_funasr_endpoint import TOKEN, stream
from tests.asr.tiny_models import synthetic_speech
from tests.audio import espeak_speech, to_pcm16
from tests.asr.tiny_punctuation import build_punctuation_dir
from tests.conftest import VoiceClient, make_settings, running_server, speech_pcm
from tests.unit.test_turn_taking import RATE, HeldModel, settle, smart_turn_taking
from voicebot.asr.base import Hypothesis
from voicebot.asr.paraformer import ParaformerRecognizer
from voicebot.asr.punctuation import Punctuator, with_end_mark
from voicebot.audio.turn_words import unpunctuated
from voicebot.config.engines import ParaformerConfig
from voicebot.messages import Utterance


@pytest.fixture(scope="module")
def punc_models(tmp_path_factory) -> dict:
    """Models that give every word one mark (so the test knows the answer), and one left random."""
    root = tmp_path_factory.mktemp("punc-models")
    return {mark: build_punctuation_dir(root / str(mark), mark=mark) for mark in ("，", "？", None)}


def test_the_text_ends_in_the_models_own_mark_not_funasrs_full_stop():
    assert with_end_mark("我想要。", "，") == "我想要，"
    assert with_end_mark("我想要。", "_") == "我想要"
    assert with_end_mark("你好吗？", "？") == "你好吗？"
    assert with_end_mark("我要，一杯。", "、") == "我要，一杯、"
    assert with_end_mark(" Hello,I want.", "，") == "Hello,I want,"  # after a Latin word, funasr's ASCII form
    assert with_end_mark("我想要", "<unk>") == "我想要"


def test_the_real_class_loads_and_marks_the_last_word_as_the_model_says(punc_models):
    comma = Punctuator("asr.paraformer.punc_model", punc_models["，"])
    comma.load()
    try:
        # funasr's own inference turns the last comma into a full stop; the punctuator keeps the model's word.
        assert comma._auto.generate(input="我想要一杯", cache={}, key="k")[0]["text"] == "我，想，要，一，杯。"
        assert comma.punctuate_blocking("我想要一杯") == "我，想，要，一，杯，"
        assert comma.punctuate_blocking("") == "" and comma.calls == 1
    finally:
        comma.close()
    random = Punctuator("asr.paraformer.punc_model", punc_models[None])
    random.load()
    try:
        text = random.punctuate_blocking("我最喜欢的游戏是围棋")
        assert unpunctuated(text).replace(" ", "") == "我最喜欢的游戏是围棋" and text != "我最喜欢的游戏是围棋"
    finally:
        random.close()


def test_the_realtime_class_is_refused(tmp_path):
    path = build_punctuation_dir(tmp_path / "realtime", kind="CTTransformerStreaming")
    with pytest.raises(ValueError, match="CTTransformerStreaming is not supported"):
        Punctuator("asr.paraformer.punc_model", path).load()


def recognized(tiny_models, punc_model) -> str:
    """What the streaming recognizer with the punctuation model gives for 3 s of speech."""
    recognizer = ParaformerRecognizer(ParaformerConfig(model=str(tiny_models["streaming"]), punc_model=str(punc_model)))
    recognizer.load()

    async def run() -> str:
        stream = recognizer.open()
        audio = synthetic_speech(3.0)
        for start in range(0, len(audio), 9600):
            await stream.accept(audio[start:start + 9600])
        return (await stream.finish()).text

    try:
        return asyncio.run(run())
    finally:
        recognizer.close()


@pytest.mark.parametrize("mark, answer, ends", [("？", 0.5, True), ("，", 0.9, False)])
def test_the_punctuated_final_is_what_the_turn_policy_weighs(tiny_models, punc_models, mark, answer, ends):
    text = recognized(tiny_models, punc_models[mark])
    assert text.endswith(mark) and text.count(mark) == len(unpunctuated(text).replace(" ", "")) > 1

    async def run() -> list:
        model, turns = HeldModel(), []
        taking, front_end = smart_turn_taking(model, np.ones(RATE, np.float32), turns, smart_early_ms=0,
                                              smart_words_hold=3.0, smart_words_go=2.0)
        front_end.silence_ms, front_end.endpointer.in_utterance = 160.0, False
        taking.on_endpoint()
        await settle()
        await model.answers.put(answer)  # alone: 0.5 waits, 0.9 goes (threshold 0.8)
        await settle()
        await taking.on_utterance(Utterance("u1", Hypothesis(text, None, "paraformer"), 0.0, 1000.0, 0, 0.16, 0.01))
        return turns

    turns = asyncio.run(run())
    # "？" at the end: the unsure answer goes; "，": the sure one waits for the user.
    assert [t.text for t in turns] == ([text] if ends else [])


def test_a_voice_session_gets_the_punctuated_final(tiny_models, punc_models):
    settings = make_settings(asr={"engine": "paraformer", "paraformer": {
        "model": str(tiny_models["streaming"]), "punc_model": str(punc_models["？"])}})

    async def talk(url: str) -> dict:
        async with VoiceClient.connect(url) as client:
            await client.stream(speech_pcm("今天天气很好"), speed=4)
            return await client.wait_for("asr.final")

    with running_server(settings) as server:
        final = asyncio.run(talk(server.ws_url))
    assert final["text"].endswith("？") and final["text"].count("？") == len(unpunctuated(final["text"]).replace(" ", ""))


def test_funasr_2pass_offline_results_are_punctuated(tiny_models, punc_models, tmp_path):
    settings = make_settings(asr={"engine": "paraformer", "paraformer": {
        "model": str(tiny_models["streaming"]), "punc_model": str(punc_models["？"])}},
        tts={"voice": "zh"}, server={"token": TOKEN})
    path = tmp_path / "speech.wav"
    speech = np.concatenate([np.zeros(4000, np.float32), espeak_speech("今天天气很好", voice="cmn"), np.zeros(16000, np.float32)])
    soundfile.write(path, np.frombuffer(to_pcm16(speech), "<i2"), 16000)
    with serve(settings) as port:
        messages = stream(f"ws://127.0.0.1:{port}/funasr", path, "2pass")
    finals = [m["text"] for m in messages if m["mode"] == "2pass-offline" and m["text"]]
    partials = "".join(m["text"] for m in messages if m["mode"] == "2pass-online")
    assert finals and all(text.endswith("？") for text in finals)
    assert partials and "？" not in partials  # the streaming partials stay as the recognizer gives them
