#!/usr/bin/env bash
# Round 11 (one GPU): recipes/smollm2-reasoning.yaml as issue 30 asks, on the device machine
# from the repository root (run by benchmarks/gpu_plans/h100x1-round11.yaml's job):
#  1. the probe: the base model on 24 reasoning-gym families (eval_probe, 8 samples a prompt);
#  2. scripts/pick_rgym_mix.py picks the mix from it -> recipes/smollm2-picked.yaml;
#  3. the whole recipe on that mix with reasoning RL seed 0, and beside it the same recipe
#     with seed 1 (the stages both share run once: the second run waits on their leases).
#   bash benchmarks/gpu_plans/smollm2_round11.sh                 # 1-3 above
#   bash benchmarks/gpu_plans/smollm2_round11.sh [--set K=V ...] --only A B ...  # just these stages of the recipe (its mix as committed)
# Every finished stage's stage_summary.json is copied to $OUT/summaries/ as it lands, so a
# collect mid-run brings back what is done.
set -euo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:?}
R=recipes/smollm2-reasoning.yaml
P=recipes/smollm2-picked.yaml
STORE=.ring/artifacts/smollm2-reasoning
mkdir -p "$OUT/summaries"
export RING_BENCHMARKS_DIR=/tmp/assets/benchmarks  # the recipes name GSM8K by hub id; this is its copy

copy_summaries() {
  while true; do
    for d in "$STORE"/*/; do
      [ -f "$d/_SUCCESS" ] && [ -f "$d/stage_summary.json" ] && cp "$d/stage_summary.json" "$OUT/summaries/$(basename "$d").json"
    done
    # the per-step curves so far, in case the machine is lost before the run ends
    python3 -c "import glob, os, sqlite3, sys
for db in glob.glob('.ring/mlflow*.db'):
    sqlite3.connect(db).backup(sqlite3.connect(os.path.join(sys.argv[1], os.path.basename(db) + '.partial')))" "$OUT" 2>/dev/null || true
    sleep 20
  done
}
copy_summaries &
trap 'kill %1 2>/dev/null || true' EXIT

sets=()  # --set KEY=VALUE ... before --only: recipe overrides (e.g. another RL seed)
while [ "${1:-}" = "--set" ]; do sets+=(--set "$2"); shift 2; done
if [ "${1:-}" = "--only" ]; then
  shift
  python3 -m pipeline.cli run "$R" "${sets[@]}" $(printf -- '--only %s ' "$@") >"$OUT/run.log" 2>&1 || echo "run: exit $?"
  sleep 25
  cp .ring/mlflow*.db "$OUT/" 2>/dev/null || true  # the per-step curves
  exit 0
fi
python3 -m pipeline.cli run "$R" --only base --only probe_data --only eval_probe
python3 scripts/pick_rgym_mix.py --summary "$(ls $STORE/eval_probe-*/stage_summary.json)" --recipe "$R" --out "$P" --min-partly 0.03 \
  | tee "$OUT/pick.txt"
cp "$P" "$OUT/"
(sleep 30; python3 -m pipeline.cli run "$P" --set stages.reasoning_rl.seed=1 >"$OUT/seed1.log" 2>&1) &
python3 -m pipeline.cli run "$P" >"$OUT/seed0.log" 2>&1 || echo "seed 0 run: exit $?"
wait %2 || echo "seed 1 run: exit $?"
sleep 25  # the last summaries
