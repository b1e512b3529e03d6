"""Test-suite set-up shared by every test module."""

import os

# Two cores run the suite: one OpenMP thread per process keeps small tensor ops in
# microseconds when several test processes (gloo ranks, Ray workers) share the cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
