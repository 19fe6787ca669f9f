#!/usr/bin/env bash
# From the repository root: bash benchmarks/results/2026-12-02_cpu_rows_engine/run.sh
# Three turns of step_time.py at the commit before the rows engine (6c55fb6) and at the one
# that added it (2ca4f01), one thread, one process at a time; JSON lines to times.jsonl.
set -euo pipefail
here=benchmarks/results/2026-12-02_cpu_rows_engine
for c in 6c55fb6 2ca4f01; do
    rm -rf "/tmp/rows_engine_$c" && git worktree add -f "/tmp/rows_engine_$c" "$c" >/dev/null 2>&1
done
export OMP_NUM_THREADS=1
: > "$here/times.jsonl"
for turn in 1 2 3; do
    for c in 6c55fb6 2ca4f01; do
        PYTHONPATH="/tmp/rows_engine_$c/src" python "$here/step_time.py" "$c" >> "$here/times.jsonl"
    done
done
for c in 6c55fb6 2ca4f01; do git worktree remove --force "/tmp/rows_engine_$c"; done
