"""Each step log's stages: steps, their median CPU seconds, attempts, and the L2RE at the
stage's end (``python step_log_summary.py step_log_*.json``)."""

import json
import statistics
import sys

for name in sys.argv[1:]:
    log = json.load(open(name))
    print(f"{name} (library {log.get('commit')}, {log['seconds']:.0f} CPU s)")
    stages = {}
    for row in log["steps"]:
        key = (row["rows"], row["solver"], sum(row["sample"]) if row["sample"] else None)
        stages.setdefault(key, []).append(row)
    for (rows, solver, points), steps in stages.items():
        l2re = [s["l2re"] for s in steps if "l2re" in s]
        print(
            f"  rows {rows}, solver {solver}, sample {points} points: steps {steps[0]['step']}-"
            f"{steps[-1]['step']}, median {statistics.median(s['cpu_s'] for s in steps):.2f} s a "
            f"step, attempts {statistics.mean(s['attempts'] for s in steps):.2f}, CG iterations "
            f"{statistics.mean(s['iterations'] for s in steps):.1f}, L2RE at the end "
            + (f"{l2re[-1]:.3g}" if l2re else "-")
        )
    last = log["steps"][-1]
    print(f"  last step {last['step']} at {last['used_s']} s")
