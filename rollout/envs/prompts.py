"""Prompt sources: where each training step's prompts come from (``data.source``), and the
validation set (``data.val_source``).

- ``env``: the environment's own generator; prompt i of a run is ``reset(stable_seed(seed, i))``
  with no extra kwargs.
- a ``.jsonl`` file: one JSON object per line; a ``.parquet`` file: the same columns, read with
  pyarrow. Every field of a record is passed to the env factory as a keyword argument.

A record is either the plain form ``{"prompt": str, ...env kwargs}`` (the ``qa`` env uses
``prompt`` and ``answer``) or verl's form::

    {"prompt": [{"role": "user", "content": "..."}, ...],   # chat messages
     "data_source": "openai/gsm8k",
     "reward_model": {"ground_truth": "72", "style": "rule"},
     "extra_info": {...}}

(the ``single_turn`` env and ``reward.function`` read those fields). The whole file is checked
when it is opened (``check_prompt_file``), so a bad row 900 fails at start-up, not at step 40;
an error names the file, the row (jsonl: line) and the field.

Training records are visited in a seeded shuffled order per epoch, so a run is reproducible;
validation visits every record once, in file order.
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


CHAT_ROLES = ("system", "user", "assistant", "tool")


def _check_messages(messages: list, where: str) -> None:
    if not messages:
        raise ValueError(f'{where}: field "prompt" is an empty list; give at least one message')
    for k, msg in enumerate(messages):
        field_name = f'"prompt[{k}]"'
        if not isinstance(msg, dict):
            raise ValueError(
                f"{where}: field {field_name} must be a message like "
                f'{{"role": "user", "content": "..."}}, got {type(msg).__name__}'
            )
        if msg.get("role") not in CHAT_ROLES:
            raise ValueError(
                f'{where}: field {field_name[:-1]}.role" must be one of {", ".join(CHAT_ROLES)}, '
                f"got {msg.get('role')!r}"
            )
        if not isinstance(msg.get("content"), str):
            raise ValueError(
                f'{where}: field {field_name[:-1]}.content" must be a string, got '
                f"{type(msg.get('content')).__name__}"
            )


def _check_record(record: object, where: str) -> dict:
    """The record itself when it is a valid plain or verl-format prompt record; a ValueError
    naming ``where`` (file and row) and the field otherwise."""
    if not isinstance(record, dict):
        raise ValueError(
            f'{where}: expected a JSON object like {{"prompt": ...}}, got {type(record).__name__}'
        )
    prompt = record.get("prompt")
    if isinstance(prompt, list):
        _check_messages(prompt, where)
    elif not isinstance(prompt, str) or not prompt:
        raise ValueError(
            f'{where}: field "prompt" must be a non-empty string or a list of chat messages '
            f"(role, content), got {prompt!r:.80}"
        )
    source = record.get("data_source")
    if source is not None and (not isinstance(source, str) or not source):
        raise ValueError(
            f'{where}: field "data_source" must be a non-empty string, got {source!r:.80}'
        )
    reward_model = record.get("reward_model")
    if reward_model is not None:
        if not isinstance(reward_model, dict):
            raise ValueError(
                f'{where}: field "reward_model" must be an object like '
                f'{{"ground_truth": ..., "style": "rule"}}, got {type(reward_model).__name__}'
            )
        if reward_model.get("ground_truth") is None:
            raise ValueError(
                f'{where}: field "reward_model.ground_truth" is missing; the reward function '
                "compares the model's answer with it"
            )
        style = reward_model.get("style")
        if style is not None and not isinstance(style, str):
            raise ValueError(
                f'{where}: field "reward_model.style" must be a string, got {style!r:.80}'
            )
    extra = record.get("extra_info")
    if extra is not None and not isinstance(extra, dict):
        raise ValueError(
            f'{where}: field "extra_info" must be an object (or absent), got {type(extra).__name__}'
        )
    return record


def read_jsonl(path: str | Path, key: str = "data.source") -> list[dict]:
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
        raise ValueError(f"{key}={str(path)!r}: the file has no records")
    return records


def read_parquet(path: str | Path, key: str = "data.source") -> list[dict]:
    """Records of a parquet prompt file (needs pyarrow); bad rows raise naming file and row."""
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise ValueError(
            f"{key}={str(path)!r}: reading parquet needs pyarrow, which is not installed; "
            "pip install pyarrow, or convert the file to jsonl"
        ) from exc
    try:
        rows = pq.read_table(str(path)).to_pylist()
    except Exception as exc:  # noqa: BLE001 - pyarrow raises several types for a bad file
        raise ValueError(f"{key}={str(path)!r}: not a readable parquet file ({exc})") from exc
    if not rows:
        raise ValueError(f"{key}={str(path)!r}: the file has no records")
    return [_check_record(r, f"{path}: row {i}") for i, r in enumerate(rows)]


def read_prompt_file(path: str | Path, key: str = "data.source") -> list[dict]:
    """Every record of a ``.jsonl`` or ``.parquet`` prompt file, each one checked; a ValueError
    names ``key`` (the config key that points at the file), the file, the row and the field."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise ValueError(f"{key}={str(path)!r}: no such file; give an existing .jsonl/.parquet")
    if path.suffix == ".jsonl":
        return read_jsonl(path, key)
    if path.suffix == ".parquet":
        return read_parquet(path, key)
    raise ValueError(f"{key}={str(path)!r}: unknown file type; use .jsonl or .parquet")


def check_prompt_file(path: str | Path, key: str = "data.source") -> int:
    """Check every record of a prompt file now (for a preflight); returns the number of
    records. Raises ValueError naming the key, file, row and field of the first bad record."""
    return len(read_prompt_file(path, key))


class PromptSource:
    """Yields ``batch_size`` prompts per training step, deterministic in (seed, step)."""

    def __init__(self, source: str = "env", *, seed: int = 0, key: str = "data.source") -> None:
        self.source, self.seed = str(source), int(seed)
        self.records: list[dict] | None = None
        self._orders: dict[int, list[int]] = {}  # epoch -> shuffled record order
        if self.source == "env":
            return
        if not Path(self.source).expanduser().is_file():
            raise ValueError(
                f"{key}={self.source!r}: no such file; use 'env' or a .jsonl/.parquet path"
            )
        self.records = read_prompt_file(self.source, key)

    def __len__(self) -> int:
        """Records in the file (0 for the env's unbounded generator)."""
        return 0 if self.records is None else len(self.records)

    def batch(self, step: int, batch_size: int) -> list[PromptItem]:
        """The prompts of training ``step`` (0-based): ``batch_size`` prompts, when every step
        consumes exactly ``batch_size`` prompts (``take`` counts for itself)."""
        if batch_size < 1:
            raise ValueError(f"train.batch_size={batch_size}: must be >= 1 prompt")
        return self.take(int(step) * batch_size, batch_size)

    def take(self, first: int, count: int) -> list[PromptItem]:
        """Prompts ``first .. first + count - 1`` of the run's stream (``first`` = prompts
        consumed so far)."""
        return [self.item(first + j) for j in range(count)]

    def all_records(self) -> list[PromptItem]:
        """Every record once, in file order (validation); seeds are ``stable_seed(seed, i)``
        for record i. An ``env`` source has no finite set: ValueError."""
        if self.records is None:
            raise ValueError(
                "data.val_source=env: validation needs a fixed set; give a .jsonl/.parquet file"
            )
        return [
            PromptItem(index=i, seed=stable_seed(self.seed, i), env_kwargs=dict(r))
            for i, r in enumerate(self.records)
        ]

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
