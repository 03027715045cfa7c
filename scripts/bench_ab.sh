#!/usr/bin/env bash
# Before/after throughput on bench.py's default workload, in one run: REV (a git revision) in a
# temporary worktree and the current tree, alternating ROUNDS times (default 1), each run in its own
# process with the same arguments. Usage: scripts/bench_ab.sh REV [ROUNDS] [-- bench.py args...]
# Needs the machine to itself: nothing else heavy may run meanwhile.
set -euo pipefail
rev=${1:?usage: scripts/bench_ab.sh REV [ROUNDS] [-- bench.py args]}; shift
rounds=1
if [[ $# -gt 0 && $1 != "--" ]]; then rounds=$1; shift; fi
[[ $# -gt 0 && $1 == "--" ]] && shift
here=$(git rev-parse --show-toplevel)
base=$(mktemp -d)
git -C "$here" worktree add -q --detach "$base" "$rev"
trap 'git -C "$here" worktree remove --force "$base"' EXIT
out=$(mktemp -d)
for round in $(seq 1 "$rounds"); do
  for side in before after; do
    tree=$here; [[ $side == before ]] && tree=$base
    # PYTHONPATH: each side imports its own tree's nanovllm, whatever is installed.
    (cd "$tree" && PYTHONPATH="$tree" python bench.py --json "$out/$side-$round.json" "$@") | grep Throughput \
      | sed "s/^/$side ($round): /"
  done
done
python - "$out" "$rounds" <<'PY'
import json, sys
out, rounds = sys.argv[1], int(sys.argv[2])
tok = {side: [json.load(open(f"{out}/{side}-{r}.json"))["nanovllm"]["tok_s"] for r in range(1, rounds + 1)]
       for side in ("before", "after")}
b, a = max(tok["before"]), max(tok["after"])
print(f"best of {rounds}: before {b:.2f} tok/s, after {a:.2f} tok/s, after/before {a / b:.3f}")
PY
