"""Print a run's per-step table: reward, step time by section, peak memory, throughput.

python scripts/summarize_run.py RUN_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(run_dir: str) -> int:
    """One line per step of ``RUN_DIR/metrics.jsonl``; exit 2 when the file is missing."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        print(f"{path}: no such file; pass a run directory that has trained at least one step")
        return 2
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    sections = sorted(
        {
            k[len("timing/") : -2]
            for r in rows
            for k in r
            if k.startswith("timing/") and k.endswith("_s")
        }
        - {"step"}
    )
    memory = sorted({k for r in rows for k in r if k.startswith("memory/")})
    head = ["step", "reward", "step_s", *sections, "tok/s", *(m.split("/")[1] for m in memory)]
    print("  ".join(f"{h:>12}" for h in head))
    for r in rows:
        cells = [r["step"], r.get("reward/mean"), r.get("timing/step_s")]
        cells += [r.get(f"timing/{s}_s") for s in sections]
        cells += [r.get("throughput/tokens_per_s"), *(r.get(m) for m in memory)]
        print("  ".join(f"{c:>12.4g}" if isinstance(c, float) else f"{c!s:>12}" for c in cells))
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1]))
