#!/usr/bin/env bash
# Table 5 in the demo's setting (docs/sweeps.md section 2): SoftmaxGRPO's tau 0.5, 1.0 and 10 with the
# study's exact-reward flags, paired by seed with the study's tau 0.1 runs (results/softmax-vs-grpo/runs).
#   bash results/table5/run_table5.sh run                   # every tau, seeds 0-4 (TAUS="10 1.0 0.5", SEEDS=0-4)
#   TAUS=10 SEEDS=3 bash results/table5/run_table5.sh run   # one run
#   bash results/table5/run_table5.sh collect               # copy finished runs here (then git add + commit)
# The runs come from the study's worktree at its fixed commit (run_study.sh), so only --tau differs from tau 0.1.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/../.." && pwd)
export STUDY_RUNS=${STUDY_RUNS:-$REPO/../softmax-grpo-table5-runs}
export STUDY_HERE=$REPO/results/table5/runs
STUDY=$REPO/results/softmax-vs-grpo
case "${1:-run}" in
run)
  # The tau 0.1 partners are the study's finished runs: copied in, so the sweep pairs with them and never reruns them.
  mkdir -p "$STUDY_RUNS"
  for done in "$STUDY"/runs/arith-softmax-tau0.1-*-exact-*/; do
    [ -d "$STUDY_RUNS/$(basename "$done")" ] || cp -r "$done" "$STUDY_RUNS/"
  done
  for done in "$STUDY_HERE"/*/; do [ -d "$done" ] && [ ! -d "$STUDY_RUNS/$(basename "$done")" ] && cp -r "$done" "$STUDY_RUNS/"; done
  WORKTREE=${STUDY_WORKTREE:-$REPO/../softmax-grpo-study}
  [ -d "$WORKTREE" ] || git -C "$REPO" worktree add --detach "$WORKTREE" ddac909  # the study's STUDY_COMMIT
  cd "$WORKTREE"
  for tau in ${TAUS:-10 1.0 0.5}; do
    python -m tools.sweep --runs-dir "$STUDY_RUNS" --out "$STUDY_RUNS/summary-tau$tau" --seeds "${SEEDS:-0-4}" \
      --baseline tau0.1 --common "--dtype float32" \
      --config "tau0.1=--advantage softmax --tau 0.1" --config "tau$tau=--advantage softmax --tau $tau"
  done ;;
collect)
  STUDY_COMMITTED=$STUDY/runs bash "$STUDY/run_study.sh" collect ;;
esac
