#!/usr/bin/env bash
# Every GPU check in one call, the first thing run on the GPU box (the device tool's machine, from the
# repository root; its steps' timeouts add up to 575 s, leaving about 20 s of ~595 to the untimed lines (the wheels'
# install, nvidia-smi, two imports of torch); each step is cut by its own timeout so the rest still runs):
#   bash bench/gpu_check.sh                  figures to stdout and, when $OUT is set, $OUT/gpu_check.txt
#   bash bench/gpu_check.sh --device cpu     the dry run: the same steps at tiny size on CPU
#                                            (tests/serving/test_gpu_check.py runs it)
# Every figure prints as it is measured (PYTHONUNBUFFERED; serve rows per N as each pass ends).
#
# The box's python3 has torch (CUDA), numpy, safetensors, onnxruntime, prometheus-client, ... and no
# package registry: the other packages the benches import travel as wheels in gpu-wheels/
# (scripts/fetch_gpu_wheels, run before the repository is carried there; data/gpu_image_packages.txt
# and tests/serving/test_gpu_imports.py keep the list whole). They are installed into a folder of
# their own, put on the path beside the repository.
set -uo pipefail
cd "$(dirname "$0")/.."
device=cuda
if [ "${1:-}" = "--device" ]; then device=${2:?--device needs a value}; fi
python=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
out=${OUT:-/tmp}/gpu_check.txt
mkdir -p "$(dirname "$out")"
status=0

step() {  # step SECONDS DESCRIPTION COMMAND...: run it under a timeout, say how it ended
  local seconds=$1 what=$2
  shift 2
  echo
  echo "== $what ($(date -u +%H:%M:%S), at most ${seconds} s)"
  timeout "$seconds" "$@"
  local rc=$?
  if [ $rc -ne 0 ]; then
    status=1
    if [ $rc -eq 124 ]; then echo "== $what: cut at ${seconds} s"; else echo "== $what: exit status $rc"; fi
  fi
}

{
  date -u
  site=$(mktemp -d "${TMPDIR:-/tmp}/voicebot-wheels.XXXXXX")
  if ! ls gpu-wheels/*.whl >/dev/null 2>&1; then
    echo "no wheels in gpu-wheels/ (scripts/fetch_gpu_wheels makes them): the interpreter's own packages only"
  elif ! $python -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))'; then
    echo "gpu-wheels/ holds CPython 3.12 wheels and $python is $($python -V 2>&1): not installed"
  else
    $python -m pip install --quiet --no-index --no-deps --target "$site" gpu-wheels/*.whl \
      && echo "installed $(ls gpu-wheels/*.whl | wc -l) wheels into $site" || status=1
  fi
  export PYTHONPATH="$PWD:$site${PYTHONPATH:+:$PYTHONPATH}"
  if [ "$device" = cuda ]; then
    nvidia-smi -L
    size=released dtype=float16
  else
    echo "dry run on $device: tiny size, float32 serving, graph steps skipped where they need CUDA"
    size=tiny dtype=float32
  fi
  $python -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda,
torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU')"
  # Which LM attention kernel the serving dtype gets (flash_attn when flash-attn imports, else sdpa).
  $python -c "import torch; from voicebot.tts.cosyvoice2.lm import attention_backend; print('LM attention:', attention_backend(torch.device('$device'), torch.$dtype))"

  # 1. Correctness first: fp16 vs fp32, graph = eager per bucket (LM step; flow and HiFT renders), host
  # syncs per step, batch vs alone.
  step 130 "correctness" $python bench/gpu_correctness.py --device "$device" --size "$size" --dtype "$dtype"

  # 2. The GPU-proxy table (aten calls and host syncs per LM step and per render), measured for real.
  if [ -f bench/gpu_proxy.py ] && [ "$device" = cuda ]; then
    step 55 "GPU proxies on the GPU" $python bench/gpu_proxy.py --device cuda
  else
    echo; echo "== GPU proxies: skipped (bench/gpu_proxy.py absent, or a dry run: it runs at released depth)"
  fi

  # 3. Many sessions through the scheduler, fp16 and CUDA graphs on the GPU: the LM targets, then
  # 1 / 16 / 64 sessions, each speaking one reply, their starts spread so that about 30 % of them
  # speak at once (bounded by work, so the unbatched passes end too), batched and not; peak GPU
  # memory per pass. Targets: first audio p50 <= 250 ms, p95 <= 500 ms, no underruns.
  if [ "$device" = cuda ]; then
    step 210 "serve" $python bench/serve.py --size released --device cuda --dtype float16 --lm-targets \
        --sessions 1,16,64 --duty 0.3 --replies 1 --pass-timeout 60
  else
    step 150 "serve" $python bench/serve.py --size tiny --device cpu --threads 1 --sessions 1,2 --duty 1 \
        --replies 1 --pass-timeout 60
  fi
  # 3b. The same engine with a 2-chunk flow window: on CUDA flow and HiFT render as CUDA graphs (every
  # bucket captured at start-up, the streams' states in the slot pool), the path a windowed GPU config
  # serves; 16 sessions, batched only, one reply each. On CPU the same flags, rendered eagerly.
  if [ "$device" = cuda ]; then
    step 75 "serve, flow window 2 (render graphs)" $python bench/serve.py --size released --device cuda \
        --dtype float16 --flow-left-chunks 2 --sessions 16 --duty 0.3 --replies 1 --pass-timeout 40 --no-unbatched
  else
    step 60 "serve, flow window 2 (render graphs)" $python bench/serve.py --size tiny --device cpu --threads 1 \
        --flow-left-chunks 2 --sessions 2 --duty 1 --replies 1 --pass-timeout 30 --no-unbatched
  fi

  # 4. CosyVoice 2 end to end, one stream: first audio and RTF per stream mode.
  if [ "$device" = cuda ]; then
    step 65 "cosyvoice2" $python bench/cosyvoice2.py --size released --device cuda --dtype float16 \
        --modes exact,fast --int8-modes '' --overlap-modes ''
  else
    step 120 "cosyvoice2" $python bench/cosyvoice2.py --size tiny --device cpu --threads 1 \
        --modes exact --int8-modes '' --overlap-modes ''
  fi
  # 5. The batched streaming Paraformer (issue 25): one chunk of 1 / 4 / 8 / 16 sessions in one step, ours only.
  step 40 "paraformer" $python bench/paraformer.py --device "$device" --dtype "$dtype" --skip-funasr --rounds 5 --warm 3 --size "$([ "$device" = cuda ] && echo large || echo tiny)"
  rm -rf "$site"
  echo
  echo "gpu_check: $([ $status -eq 0 ] && echo 'every step ended cleanly' || echo 'a step failed or was cut (above)')"
  exit $status
} 2>&1 | tee "$out"
exit "${PIPESTATUS[0]}"
