"""Compares two benchmarks/nist_strd.py records fit by fit: solution bits, status, steps and
evaluations. Usage: python compare_nist.py BEFORE.json AFTER.json"""

import json
import sys
from collections import Counter

before, after = (json.load(open(path))["rows"] for path in sys.argv[1:3])
changed = Counter()
for a, b in zip(before, after):
    assert (a["problem"], a["start"], a["method"]) == (b["problem"], b["start"], b["method"])
    for key in ("b", "status", "steps", "evaluations"):
        if a[key] != b[key]:
            changed[(a["method"], key)] += 1
methods = Counter(a["method"] for a in before)
for method, fits in sorted(methods.items()):
    what = {key: changed[(method, key)] for key in ("b", "status", "steps", "evaluations")}
    print(f"{method}: {fits} fits; fits that differ, by field: {what}")
    total = [
        sum(r["evaluations"] for r in rows if r["method"] == method) for rows in (before, after)
    ]
    print(f"  evaluations in all: {total[0]} before, {total[1]} after")
