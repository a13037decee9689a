"""Make the streaming Paraformer golden fixtures with funasr 1.4.16 itself.

    PYTHONPATH=. .venv/bin/python tests/data/paraformer/make_fixtures.py

Writes, next to this file:
  model/      a micro random-weight ParaformerStreaming built with funasr's own classes
              (tests/asr/tiny_models.py, ../shared/specs/funasr.md section 4): config.yaml,
              configuration.json, model.pt, tokens.json, am.mvn
  golden.pt   the utterances (int16), and for each case: which utterance, how it was fed (call sizes, is_final), the
              chunk geometry and look-backs, and what funasr produced: each call's text and, per
              decode step, the encoder output, the CIF weights, the fired token embeddings, the
              carried CIF state and the emitted token ids with their log posteriors.

The values are taken from inside funasr's streaming path by wrapping its own methods on the
loaded model instance (encoder.forward_chunk, predictor.forward_chunk,
cal_decoder_with_predictor_chunk); the CIF weights are recomputed from the recorded encoder output
by funasr's predictor modules, exactly as the first lines of its forward_chunk do.
tests/asr/test_sanm_golden.py loads model/ through our loader and compares.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2]))

from tests.asr.tiny_models import build_model_dir, synthetic_speech  # noqa: E402

SAMPLE_RATE = 16000
# (name, seconds, seed): lengths with a short final piece, an exact multiple of 600 ms (its flush
# is funasr's tail chunk), a tail under 960 samples, and a sub-chunk utterance.
UTTERANCES = [("short", 0.5, 11), ("mid", 2.3, 12), ("exact", 4.8, 13), ("tail", 3.0 + 100 / SAMPLE_RATE, 14)]
# (chunk_size, encoder look-back, decoder look-back)
GEOMETRIES = [([0, 10, 5], 4, 1), ([0, 8, 4], 0, 0), ([5, 10, 5], 2, 3), ([0, 5, 5], -1, -1)]


def _feeds(n_samples: int, stride: int, style: str) -> list[tuple[int, bool]]:
    """How a case feeds its audio: (samples in the call, is_final) per generate() call."""
    if style == "strides":  # whole strides, the last call final with whatever is left
        sizes = [stride] * (n_samples // stride)
        rest = n_samples - sum(sizes)
        return [(s, False) for s in sizes] + [(rest, True)]
    if style == "ragged":  # odd-sized calls (funasr keeps the remainder), then an empty flush
        out, fed = [], 0
        for size in [4000, 7000, 13000, 2500, 9000] * 10:
            size = min(size, n_samples - fed)
            if size <= 0:
                break
            out.append((size, False))
            fed += size
        return out + [(0, True)]
    raise ValueError(style)


def _record(model) -> dict:
    """Wrap the instance's streaming methods to record each decode step into `log["steps"]`."""
    log: dict = {"steps": []}
    encoder, predictor = model.encoder, model.predictor
    encoder_forward, predictor_forward = encoder.forward_chunk, predictor.forward_chunk
    decoder_call = model.cal_decoder_with_predictor_chunk

    def encoder_hook(xs_pad, ilens, cache=None, **kwargs):
        out, lens, extra = encoder_forward(xs_pad, ilens, cache=cache, **kwargs)
        log["steps"].append({"encoder_out": out[0].detach().clone()})
        return out, lens, extra

    def predictor_hook(hidden, cache=None, **kwargs):
        step = log["steps"][-1]
        with torch.no_grad():  # the first lines of CifPredictorV2.forward_chunk, by its own modules
            h = torch.relu(predictor.cif_conv1d(predictor.pad(hidden.transpose(1, 2)))).transpose(1, 2)
            alphas = torch.sigmoid(predictor.cif_output(h))
            alphas = torch.relu(alphas * predictor.smooth_factor - predictor.noise_threshold).squeeze(-1)
            alphas[:, : cache["chunk_size"][0]] = 0.0
            if not kwargs.get("is_final", False):
                alphas[:, sum(cache["chunk_size"][:2]):] = 0.0
        embeds, token_length, a, b = predictor_forward(hidden, cache=cache, **kwargs)
        n = int(token_length[0].round())
        step.update(alphas=alphas[0].clone(), fired=(embeds[0, :n].clone() if n else torch.zeros(0, hidden.shape[-1])),
                    cif_alpha=cache["cif_alphas"].reshape(()).clone(), cif_hidden=cache["cif_hidden"].reshape(-1).clone(),
                    final=bool(kwargs.get("is_final", False)), token_ids=[], token_logprobs=[])
        return embeds, token_length, a, b

    def decoder_hook(enc, enc_lens, embeds, ys_lens, cache=None):
        logp, lens = decoder_call(enc, enc_lens, embeds, ys_lens, cache=cache)
        best, ids = logp[0, : int(lens[0])].max(-1)
        skip = {model.blank_id, model.sos, model.eos}
        kept = [(i, v) for i, v in zip(ids.tolist(), best.tolist()) if i not in skip]
        log["steps"][-1].update(token_ids=[i for i, _ in kept], token_logprobs=[v for _, v in kept])
        return logp, lens

    encoder.forward_chunk, predictor.forward_chunk = encoder_hook, predictor_hook
    model.cal_decoder_with_predictor_chunk = decoder_hook
    return log


def main() -> None:
    from voicebot.asr.funasr_model import load_automodel

    model_dir = HERE / "model"
    shutil.rmtree(model_dir, ignore_errors=True)
    build_model_dir(model_dir, "paraformer-streaming", size="micro", seed=0)
    auto = load_automodel(model_dir, "cpu", 1)
    log = _record(auto.model)

    audios = {name: (synthetic_speech(seconds, seed=seed) * 32767).astype(np.int16) for name, seconds, seed in UTTERANCES}
    cases = []
    for (chunk_size, enc_lb, dec_lb) in GEOMETRIES:
        stride = chunk_size[1] * 960
        for name, audio in audios.items():
            for style in ("strides", "ragged"):
                # Two utterances on one cache: the second checks the reset after is_final.
                feeds = _feeds(len(audio), stride, style)
                calls = []
                cache: dict = {}
                for utterance in range(2):
                    fed = 0
                    for size, final in feeds:
                        piece = audio[fed: fed + size].astype(np.float32) / 32768
                        fed += size
                        log["steps"] = []
                        result = auto.generate(input=piece, cache=cache, is_final=final, key="golden",
                                               chunk_size=chunk_size, encoder_chunk_look_back=enc_lb,
                                               decoder_chunk_look_back=dec_lb)
                        calls.append({"utterance": utterance, "samples": size, "final": final,
                                      "text": result[0]["text"] if result else "", "steps": log["steps"]})
                cases.append({"name": f"{name}-{style}-{'_'.join(map(str, chunk_size))}-lb{enc_lb}_{dec_lb}",
                              "audio": name, "chunk_size": chunk_size,
                              "encoder_look_back": enc_lb, "decoder_look_back": dec_lb, "calls": calls})
                n_tokens = sum(len(s["token_ids"]) for c in calls for s in c["steps"])
                print(f"{cases[-1]['name']}: {len(calls)} calls, {sum(len(c['steps']) for c in calls)} steps, "
                      f"{n_tokens} tokens")
    import funasr

    torch.save({"funasr_version": funasr.__version__, "cases": cases,
                "audio": {name: torch.from_numpy(a) for name, a in audios.items()}}, HERE / "golden.pt")
    print(f"wrote {HERE / 'golden.pt'} ({(HERE / 'golden.pt').stat().st_size} bytes), {len(cases)} cases")


if __name__ == "__main__":
    main()
