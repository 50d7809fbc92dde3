#!/usr/bin/env bash
# The powered SoftmaxGRPO-vs-GRPO study (docs/study.md), resumable on any machine.
#   bash results/softmax-vs-grpo/run_study.sh run        # pilots: 5 paired seeds, exact reward, then sim
#   bash results/softmax-vs-grpo/run_study.sh collect    # copy finished runs here (then git add + commit)
#   SEEDS=5-12 REWARDS=exact bash results/softmax-vs-grpo/run_study.sh run   # the powered runs, once sized
# Runs come from a worktree at one fixed commit (STUDY_COMMIT), outside this checkout, so that code changes made
# while the study runs cannot mix into it. Finished runs already collected here are copied back into the runs
# folder first, so tools/sweep.py skips them (it never relaunches a run whose eval.json has "after").
set -euo pipefail
REPO=$(cd "$(dirname "$0")/../.." && pwd)
STUDY_COMMIT=${STUDY_COMMIT:-ddac909}
WORKTREE=${STUDY_WORKTREE:-$REPO/../softmax-grpo-study}
RUNS=${STUDY_RUNS:-$REPO/../softmax-grpo-study-runs}
HERE=${STUDY_HERE:-$REPO/results/softmax-vs-grpo/runs}  # where collect copies finished runs
mkdir -p "$HERE" "$RUNS"
case "${1:-run}" in
run)
  [ -d "$WORKTREE" ] || git -C "$REPO" worktree add --detach "$WORKTREE" "$STUDY_COMMIT"
  for done in "$HERE"/*/; do [ -d "$done" ] && [ ! -d "$RUNS/$(basename "$done")" ] && cp -r "$done" "$RUNS/"; done
  cd "$WORKTREE"
  for r in ${REWARDS:-exact sim}; do
    extra=""; [ "$r" = sim ] && extra="--reward sim"
    python -m tools.sweep --runs-dir "$RUNS" --out "$RUNS/summary-$r" --seeds "${SEEDS:-0-4}" --baseline grpo \
      --common "--dtype float32 $extra" --config "softmax=--advantage softmax --tau 0.1" --config "grpo=--advantage grpo"
  done ;;
collect)
  for run in "$RUNS"/*/; do
    name=$(basename "$run")
    python -c "import json,sys; sys.exit(0 if 'after' in json.load(open('$run/eval.json')) else 1)" 2>/dev/null || continue
    [ -d "$HERE/$name" ] && continue
    [ -n "${STUDY_COMMITTED:-}" ] && [ -d "$STUDY_COMMITTED/$name" ] && continue  # committed elsewhere already
    mkdir -p "$HERE/$name"
    cp "$run/eval.json" "$run"/eval-*.jsonl "$run/completions.jsonl" "$run/metrics.jsonl" "$run/args.json" \
       "$run/wall_seconds.txt" "$HERE/$name/"
    (cd "$WORKTREE" && python -c "
import json, shlex, sys
from tools.sweep import train_argv
a = json.load(open('$run/args.json')); seed = a.pop('seed')
print('python ' + ' '.join(shlex.quote(x) for x in train_argv(a, seed, 'RUN', 'new')[1:]))") > "$HERE/$name/command.txt"
    { echo "commit $(git -C "$WORKTREE" rev-parse HEAD)"; lscpu | grep -E '^Model name|^Flags'; } > "$HERE/$name/cpu.txt"
    echo "collected $name"
  done ;;
esac
