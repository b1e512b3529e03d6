"""Lagged runs resumed and validated exactly (issue 32 item 5): a checkpoint keeps the
rollouts of the lag's next steps also past ``train.total_steps``, so a lag-2 run resumed with
more steps trains on the batches an uninterrupted longer run does; a resume with another lag,
or from a checkpoint that lacks a rollout the schedule needs, is refused before start-up; a
validation reads the pipeline without draining it and changes nothing the run trains on; the
held metrics lines and checkpoints of a lagged run are written in step order."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray

from trainer.config import load_config
from trainer.loop.cluster.group import Later, start_ray
from trainer.loop.cluster.local import LocalRef
from trainer.loop.schedule.backlog import Backlog, PendingCheckpoint
from trainer.loop.start.preflight import PreflightError, _check_resumed_lag
from trainer.loop.start.run import run_training
from trainer.records.jsonl_files import read_jsonl

LAG2 = [
    "train.rollout_lag=2",
    "rollout.engine_devices=1",
    "algorithm.rollout_correction=token",
    "train.batch_size=2",
    "train.mini_batch_size=2",
    "rollout.n=2",
    "rollout.max_new_tokens=6",
    "run.save_every=2",
    "run.resume=never",
]


# ---------------------------------------------------------------- the resume check, no run


def _checkpoint(tmp_path, step: int, kept: list[int], lag: int | None):
    ckpt = tmp_path / f"step_{step}"
    (ckpt / "pending").mkdir(parents=True)
    state = {"step": step, "prompts_consumed": 2 * step}
    if lag is not None:
        state["rollout_lag"] = lag
    (ckpt / "trainer_state.json").write_text(json.dumps(state))
    for s in kept:
        (ckpt / "pending" / f"step_{s}.npz").write_bytes(b"")
    return ckpt


def _cfg(*keys):
    return load_config(None, [*LAG2, *keys], check_environment=False)


def test_a_resume_with_another_lag_is_refused_naming_the_key(tmp_path):
    ckpt = _checkpoint(tmp_path, 4, [5, 6], lag=2)
    _check_resumed_lag(_cfg("train.total_steps=6"), ckpt)  # the same lag resumes
    with pytest.raises(PreflightError) as info:
        _check_resumed_lag(_cfg("train.total_steps=6", "train.rollout_lag=1"), ckpt)
    text = str(info.value)
    assert "train.rollout_lag=1" in text and "train.rollout_lag=2" in text and "\n" not in text


def test_a_lagged_checkpoint_without_engine_devices_is_refused(tmp_path):
    # No engine devices of its own means no lag: the kept rollouts would be dropped.
    ckpt = _checkpoint(tmp_path, 2, [3, 4], lag=2)
    cfg = load_config(None, ["train.total_steps=6"], check_environment=False)
    with pytest.raises(PreflightError, match="rollout.engine_devices"):
        _check_resumed_lag(cfg, ckpt)
    # A checkpoint from before the lag was saved: its kept rollouts tell the lag.
    old = _checkpoint(tmp_path / "old", 2, [3, 4], lag=None)
    with pytest.raises(PreflightError, match="train.rollout_lag=2"):
        _check_resumed_lag(cfg, old)


def test_a_checkpoint_missing_a_kept_rollout_is_refused_with_the_steps_it_can_run(tmp_path):
    # What an earlier crossrl wrote at the end of a 4-step lag-2 run: nothing past step 4.
    ckpt = _checkpoint(tmp_path, 4, [], lag=2)
    _check_resumed_lag(_cfg("train.total_steps=4"), ckpt)  # nothing left to sample
    with pytest.raises(PreflightError) as info:
        _check_resumed_lag(_cfg("train.total_steps=6"), ckpt)
    assert "[5, 6]" in str(info.value) and "train.total_steps=4" in str(info.value)


# ---------------------------------------------------------------- the backlog, no run


class _Log:
    def __init__(self) -> None:
        self.lines: list[tuple[int, dict]] = []

    def log(self, step, metrics):
        self.lines.append((step, metrics))


class _Held(Later):
    """A validation that finishes when the test says so."""

    def __init__(self, value) -> None:
        super().__init__(LocalRef(value), "rollout host", "rollout.validate")
        self.finished = False

    def done(self) -> bool:
        return self.finished


class _Staged:
    def __init__(self, step, commits) -> None:
        self.step, self.commits = step, commits

    def commit(self, pending=None):
        self.commits.append((self.step, sorted(pending or {})))


class _Pending(PendingCheckpoint):
    finished = False

    def ready(self) -> bool:
        return self.finished


def test_held_lines_and_checkpoints_are_written_in_step_order():
    log, commits = _Log(), []
    with Backlog(log) as backlog:
        val = _Held({"val/reward_mean": 0.5})
        backlog.add_line(1, {"reward/mean": 0.1})
        backlog.add_line(2, {"reward/mean": 0.2}, val)
        ckpt = _Pending(_Staged(2, commits), {3: LocalRef(({"metrics": {}}, [LocalRef({})]))})
        backlog.add_checkpoint(ckpt)
        backlog.add_line(3, {"reward/mean": 0.3})
        assert [s for s, _ in log.lines] == [1]  # step 2 waits for its validation
        val.finished = True
        backlog.settle(wait=False)
        assert [s for s, _ in log.lines] == [1, 2, 3] and log.lines[1][1]["val/reward_mean"] == 0.5
        assert commits == []  # its kept rollout is still being sampled
        ckpt.finished = True
        backlog.settle(wait=False)
        assert commits == [(2, [3])]
        backlog.add_line(4, {"reward/mean": 0.4}, _Held({"val/reward_mean": 0.7}))
    assert [s for s, _ in log.lines] == [1, 2, 3, 4]  # the end waits for everything


def test_a_run_that_stops_writes_its_lines_and_commits_nothing_more():
    log, commits = _Log(), []
    with pytest.raises(KeyboardInterrupt), Backlog(log) as backlog:
        backlog.add_line(1, {"reward/mean": 0.1}, _Held({"val/reward_mean": 0.5}))
        backlog.add_checkpoint(_Pending(_Staged(1, commits), {}))
        raise KeyboardInterrupt
    assert log.lines == [(1, {"reward/mean": 0.1})]  # no validation that had not run
    assert commits == []


# ---------------------------------------------------------------- end to end


def _rows(n: int) -> list[dict]:
    return [
        {
            "data_source": "recall",
            "prompt": [{"role": "user", "content": f"say {i}{i}"}],
            "reward_model": {"ground_truth": f"{i}{i}", "style": "rule"},
        }
        for i in range(n)
    ]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("data")
    train, val = folder / "train.parquet", folder / "val.parquet"
    pq.write_table(pa.Table.from_pylist(_rows(24)), str(train))
    pq.write_table(pa.Table.from_pylist(_rows(3)), str(val))
    started = start_ray(None, num_cpus=6)
    yield (
        [
            f"data.source={train}",
            "rollout.env=single_turn",
            "reward.function=tests.verl_reward_fns:length_score",
        ],
        [
            f"data.val_source={val}",
            "run.val_every=2",
            "run.val_before_train=true",
        ],
    )
    if started:
        ray.shutdown()


def _train(run_dir, *keys) -> int:
    return run_training(load_config(None, [*LAG2, *keys, f"run.dir={run_dir}"]))


def _fingerprints(run_dir) -> list[str]:
    return (run_dir / "fingerprint.jsonl").read_text().splitlines()


@pytest.mark.slow
def test_a_lag_2_run_resumed_with_more_steps_equals_an_uninterrupted_one(data, tmp_path, capsys):
    source, val_keys = data
    full, short, resumed = tmp_path / "full", tmp_path / "short", tmp_path / "resumed"
    assert _train(full, *source, "train.total_steps=6") == 0
    assert _train(short, *source, "train.total_steps=4") == 0
    last = short / "checkpoints" / "step_4"
    # The last checkpoint keeps the two steps the lag samples past the run's end.
    assert sorted(p.name for p in (last / "pending").glob("*.npz")) == [
        "step_5.npz",
        "step_6.npz",
    ]
    assert _train(resumed, *source, "train.total_steps=6", f"run.resume={last}") == 0
    assert _fingerprints(resumed) == _fingerprints(full)[4:]
    versions = [m["pipeline/policy_version"] for m in read_jsonl(resumed / "metrics.jsonl")]
    assert versions == [2.0, 3.0]  # the weights after steps 2 and 3, not 4 and 4

    # Resuming with another lag is refused before anything starts, naming the key.
    capsys.readouterr()
    assert _train(tmp_path / "other", *source, "train.total_steps=6", "train.rollout_lag=1",
                  f"run.resume={last}") == 2  # fmt: skip
    assert "train.rollout_lag=2" in capsys.readouterr().err

    # Validation reads the pipeline without changing what the run trains on.
    validated = tmp_path / "validated"
    assert _train(validated, *source, *val_keys, "train.total_steps=6") == 0
    assert _fingerprints(validated) == _fingerprints(full)
    metrics = read_jsonl(validated / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [0, 1, 2, 3, 4, 5, 6]
    assert [m["step"] for m in metrics if "val/reward_mean" in m] == [0, 2, 4, 6]
    assert all(m["timing/val_s"] > 0 for m in metrics if "val/reward_mean" in m)


def _first_prompts(run_dir) -> dict[int, list[list[int]]]:
    """Per recorded step, the prompt tokens of every trajectory's first turn, in row order."""
    from rollout.replay import load_rollout, recorded_steps

    out = {}
    for step in recorded_steps(run_dir / "rollouts"):
        arrays = load_rollout(run_dir / "rollouts" / f"step_{step}.npz")
        ids, cu = arrays["token/input_ids"], arrays["cu_seqlens"]
        first = arrays["row/step_index"] == 0
        lens = arrays["row/prompt_len"]
        out[step] = [ids[cu[i] : cu[i] + lens[i]].tolist() for i in range(len(lens)) if first[i]]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("engines", [1, 2])
def test_the_agent_configs_determinism_settings_keep_the_documented_promise(
    data, tmp_path, engines
):
    # configs/base/agent-grpo.yaml runs with run.deterministic=false: docs/cluster.md
    # ("What makes two runs identical") promises the schedule, not the samples: every step
    # is sampled by the weights its number names and takes the same prompts, whatever the
    # engine's timing; the tokens sampled (and so the fingerprints) may differ. With two
    # engines the peer replica serves its turns from its own engine server (issue 57).
    keys = [
        "train.rollout_lag=1",
        f"rollout.engine_devices={engines}",
        "algorithm.rollout_correction=token",
        "train.batch_size=4",
        "train.mini_batch_size=2",
        "train.total_steps=3",
        "run.deterministic=false",
        "run.record_rollouts=true",
        "run.resume=never",
        "rollout.env=rollout.envs.sleepy:SleepyEnv",
        "rollout.env_kwargs={turns: 2, max_delay_s: 0.05}",
        "rollout.max_turns=2",
    ]
    runs = [tmp_path / "a", tmp_path / "b"]
    for run_dir in runs:
        assert run_training(load_config(None, [*keys, f"run.dir={run_dir}"])) == 0
    versions = [
        [m["pipeline/policy_version"] for m in read_jsonl(r / "metrics.jsonl")] for r in runs
    ]
    assert versions[0] == versions[1] == [0.0, 0.0, 1.0]
    prompts = [_first_prompts(r) for r in runs]
    assert sorted(prompts[0]) == [1, 2, 3, 4]  # and step 4, sampled past the end
    assert prompts[0] == prompts[1]
    assert all(len(p) == 4 * 8 for p in prompts[0].values())  # batch_size x rollout.n


@pytest.mark.slow
@pytest.mark.parametrize("dp", [1, 2])
def test_a_lagged_run_resumed_in_place_with_more_steps_is_bit_identical(data, tmp_path, dp):
    """Issue 45 item 1: the resumed run commits checkpoints (``run.save_every=1``) while the
    pipeline holds both the checkpoint's kept rollouts and ones it samples afresh."""
    source, _ = data
    keys = [*source, f"train.dp_size={dp}", "run.save_every=1"]
    full, run = tmp_path / "full", tmp_path / "run"
    assert _train(full, *keys, "train.total_steps=6") == 0
    assert _train(run, *keys, "train.total_steps=4") == 0
    assert _train(run, *keys, "train.total_steps=6", "run.resume=auto") == 0
    assert _fingerprints(run) == _fingerprints(full)
    steps = sorted(int(p.name.split("_")[1]) for p in (run / "checkpoints").glob("step_*"))
    assert steps[-1] == 6  # the resumed run's own checkpoints were committed
