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
  # Many sessions through the scheduler at released size, fp16, CUDA graphs: the LM targets, then
  # 64 sessions at 30 % duty (target: first audio p50 <= 250 ms, p95 <= 500 ms, no underruns), batched and not.
  PYTHONPATH=. timeout 330 python3 bench/serve.py --size released --device cuda --dtype float16 --lm-targets \
      --sessions 1,16,64 --duty 0.3 --seconds 30
  # CosyVoice 2 at released size, random weights, float16.
  PYTHONPATH=. timeout 240 python3 bench/cosyvoice2.py --size released --device cuda --dtype float16 \
      --modes exact,fast --int8-modes '' --overlap-modes ''
} 2>&1 | tee "$out"
