"""GPU memory per configuration of the released CosyVoice 2, and how many streams fit (issue 24).

Counted from the released shapes (tests/data/cosyvoice2/manifest_full.json: parameter counts, the
Qwen2 geometry) and the estimator's structure, not measured on a GPU:

- weights: LM, flow and HiFT parameters (HiFT always fp32);
- LM KV pool: `batch_slots` + 1 rows (the scratch row graphs pad into) of `kv_cache_tokens`
  positions, keys and values of every layer (voicebot/tts/cosyvoice2/lm_pool.py);
- flow cache per stream: keys/values of every estimator attention layer, CFG pair, 10 Euler steps,
  for the frames it holds: the window (`flow_left_chunks` × 50 frames) or, unbounded, every frame of
  the reply (the reply length is then an input);
- voice states: a voice's flow prompt state (the prompt's complete chunks, or the window of them)
  for `flow_prompt_states` voices;
- graph pools and activations: one render of the largest bucket — the estimator's widest live set
  for every row (x, qkv, the feed-forward hidden layer, the conv windows) plus the padded keys,
  values and bias of one attention layer — and the LM decode step's (small). An estimate from the
  shapes: a CUDA graph pool holds at least a captured region's peak; bench/gpu_check.sh measures
  the real peak on the device;
- bucketed renders (a window, CUDA graphs: voicebot/tts/cosyvoice2/flow_window.py): every
  stream's window state is a slot of one pool the graphs read in place, allocated at start-up for
  `batch_slots` streams (one per LM slot) and a scratch slot; nothing is stacked or copied out per
  render. Its streams are then the LM slots: what fits is the most slots whose KV row and flow
  state fit beside the rest.

    python -m bench.memory_model                      # the table for a few configurations
    python -m bench.memory_model --left-chunks 2 --reply-s 30 --dtype float16
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MANIFEST = ROOT / "tests" / "data" / "cosyvoice2" / "manifest_full.json"
GIB = 2**30
DEVICES = {"24 GB (A10)": 24e9, "141 GB (H200)": 141e9}
FRAMES_PER_S, CHUNK_FRAMES, STEPS = 50, 50, 10
# the released estimator (cosyvoice2.yaml): 1 + 12 + 1 stages of 4 transformer blocks, 8 heads of 64
ESTIMATOR = {"channels": 256, "heads": 8, "head_dim": 64, "attn_layers": (1 + 12 + 1) * 4,
             "convs": (1 + 12 + 1) * 2 + 3}  # two per ResNet block, the down and up convs, the final block
MAX_HOP_FRAMES = 200  # the largest streaming chunk (100 tokens)
RENDER_BUCKET = 8  # streams in the largest render


@dataclass
class Config:
    name: str
    dtype_bytes: int = 2
    batch_slots: int = 16
    kv_cache_tokens: int = 2048
    left_chunks: int = -1  # -1: unbounded
    reply_s: float = 30.0  # what an unbounded flow cache grows to
    prompt_s: float = 6.0
    voices: int = 4
    bucketed: bool = False  # flow and HiFT at bucketed shapes as CUDA graphs (needs a window)


def flow_frame_bytes(elem: int) -> int:
    e = ESTIMATOR
    return e["attn_layers"] * 2 * 2 * e["heads"] * e["head_dim"] * STEPS * elem


def breakdown(c: Config) -> dict[str, float]:
    manifest = json.loads(MANIFEST.read_text())
    q = manifest["qwen2_config"]
    head_dim = q["hidden_size"] // q["num_attention_heads"]
    held_frames = (c.reply_s * FRAMES_PER_S if c.left_chunks < 0 else c.left_chunks * CHUNK_FRAMES)
    # each causal conv's context: 2 frames of the CFG pair, at most 512 channels (the up stage's input)
    conv_bytes = ESTIMATOR["convs"] * STEPS * 2 * 2 * 512 * c.dtype_bytes
    prompt_frames = int(c.prompt_s * FRAMES_PER_S) // CHUNK_FRAMES * CHUNK_FRAMES
    if c.left_chunks >= 0:
        prompt_frames = min(prompt_frames, c.left_chunks * CHUNK_FRAMES)
    rows = 2 * RENDER_BUCKET * MAX_HOP_FRAMES
    keys = held_frames + MAX_HOP_FRAMES + (prompt_frames if c.left_chunks < 0 else 0)
    widest = ESTIMATOR["channels"] * (1 + 3 + 4 + 3)  # x, qkv, feed-forward hidden, conv windows
    e = ESTIMATOR
    attention = (2 * 2 * RENDER_BUCKET * e["heads"] * keys * e["head_dim"] + RENDER_BUCKET * MAX_HOP_FRAMES * keys)
    parts = {
        "weights (LM, flow; HiFT fp32)": (manifest["llm"]["num_params_unique"] + manifest["flow"]["num_params_unique"])
        * c.dtype_bytes + manifest["hift"]["num_params_unique"] * 4,
        "LM KV pool": (c.batch_slots + 1) * c.kv_cache_tokens * q["num_hidden_layers"] * 2
        * q["num_key_value_heads"] * head_dim * c.dtype_bytes,
        "voice states (flow prompt)": c.voices * prompt_frames * flow_frame_bytes(c.dtype_bytes),
        "graph pools / activations (est.)": (rows * widest + attention) * c.dtype_bytes,
        "per stream: flow cache": held_frames * flow_frame_bytes(c.dtype_bytes) + conv_bytes,
    }
    if c.bucketed:  # every stream's state preallocated: the LM slots' and the scratch slot
        parts["flow state pool, bucketed (slots+1)"] = (c.batch_slots + 1) * parts["per stream: flow cache"]
    return parts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=["float16", "float32"], default=None)
    parser.add_argument("--left-chunks", type=int, default=None)
    parser.add_argument("--reply-s", type=float, default=None)
    parser.add_argument("--slots", type=int, default=None)
    parser.add_argument("--bucketed", action="store_true", default=None,
                        help="flow and HiFT as CUDA graphs at bucketed shapes (needs --left-chunks >= 0)")
    args = parser.parse_args()
    configs = [Config("fp16, unbounded, 10 s replies (configs/a10.yaml)", reply_s=10),
               Config("fp16, unbounded, 30 s replies (configs/a10.yaml)"),
               Config("fp16, window 2 chunks", left_chunks=2), Config("fp16, window 4 chunks", left_chunks=4),
               Config("fp32, window 2 chunks", dtype_bytes=4, left_chunks=2),
               Config("fp16, window 2, 64 LM slots", left_chunks=2, batch_slots=64),
               Config("fp16, window 2, 64 LM slots, bucketed render graphs", left_chunks=2, batch_slots=64,
                      bucketed=True)]
    if any(v is not None for v in vars(args).values()):
        c = Config("this configuration")
        c.dtype_bytes = {"float16": 2, "float32": 4}.get(args.dtype, c.dtype_bytes)
        c.left_chunks = c.left_chunks if args.left_chunks is None else args.left_chunks
        c.reply_s = c.reply_s if args.reply_s is None else args.reply_s
        c.batch_slots = c.batch_slots if args.slots is None else args.slots
        c.bucketed = args.bucketed
        configs = [c]
    for c in configs:
        parts = breakdown(c)
        print(f"\n{c.name} (LM slots {c.batch_slots} × {c.kv_cache_tokens} positions, {c.voices} voices "
              f"of {c.prompt_s:g} s, render bucket {RENDER_BUCKET} streams):")
        for name, value in parts.items():
            print(f"  {name:36} {value / GIB:8.2f} GiB")
        fixed = sum(v for k, v in parts.items() if not k.startswith("per stream"))
        per_stream = parts["per stream: flow cache"]
        for device, capacity in DEVICES.items():
            if c.bucketed:  # pool and KV rows both sized by the LM slots: one slot = one stream
                per_slot = per_stream + parts["LM KV pool"] / (c.batch_slots + 1)
                rest = fixed - parts["flow state pool, bucketed (slots+1)"] - parts["LM KV pool"]
                fit = max(0, int((capacity - rest - per_slot) // per_slot))  # less the scratch slot and row
                print(f"  LM slots (= streams) that fit in {device:14} {fit:6d}  "
                      f"({'fits' if fixed <= capacity else 'does not fit'} with {c.batch_slots})")
                continue
            fit = max(0, int((capacity - fixed) // per_stream))
            # a stream also needs an LM slot while it decodes; beyond the slots it waits for one
            print(f"  streams that fit in {device:14} {fit:6d}  (LM slots {c.batch_slots})")


if __name__ == "__main__":
    main()
