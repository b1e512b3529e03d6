"""Job configs: load, check, document.

``load_config(path, overrides)`` reads a YAML job file (following its ``include:`` files),
applies ``key.path=value`` overrides, validates the result against the typed schema in
``trainer/config/schema.py`` and then runs the cross-field checks and, unless told not to,
the checks against this machine (devices, packages, files). Every failure is a
``ConfigError`` whose one-line message names the key, the bad value and what is allowed,
so a typo fails in the first second instead of after Ray and the models have started.

Who owns what:

- ``loading.py``: YAML reading, ``include:``, overrides, schema errors, ``load_config``
- ``checks.py``: cross-field and environment checks (``validate_config``); those of the
  engines' placement, weight transport and lag in ``engine_checks.py``
- ``errors.py``: ``ConfigError`` and the one-line problem messages
- ``docs.py``: the generated key reference in docs/config.md
- ``cli.py``: ``python -m trainer.config [--config FILE] [key=value ...]`` prints a resolved
  config; ``python -m trainer.config --write-docs docs/config.md`` regenerates the reference

The run directory's ``config.yaml`` is ``Config.to_yaml()`` written by the controller.
"""

from trainer.config.checks import validate_config
from trainer.config.cli import main_check
from trainer.config.docs import config_reference_markdown, generated_doc_block, update_config_doc
from trainer.config.errors import ConfigError
from trainer.config.loading import (
    all_keys,
    default_config_path,
    load_config,
    parse_override,
    read_yaml,
)
from trainer.config.schema import (
    LAYOUT_KEYS,
    AlgorithmConfig,
    Config,
    CriticConfig,
    DataConfig,
    ModelConfig,
    RayConfig,
    RolloutConfig,
    RunConfig,
    TrainConfig,
)

__all__ = [
    "LAYOUT_KEYS",
    "AlgorithmConfig",
    "Config",
    "ConfigError",
    "CriticConfig",
    "DataConfig",
    "ModelConfig",
    "RayConfig",
    "RolloutConfig",
    "RunConfig",
    "TrainConfig",
    "all_keys",
    "config_reference_markdown",
    "default_config_path",
    "generated_doc_block",
    "load_config",
    "main_check",
    "parse_override",
    "read_yaml",
    "update_config_doc",
    "validate_config",
]
