"""Prompt sources: where each training step's prompts come from (``data.source``).

- ``env``: the environment's own generator; prompt i of a run is ``reset(stable_seed(seed, i))``
  with no extra kwargs.
- a ``.jsonl`` file: one JSON object per line, ``{"prompt": str, ...env kwargs}``; every field is
  passed to the env factory as a keyword argument (the ``qa`` env uses ``prompt`` and
  ``answer``).
- a ``.parquet`` file: the same columns, read with pyarrow when it is installed.

Records are visited in a seeded shuffled order per epoch, so a run is reproducible.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path

from rollout.seeding import stable_seed


@dataclass(frozen=True)
class PromptItem:
    """One prompt: ``index`` (its position in the run's prompt stream), the env ``seed`` and the
    keyword arguments for the env factory."""

    index: int
    seed: int
    env_kwargs: dict = field(default_factory=dict)


def _check_record(record: object, where: str) -> dict:
    if not isinstance(record, dict):
        raise ValueError(
            f'{where}: expected a JSON object like {{"prompt": ...}}, got {type(record).__name__}'
        )
    if not isinstance(record.get("prompt"), str) or not record["prompt"]:
        raise ValueError(
            f'{where}: field "prompt" must be a non-empty string, got {record.get("prompt")!r}'
        )
    return record


def read_jsonl(path: str | Path) -> list[dict]:
    """Records of a jsonl prompt file; a malformed line raises ValueError naming file and line."""
    path = Path(path)
    records = []
    with path.open("rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ValueError(
                    f"{where}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at column "
                    f"{exc.start + 1}); save the file as UTF-8"
                ) from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(
                    f"{where}: not valid JSON ({exc.msg}); fix or remove that line"
                ) from exc
            records.append(_check_record(record, where))
    if not records:
        raise ValueError(f"data.source={str(path)!r}: the file has no records")
    return records


def read_parquet(path: str | Path) -> list[dict]:
    """Records of a parquet prompt file (needs pyarrow); bad rows raise naming file and row."""
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise ValueError(
            f"data.source={str(path)!r}: reading parquet needs pyarrow, which is not installed; "
            "pip install pyarrow, or convert the file to jsonl"
        ) from exc
    rows = pq.read_table(str(path)).to_pylist()
    if not rows:
        raise ValueError(f"data.source={str(path)!r}: the file has no records")
    return [_check_record(r, f"{path}: row {i}") for i, r in enumerate(rows)]


class PromptSource:
    """Yields ``batch_size`` prompts per training step, deterministic in (seed, step)."""

    def __init__(self, source: str = "env", *, seed: int = 0) -> None:
        self.source, self.seed = str(source), int(seed)
        self.records: list[dict] | None = None
        self._orders: dict[int, list[int]] = {}  # epoch -> shuffled record order
        if self.source == "env":
            return
        path = Path(self.source).expanduser()
        if not path.is_file():
            raise ValueError(
                f"data.source={self.source!r}: no such file; use 'env' or a .jsonl/.parquet path"
            )
        if path.suffix == ".jsonl":
            self.records = read_jsonl(path)
        elif path.suffix == ".parquet":
            self.records = read_parquet(path)
        else:
            raise ValueError(
                f"data.source={self.source!r}: unknown file type; use .jsonl or .parquet"
            )

    def __len__(self) -> int:
        """Records in the file (0 for the env's unbounded generator)."""
        return 0 if self.records is None else len(self.records)

    def batch(self, step: int, batch_size: int) -> list[PromptItem]:
        """The prompts of training ``step`` (0-based): ``batch_size`` prompts."""
        if batch_size < 1:
            raise ValueError(f"train.batch_size={batch_size}: must be >= 1 prompt")
        first = int(step) * batch_size
        return [self.item(first + j) for j in range(batch_size)]

    def item(self, index: int) -> PromptItem:
        """Prompt number ``index`` of the run's stream."""
        seed = stable_seed(self.seed, index)
        if self.records is None:
            return PromptItem(index=index, seed=seed)
        epoch, pos = divmod(index, len(self.records))
        order = self._orders.get(epoch)
        if order is None:
            order = list(range(len(self.records)))
            random.Random(stable_seed(self.seed, -1, epoch)).shuffle(order)
            self._orders = {epoch: order}  # keep one epoch: a run walks epochs in order
        return PromptItem(index=index, seed=seed, env_kwargs=dict(self.records[order[pos]]))
