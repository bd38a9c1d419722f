#!/usr/bin/env bash
# Issue 19's decode measurements for one GPU (run by gpu_queue.py; results in $OUT): the torch
# engine vs `generate`, 0.5B and 1.5B shapes at batch 256 and 64, same machine and run.
set -uo pipefail
cd "$(dirname "$0")/../.."
B15="--hidden 1536 --layers 28 --heads 12 --kv-heads 2 --intermediate 8960"
run() { echo "### $*"; python3 benchmarks/engine_decode.py --device cuda --dtype bfloat16 --prompt-len 128 --new-tokens 512 "$@"; }
{
  run --batch 256 --header
  run --batch 64
  run --batch 256 $B15
  run --batch 64 $B15
} 2>&1 | tee "$OUT/decode.log"
