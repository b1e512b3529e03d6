"""Reward functions with verl's signature, imported by tests as ``verl_reward_fns:<name>``
(tests/ is on sys.path under pytest's rootdir conftest)."""

from __future__ import annotations

import math
import time

CALLS: list[tuple] = []


def exact(data_source, solution_str, ground_truth, extra_info):
    """1.0 when the reply (stripped) is the ground truth; a dict with an extra key."""
    CALLS.append((data_source, solution_str, ground_truth, extra_info))
    return {"score": float(solution_str.strip() == str(ground_truth)), "length": len(solution_str)}


def length_score(data_source, solution_str, ground_truth, extra_info=None):
    """Any reply scores; longer replies a little more (a reward outside [0, 1] is fine)."""
    return 2.0 + 0.01 * len(solution_str)


def raises(data_source, solution_str, ground_truth, extra_info):
    raise RuntimeError("scorer bug")


def returns_nan(data_source, solution_str, ground_truth, extra_info):
    return math.nan


def returns_text(data_source, solution_str, ground_truth, extra_info):
    return "1.0"


def sleeps(data_source, solution_str, ground_truth, extra_info):
    time.sleep(5)
    return 1.0
