"""Each row of docs/RESULTS.md against the records it links.

    python scripts/check_results.py        # one line per mismatch; exit status 1 if any

For every row of the results table:

* it links at least one record folder under ``benchmarks/results/``, and each exists;
* its commit column names exactly the commits its records state: every commit a record's JSON
  files carry (a ``commit`` entry at any depth, e.g. ``environment.commit`` or
  ``meta.commit``) is named, or, for a record without JSON, every commit of its README's
  ``Commit:`` item; and every commit named is one the records state (in a JSON file or in the
  README's text);
* its clock column says ``CPU`` or ``wall`` (or both, for a row with CPU and GPU runs), and a
  record whose JSON states its clock (``"clock": "cpu"`` or ``"wall"``) agrees with it;
* the same column names every processor its records name (AMD EPYC, Intel Xeon, NVIDIA H100
  or H200).

Commits are compared by their first 7 hexadecimal digits. tests/test_docs.py runs this check.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "RESULTS.md"
HARDWARE = ("EPYC", "Xeon", "H100", "H200")
RECORD = re.compile(r"\]\(\.\./(benchmarks/results/[^)#]+)\)")
# A commit: 7 to 40 hexadecimal digits, at least one of them a digit and one a letter.
COMMIT = re.compile(r"\b(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b")
# A README's commit item: a line (or list item) that starts with "Commit:", "Commits:" or
# "commit <hash>", with the lines that continue it.
COMMIT_ITEM = re.compile(r"^[*-]?\s*(?:[Cc]ommits?:|commit\s+[0-9a-f]{7})")


def _json_values(value, key: str, found: set) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            if k == key and isinstance(v, str):
                found.add(v)
            else:
                _json_values(v, key, found)
    elif isinstance(value, list):
        for v in value:
            _json_values(v, key, found)


def _json_files(folder: Path) -> list:
    found = []
    for path in sorted(folder.rglob("*.json")):
        try:
            found.append(json.loads(path.read_text()))
        except (json.JSONDecodeError, UnicodeDecodeError):
            continue
    return found


def _readme_commits(folder: Path) -> tuple:
    """``(the commits of the README's commit item, every commit its text names)``."""
    readme = folder / "README.md"
    if not readme.is_file():
        return set(), set()
    text = readme.read_text()
    found, inside = set(), False
    for line in text.splitlines():
        if COMMIT_ITEM.match(line.strip()):
            inside = True
        elif not line.startswith("  ") or not line.strip():
            inside = False
        if inside:
            found |= {c[:7] for c in COMMIT.findall(line)}
    return found, {c[:7] for c in COMMIT.findall(text)}


def record_metadata(folder: Path) -> tuple:
    """``(commits in the JSON files, in the README's commit item, in its text, clocks)``."""
    data = _json_files(folder)
    commits, clocks = set(), set()
    for value in data:
        _json_values(value, "commit", commits)
        _json_values(value, "clock", clocks)
    json_commits = {c[:7] for c in commits if COMMIT.fullmatch(c[:7])}
    return json_commits, *_readme_commits(folder), {c.lower() for c in clocks}


def hardware(folder: Path) -> set:
    """The processors a record's README and JSON files name."""
    files = [folder / "README.md", *sorted(folder.rglob("*.json"))]
    text = "".join(f.read_text(errors="replace") for f in files if f.is_file())
    return {name for name in HARDWARE if name in text}


def rows(text: str) -> list:
    """The results table's rows as dicts of header -> cell."""
    lines = [line for line in text.splitlines() if line.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    return [
        dict(zip(header, (c.strip() for c in line.strip("|").split("|")))) for line in lines[2:]
    ]


def problems(text: str) -> list:
    """Every mismatch between the table and its records, one line each."""
    found = []
    for row in rows(text):
        name = row["problem"][:50]
        folders = [ROOT / link for link in RECORD.findall(row["record"])]
        if not folders:
            found.append(f"{name}: links no record")
            continue
        missing = [f for f in folders if not f.is_dir()]
        if missing:
            found.append(f"{name}: no record {[str(f.relative_to(ROOT)) for f in missing]}")
            continue
        stated, required, clocks, processors = set(), set(), set(), set()
        for folder in folders:
            in_json, in_readme, in_text, in_clocks = record_metadata(folder)
            if not in_json | in_readme:
                found.append(f"{name}: {folder.name} states no commit")
            stated |= in_json | in_text
            required |= in_json or in_readme  # a record's JSON, where it has any, is its own
            clocks |= in_clocks
            processors |= hardware(folder)
        named = {c[:7] for c in COMMIT.findall(row["run at commit"])}
        unnamed = sorted(required - named)
        if unnamed:
            found.append(f"{name}: commits of its records not named: {unnamed}")
        unknown = sorted(named - stated)
        if unknown:
            found.append(f"{name}: commits named that its records do not state: {unknown}")
        clock = row["clock, hardware"]
        unnamed_hardware = sorted(p for p in processors if p not in clock)
        if unnamed_hardware:
            found.append(f"{name}: its records ran on {unnamed_hardware}, not named")
        if not re.search(r"\b(CPU|wall)\b", clock):
            found.append(f"{name}: clock {clock!r} says neither CPU nor wall")
        if "cpu" in clocks and "CPU" not in clock or "wall" in clocks and "wall" not in clock:
            found.append(f"{name}: clock {clock!r}, its records: {sorted(clocks)}")
    return found


if __name__ == "__main__":
    lines = problems(RESULTS.read_text())
    print("\n".join(lines) if lines else "every row matches its records")
    sys.exit(1 if lines else 0)
