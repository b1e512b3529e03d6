"""``bench peer``: both trainers get the same rows, scorer, tokens and settings; the table reads
right; without TRL the command says how to install it. No timing is asserted."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import peer
from bench.__main__ import _resolve
from bench.__main__ import main as bench_main
from bench.peer_task import (
    CPU_JOBS,
    JOBS,
    crossrl_overrides,
    model_path,
    read_prompts,
    recall_reward,
    trl_config_kwargs,
    trl_recall_reward,
    write_prompts,
)
from rollout.envs.base import match_credit

HAS_TRL = importlib.util.find_spec("trl") is not None
ROOT = Path(__file__).resolve().parents[1]


def test_prompt_file_is_seeded_say_two_digits_and_crossrl_reads_it(tmp_path):
    from rollout.envs.prompts import check_prompt_file

    a = write_prompts(tmp_path / "a.jsonl", seed=1, rows=200)
    b = write_prompts(tmp_path / "b.jsonl", seed=1, rows=200)
    c = write_prompts(tmp_path / "c.jsonl", seed=2, rows=200)
    assert a.read_bytes() == b.read_bytes() != c.read_bytes()
    rows = read_prompts(a)
    assert len(rows) == 200
    for row in rows:
        assert row["prompt"] == f"say {row['answer']}"
        assert len(row["answer"]) == 2 and row["answer"].isdigit()
    assert len({r["answer"] for r in rows}) > 50  # the digits vary
    assert check_prompt_file(a) == 200  # crossrl's own data.source check accepts every row


@pytest.mark.parametrize("reply", ["42", " 42 ", "4", "421", "ab", "", "24", "x42"])
def test_reward_is_the_same_through_verl_crossrl_and_trl_signatures(reply):
    from rollout.envs.single_turn import SingleTurnEnv
    from rollout.rewards import RewardFunction

    want = match_credit(reply, "42")
    assert recall_reward("", reply, "42", {}) == want
    # crossrl: reward.function=bench.peer:recall_reward through the single_turn env
    fn = RewardFunction("bench.peer:recall_reward", timeout_s=10)
    env = SingleTurnEnv(prompt="say 42", answer="42", reward_fn=fn)
    assert env.reset(0) == "say 42"
    assert asyncio.run(env.step(reply))[1] == want  # awaited, as the agent loop does
    # TRL: conversational completions and the dataset's answer column
    got = trl_recall_reward(
        [[{"role": "user", "content": "say 42"}]] * 2,
        [[{"role": "assistant", "content": reply}], reply],
        ["42", "42"],
        completion_ids=[[1], [1]],
    )
    assert got == [want, want]


@pytest.mark.parametrize("name", CPU_JOBS)
def test_both_trainers_get_the_same_settings(name, tmp_path):
    from trainer.config import load_config

    job = JOBS[name]
    data = write_prompts(tmp_path / "p.jsonl", rows=8)
    cfg = load_config(
        None, [*crossrl_overrides(job, steps=7, data_file=data), f"run.dir={tmp_path / 'run'}"]
    )
    trl = trl_config_kwargs(job, steps=7, output_dir=tmp_path / "out")
    r, a, t = cfg.rollout, cfg.algorithm, cfg.train
    assert cfg.model.path == job.model and cfg.seed == trl["seed"] == job.seed
    assert cfg.model.dtype == t.param_dtype == "float32" and cfg.device == "cpu"
    assert trl["bf16"] is trl["fp16"] is False and trl["use_cpu"] is True
    assert r.env == "single_turn" and r.max_turns == 1 and cfg.data.source == str(data)
    assert r.n == trl["num_generations"] == job.samples_per_prompt
    assert t.batch_size == job.prompts_per_step
    assert t.mini_batch_size * r.n == trl["per_device_train_batch_size"]
    assert t.batch_size // t.mini_batch_size == trl["steps_per_generation"]
    assert trl["gradient_accumulation_steps"] == 1 and t.max_tokens_per_micro_batch is None
    assert t.total_steps * trl["steps_per_generation"] == trl["max_steps"]
    # crossrl samples max_new_tokens - 1 tokens and keeps one for the closing EOS
    assert r.max_new_tokens - 1 == trl["max_completion_length"]
    assert (r.temperature, r.top_p, r.top_k) == (trl["temperature"], trl["top_p"], trl["top_k"])
    assert (a.clip_ratio_low, a.clip_ratio_high) == (trl["epsilon"], trl["epsilon_high"])
    assert a.adv_estimator == "grpo" and a.norm_adv_by_std and trl["scale_rewards"] == "group"
    assert a.loss_agg == "token-mean" and trl["loss_type"] == "bnpo"
    assert a.kl_coef == trl["beta"] == 0.0 and not a.use_kl_loss
    assert a.entropy_coef == trl["entropy_coef"] == 0.0
    assert t.ppo_epochs == trl["num_iterations"] == 1
    assert t.lr == trl["learning_rate"] and t.lr_schedule == trl["lr_scheduler_type"]
    assert t.warmup_steps == trl["warmup_steps"] == 0
    assert t.weight_decay == trl["weight_decay"] and t.grad_clip == trl["max_grad_norm"]
    assert trl["gradient_checkpointing"] is False and not t.activation_checkpointing
    assert cfg.critic.enable is False and t.dp_size == 1
    if HAS_TRL:  # TRL accepts them and derives the same generation batch
        from trl import GRPOConfig

        config = GRPOConfig(**trl)
        assert config.generation_batch_size == t.batch_size * r.n
        assert config.steps_per_generation == trl["steps_per_generation"]
        assert config.gradient_checkpointing is False
        assert getattr(config, "activation_checkpointing", False) is False


@pytest.mark.parametrize("name", CPU_JOBS)
def test_both_trainers_send_the_same_prompt_tokens(name):
    from transformers import AutoTokenizer

    from rollout.tokenizer import chat_token_ids, eos_token_ids, load_tokenizer, tokenizer_dir

    job = JOBS[name]
    ours = load_tokenizer(job.model)
    theirs = AutoTokenizer.from_pretrained(str(tokenizer_dir(job.model)), local_files_only=True)
    for text in ("say 42", "say 07"):
        messages = [{"role": "user", "content": text}]
        trl_ids = theirs.apply_chat_template(
            [messages], add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"][0]
        assert chat_token_ids(ours, messages) == list(trl_ids)
    assert theirs.eos_token_id == eos_token_ids(ours)[0]
    assert theirs.pad_token_id == ours.pad_token_id != theirs.eos_token_id


def _side(step_s: float, reward0: float, *, runs: int = 2) -> list[dict]:
    out = []
    for r in range(runs):
        steps = []
        for i in range(4):
            t = 100.0 * r + 10.0 * i
            steps.append(
                {
                    "step": i + 1,
                    "start": t,
                    "end": t + step_s,
                    "step_s": step_s * (3 if i == 0 else 1),  # warm-up: dropped
                    "rollout_s": step_s / 4,
                    "old_logprobs_s": step_s / 4,
                    "update_s": step_s / 2,
                    "reward_mean": reward0 + 0.1 * i,
                }
            )
        out.append({"steps": steps, "startup_s": 10.0 + r})
    return out


class _LoadAt:
    """Outside load of 1 core from wall time 110 to 130 (run 2, steps 2-3), else none."""

    def cores(self, start, end):
        return 1.0 if 110 <= start < 130 else 0.0


def test_summary_drops_warm_up_and_loaded_steps_and_the_table_shows_ratios():
    cx = peer.summarise_side(_side(0.4, 0.1), _LoadAt())
    trl = peer.summarise_side(_side(0.2, 0.2), None)
    assert (cx["steps_measured"], cx["steps_kept"]) == (6, 4)  # 2 loaded steps dropped
    assert (trl["steps_measured"], trl["steps_kept"]) == (6, 6)
    assert cx["step_s"] == pytest.approx(0.4) and trl["step_s"] == pytest.approx(0.2)
    assert cx["startup_median_s"] == pytest.approx(10.5)
    assert cx["reward_mean_curve"] == pytest.approx([0.1, 0.2, 0.3, 0.4])
    job = JOBS["default"]
    res = {
        "trl_version": "1.16.0",
        "jobs": {
            "default": {
                "steps": 4,
                "repeats": 2,
                "prompt_tokens": {"crossrl": [25], "trl": [25]},
                "crossrl": cx,
                "trl": trl,
                "settings": {"job": {**job.__dict__}},
            }
        },
    }
    table = peer.format_table(res)
    assert "TRL 1.16.0" in table
    assert "prompt tokens both [25]" in table
    step_line = next(line for line in table.splitlines() if line.startswith("step"))
    assert step_line.split()[1:] == ["0.400", "0.200", "2.00x"]
    assert "4/6 steps kept" in table and "6/6 steps kept" in table
    assert "0.100 0.200 0.300 0.400" in table and "0.200 0.300 0.400 0.500" in table
    assert "weight sync (crossrl only)" in table


def test_peer_is_left_out_of_all_and_needs_trl(monkeypatch, capsys):
    assert "peer" not in _resolve(["all"])
    assert _resolve(["peer"]) == ["peer"]
    monkeypatch.setattr(peer, "trl_available", lambda: False)
    assert bench_main(["peer", "--quick"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pip install -c constraints-cpu.txt -e '.[bench]'" in err[0]
    assert peer.main(["--quick"]) == 2


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TRL, reason="needs TRL: pip install -e '.[bench]'")
def test_quick_peer_run_trains_both_sides_and_writes_results(tmp_path):
    out = tmp_path / "peer.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.peer", "--quick", "--jobs", "default", "--steps", "2"]
        + ["--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    res = json.loads(out.read_text())["jobs"]["default"]
    assert res["prompt_tokens"]["crossrl"] == res["prompt_tokens"]["trl"] == [25]
    for side in ("crossrl", "trl"):
        curve = res[side]["reward_mean_curve"]
        assert len(curve) == 2 and all(0.0 <= v <= 1.0 for v in curve)
        assert res[side]["startup_s"][0] > 0
    assert "crossrl/TRL" in proc.stdout and "mean reward per step" in proc.stdout


def test_the_gpu_job_runs_both_sides_alike_on_the_gpu_with_vllm_colocated(tmp_path, monkeypatch):
    """``gpu-1.5b`` (the GPU issue's tier 2): both sides on cuda with vLLM colocated and
    sleeping while they train, the same device share, bf16 compute over fp32 master weights,
    gradient checkpointing; the model is random weights of Qwen2.5-1.5B's shape, written once.
    It is not among the jobs ``bench peer`` runs by default (it needs a GPU)."""
    from trainer.config import load_config

    job = JOBS["gpu-1.5b"]
    assert "gpu-1.5b" not in CPU_JOBS and set(CPU_JOBS) == {"default", "small"}
    monkeypatch.setenv("CROSSRL_PEER_MODELS", str(tmp_path / "models"))
    written = []

    def write_random_model(directory, shape, **kwargs):  # the real one writes 6 GB
        written.append((shape, kwargs))
        Path(directory).mkdir(parents=True)
        (Path(directory) / "config.json").write_text("{}")

    monkeypatch.setattr("rollout.models.write_random_model", write_random_model)
    model = model_path(job)
    assert model == str(tmp_path / "models" / "qwen2.5-1.5b-seed1") == model_path(job)
    assert written == [("qwen2.5-1.5b", {"seed": 1, "dtype": "bfloat16"})]  # once
    data = write_prompts(tmp_path / "p.jsonl", rows=8)
    overrides = crossrl_overrides(job, steps=5, data_file=data, model="builtin:small")
    cfg = load_config(None, [*overrides, f"run.dir={tmp_path / 'run'}"], check_environment=False)
    trl = trl_config_kwargs(job, steps=5, output_dir=tmp_path / "out")
    r, t = cfg.rollout, cfg.train
    assert cfg.device == "cuda" and trl["use_cpu"] is False
    assert r.engine == "vllm" and trl["use_vllm"] is True and trl["vllm_mode"] == "colocate"
    assert r.memory_fraction == trl["vllm_gpu_memory_utilization"] == job.memory_fraction
    assert trl["vllm_enable_sleep_mode"] is True and trl["vllm_tensor_parallel_size"] == 1
    assert t.param_dtype == cfg.model.dtype == "bfloat16" and trl["bf16"] is True
    assert t.activation_checkpointing is True and trl["gradient_checkpointing"] is True
    assert r.max_new_tokens - 1 == trl["max_completion_length"] == 255
    assert r.n == trl["num_generations"] and t.lr == trl["learning_rate"] == 1e-6
