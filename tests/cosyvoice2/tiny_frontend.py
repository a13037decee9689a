"""Stand-ins for the frontend files the fixture directory lacks: a tiny Qwen-style tokenizer and
tiny ONNX graphs with the input/output signatures of campplus.onnx and speech_tokenizer_v2.onnx."""

from __future__ import annotations

import json
import string
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from voicebot.tts.cosyvoice2.hparams import load_hparams

SPEECH_CODES = 6561


def make_tokenizer(directory: Path, vocab_size: int) -> Path:
    """A byte-level BPE saved as a HF tokenizer dir; ids stay below `vocab_size` with the CosyVoice specials added."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from voicebot.tts.cosyvoice2.frontend import SPECIAL_TOKENS

    n_specials = 1 + len(SPECIAL_TOKENS)  # <|endoftext|> and the CosyVoice list (which starts with the im_ pair)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # The alphabet is printable ASCII only, so even a 256-row embedding table holds every id.
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - n_specials, show_progress=False)
    corpus = ["Hello world. This is a tiny test of the tokenizer, one two three!", string.printable]
    tok.train_from_iterator(corpus * 4, trainer)
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "Qwen2Tokenizer", "eos_token": "<|endoftext|>", "model_max_length": 32768}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def _save(graph: onnx.GraphProto, path: Path) -> Path:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8  # readable by every onnxruntime we support
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def make_campplus(path: Path, seed: int = 0) -> Path:
    """fbank (1, T, 80) → mean over time of a 80×192 projection: (1, 192)."""
    weight = np.random.default_rng(seed).standard_normal((80, 192)).astype(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["input", "w"], ["proj"]),
            helper.make_node("ReduceMean", ["proj"], ["embedding"], axes=[1], keepdims=0),
        ],
        "tiny_campplus",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, "T", 80])],
        [helper.make_tensor_value_info("embedding", TensorProto.FLOAT, [1, 192])],
        initializer=[numpy_helper.from_array(weight, "w")],
    )
    return _save(graph, path)


def make_speech_tokenizer(path: Path, codes: int = SPEECH_CODES) -> Path:
    """log-mel (1, 128, T) + length (1,) → one id in [0, codes) per 4 frames: (1, T/4), from the frames' mean bin value.

    The length input is consumed (added as 0 · length) so the graph has the real two-input signature.
    """
    graph = helper.make_graph(
        [
            helper.make_node("Slice", ["feats", "starts", "ends", "axes", "steps"], ["every4"]),
            helper.make_node("ReduceMean", ["every4"], ["mean"], axes=[1], keepdims=0),
            helper.make_node("Abs", ["mean"], ["abs"]),
            helper.make_node("Mul", ["abs", "scale"], ["scaled"]),
            helper.make_node("Cast", ["scaled"], ["ids"], to=TensorProto.INT64),
            helper.make_node("Cast", ["feats_length"], ["len64"], to=TensorProto.INT64),
            helper.make_node("Mul", ["len64", "zero"], ["no_len"]),
            helper.make_node("Add", ["ids", "no_len"], ["ids2"]),
            helper.make_node("Mod", ["ids2", "codes"], ["tokens"]),
        ],
        "tiny_speech_tokenizer",
        [
            helper.make_tensor_value_info("feats", TensorProto.FLOAT, [1, 128, "T"]),
            helper.make_tensor_value_info("feats_length", TensorProto.INT32, [1]),
        ],
        [helper.make_tensor_value_info("tokens", TensorProto.INT64, [1, "T4"])],
        initializer=[
            numpy_helper.from_array(np.array([0], np.int64), "starts"),
            numpy_helper.from_array(np.array([2**62], np.int64), "ends"),
            numpy_helper.from_array(np.array([2], np.int64), "axes"),
            numpy_helper.from_array(np.array([4], np.int64), "steps"),
            numpy_helper.from_array(np.array(1000.0, np.float32), "scale"),
            numpy_helper.from_array(np.array(0, np.int64), "zero"),
            numpy_helper.from_array(np.array(codes, np.int64), "codes"),
        ],
    )
    return _save(graph, path)


def speech_tokens_reference(log_mel: np.ndarray, codes: int = SPEECH_CODES) -> np.ndarray:
    """What make_speech_tokenizer's graph computes, in numpy, for the tests' expectations."""
    return (np.abs(log_mel[:, :, ::4].mean(axis=1)) * np.float32(1000.0)).astype(np.int64) % codes


def make_model_dir(directory: Path, fixtures: Path) -> Path:
    """The fixture model directory completed with a tokenizer and the two ONNX stand-ins (links, no copies)."""
    directory.mkdir(parents=True, exist_ok=True)
    for name in ("cosyvoice2.yaml", "llm.pt", "flow.pt", "hift.pt", "spk2info.pt", "flow_rand_noise.safetensors"):
        if (fixtures / name).exists():
            (directory / name).symlink_to(fixtures / name)
    qwen = directory / "CosyVoice-BlankEN"
    qwen.mkdir()
    for src in (fixtures / "CosyVoice-BlankEN").iterdir():
        (qwen / src.name).symlink_to(src)
    vocab = json.loads((qwen / "config.json").read_text())["vocab_size"]
    make_tokenizer(qwen, vocab_size=vocab)
    make_campplus(directory / "campplus.onnx")
    # Ids must fit the model's speech vocabulary, which is tiny here.
    make_speech_tokenizer(directory / "speech_tokenizer_v2.onnx", load_hparams(directory)["llm"]["speech_token_size"])
    return directory
