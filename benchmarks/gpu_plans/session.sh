#!/usr/bin/env bash
# One device session driven by benchmarks/gpu_queue.py, over several short calls on the same
# warm machine (files outside the work tree survive between back-to-back calls; the work tree
# does not, so the jobs run from a copy of it in /tmp/repo):
#
#   bash benchmarks/gpu_plans/session.sh start PLAN.yaml   # carry [".whl"]: wheels -> /tmp/site, repo -> /tmp/repo, queue started detached
#   bash benchmarks/gpu_plans/session.sh part K            # carry [".vllm/partK"]: one part of scripts/gpu_vllm.sh's payload -> /tmp/vllm_parts
#   bash benchmarks/gpu_plans/session.sh vllm              # after the last part: unpack + install into /tmp/site_vllm, then /tmp/vllm_ready
#   bash benchmarks/gpu_plans/session.sh late              # this call's tree -> /tmp/repo_late, then /tmp/late_ready (jobs that need later code)
#   bash benchmarks/gpu_plans/session.sh asset DIR         # carry [DIR]: split parts of a data wheel (NAME.whl.00, .01, ...) -> /tmp/assets
#   bash benchmarks/gpu_plans/session.sh assets [NAME]     # after the last part: join the parts, install the wheels not installed yet into /tmp/site,
#                                                          # then /tmp/NAME_ready (default assets: a second batch, e.g. ray's, gets a name of its own)
#   bash benchmarks/gpu_plans/session.sh collect [SECONDS [JOB ...]] # wait up to SECONDS for the queue (or those jobs) to finish, then $OUT/results.tgz + a summary
#   bash benchmarks/gpu_plans/session.sh stop JOB          # end a running job's command but not its bash: `CMD; true` then ends it as done,
#                                                          # so the jobs after it still run (a hand `pkill -f PATTERN` also matches the
#                                                          # job's bash, and its own shell: round 17 lost a plan's every later job so)
#
# NVLink multicast stays off in every process (also set by gpu_queue.py for each job).
set -euo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
RESULTS=/tmp/results
OUT=${OUT:-/tmp/out}

summary() {
  python3 - "$RESULTS" <<'EOF'
import json, sys
from pathlib import Path
res = Path(sys.argv[1])
q = res / "queue.json"
if not q.exists():
    print("no queue.json yet"); sys.exit()
for j in json.loads(q.read_text())["jobs"]:
    print(f"{j['name']:16} {j['state']:8} gpus={j['gpus']} start={j['start_s']} s={j['seconds']} rc={j['exit_code']}")
    tel = j.get("telemetry") or {}
    if tel and "unavailable" not in tel:  # a slow loan shows here: clocks held down, power or thermal caps
        print("    gpus: " + "; ".join(f"{g} sm {s['sm_clock_mhz_median']} MHz (min {s['sm_clock_mhz_min']}), "
                                      f"slowed {s['slowdown_fraction']}" for g, s in tel.items()))
    log = res / j["name"] / "job.log"
    if log.exists() and j["state"] != "waiting":
        for line in log.read_text(errors="replace").splitlines()[-4:]:
            print("    " + line[:220])
EOF
}

case "${1:?start|part|vllm|collect}" in
  start)
    plan=${2:?plan yaml}
    # sdists with C code (scripts/gpu_wheels.sh BUILD_THERE) are built here, for this Python
    for sdist in .whl/*.tar.gz; do [ -e "$sdist" ] && python3 -m pip wheel -q --no-deps --no-build-isolation -w .whl "$sdist"; done
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    rm -rf /tmp/repo && mkdir -p /tmp/repo
    tar --exclude=./.whl --exclude=./.vllm -cf - . | tar -xf - -C /tmp/repo
    nvidia-smi -L
    cd /tmp/repo
    export PYTHONPATH=/tmp/site:/tmp/repo
    setsid nohup python3 benchmarks/gpu_queue.py "$plan" --results "$RESULTS" >/tmp/queue.log 2>&1 </dev/null &
    sleep 15
    cat /tmp/queue.log
    summary
    ;;
  part)
    k=${2:?part number}
    mkdir -p /tmp/vllm_parts && cp ".vllm/part$k"/* /tmp/vllm_parts/
    ls -la /tmp/vllm_parts
    summary
    ;;
  vllm)
    mkdir -p /tmp/vllm_payload /tmp/site_vllm
    cat /tmp/vllm_parts/vllm.tar.xz.* | xz -d | tar -x -C /tmp/vllm_payload
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site_vllm /tmp/vllm_payload/wheels/*.whl
    cp -r /tmp/vllm_payload/site/. /tmp/site_vllm/
    PYTHONPATH=/tmp/site_vllm:/tmp/site python3 -c "import vllm; print('vllm', vllm.__version__)"
    touch /tmp/vllm_ready
    summary
    ;;
  stop)
    name=${2:?job name}
    pgid=$(python3 -c 'import json, sys
jobs = json.load(open(sys.argv[1]))["jobs"]
print(next((j["pid"] for j in jobs if j["name"] == sys.argv[2] and j["state"] == "running"), "") or "")' \
      "$RESULTS/queue.json" "$name")
    [ -n "$pgid" ] || { echo "no running job named $name"; summary; exit 1; }
    # the job's processes but its bash; a stage job the command started watches its parent
    # (pipeline/job_guard.py) and takes its own process group down with it
    for p in $(pgrep -g "$pgid"); do [ "$p" != "$pgid" ] && kill -9 "$p" 2>/dev/null; done
    sleep 3
    summary
    ;;
  asset)
    mkdir -p /tmp/assets && cp -r "${2:?folder}"/. /tmp/assets/
    ls -la /tmp/assets
    ;;
  assets)
    # a second batch may come while jobs of the first already run from /tmp/site: join only the
    # parts not joined yet and install only the wheels not installed yet
    cd /tmp/assets
    for first in *.whl.00; do [ -e "$first" ] && [ ! -e "${first%.00}" ] && cat "${first%.00}".[0-9][0-9] >"${first%.00}"; done
    touch .installed
    new_wheels=$(for w in *.whl; do grep -qxF "$w" .installed || echo "$w"; done)
    if [ -n "$new_wheels" ]; then
      sha256sum $new_wheels
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $new_wheels
      printf '%s\n' $new_wheels >>.installed
    fi
    touch "/tmp/${2:-assets}_ready"
    summary
    ;;
  late)
    rm -rf /tmp/repo_late && mkdir -p /tmp/repo_late
    tar --exclude=./.whl --exclude=./.vllm -cf - . | tar -xf - -C /tmp/repo_late
    touch /tmp/late_ready
    git -C /tmp/repo_late log --oneline -1 2>/dev/null || true
    summary
    ;;
  collect)
    wait_s=${2:-0}
    # a machine with no queue is a fresh one (the earlier machine went back: idle for 30 s, or
    # 30 minutes held): say so at once rather than wait out the call on an idle GPU (round 13
    # lost 940 s of device time so, twice)
    if [ ! -f "$RESULTS/queue.json" ]; then
      echo "no queue on this machine: it is a fresh one, the earlier machine and its results are gone" >&2
      exit 3
    fi
    shift $(( $# < 2 ? $# : 2 ))  # past `collect [SECONDS]`
    wanted="$*"  # job names to wait for (default: all)
    end=$((SECONDS + wait_s))
    while (( SECONDS < end )) && ! python3 -c "
import json, sys; q = json.load(open('$RESULTS/queue.json')); wanted = '$wanted'.split()
sys.exit(0 if all(j['state'] not in ('waiting', 'running') for j in q['jobs']
                  if not wanted or j['name'] in wanted) else 1)" 2>/dev/null; do
      sleep 10
    done
    mkdir -p "$OUT"
    # a job's work folder (stores, checkpoints) stays behind: it passed a call's size limit
    tar -czf "$OUT/results.tgz" --exclude='results/*/work' --exclude='*.safetensors' --exclude='*.pt' -C /tmp results
    ls -la "$OUT"
    summary
    ;;
esac
