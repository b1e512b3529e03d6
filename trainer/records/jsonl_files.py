"""Reading the run directory's jsonl files (``metrics.jsonl``, ``fingerprint.jsonl``, a
recording's lines): one JSON object per line, each line named by file and number when it is
malformed, a torn last line (a crash mid-write) dropped on resume, and the lines past a
checkpoint's step dropped atomically (``truncate_jsonl``) before a resumed run writes them
again (``trainer.records.metrics``' writers).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from rollout.files import atomic_write_text, undecodable

log = logging.getLogger(__name__)


class MetricsFileError(ValueError):
    """A jsonl file in the run dir has a malformed line; the message names file and line."""


def _parse_lines(path: Path, text: str, *, allow_torn_tail: bool) -> list[tuple[str, dict]]:
    """(raw line, record) pairs; a torn last line is dropped when ``allow_torn_tail``."""
    lines = text.split("\n")
    # A file written by us ends with "\n", so the last split piece is "" unless torn.
    out: list[tuple[str, dict]] = []
    for lineno, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        is_last = lineno == len(lines)
        try:
            record = json.loads(raw)
            if not isinstance(record, dict):
                raise ValueError(f"a JSON {type(record).__name__}, not an object")
        except ValueError as err:
            if allow_torn_tail and is_last:
                log.warning(
                    "%s:%d: dropping torn last line (crash mid-write): %.80r", path, lineno, raw
                )
                continue
            raise MetricsFileError(
                f"{path}:{lineno}: malformed line ({err}): {raw[:80]!r}; fix or delete that line"
            ) from None
        out.append((raw, record))
    return out


def read_jsonl(path: str | os.PathLike, *, allow_torn_tail: bool = False) -> list[dict]:
    """Read a jsonl file (one JSON object per line) into a list of dicts.

    A missing file raises FileNotFoundError naming it; a malformed line raises
    ``MetricsFileError`` naming file and line number. With ``allow_torn_tail`` an unparsable
    last line (a crash mid-write) is dropped with a warning instead.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such file") from None
    return [rec for _, rec in _parse_lines(path, text, allow_torn_tail=allow_torn_tail)]


def read_error_line(path: str | os.PathLike, err: OSError | UnicodeDecodeError, what: str) -> str:
    """One line for a run file that exists but cannot be read as text: undecodable bytes, or
    a directory (or another non-file) in its place; ``what`` says what the file should be."""
    if isinstance(err, UnicodeDecodeError):
        return f"{path}: {undecodable(path, err)}"
    return f"{path}: cannot be read as a file ({err.strerror or err}); it should be {what}"


def truncate_jsonl(path: str | os.PathLike, keep_through_step: int) -> int:
    """Atomically drop the lines of ``path`` whose ``step`` is > ``keep_through_step``.

    Also drops a torn last line. Missing file: nothing to do. Returns the lines kept.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return 0
    pairs = _parse_lines(path, text, allow_torn_tail=True)
    kept = []
    for raw, record in pairs:
        step = record.get("step")
        if not isinstance(step, int) or isinstance(step, bool):
            raise MetricsFileError(
                f"{path}: line {raw[:80]!r} has no integer 'step'; fix or delete that line"
            )
        if step <= keep_through_step:
            kept.append(raw)
    new_text = "".join(line + "\n" for line in kept)
    if new_text != text:
        atomic_write_text(path, new_text)
    return len(kept)
