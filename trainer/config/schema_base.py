"""What every section of the typed job config shares (``trainer.config.schema``,
``trainer.config.schema_run``)."""

from __future__ import annotations

import math
import re
from typing import Any

from pydantic import ConfigDict

#: Unknown keys are errors (a typo must fail in the first second, not after an hour of
#: rollout), no silent type coercion ("8" is not 8), and no inf/nan in any float
#: (``train.lr=.inf`` would train every weight to inf).
SECTION = ConfigDict(extra="forbid", strict=True, validate_assignment=True, allow_inf_nan=False)


def first_nonfinite(tree: Any, where: str = "") -> tuple[str, float] | None:
    """``(path, value)`` of the first inf/nan float in nested dicts/lists, else None."""
    if isinstance(tree, float) and not math.isfinite(tree):
        return where or "value", tree
    items: Any = tree.items() if isinstance(tree, dict) else ()
    items = enumerate(tree) if isinstance(tree, list) else items
    for key, child in items:
        found = first_nonfinite(child, f"{where}.{key}" if where else str(key))
        if found is not None:
            return found
    return None


#: ``module.path:function`` or ``builtin:<name>``: where a config names user code.
FUNCTION_SPEC = re.compile(r"^(?:builtin:[a-z0-9_]+|[A-Za-z_][\w.]*:[A-Za-z_]\w*)$")
