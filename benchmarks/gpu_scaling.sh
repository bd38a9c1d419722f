#!/usr/bin/env bash
# Issue 17's GPU measurements in one command (benchmarks/gpu_scaling.py says what and how):
# installs the wheels built by scripts/gpu_wheels.sh (.whl/, carried to the GPU machine) into
# /tmp/site, keeps NVLink multicast off, and runs the benchmark on every GPU present with its
# results (gpu_scaling.json, gpu_scaling.log) in $OUT. Extra arguments go to the script.
set -euo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
fi
export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
python3 benchmarks/gpu_scaling.py --out "${OUT:-$PWD/gpu_scaling_out}" "$@"
