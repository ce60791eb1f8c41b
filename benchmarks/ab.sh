#!/usr/bin/env bash
# Before/after on one machine: run the same benchmark command in two source trees, alternating (A B A B ...),
# so that both see the same GPU, clocks and warm caches. Each run's log goes to $OUT/<name>-<tree>-<round>.log
# and its last lines to stdout. Run from the repository root (tree B is usually "."; tree A an exported old
# commit, e.g. `git archive <rev> | tar -x -C .before`, carried to the device machine).
#   usage: benchmarks/ab.sh TREE_A TREE_B ROUNDS NAME -- python benchmarks/grpo_step.py --workload W1
set -uo pipefail
a=$1 b=$2 rounds=$3 name=$4
shift 4
[ "$1" = "--" ] && shift
out=${OUT:-/tmp}
for round in $(seq 1 "$rounds"); do
  for tree in "$a" "$b"; do
    tag=$( [ "$tree" = "$a" ] && echo A || echo B )
    log="$out/$name-$tag-$round.log"
    start=$(date +%s)
    (cd "$tree" && PYTHONPATH="$PWD" "$@") >"$log" 2>&1
    rc=$?
    echo "== $name tree $tag ($tree) round $round: rc=$rc, $(( $(date +%s) - start )) s"
    grep -E "^(step [0-9]|timing_s/(gen|update_actor|ref|old_log_prob|reward)\b|perf/(time_per_step|throughput)|memory/|GPU:|machine:| +[0-9]+ +(graphs|HF))" "$log" | tail -n 40
    [ $rc -eq 0 ] || tail -n 20 "$log"
  done
done
