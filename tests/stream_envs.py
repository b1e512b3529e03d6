"""Environments for the streaming tests, imported by them as ``tests.stream_envs:<Name>``
(tests/ is on sys.path under pytest's rootdir conftest, in Ray's workers too)."""

from __future__ import annotations

import threading

from rollout.envs.single_turn import SingleTurnEnv


class LateFailingReset(SingleTurnEnv):
    """``single_turn`` whose ``reset`` fails for the rows with an odd ``extra_info.index``
    once this process has reset ``fail_after`` environments: the groups of those rows,
    streamed late in a run, have every reset failed and sample no token."""

    resets = 0
    _lock = threading.Lock()

    def __init__(self, fail_after: int = 0, **row) -> None:
        super().__init__(**row)
        self.fail_after = int(fail_after)

    def reset(self, seed: int):
        cls = type(self)
        with cls._lock:
            cls.resets += 1
            late = cls.resets > self.fail_after
        if late and int(self.extra_info.get("index", 0)) % 2:
            raise ConnectionError("sandbox refused the episode")
        return super().reset(seed)


def recall_rows(n: int, split: str = "train") -> list[dict]:
    """``n`` verl-format rows of the ``recall`` task ("say 00" ... ), split ``split``: the
    datasets the streaming tests write as parquet."""
    return [
        {
            "data_source": "recall",
            "prompt": [{"role": "user", "content": f"say {i}{i}"}],
            "reward_model": {"ground_truth": f"{i}{i}", "style": "rule"},
            "extra_info": {"split": split, "index": i},
        }
        for i in range(n)
    ]
