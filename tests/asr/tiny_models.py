"""Random-weight FunASR model directories of the real classes, for tests and benchmarks.

`build_model_dir` writes the same files a ModelScope download has (config.yaml, configuration.json,
model.pt, tokens.json, am.mvn), so the server loads them through exactly the code that loads real
weights. "tiny" dimensions build in well under a second; "large" has the exact dimensions of
paraformer-large (220 M parameters, 880 MB model.pt) and exists for bench/asr.py: its compute per
chunk is the real model's, only the words are nonsense.

Nothing here downloads anything.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import numpy as np
import yaml

Kind = Literal["paraformer-streaming", "paraformer", "fsmn-vad"]
Size = Literal["micro", "tiny", "large"]
# How sure the decoder is, set through its output layer: "low" flattens the posteriors towards
# uniform, "high" puts a large bias on one token so its posterior approaches 1.
Confidence = Literal["random", "low", "high"]

_SPECIALS = ["<blank>", "<s>", "</s>"]
# Common CJK characters starting at 一 (U+4E00): plain single characters, as in the real vocabulary.
_CJK_START = 0x4E00

_DIMS = {
    # The golden fixtures' model (tests/data/paraformer): committed, so as small as keeps every
    # code path (three encoder layers: the first and two more; two decoder layers).
    "micro": {"d": 32, "heads": 2, "ffn": 64, "enc_blocks": 3, "dec_blocks": 2, "vocab_chars": 100},
    "tiny": {"d": 64, "heads": 2, "ffn": 128, "enc_blocks": 2, "dec_blocks": 2, "vocab_chars": 300},
    "large": {"d": 512, "heads": 4, "ffn": 2048, "enc_blocks": 50, "dec_blocks": 16, "vocab_chars": 8400},
}


def synthetic_speech(seconds: float, seed: int = 0, sample_rate: int = 16000) -> np.ndarray:
    """Speech-like float32 audio: voiced syllables (harmonics of a moving pitch) with short gaps.

    Enough spectral movement that a random-weight CIF predictor fires tokens at a speech-like rate.
    """
    rng = np.random.default_rng(seed)
    n = int(seconds * sample_rate)
    t = np.arange(n) / sample_rate
    f0 = 120 + 40 * np.sin(2 * np.pi * 0.7 * t) + 20 * rng.standard_normal() * np.sin(2 * np.pi * 3.1 * t)
    phase = 2 * np.pi * np.cumsum(f0) / sample_rate
    voiced = sum(np.sin(k * phase) / k for k in range(1, 12))
    syllable = 0.5 * (1 + np.sin(2 * np.pi * 4.0 * t + rng.uniform(0, np.pi)))
    audio = 0.3 * voiced * syllable + 0.01 * rng.standard_normal(n)
    return (audio / np.max(np.abs(audio)) * 0.5).astype(np.float32)


def _tokens(size: Size) -> list[str]:
    chars = [chr(_CJK_START + i) for i in range(_DIMS[size]["vocab_chars"])]
    return _SPECIALS + chars + ["<unk>"]


def _paraformer_config(kind: Kind, size: Size) -> dict:
    dims = _DIMS[size]
    streaming = kind == "paraformer-streaming"
    encoder_conf = {
        "output_size": dims["d"],
        "attention_heads": dims["heads"],
        "linear_units": dims["ffn"],
        "num_blocks": dims["enc_blocks"],
        "dropout_rate": 0.1,
        "positional_dropout_rate": 0.1,
        "attention_dropout_rate": 0.1,
        "input_layer": "pe_online" if streaming else "pe",
        "pos_enc_class": "SinusoidalPositionEncoder",
        "normalize_before": True,
        "kernel_size": 11,
        "sanm_shfit": 0,
        "selfattention_layer_type": "sanm",
    }
    if streaming:
        encoder_conf |= {
            "chunk_size": [12, 15],
            "stride": [8, 10],
            "pad_left": [0, 0],
            "encoder_att_look_back_factor": [4, 4],
            "decoder_att_look_back_factor": [1, 1],
        }
    return {
        "model": "ParaformerStreaming" if streaming else "Paraformer",
        "model_conf": {"ctc_weight": 0.0, "lsm_weight": 0.1, "length_normalized_loss": True,
                       "predictor_weight": 1.0, "predictor_bias": 1, "sampling_ratio": 0.75},
        "encoder": "SANMEncoderChunkOpt" if streaming else "SANMEncoder",
        "encoder_conf": encoder_conf,
        "decoder": "ParaformerSANMDecoder",
        "decoder_conf": {
            "attention_heads": dims["heads"],
            "linear_units": dims["ffn"],
            "num_blocks": dims["dec_blocks"],
            "dropout_rate": 0.1,
            "positional_dropout_rate": 0.1,
            "self_attention_dropout_rate": 0.1,
            "src_attention_dropout_rate": 0.1,
            "att_layer_num": dims["dec_blocks"],
            "kernel_size": 11,
            "sanm_shfit": 5,
        },
        "predictor": "CifPredictorV2",
        "predictor_conf": {"idim": dims["d"], "threshold": 1.0, "l_order": 1, "r_order": 1, "tail_threshold": 0.45},
        "frontend": "WavFrontendOnline" if streaming else "WavFrontend",
        "frontend_conf": {"fs": 16000, "window": "hamming", "n_mels": 80, "frame_length": 25,
                          "frame_shift": 10, "lfr_m": 7, "lfr_n": 6, "dither": 0.0},
        "tokenizer": "CharTokenizer",
        "tokenizer_conf": {"unk_symbol": "<unk>"},
    }


def _vad_config() -> dict:
    return {
        "model": "FsmnVADStreaming",
        "model_conf": {
            "sample_rate": 16000, "detect_mode": 1, "snr_mode": 0, "max_end_silence_time": 800,
            "max_start_silence_time": 3000, "do_start_point_detection": True, "do_end_point_detection": True,
            "window_size_ms": 200, "sil_to_speech_time_thres": 150, "speech_to_sil_time_thres": 150,
            "speech_2_noise_ratio": 1.0, "do_extend": 1, "lookback_time_start_point": 200,
            "lookahead_time_end_point": 100, "max_single_segment_time": 60000, "snr_thres": -100.0,
            # Random weights cannot tell speech from silence; this energy floor (the real model
            # has -100, i.e. none) makes the tiny VAD call digital silence silence.
            "noise_frame_num_used_for_snr": 100, "decibel_thres": -20.0, "speech_noise_thres": 0.6,
            "fe_prior_thres": 0.0001, "silence_pdf_num": 1, "sil_pdf_ids": [0],
            "speech_noise_thresh_low": -0.1, "speech_noise_thresh_high": 0.3, "output_frame_probs": False,
            "frame_in_ms": 10, "frame_length_ms": 25,
        },
        "encoder": "FSMN",
        "encoder_conf": {"input_dim": 400, "input_affine_dim": 32, "fsmn_layers": 2, "linear_dim": 32,
                         "proj_dim": 32, "lorder": 20, "rorder": 0, "lstride": 1, "rstride": 0,
                         "output_affine_dim": 32, "output_dim": 248},
        # The streaming VAD needs the online frontend (the repo template's WavFrontend fails in 1.4.16).
        "frontend": "WavFrontendOnline",
        "frontend_conf": {"fs": 16000, "window": "hamming", "n_mels": 80, "frame_length": 25,
                          "frame_shift": 10, "dither": 0.0, "lfr_m": 5, "lfr_n": 1},
    }


def _write_cmvn(path: Path, frontend_conf: dict) -> None:
    """am.mvn from the feature statistics of synthetic speech, in Kaldi nnet1 text form."""
    import torch
    from funasr.frontends.wav_frontend import WavFrontend

    conf = {k: v for k, v in frontend_conf.items() if k != "dither"}
    frontend = WavFrontend(cmvn_file=None, dither=0.0, **conf)
    audio = torch.from_numpy(synthetic_speech(8.0, seed=1))[None, :]
    feats, _ = frontend(audio, torch.tensor([audio.shape[1]]))
    feats = feats[0].numpy()
    shift = -feats.mean(0)
    scale = 1.0 / (feats.std(0) + 1e-5)
    dim = feats.shape[1]

    def row(values: np.ndarray) -> str:
        return " ".join(f"{v:.6f}" for v in values)

    path.write_text(
        f"<Nnet>\n<Splice> {dim} {dim}\n[ 0 ]\n"
        f"<AddShift> {dim} {dim}\n<LearnRateCoef> 0 [ {row(shift)} ]\n"
        f"<Rescale> {dim} {dim}\n<LearnRateCoef> 0 [ {row(scale)} ]\n</Nnet>\n",
        encoding="utf-8",
    )


def _bias_output_layer(model, confidence: Confidence, n_tokens: int) -> None:
    import torch

    layer = model.decoder.output_layer
    with torch.no_grad():
        if confidence == "low":
            layer.weight.mul_(1e-3)
            layer.bias.zero_()
        elif confidence == "high":
            # One ordinary character gets a huge bias: every token is it, with a posterior near 1.
            layer.bias[len(_SPECIALS)] = 30.0
    assert layer.bias.shape[0] == n_tokens


def build_model_dir(
    out: str | Path,
    kind: Kind,
    size: Size = "tiny",
    confidence: Confidence = "random",
    seed: int = 0,
) -> Path:
    """Write a loadable model directory of `kind` with random weights; returns its path."""
    import torch
    from funasr.register import tables

    # Importing funasr registers the model classes in `tables`.
    import funasr  # noqa: F401

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    if kind == "fsmn-vad":
        config = _vad_config()
        files = {"init_param": "model.pt", "config": "config.yaml", "frontend_conf": {"cmvn_file": "am.mvn"}}
        model = tables.model_classes[config["model"]](**config["model_conf"], **config, input_size=400)
    else:
        config = _paraformer_config(kind, size)
        tokens = _tokens(size)
        (out / "tokens.json").write_text(json.dumps(tokens, ensure_ascii=False), encoding="utf-8")
        files = {"init_param": "model.pt", "config": "config.yaml", "tokenizer_conf": {"token_list": "tokens.json"},
                 "frontend_conf": {"cmvn_file": "am.mvn"}}
        model = tables.model_classes[config["model"]](
            **config["model_conf"], **{k: v for k, v in config.items() if k != "model_conf"},
            input_size=560, vocab_size=len(tokens),
        )
        with torch.no_grad():
            # Negative bias makes the CIF fire about every 3-4 frames, a speech-like token rate.
            model.predictor.cif_output.bias.fill_(-0.8)
        if confidence != "random":
            _bias_output_layer(model, confidence, len(tokens))
    _write_cmvn(out / "am.mvn", config["frontend_conf"])
    (out / "config.yaml").write_text(yaml.safe_dump(config, allow_unicode=True, sort_keys=False), encoding="utf-8")
    (out / "configuration.json").write_text(
        json.dumps({"framework": "pytorch", "task": "auto-speech-recognition", "file_path_metas": files}),
        encoding="utf-8",
    )
    torch.save(model.state_dict(), out / "model.pt")
    return out
