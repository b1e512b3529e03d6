"""Checks that a whole config makes sense: fields against each other, and against this machine.

``validate_config`` runs them after the schema has checked each value on its own. Every failure
is a problem naming the key to change (``trainer/config/errors.py``); warnings are settings that
are legal but probably not what was meant.
"""

from __future__ import annotations

import difflib
import importlib.util
import logging
import re
from pathlib import Path

from rollout.assets import BUILTIN_MODELS
from trainer.config.engine_checks import engine_problems
from trainer.config.errors import Problem, problem, raise_first
from trainer.config.parallel_checks import expert_parallel_problems
from trainer.config.schema import Config

log = logging.getLogger("crossrl.config")


def _builtin_env_names() -> list[str] | None:
    """Names of rollout's built-in environments, or None when rollout cannot be imported."""
    try:
        from rollout.envs import BUILTIN_ENVS
    except ImportError:
        return None
    return sorted(BUILTIN_ENVS)


def compile_problem(cfg: Config, *, chosen: bool = False) -> Problem | None:
    """``train.compile_blocks`` beside activation checkpointing: torch runs a checkpointed
    layer eagerly when the varlen attention breaks its graph, so the pair compiles nothing.
    Checked on the config as written and again once ``auto`` sizes resolve (``chosen``:
    ``train.activation_checkpointing`` was ``auto`` and the memory budget chose true)."""
    tr = cfg.train
    if not (tr.compile_blocks and tr.activation_checkpointing is True):
        return None
    which = "auto, which the memory budget chose true" if chosen else "true"
    return problem(
        "train.compile_blocks",
        tr.compile_blocks,
        f"cannot go with train.activation_checkpointing={which} (torch runs a checkpointed "
        "layer eagerly when the varlen attention breaks its graph); set one of them false",
    )


def _static_problems(cfg: Config) -> tuple[list[Problem], list[str]]:
    """Checks that relate fields to each other; no file, package or device is looked at."""
    p: list[Problem] = []
    warn: list[str] = []
    tr, ro, alg = cfg.train, cfg.rollout, cfg.algorithm

    if ro.agent_workers > cfg.env_call_slots():
        p.append(
            problem(
                "rollout.agent_workers",
                ro.agent_workers,
                f"must be <= the environment calls that may run at once ({cfg.env_call_slots()}"
                ", rollout.env_concurrency): each worker needs one; use fewer workers or raise "
                "rollout.env_concurrency",
            )
        )
    if tr.mini_batch_size > tr.batch_size:
        p.append(
            problem(
                "train.mini_batch_size",
                tr.mini_batch_size,
                f"must be <= train.batch_size ({tr.batch_size}); both count prompts",
            )
        )
    elif tr.batch_size % tr.mini_batch_size:
        # Like verl we require equal mini-batches: a short last mini-batch would take an
        # optimizer step on fewer prompts, i.e. a noisier, differently weighted update.
        p.append(
            problem(
                "train.batch_size",
                tr.batch_size,
                f"must be a multiple of train.mini_batch_size ({tr.mini_batch_size}) so every "
                "optimizer step sees the same number of prompts",
            )
        )
    compiled = compile_problem(cfg)
    if compiled:
        p.append(compiled)
    p += expert_parallel_problems(cfg)
    if alg.adv_estimator == "gae" and not cfg.critic.enable:
        p.append(
            problem(
                "critic.enable",
                cfg.critic.enable,
                "algorithm.adv_estimator=gae needs a critic; set critic.enable=true",
            )
        )
    if cfg.critic.enable and alg.adv_estimator != "gae":
        # An error, not a warning: a critic nobody reads doubles memory and time.
        p.append(
            problem(
                "critic.enable",
                cfg.critic.enable,
                f"only gae uses a critic, but algorithm.adv_estimator={alg.adv_estimator}; "
                "set critic.enable=false or algorithm.adv_estimator=gae",
            )
        )
    builtin_envs = _builtin_env_names()
    if ":" not in ro.env and builtin_envs is not None and ro.env not in builtin_envs:
        close = difflib.get_close_matches(ro.env, builtin_envs, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        p.append(
            problem(
                "rollout.env",
                ro.env,
                f"not a built-in environment ({', '.join(builtin_envs)}); {hint}"
                "for your own class write module.path:ClassName",
            )
        )
    if any(not stop for stop in ro.stop_strings):
        p.append(
            problem(
                "rollout.stop_strings",
                ro.stop_strings,
                "an empty string would end every turn at its first token; remove it",
            )
        )
    if ro.merge_stepwise and not ro.step_wise:
        p.append(
            problem(
                "rollout.merge_stepwise",
                ro.merge_stepwise,
                "merges step-wise rows, so it needs rollout.step_wise=true",
            )
        )
    if (
        alg.loss_agg == "seq-mean-token-sum-norm"
        and alg.loss_agg_horizon is None
        and ro.max_turns > 1
        and (not ro.step_wise or ro.merge_stepwise)
    ):
        p.append(
            problem(
                "algorithm.loss_agg_horizon",
                None,
                "seq-mean-token-sum-norm divides by a fixed horizon in tokens; rows here hold "
                "several turns, so rollout.max_new_tokens is not it: set "
                "algorithm.loss_agg_horizon",
            )
        )
    if alg.adv_estimator in ("grpo", "rloo") and ro.n < 2:
        p.append(
            problem(
                "rollout.n",
                ro.n,
                f"{alg.adv_estimator} compares samples of one prompt, so it needs rollout.n >= 2",
            )
        )
    if ro.engine == "hf" and ro.tensor_parallel_size != 1:
        p.append(
            problem(
                "rollout.tensor_parallel_size",
                ro.tensor_parallel_size,
                "the hf engine runs one device per replica; use 1 or rollout.engine=vllm",
            )
        )
    elif ro.engine_devices and ro.engine_devices % ro.tensor_parallel_size:
        p.append(
            problem(
                "rollout.engine_devices",
                ro.engine_devices,
                f"must be a multiple of rollout.tensor_parallel_size ({ro.tensor_parallel_size}): "
                "each engine replica takes that many of the engines' own devices",
            )
        )
    elif not ro.engine_devices and tr.dp_size % ro.tensor_parallel_size:
        p.append(
            problem(
                "rollout.tensor_parallel_size",
                ro.tensor_parallel_size,
                f"must divide train.dp_size ({tr.dp_size}): engine replicas share the "
                "trainer's devices (or give them their own: rollout.engine_devices)",
            )
        )
    p += engine_problems(cfg)
    if alg.use_kl_loss and alg.kl_coef == 0:
        p.append(
            problem(
                "algorithm.kl_coef",
                alg.kl_coef,
                "algorithm.use_kl_loss=true needs algorithm.kl_coef > 0 (else the KL term is "
                "zero and the reference model is wasted)",
            )
        )
    p += _verl_problems(cfg, warn)
    total_opt_steps = cfg.optimizer_steps_per_step() * tr.total_steps
    for key, warmup in (
        ("train.warmup_steps", tr.warmup_steps),
        ("critic.warmup_steps", cfg.critic.warmup_steps),
    ):
        if tr.batch_size % tr.mini_batch_size == 0 and warmup and warmup >= total_opt_steps:
            p.append(
                problem(
                    key,
                    warmup,
                    f"counts optimizer steps and must be < the run's {total_opt_steps} "
                    "(train.total_steps x mini-batches per step x train.ppo_epochs)",
                )
            )

    if (
        isinstance(tr.max_tokens_per_micro_batch, int)
        and tr.max_tokens_per_micro_batch < ro.max_input_len + ro.max_new_tokens
    ):
        warn.append(
            f"train.max_tokens_per_micro_batch={tr.max_tokens_per_micro_batch} < "
            f"rollout.max_input_len + rollout.max_new_tokens "
            f"({ro.max_input_len + ro.max_new_tokens}): a longer row gets a micro-batch alone"
        )
    if tr.lr_schedule == "constant" and tr.min_lr_ratio:
        warn.append("train.min_lr_ratio is ignored with train.lr_schedule=constant")
    if cfg.model.critic_path is not None and not cfg.critic.enable:
        warn.append("model.critic_path is ignored with critic.enable=false")
    if cfg.ray.num_cpus is not None and cfg.ray.address is not None:
        warn.append("ray.num_cpus is ignored when joining a cluster (ray.address is set)")
    if tr.mini_batch_size * ro.n < tr.dp_size:
        warn.append(
            f"train.mini_batch_size x rollout.n = {tr.mini_batch_size * ro.n} trajectories per "
            f"mini-batch < train.dp_size ({tr.dp_size}): some ranks will train on padding rows only"
        )
    return p, warn


def _verl_problems(cfg: Config, warn: list[str]) -> list[Problem]:
    """Rewards, validation, loggers and the algorithm variants (issue 17): fields together."""
    p: list[Problem] = []
    ro, alg, rew, run = cfg.rollout, cfg.algorithm, cfg.reward, cfg.run
    if ro.env == "single_turn":
        if rew.function is None:
            p.append(
                problem(
                    "reward.function",
                    None,
                    "rollout.env=single_turn scores replies with a reward function; set "
                    "module:function, builtin:gsm8k or builtin:math",
                )
            )
        if cfg.data.source == "env":
            p.append(
                problem(
                    "data.source",
                    "env",
                    "rollout.env=single_turn reads dataset rows; give a .jsonl/.parquet file",
                )
            )
    if (run.val_every or run.val_before_train) and cfg.data.val_source is None:
        key = "run.val_every" if run.val_every else "run.val_before_train"
        p.append(problem(key, run.val_every or True, "validation needs data.val_source (a file)"))
    if "jsonl" not in run.loggers:
        p.append(
            problem(
                "run.loggers",
                run.loggers,
                "metrics.jsonl is the run directory's contract; keep jsonl in the list",
            )
        )
    if rew.overlong_buffer_len and rew.overlong_buffer_len >= ro.max_new_tokens - 1:
        p.append(
            problem(
                "reward.overlong_buffer_len",
                rew.overlong_buffer_len,
                f"must be < rollout.max_new_tokens - 1 ({ro.max_new_tokens - 1}), the most "
                "tokens a turn can generate",
            )
        )
    if ro.max_sample_batches > 1 and alg.adv_estimator in ("gae", "reinforce_pp"):
        warn.append(
            f"rollout.max_sample_batches={ro.max_sample_batches} drops groups with equal "
            f"scores, which still carry signal for algorithm.adv_estimator={alg.adv_estimator} "
            "(no group baseline)"
        )
    if alg.policy_loss == "gspo" and alg.loss_agg != "seq-mean-token-mean":
        warn.append(
            f"algorithm.policy_loss=gspo is defined with seq-mean-token-mean; "
            f"algorithm.loss_agg={alg.loss_agg} weights sequences differently"
        )
    return p


def _reward_and_logger_problems(cfg: Config) -> list[Problem]:
    """Against this machine: the reward function imports, the env takes it, loggers are
    installed, the validation file exists."""
    p: list[Problem] = []
    spec = cfg.reward.function
    if spec is not None:
        try:
            from rollout.envs import make_env, takes_reward_fn
            from rollout.rewards import load_reward_function

            load_reward_function(spec)
            env = cfg.rollout.env
            if not takes_reward_fn(make_env(env)):
                p.append(
                    problem(
                        "reward.function",
                        spec,
                        f"rollout.env={env} does not take a reward function (no reward_fn "
                        "argument); use single_turn or qa, or set reward.function=null",
                    )
                )
        except ValueError as exc:
            reason = str(exc).split(": ", 1)[-1]
            p.append(problem("reward.function", spec, reason))
    for name in cfg.run.loggers:
        if name != "jsonl" and not _module_available(name):
            p.append(
                problem(
                    "run.loggers",
                    cfg.run.loggers,
                    f"{name} is not installed; pip install 'crossrl[{name}]' or remove {name}",
                )
            )
    val = cfg.data.val_source
    if val is not None and not Path(val).is_file():
        p.append(
            problem("data.val_source", val, "file not found; give an existing .jsonl/.parquet")
        )
    return p


def _model_dir_problem(key: str, path: str) -> Problem | None:
    if path.startswith("builtin:"):
        return None
    if not Path(path).is_dir():
        return problem(
            key,
            path,
            f"must be {', '.join(f'builtin:{n}' for n in BUILTIN_MODELS)} or an existing local "
            "model directory (download the model first; nothing is fetched at run time)",
        )
    if not (Path(path) / "config.json").is_file():
        return problem(key, path, "directory has no config.json; point at a HF model directory")
    return None


def _module_available(name: str) -> bool:
    """Whether ``import name`` would find a module, without importing it (a dotted name
    imports its parent packages)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False
    except Exception:  # noqa: BLE001 - a parent package raised: it exists, importing names why
        return True


def env_problem(cfg: Config, record: dict | None = None) -> Problem | None:
    """Import the environment class and construct it once, so a module that raises on import
    or a constructor that raises fails at start-up, in one line. The constructor gets
    ``rollout.env_kwargs`` updated by ``record`` (a prompt file's first record, as the rollout
    passes it); with a prompt file and no record yet the class is only imported (its required
    arguments may come from the file: ``trainer.loop.start.preflight`` constructs it then)."""
    env, kwargs = cfg.rollout.env, dict(cfg.rollout.env_kwargs)
    if ":" in env and not _module_available(env.split(":", 1)[0]):
        module = env.split(":", 1)[0]
        return problem(
            "rollout.env",
            env,
            f"module {module!r} is not importable; check PYTHONPATH or the spelling",
        )
    try:
        from rollout.envs import bind_env, exception_line, make_env
    except ImportError:
        return None
    try:
        make_env(env)  # imports the class and checks it has reset/step
    except ValueError as exc:
        reason = str(exc).split(": ", 1)[-1]  # drop its own "rollout.env=...: " head
        return problem("rollout.env", env, reason)
    if record is None and cfg.data.source != "env":
        # each prompt-file row brings arguments: trainer.loop.start.preflight constructs it
        return None
    where = "rollout.env_kwargs" + (f" and {cfg.data.source}'s first record" if record else "")
    reward_fn = None
    if cfg.reward.function is not None:
        try:
            from rollout.rewards import RewardFunction

            reward_fn = RewardFunction(cfg.reward.function, timeout_s=cfg.reward.timeout_s)
        except Exception:  # noqa: BLE001 - reported by the reward.function check
            return None
    try:
        # The factory the rollout host builds (bind_env), called with a row's fields.
        bind_env(env, kwargs, reward_fn)(**(record or {}))
    except (TypeError, ValueError) as exc:
        if kwargs and record is None:
            return problem("rollout.env_kwargs", kwargs, f"{env} does not accept them: {exc}")
        return problem(
            "rollout.env", env, f"constructing it with {where} raised {exception_line(exc)}"
        )
    except Exception as exc:  # noqa: BLE001 - the user's constructor: report, never crash
        return problem(
            "rollout.env",
            env,
            f"constructing it with {where} raised {exception_line(exc)}; fix the "
            "environment's __init__",
        )
    return None


def _device_problem(key: str, name: str, fix: str) -> Problem | None:
    """``key=name`` names a device type that this machine has none of (the HAL's
    ``available_backends``; ``auto`` and ``cpu`` are always there), or None. ``fix``: what to set
    instead; the message also says why the type is missing (``hal.registry.unavailable_reason``)."""
    if name in ("auto", "cpu"):  # before importing hal: the config check imports no torch
        return None
    from hal import available_backends
    from hal.registry import unavailable_reason

    found = list(available_backends())
    if name in found:
        return None
    reason = unavailable_reason(name)  # a name the schema refused never gets here
    return problem(
        key,
        name,
        f"no such device on this machine{f': {reason}' if reason else ''} (found: "
        f"{', '.join(found) or 'none'}); run `crossrl devices`, {fix}, or install that backend "
        "and run where it sees a device",
    )


def _environment_problems(cfg: Config) -> list[Problem]:
    """Checks against this machine: devices, packages and files."""
    p: list[Problem] = []
    devices = [_device_problem("device", cfg.device, "set device=auto")]
    # The engines' own device type: on a local run their devices are this machine's (on a
    # cluster they may sit on other nodes, which the layout checks once Ray has joined).
    if cfg.rollout.device is not None and cfg.ray.address is None:
        fix = f"set rollout.device=null (the trainer's device, {cfg.device}) or rollout.device=auto"
        devices.append(_device_problem("rollout.device", cfg.rollout.device, fix))
    p.extend(found for found in devices if found)
    if cfg.rollout.engine == "vllm" and not _module_available("vllm"):
        p.append(
            problem(
                "rollout.engine",
                "vllm",
                "the vllm package is not importable here; install it (see docs/cluster.md) or "
                "set rollout.engine=hf",
            )
        )
    for key, path in (("model.path", cfg.model.path), ("model.critic_path", cfg.model.critic_path)):
        if path is not None and (key == "model.path" or cfg.critic.enable):
            bad_dir = _model_dir_problem(key, path)
            if bad_dir:
                p.append(bad_dir)
    if cfg.data.source != "env" and not Path(cfg.data.source).is_file():
        p.append(
            problem(
                "data.source", cfg.data.source, "file not found; give an existing .jsonl/.parquet"
            )
        )
    resume = cfg.run.resume
    named_step = re.fullmatch(r"(step_)?\d+", resume) is not None
    if resume not in ("auto", "latest", "never") and not named_step and not Path(resume).exists():
        p.append(
            problem(
                "run.resume",
                resume,
                "must be auto, latest, never, step_<N> (a checkpoint in run.dir) or the path "
                "of an existing checkpoint directory (step_<N>)",
            )
        )
    p += _reward_and_logger_problems(cfg)
    bad_env = env_problem(cfg)
    if bad_env:
        p.append(bad_env)
    return p


def validate_config(cfg: Config, *, check_environment: bool = True) -> list[str]:
    """Run the cross-field checks (and, with ``check_environment``, the device, package and
    file checks). Raises ``ConfigError`` for the first problem (``.problems`` has them all);
    returns warnings about settings that are legal but probably not what was meant."""
    problems, warnings = _static_problems(cfg)
    if check_environment:
        problems += _environment_problems(cfg)
    raise_first(problems)
    return warnings
