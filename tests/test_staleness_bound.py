"""``train.max_staleness`` has an upper bound (issue 45, item 3): no group of a run can be more
than ``train.total_steps - 1`` policies behind, so a larger bound is refused before start-up
(exit 2, one line naming the key, the value and the fix); a streamed run's groups in flight
must fit the rollout host's memory; and the stream starts no more threads, nor groups, than
the steps left take."""

from __future__ import annotations

import time

import pytest

from rollout.agent_loop import RolloutOutput
from rollout.engines.base import GenerationRequest, GenerationResult, SamplingParams
from trainer.config import ConfigError, load_config

STREAM = ["train.max_staleness=1", "rollout.engine_devices=1", "algorithm.rollout_correction=token"]


def test_a_bound_past_the_runs_steps_is_refused_naming_the_key_value_and_fix():
    with pytest.raises(ConfigError) as err:
        load_config(None, [*STREAM, "train.max_staleness=1000000"])  # the default job: 30 steps
    text = str(err.value)
    assert err.value.key == "train.max_staleness" and err.value.value == 1000000
    assert text.startswith("train.max_staleness: got 1000000;")
    assert text.endswith("set train.max_staleness to at most 29") and "\n" not in text
    assert load_config(None, [*STREAM, "train.max_staleness=29"]).train.max_staleness == 29
    one_step = [*STREAM, "train.total_steps=1"]  # 1 is the least bound: a one-step run has it
    assert load_config(None, one_step).train.max_staleness == 1
    with pytest.raises(ConfigError, match="at most 1$"):
        load_config(None, [*one_step, "train.max_staleness=2"])


def test_the_cli_exits_2_with_one_line_before_anything_starts(tmp_path, capsys):
    from trainer.cli import main

    run_dir = tmp_path / "run"
    code = main(["train", *STREAM, "train.max_staleness=1000000", f"run.dir={run_dir}"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "train.max_staleness" in err and "1000000" in err and "at most 29" in err
    assert not run_dir.exists()


def test_groups_in_flight_that_do_not_fit_the_host_are_refused_before_start_up(monkeypatch):
    """The default job streamed at s = 29 keeps up to 480 groups in flight (30 steps x 16
    prompts), 0.38 GB of rows at 128 bytes a token: more than half of a 0.5 GB host, which
    holds 18 + 1 steps of them."""
    from trainer.loop.plan import stream_budget
    from trainer.loop.start.preflight import PreflightError, preflight

    cfg = load_config(None, [*STREAM, "train.max_staleness=29"])
    assert stream_budget.groups_in_flight(cfg) == 480
    tokens = 480 * 8 * 3 * (256 + 4)  # n x rows per trajectory (step-wise) x tokens per row
    assert stream_budget.in_flight_bytes(cfg) == tokens * stream_budget.ROW_BYTES_PER_TOKEN
    text = stream_budget.in_flight_problem(cfg, 0.5e9, "this host's memory")
    assert text.startswith("train.max_staleness=29: up to 480 groups in flight")
    assert text.endswith("lower train.max_staleness to 18") and "\n" not in text
    assert stream_budget.in_flight_problem(cfg, 1e9, "x") is None  # 0.38 GB <= half of 1 GB
    monkeypatch.setattr(stream_budget, "host_memory_bytes", lambda: 0.5e9)
    with pytest.raises(PreflightError, match="lower train.max_staleness to 18"):
        preflight(cfg)
    tiny_host = stream_budget.in_flight_problem(cfg, 1e6, "a 1 MB host")
    assert tiny_host.endswith("(not even train.max_staleness=1 fits)")


class _Engine:
    def generate(self, requests, sampling):
        return [GenerationResult([1], [0.0], "length") for _ in requests]


class _Prompts:
    def take(self, first, count):
        return list(range(first, first + count))


def test_the_stream_starts_no_threads_nor_groups_past_the_steps_left(tmp_path):
    """Resumed after step 28 of 30 at s = 5 and 2 prompts a step: the two steps left take 4
    groups, so the stream runs 4 threads (not (s + 1) x 2 = 12) and starts 4 groups."""
    from trainer.loop.engines.stream_host import StreamingHost

    class Host(StreamingHost):
        cfg = load_config(
            None,
            [
                *STREAM,
                "train.max_staleness=5",
                "train.batch_size=2",
                "train.mini_batch_size=2",
                f"run.dir={tmp_path}",
            ],
        )
        generator, prompts, prompts_consumed = _Engine(), _Prompts(), 56

        def _sample(self, ordinal, items, engine, env_slots=None):
            engine.generate([GenerationRequest([1], seed=0, group=ordinal)], SamplingParams())
            return RolloutOutput(rows=[], metrics={}, faults=[])

    host = Host()
    assert host.stream_start(28, 5) == 56
    try:
        deadline = time.perf_counter() + 10
        while host.stream.waiting < 4 and time.perf_counter() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)  # a fifth group would have started by now
        assert len(host.stream._threads) == 4
        assert host.stream.started == host.stream.waiting == 4
        assert host.stream.next_ordinal == 60
    finally:
        host.stream_stop()
