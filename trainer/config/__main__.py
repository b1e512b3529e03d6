"""``python -m trainer.config``: see ``trainer/config/cli.py``."""

import sys

from trainer.config.cli import main_check

sys.exit(main_check())
