"""Bad configs fail at load time with a ConfigError naming the key to fix."""

from __future__ import annotations

import pytest

import hal
import trainer.config.checks as checks
from trainer.config import ConfigError, load_config


@pytest.fixture(autouse=True)
def _cpu_only_machine(monkeypatch):
    """Pretend this machine has a CPU and nothing else, whatever it really has."""
    monkeypatch.setattr(hal, "available_backends", lambda: ["cpu"], raising=False)


def _vllm_installed(monkeypatch):
    real = checks._module_available
    monkeypatch.setattr(checks, "_module_available", lambda name: name == "vllm" or real(name))


# (overrides on top of configs/cpu/tiny.yaml, key the error must name, text the message must hold)
BAD = [
    # unknown keys, with the closest valid key suggested
    (["trian.lr=1e-3"], "trian.lr", "did you mean 'train.lr'"),
    (["train.lrr=1e-3"], "train.lrr", "did you mean 'train.lr'"),
    (["rollout.temprature=0.5"], "rollout.temprature", "did you mean 'rollout.temperature'"),
    (["algorithm.kl_coeff=0.1"], "algorithm.kl_coeff", "did you mean 'algorithm.kl_coef'"),
    (["devcie=cpu"], "devcie", "did you mean 'device'"),
    (["rollout.env_concurrency=0"], "rollout.env_concurrency", "or auto"),
    (["rollout.env_concurrency=many"], "rollout.env_concurrency", "auto"),
    (["rollout.agent_workers=-1"], "rollout.agent_workers", "greater than or equal to 0"),
    # more agent workers than environment-call slots, auto or a number (issue 57)
    (["rollout.agent_workers=4", "rollout.env_concurrency=3"], "rollout.agent_workers", "(3"),
    (["rollout.agent_workers=200"], "rollout.agent_workers", "(128"),
    # wrong types
    (["train.batch_size=eight"], "train.batch_size", "'eight'"),
    (["train.batch_size=8.5"], "train.batch_size", "8.5"),
    (["train.batch_size=true"], "train.batch_size", "integer"),
    (["rollout.step_wise=maybe"], "rollout.step_wise", "boolean"),
    (["train.lr=null"], "train.lr", "null"),
    (["train=5"], "train", "mapping"),
    # words outside the allowed set
    (["device=tpu"], "device", "'npu'"),
    (["model.dtype=fp16"], "model.dtype", "'bfloat16'"),
    (["algorithm.adv_estimator=ppo"], "algorithm.adv_estimator", "'gae'"),
    (["algorithm.kl_estimator=k4"], "algorithm.kl_estimator", "'k3'"),
    (["train.lr_schedule=linear"], "train.lr_schedule", "'cosine'"),
    (["train.param_dtype=float16"], "train.param_dtype", "'bfloat16'"),
    (["algorithm.loss_agg=sum"], "algorithm.loss_agg", "'token-mean'"),
    # out of range
    (["rollout.temperature=0"], "rollout.temperature", "greater than 0"),
    (["rollout.temperature=-1.0"], "rollout.temperature", "greater than 0"),
    (["rollout.top_p=1.5"], "rollout.top_p", "1.5"),
    (["rollout.top_k=-1"], "rollout.top_k", "-1"),
    (["rollout.n=0"], "rollout.n", "0"),
    # one token is kept for the end-of-turn token: 1 used to pass here and fail after Ray
    (["rollout.max_new_tokens=1"], "rollout.max_new_tokens", "greater than or equal to 2"),
    (["rollout.memory_fraction=1.0"], "rollout.memory_fraction", "less than 1"),
    (["algorithm.clip_ratio_low=1.2"], "algorithm.clip_ratio_low", "1.2"),
    (["algorithm.clip_ratio_high=0"], "algorithm.clip_ratio_high", "greater than 0"),
    (["algorithm.clip_ratio_c=0.5"], "algorithm.clip_ratio_c", "greater than 1"),
    (["algorithm.gamma=1.5"], "algorithm.gamma", "1.5"),
    (["train.max_tokens_per_micro_batch=1"], "train.max_tokens_per_micro_batch", "2"),
    (["train.grad_clip=0"], "train.grad_clip", "greater than 0"),
    (["seed=-1"], "seed", "-1"),
    (["ray.address=nohost"], "ray.address", "host:port"),
    (["ray.address=node1:99999"], "ray.address", "host:port"),
    (["run.dir=' '"], "run.dir", "empty"),
    (["rollout.env=not a spec!"], "rollout.env", "module.path:ClassName"),
    (["model.path=builtin:huge"], "model.path", "builtin:tiny"),
    (["data.source=prompts.csv"], "data.source", ".jsonl"),
    (["rollout.env_kwargs={turns: 0}"], "rollout.env_kwargs", "turns"),
    (["rollout.stop_strings=['</tool>', '']"], "rollout.stop_strings", "empty string"),
    (["rollout.env_kwargs={colour: red}"], "rollout.env_kwargs", "colour"),
    # inconsistent combinations
    (
        ["train.batch_size=8", "train.mini_batch_size=16"],
        "train.mini_batch_size",
        "train.batch_size (8)",
    ),
    (["train.mini_batch_size=3"], "train.batch_size", "multiple of train.mini_batch_size (3)"),
    (["algorithm.adv_estimator=gae"], "critic.enable", "critic.enable=true"),
    (["critic.enable=true"], "critic.enable", "only gae"),
    (["rollout.merge_stepwise=true", "rollout.step_wise=false"], "rollout.merge_stepwise", ""),
    (
        ["algorithm.loss_agg=seq-mean-token-sum-norm", "rollout.step_wise=false"],
        "algorithm.loss_agg_horizon",
        "horizon",
    ),
    (["rollout.n=1"], "rollout.n", "grpo"),
    (["algorithm.adv_estimator=rloo", "rollout.n=1"], "rollout.n", "rloo"),
    (["rollout.tensor_parallel_size=2"], "rollout.tensor_parallel_size", "hf engine"),
    (["algorithm.use_kl_loss=true", "algorithm.kl_coef=0.0"], "algorithm.kl_coef", "> 0"),
    (["train.warmup_steps=1000"], "train.warmup_steps", "optimizer steps"),
    # this machine: devices, packages, files
    (["device=npu"], "device", "found: cpu"),
    (["device=cuda"], "device", "found: cpu"),
    # the engines' own device type, refused here rather than by the layout after start-up
    (["rollout.device=npu", "rollout.engine_devices=1"], "rollout.device", "no such device"),
    (["rollout.device=cuda", "rollout.engine_devices=1"], "rollout.device", "rollout.device=auto"),
    (["model.path=/nonexistent/Qwen2.5-7B-Instruct"], "model.path", "download the model"),
    (["data.source=/nonexistent/prompts.jsonl"], "data.source", "not found"),
    (["run.resume=/nonexistent/step_3"], "run.resume", "existing checkpoint"),
    (["rollout.env=no_such_module_xyz:Env"], "rollout.env", "not importable"),
    (["rollout.env=json:NoSuchClass"], "rollout.env", "NoSuchClass"),
    (["rollout.env=json:JSONDecoder"], "rollout.env", "reset"),
    (["rollout.env=recal"], "rollout.env", "did you mean 'recall'"),
]


@pytest.mark.parametrize(("overrides", "key", "text"), BAD, ids=lambda v: str(v))
def test_bad_config_names_the_key(overrides, key, text):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    err = info.value
    message = str(err)
    assert err.key == key
    assert message.startswith(key + ":"), message
    assert text in message
    assert "\n" not in message
    assert isinstance(err, ValueError)


def test_vllm_engine_needs_vllm_importable(monkeypatch):
    monkeypatch.setattr(checks, "_module_available", lambda name: False)
    with pytest.raises(ConfigError) as info:
        load_config(None, ["rollout.engine=vllm"])
    assert info.value.key == "rollout.engine"
    assert "rollout.engine=hf" in str(info.value)


def test_vllm_tensor_parallel_must_divide_dp_size(monkeypatch):
    _vllm_installed(monkeypatch)
    with pytest.raises(ConfigError) as info:
        load_config(
            None, ["rollout.engine=vllm", "rollout.tensor_parallel_size=3", "train.dp_size=4"]
        )
    assert info.value.key == "rollout.tensor_parallel_size"
    assert "train.dp_size (4)" in str(info.value)
    cfg = load_config(
        None, ["rollout.engine=vllm", "rollout.tensor_parallel_size=2", "train.dp_size=4"]
    )
    assert cfg.rollout.tensor_parallel_size == 2


def test_user_environment_class_is_accepted():
    cfg = load_config(None, ["rollout.env=rollout.envs.recall:RecallEnv"])
    assert cfg.rollout.env == "rollout.envs.recall:RecallEnv"


def test_present_device_passes(monkeypatch):
    monkeypatch.setattr(hal, "available_backends", lambda: ["cpu", "npu"], raising=False)
    assert load_config(None, ["device=npu"]).device == "npu"


def test_engine_device_present_passes(monkeypatch):
    monkeypatch.setattr(hal, "available_backends", lambda: ["npu", "cpu"], raising=False)
    cfg = load_config(None, ["rollout.device=npu", "rollout.engine_devices=1"])
    assert cfg.rollout.device == "npu"


def test_engine_device_on_a_cluster_is_left_to_the_layout():
    """On a cluster the engines' devices may be on other nodes: this machine has no say."""
    overrides = ["rollout.device=npu", "rollout.engine_devices=1", "ray.address=10.0.0.1:6379"]
    assert load_config(None, overrides).rollout.device == "npu"


@pytest.mark.parametrize(
    ("overrides", "key", "fix"),
    [
        (
            ["rollout.device=npu", "rollout.engine_devices=1"],
            "rollout.device",
            "rollout.device=null",
        ),
        (["device=npu"], "device", "set device=auto"),
    ],
)
def test_missing_device_says_why_and_what_to_set(overrides, key, fix):
    """Refused at load, before Ray or a model starts (the engines' device used to pass here
    and fail in the layout with "nodes of 0 NPU devices hold only 0 whole replica(s)")."""
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    message = str(info.value)
    assert message.startswith(f"{key}: got 'npu'; no such device on this machine: "), message
    assert "found: cpu" in message and fix in message and "install" in message
    assert "whole replica" not in message


def test_environment_checks_can_be_skipped():
    cfg = load_config(
        None,
        ["device=npu", "model.path=/nonexistent/model", "data.source=/nonexistent/p.jsonl"],
        check_environment=False,
    )
    assert (cfg.device, cfg.model.path) == ("npu", "/nonexistent/model")


def test_model_directory_needs_config_json(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_config(None, [f"model.path={tmp_path}"])
    assert info.value.key == "model.path"
    assert "config.json" in str(info.value)
    (tmp_path / "config.json").write_text("{}")
    assert load_config(None, [f"model.path={tmp_path}"]).model.path == str(tmp_path)


def test_every_problem_is_reported():
    with pytest.raises(ConfigError) as info:
        load_config(None, ["rollout.temperature=0", "train.lr=-1.0", "trian.x=1"])
    keys = {key for key, _value, _message in info.value.problems}
    assert keys == {"rollout.temperature", "train.lr", "trian.x"}
    assert "and 2 more problems" in str(info.value)


def test_legal_but_odd_settings_only_warn(caplog):
    with caplog.at_level("WARNING", logger="crossrl.config"):
        cfg = load_config(None, ["train.max_tokens_per_micro_batch=16"])
    assert cfg.train.max_tokens_per_micro_batch == 16
    assert "gets a micro-batch alone" in caplog.text


def test_compiled_blocks_refuse_activation_checkpointing():
    """torch runs a checkpointed layer with a graph break (the varlen attention's) eagerly:
    the pair would silently compile nothing, so it is refused naming both keys."""
    both = ["train.compile_blocks=true", "train.activation_checkpointing=true"]
    with pytest.raises(ConfigError) as info:
        load_config(None, both)
    assert info.value.key == "train.compile_blocks"
    assert "train.activation_checkpointing=true" in str(info.value)
    assert load_config(None, both[:1]).train.compile_blocks is True


STREAM = ["train.max_staleness=1", "algorithm.rollout_correction=token"]


@pytest.mark.parametrize(
    ("overrides", "slots"),
    [
        ([], lambda cfg: cfg.train.batch_size * cfg.rollout.n),  # a lag-0 step's episodes
        (STREAM, lambda cfg: cfg.train.batch_size * cfg.rollout.n * 2),  # groups span 2 steps
        (["train.batch_size=512", "rollout.n=16"], lambda cfg: 1024),  # the ceiling
        (["rollout.env_concurrency=3", *STREAM], lambda cfg: 3),  # a number is kept
    ],
    ids=["lag0", "stream", "ceiling", "number"],
)
def test_env_concurrency_auto_gives_every_episode_in_flight_a_slot(overrides, slots):
    """``rollout.env_concurrency=auto`` (the default): the episodes the run may have in
    flight, at most ``ENV_SLOTS_AUTO_MAX``; a number is used as given."""
    from trainer.config.schema import ENV_SLOTS_AUTO_MAX

    cfg = load_config(None, overrides, check_environment=False)
    assert cfg.env_call_slots() == slots(cfg) <= ENV_SLOTS_AUTO_MAX
    assert cfg.rollout.env_concurrency == (
        3 if "rollout.env_concurrency=3" in overrides else "auto"
    )
