#!/usr/bin/env bash
# Every GPU check in one call (the device tool's machine: run it from the repository root).
#   bash bench/gpu_check.sh            figures go to stdout and, when set, to $OUT/gpu_check.txt
# It uses the machine's own python3 and torch (nothing can be installed there); the CosyVoice 2
# modules need only torch, numpy, pyyaml and safetensors.
set -uo pipefail
out=${OUT:-/tmp}/gpu_check.txt
{
  date -u
  nvidia-smi -L
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"
  # CosyVoice 2 at released size, random weights: float16 with SDPA, then the same with the
  # decode step captured in a CUDA graph where the LM supports it.
  PYTHONPATH=. timeout 420 python3 bench/cosyvoice2.py --size released --device cuda --dtype float16 \
      --modes exact,fast --int8-modes '' --overlap-modes ''
} 2>&1 | tee "$out"
