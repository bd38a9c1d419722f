#!/usr/bin/env bash
# Issue 19's decode measurements for one GPU (run by gpu_queue.py; results in $OUT): the torch
# engine (eager step in CUDA graphs, then compiled) vs `generate`, same machine and run.
set -uo pipefail
cd "$(dirname "$0")/../.."
B15="--hidden 1536 --layers 28 --heads 12 --kv-heads 2 --intermediate 8960"
run() { echo "### $*"; timeout 240 python3 benchmarks/engine_decode.py --device cuda --dtype bfloat16 --prompt-len 128 --new-tokens 512 "$@"; }
{
  run --batch 256 --header --profile
  run --batch 256 --compile --profile
  run --batch 64
  run --batch 64 --compile
  run --batch 256 $B15
  run --batch 256 $B15 --compile
} 2>&1 | tee "$OUT/decode.log"
