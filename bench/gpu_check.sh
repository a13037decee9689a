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
  # Which LM attention kernel fp16 on this GPU gets (flash_attn when flash-attn imports, else sdpa).
  PYTHONPATH=. python3 -c "import torch; from voicebot.tts.cosyvoice2.lm import attention_backend; print('LM attention:', attention_backend(torch.device('cuda'), torch.float16))"
  # CosyVoice 2 at released size, random weights, float16.
  PYTHONPATH=. timeout 420 python3 bench/cosyvoice2.py --size released --device cuda --dtype float16 \
      --modes exact,fast --int8-modes '' --overlap-modes ''
} 2>&1 | tee "$out"
