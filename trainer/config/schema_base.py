"""What every section of the typed job config shares (``trainer.config.schema``,
``trainer.config.schema_run``)."""

from __future__ import annotations

from pydantic import ConfigDict

#: Unknown keys are errors (a typo must fail in the first second, not after an hour of
#: rollout), no silent type coercion ("8" is not 8), and no inf/nan in any float
#: (``train.lr=.inf`` would train every weight to inf).
SECTION = ConfigDict(extra="forbid", strict=True, validate_assignment=True, allow_inf_nan=False)
