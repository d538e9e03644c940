#!/usr/bin/env bash
# The GPU checks of issue 20 as one short script for a lent GPU machine (its python3 holds a CUDA
# build of torch; nothing can be installed there from the network):
#   scripts/gpu_check.sh OUTDIR
# 1. the machine: GPUs, torch/CUDA/NCCL versions, locked-memory limit, /dev/shm;
# 2. the GPU-only tests (pytest -m gpu: tests/e2e/test_gpu.py, tests/snapshot/test_capture_gpu.py) and the
#    fake-CUDA capture tests, on the real driver;
# 3. benchmarks/bench_gpu_capture.py: D2H bandwidth of a snapshot vs the pinned floor, and what an
#    every-step snapshot adds to a real training step (nonstop vs torch's DCP staging), each step's
#    host time by phase; again with CUDA_DEVICE_MAX_CONNECTIONS=32;
# 4. nonstop demo on the GPU through a kill and a hang, --verify (bitwise against a clean run).
# Wheels in .whl/ (what the machine lacks: blosc2, crc32c, ... for its Python) are installed into
# /tmp/site first; nonstop itself runs from this checkout (PYTHONPATH), not installed, so the
# machine's own torch is kept whatever its version.
set -u
out=${1:-${OUT:-/tmp/nonstop-gpu}}
mkdir -p "$out"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed" | tee "$out/env.txt"; exit 1; }
  export PYTHONPATH="/tmp/site:$PWD"
else
  export PYTHONPATH="$PWD"
fi
{
  nvidia-smi -L
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version() if torch.cuda.is_available() else None, "devices", torch.cuda.device_count())'
  python3 -c 'import nonstop, blosc2, crc32c; print("nonstop imports; blosc2", blosc2.__version__)'
  echo "ulimit -l: $(ulimit -l)"; df -h /dev/shm; nproc; free -g | head -2
} > "$out/env.txt" 2>&1
cat "$out/env.txt"
step() {  # name, seconds, command...: one stage, bounded, its output kept
  local name=$1 secs=$2; shift 2
  echo "=== $name"
  local t0=$SECONDS
  timeout "$secs" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$out/$name.log"
  echo "=== $name: rc $rc in $((SECONDS - t0)) s"
}
step pytest 180 python3 -m pytest -q -p no:cacheprovider -s --timeout 200 \
  tests/snapshot/test_capture_gpu.py tests/e2e/test_gpu.py tests/snapshot/test_capture_device.py
step bench 150 python3 benchmarks/bench_gpu_capture.py --out "$out/gpu_capture.json"
# the same with more hardware queues: with CUDA's default 8, two streams can share one and run
# in submission order (a false dependency) -- one candidate for the paced snapshot's steps that
# still wait for a whole copy (BENCHMARKS.md, "On a GPU")
step bench-conn32 150 env CUDA_DEVICE_MAX_CONNECTIONS=32 python3 benchmarks/bench_gpu_capture.py \
  --out "$out/gpu_capture-conn32.json"
step demo 150 python3 -m nonstop.cli demo --nproc 1 --spares 0 --steps 30 --model small \
  --fail kill:rank=0,step=8 --fail hang:rank=0,step=18 --verify --job-dir /tmp/nonstop-demo \
  --json "$out/demo.json"
