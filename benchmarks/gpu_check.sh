#!/usr/bin/env bash
# The GPU check: every GPU test (pytest -m gpu) and two short smoke benchmarks (the W1 GRPO step and the
# rollout at batch 64), one line per figure, in under 9 minutes on one H100 or H200. CI has no GPU, so GPU tests
# rot unseen: run this before landing a change to engine/, workers/ or models/ (CONTRIBUTING.md).
#   usage: benchmarks/gpu_check.sh [LOGDIR]      (default $OUT/gpu_check or /tmp/gpu_check; full logs there)
# Exit status: 0 when every GPU test passed and both benchmarks ran.
set -uo pipefail
cd "$(dirname "$0")/.."
logs=${1:-${OUT:-/tmp}/gpu_check}
mkdir -p "$logs"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
status=0
echo "gpu: $($py -c 'import torch; print(torch.cuda.get_device_name(0), "torch", torch.__version__)' 2>&1)"

# Only the modules that hold GPU tests are collected: the others may import packages a GPU box lacks.
mapfile -t files < <(grep -rlE "mark\.gpu" tests --include='test_*.py' | sort)
start=$(date +%s)
# -v names each test as it starts (a hang shows which); a test past 150 s dumps every thread's stack
timeout 420 "$py" -m pytest -v -p no:cacheprovider -m gpu -rfE -o faulthandler_timeout=150 "${files[@]}" \
    >"$logs/pytest.log" 2>&1
rc=$?
summary=$(grep -E "^[0-9]+ (passed|failed)|^=+ .*(passed|failed|error).* =+$" "$logs/pytest.log" | tail -n 1)
echo "gpu tests: ${summary:-no summary (rc=$rc)} in $(( $(date +%s) - start )) s (${#files[@]} modules)"
grep -E "^(FAILED|ERROR) " "$logs/pytest.log" | head -n 20
[ $rc -eq 0 ] || status=1

start=$(date +%s)
timeout 240 "$py" benchmarks/grpo_step.py --workload W1 --model-size 0.5b --steps 3 --warmup 1 \
    --out "$logs/w1.jsonl" >"$logs/w1.log" 2>&1
rc=$?
if [ $rc -eq 0 ]; then
    "$py" - "$logs/w1.jsonl" <<'EOF'
import json, sys
r = json.loads(open(sys.argv[1]).read().splitlines()[-1])
get = lambda *keys: next((r[k] for k in keys if k in r), float("nan"))
print(f"W1 0.5B: {get('step_s', 'perf/time_per_step'):.3f} s/step (gen {get('timing_s/gen'):.3f} s, "
      f"update {get('timing_s/update_actor'):.3f} s)")
EOF
else
    echo "W1 0.5B: failed (rc=$rc), see $logs/w1.log"; tail -n 5 "$logs/w1.log"; status=1
fi
echo "  ($(( $(date +%s) - start )) s)"

start=$(date +%s)
timeout 180 "$py" benchmarks/rollout.py --batches 64 --prompt-len 128 --new-tokens 256 --repeats 2 \
    >"$logs/rollout.log" 2>&1
rc=$?
if [ $rc -eq 0 ]; then
    # the rows under the table's header: batch, engine, tok/s, roofline, fraction of it
    awk '/tok\/s/ {rows = 1; next} rows && NF' "$logs/rollout.log" | head -n 4 | sed 's/^ */rollout 0.5B: batch /'
else
    echo "rollout 0.5B: failed (rc=$rc), see $logs/rollout.log"; tail -n 5 "$logs/rollout.log"; status=1
fi
echo "  ($(( $(date +%s) - start )) s)"
exit $status
