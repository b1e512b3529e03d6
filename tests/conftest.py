"""Test-suite set-up shared by every test module."""

import os

# Two cores run the suite: one OpenMP thread per process keeps small tensor ops in
# microseconds when several test processes (gloo ranks, Ray workers) share the cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402 - after the environment every test process inherits


@pytest.fixture(scope="module")
def local_ray():
    """A local Ray for one test module's runs (8 CPUs), shut down after the module; a module
    whose Ray needs other settings defines its own."""
    import ray

    from trainer.loop.cluster.group import start_ray

    started = start_ray(None, num_cpus=8)
    yield
    if started:
        ray.shutdown()


@pytest.fixture(scope="module")
def tiny_engine(tok, tmp_path_factory):
    """The HF engine over ``builtin:tiny`` (float32, seed 1) with the module's ``tok``."""
    from rollout.engines import make_engine
    from rollout.models import load_model

    os.environ.setdefault("CROSSRL_CACHE", str(tmp_path_factory.mktemp("cache")))
    model = load_model("builtin:tiny", dtype="float32", seed=1, device="cpu")
    model.eval()
    return make_engine("hf", model, tok)
