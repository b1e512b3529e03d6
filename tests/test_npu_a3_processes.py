"""What every trainer and engine process on an Ascend A3 die is started with (issue 33): the
engine options that keep the rollout host off vllm-ascend's CPU binding, HCCL port ranges
that keep a die's processes apart, and run.deterministic's switches inside every engine
worker. Device-free: the backends' plain functions, a recording ``collective_rpc``."""

from __future__ import annotations

import os

import pytest

import hal
from hal.npu_versions import ENGINE_OPTION_SPELLINGS, vllm_ascend_engine_options

# ---- item 6: no CPU binding of the engine worker (the rollout host at tp 1) ----------------


@pytest.mark.parametrize("version", ["0.26.0rc1", "0.27.1rc1"])
def test_engine_options_turn_vllm_ascend_cpu_binding_off(version):
    """Both spellings carry ``enable_cpu_binding=false`` at the top of ``additional_config``
    (read there by 0.26.0rc1's ``AscendConfig`` and 0.27.1rc1's pydantic model alike)."""
    extra = vllm_ascend_engine_options(version)["additional_config"]
    assert extra["enable_cpu_binding"] is False


def test_every_spelling_row_says_so_for_the_doctor():
    for row in ENGINE_OPTION_SPELLINGS:
        assert row.additional_config["enable_cpu_binding"] is False
        assert "enable_cpu_binding=false" in row.summary


def test_the_npu_backend_passes_it_to_the_engine(monkeypatch):
    import hal.npu

    monkeypatch.setattr(hal.npu, "installed_version", lambda name: "0.26.0rc1")
    options = hal.backend_class("npu")().vllm_engine_options()
    assert options["additional_config"]["enable_cpu_binding"] is False


# ---- item 3: run.deterministic inside every engine worker ----------------------------------


class _RecordingBackend:
    """Stands for a device backend: records where ``set_deterministic`` ran."""

    name = "npu"
    is_accelerator = True
    vllm_layerwise_reload = False
    vllm_batch_invariant = True  # vllm-ascend's, as hal.NpuBackend says
    colocated_transfer_engine = "npu_ipc"  # hal.NpuBackend's, for a colocated vLLM engine

    def __init__(self, calls: list, where: str = "host") -> None:
        self.calls, self.where = calls, where

    def set_deterministic(self, seed: int) -> dict[str, str]:
        self.calls.append((self.where, seed))
        return {"HCCL_DETERMINISTIC": "true", "seed": str(seed)}

    def vllm_engine_options(self) -> dict:
        return {}

    def vllm_expert_parallel_options(self, enabled: bool) -> dict:
        from hal.npu import NpuBackend

        return NpuBackend.vllm_expert_parallel_options(self, enabled)  # the backend's own

    def check_engine_build(self) -> None:
        """The installed engine build matches the chip (nothing to check in this stand-in)."""


class _FakeLLM:
    """``vllm.LLM`` reduced to ``collective_rpc``: calls the method by name on each of its
    workers (as vLLM does, one per tp rank) and records the call."""

    def __init__(self, workers: list) -> None:
        self.workers, self.rpcs = workers, []

    def collective_rpc(self, method: str, args: tuple = ()) -> list:
        self.rpcs.append((method, args))
        return [getattr(w, method)(*args) for w in self.workers]


def _engine_with_workers(monkeypatch, tp: int, calls: list):
    from rollout.engines.vllm.engine import VLLMEngine
    from rollout.engines.vllm.worker import VLLMWorkerExtension

    class Worker(VLLMWorkerExtension):
        def __init__(self, rank: int) -> None:
            self.rank = rank

    workers = [Worker(r) for r in range(tp)]
    # Each worker asks hal for the backend in its own process: record which worker asked.
    asking = iter(range(tp))
    monkeypatch.setattr(
        hal, "get_backend", lambda name="auto": _RecordingBackend(calls, f"worker {next(asking)}")
    )
    engine = VLLMEngine.__new__(VLLMEngine)
    engine.llm = _FakeLLM(workers)
    return engine


def test_every_engine_worker_applies_the_deterministic_switches(monkeypatch):
    calls: list = []
    engine = _engine_with_workers(monkeypatch, 2, calls)
    applied = engine.set_worker_deterministic("npu", 7)
    assert engine.llm.rpcs == [("crossrl_set_deterministic", ("npu", 7))]
    assert calls == [("worker 0", 7), ("worker 1", 7)]
    assert applied == [{"HCCL_DETERMINISTIC": "true", "seed": "7"}] * 2


def test_a_worker_that_applied_other_settings_is_named():
    from trainer.loop.cluster.group import WorkerFailedError
    from trainer.loop.engines.engine_host import agree_with_engine_workers

    host = {"seed": "7", "flag": "True"}
    assert agree_with_engine_workers(host, [dict(host), dict(host)], 1) == host
    with pytest.raises(WorkerFailedError, match="engine replica 1 worker 1"):
        agree_with_engine_workers(host, [dict(host), {"seed": "7"}], 1)


@pytest.mark.parametrize("deterministic", [True, False])
def test_the_engine_host_sets_its_workers_deterministic(monkeypatch, deterministic):
    """run.deterministic reaches the engine's workers through ``collective_rpc`` after the
    engine is built; without it nothing is asked of them."""
    import rollout.engines
    from trainer.config import load_config
    from trainer.loop.engines.engine_host import EngineHost

    calls: list = []
    engine = _engine_with_workers(monkeypatch, 2, calls)
    host_backend = _RecordingBackend(calls)
    monkeypatch.setattr(hal, "get_backend", lambda name="auto": host_backend)
    monkeypatch.setattr(rollout.engines, "make_engine", lambda name, model, tok=None, **kw: engine)

    # the workers' own hal look-ups, as they would happen in their processes
    workers_backend = iter(_RecordingBackend(calls, f"worker {r}") for r in range(2))
    real_rpc = engine.llm.collective_rpc

    def rpc(method, args=()):
        monkeypatch.setattr(hal, "get_backend", lambda name="auto": next(workers_backend))
        try:
            return real_rpc(method, args)
        finally:
            monkeypatch.setattr(hal, "get_backend", lambda name="auto": host_backend)

    engine.llm.collective_rpc = rpc
    overrides = [
        "device=cpu",
        "model.path=builtin:tiny",
        "seed=3",
        f"run.deterministic={str(deterministic).lower()}",
        "rollout.engine=vllm",
    ]
    cfg = load_config(None, overrides, check_environment=False)
    monkeypatch.delenv("VLLM_BATCH_INVARIANT", raising=False)  # the host sets it: restored after
    info = EngineHost(cfg).setup()
    if deterministic:
        assert calls == [("host", 3), ("worker 0", 3), ("worker 1", 3)]
        assert engine.llm.rpcs == [("crossrl_set_deterministic", ("npu", 3))]
        assert info["deterministic"] == {"HCCL_DETERMINISTIC": "true", "seed": "3"}
        # vllm-ascend's batch-invariant mode, in the environment its workers inherit
        assert info["batch_invariant"] == {"VLLM_BATCH_INVARIANT": "1"}
        assert os.environ["VLLM_BATCH_INVARIANT"] == "1"
    else:
        assert calls == [] and engine.llm.rpcs == []
        assert info["deterministic"] == info["batch_invariant"] == {}
        assert "VLLM_BATCH_INVARIANT" not in os.environ


# ---- item 2: HCCL port ranges, one per process kind on a die --------------------------------

PORT_VARS = ("HCCL_HOST_SOCKET_PORT_RANGE", "HCCL_NPU_SOCKET_PORT_RANGE")


def _ports(value: str) -> set[int]:
    start, end = (int(x) for x in value.split("-"))  # CANN's "start-end" form
    assert 1024 <= start <= end <= 65535
    return set(range(start, end + 1))


def test_every_slot_has_its_own_ranges():
    from hal.npu import HCCL_PORT_SLOTS, hccl_port_ranges

    for var in PORT_VARS:
        seen: set[int] = set()
        for slot in range(HCCL_PORT_SLOTS):
            ports = _ports(hccl_port_ranges(slot)[var])
            assert not ports & seen, (var, slot)
            seen |= ports
    with pytest.raises(ValueError, match="HCCL port slot 8"):
        hccl_port_ranges(HCCL_PORT_SLOTS)


def test_a_users_own_export_wins():
    backend = hal.backend_class("npu")()
    assert set(backend.process_port_env(0, environ={})) == set(PORT_VARS)
    mine = {"HCCL_NPU_SOCKET_PORT_RANGE": "auto"}
    assert set(backend.process_port_env(0, environ=mine)) == {"HCCL_HOST_SOCKET_PORT_RANGE"}


@pytest.mark.parametrize("name", ["cpu", "cuda"])
def test_other_devices_set_no_ports(name):
    assert hal.backend_class(name)().process_port_env(0, environ={}) == {}


def _spawner(monkeypatch, backend_name: str):
    """A Spawner over a colocated layout (actor, reference, critic; one tp-2 engine replica)
    whose ``spawn`` records each process's class and environment instead of starting it."""
    from types import SimpleNamespace

    from trainer.config import load_config
    from trainer.loop.start.spawn import Spawner

    for var in PORT_VARS:
        monkeypatch.delenv(var, raising=False)
    cfg = load_config(
        None,
        ["device=cpu", "model.path=builtin:tiny", "train.dp_size=2"],
        check_environment=False,
    )
    roles = ("actor", "reference", "critic")
    layout = SimpleNamespace(
        roles=roles,
        shares={**dict.fromkeys(roles, 0.25), "rollout": 0.25},
        replicas=[SimpleNamespace(index=0, tp=2, ranks=(0, 1))],
        separate=False,
        other_engine_device=False,
    )
    backend = hal.backend_class(backend_name)()
    spawner = Spawner(cfg, layout, None, backend, in_process=False)
    started: list = []

    def spawn(cls, rank, share, *args, env=None, engine=None, actor=None):
        started.append((cls.__name__, rank, env))
        return object()

    monkeypatch.setattr(spawner, "spawn", spawn)
    monkeypatch.setattr(spawner, "_device_ids", lambda rep, bundle: [str(bundle)])
    return spawner, started, roles


def test_each_process_on_a_die_gets_disjoint_hccl_ports(monkeypatch):
    """Every rank of a role, and the engine replica (whose tp workers inherit its
    environment), start with their own kind's ranges; kinds on one die never overlap."""
    spawner, started, roles = _spawner(monkeypatch, "npu")
    for role in roles:
        spawner.group(role)
    spawner.replicas()
    by_kind: dict[str, dict] = {}
    for role, (name, rank, env) in zip(
        [r for r in roles for _ in range(2)] + ["engine"], started, strict=True
    ):
        assert env is not None and set(PORT_VARS) <= set(env), (name, rank, env)
        ranges = {var: env[var] for var in PORT_VARS}
        assert by_kind.setdefault(role, ranges) == ranges  # every rank of a kind alike
    engine_env = started[-1][2]
    assert engine_env["ASCEND_RT_VISIBLE_DEVICES"] == "0,1"
    for var in PORT_VARS:
        seen: set[int] = set()
        for kind, ranges in by_kind.items():
            ports = _ports(ranges[var])
            assert not ports & seen, (var, kind)
            seen |= ports


def test_an_exported_range_is_not_overridden(monkeypatch):
    spawner, started, _ = _spawner(monkeypatch, "npu")
    monkeypatch.setenv("HCCL_HOST_SOCKET_PORT_RANGE", "auto")
    spawner.group("actor")
    env = started[0][2]
    assert "HCCL_HOST_SOCKET_PORT_RANGE" not in env and "HCCL_NPU_SOCKET_PORT_RANGE" in env


def test_cpu_processes_start_with_nothing_extra(monkeypatch):
    spawner, started, _ = _spawner(monkeypatch, "cpu")
    spawner.group("actor")
    spawner.replicas()
    assert [env for _, _, env in started] == [None, None, None]
