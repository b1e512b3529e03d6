"""Cross-field checks of the engines' placement, weight transport and lag (part of
``trainer.config.checks``): each problem names the key to change and how."""

from __future__ import annotations

from trainer.config.errors import Problem, problem
from trainer.config.schema import Config

#: The device settings that are no accelerator (``auto`` resolves later, at the layout).
CPU_OR_AUTO = ("cpu", "auto")


def engine_problems(cfg: Config) -> list[Problem]:
    """Where the engines run and how their weights reach them: ``rollout.device`` other than
    the trainer's needs devices of their own; ``rollout.weight_transport=collective`` needs
    them too, on the trainer's device type; ``train.rollout_lag`` > 0: the engines must
    generate while the ranks train, so they need devices of their own, and the loss must
    correct for the older behaviour policy."""
    p = []
    ro = cfg.rollout
    if ro.expert_parallel and (ro.engine != "vllm" or ro.tensor_parallel_size < 2):
        p.append(
            problem(
                "rollout.expert_parallel",
                ro.expert_parallel,
                "splits a vllm replica's experts over its tensor-parallel ranks: it needs "
                f"rollout.engine=vllm (now {ro.engine}) and rollout.tensor_parallel_size >= 2 "
                f"(now {ro.tensor_parallel_size}); set rollout.expert_parallel=false",
            )
        )
    on_cpu = (cfg.rollout.device or cfg.device) == "cpu"
    if cfg.algorithm.routing_replay != "none" and cfg.rollout.engine == "vllm" and on_cpu:
        p.append(
            problem(
                "algorithm.routing_replay",
                cfg.algorithm.routing_replay,
                "vLLM's CPU build returns no routing (its aux outputs need Model Runner V2 and "
                "Triton): set rollout.engine=hf on the CPU, or algorithm.routing_replay=none",
            )
        )
    if cfg.rollout.device not in (None, cfg.device) and not cfg.rollout.engine_devices:
        p.append(
            problem(
                "rollout.device",
                cfg.rollout.device,
                f"engines on another device than the trainer's ({cfg.device}) need devices of "
                "their own: set rollout.engine_devices, or rollout.device=null",
            )
        )
    transport = cfg.rollout.weight_transport
    if transport == "collective" and not cfg.rollout.engine_devices:
        p.append(
            problem(
                "rollout.weight_transport",
                transport,
                "only engines of their own take weights through a collective (colocated "
                "engines take them through their devices' shared memory): set "
                "rollout.engine_devices, or rollout.weight_transport=auto",
            )
        )
    elif transport == "collective" and cfg.rollout.device not in (None, cfg.device):
        p.append(
            problem(
                "rollout.weight_transport",
                transport,
                f"no collective joins the trainer's {cfg.device} devices and the engines' "
                f"{cfg.rollout.device} ones (rollout.device): set rollout.weight_transport="
                "host (or auto), or rollout.device=null",
            )
        )
    elif transport == "collective" and cfg.rollout.engine == "hf" and cfg.device not in CPU_OR_AUTO:
        p.append(
            problem(
                "rollout.weight_transport",
                transport,
                f"the HF engine on {cfg.device} devices of its own takes host-memory snapshots "
                "(only vLLM's weight-transfer engines push through a collective there, "
                "rollout.engine): set rollout.weight_transport=auto (or host), or "
                "rollout.engine=vllm",
            )
        )
    elif transport == "collective" and cfg.model.lora.enabled:
        p.append(
            problem(
                "rollout.weight_transport",
                transport,
                "LoRA adapters reach the engines through their LoRA load, not their weight "
                "transfer (model.lora.enabled): set rollout.weight_transport=auto (or host)",
            )
        )
    p += _streaming_problems(cfg)
    lag = cfg.train.rollout_lag
    if not lag:
        return p
    if not cfg.rollout.engine_devices:
        p.append(
            problem(
                "train.rollout_lag",
                lag,
                "the engines generate the next steps while the ranks train, so they need "
                "devices of their own: set rollout.engine_devices (e.g. to "
                f"{cfg.rollout.tensor_parallel_size}) or train.rollout_lag=0",
            )
        )
    if cfg.algorithm.rollout_correction == "none":
        p.append(
            problem(
                "train.rollout_lag",
                lag,
                "samples come from an older policy, so the loss needs importance weights "
                "(decoupled PPO): set algorithm.rollout_correction=token or sequence, or "
                "train.rollout_lag=0",
            )
        )
    return p


def _streaming_problems(cfg: Config) -> list[Problem]:
    """What ``train.max_staleness`` (streaming rollouts) cannot run with, by key."""
    bound = cfg.train.max_staleness
    if not bound:
        out = []
        if cfg.rollout.partial_rollout:
            out.append(
                problem(
                    "rollout.partial_rollout",
                    True,
                    "partial rollouts continue streamed trajectories under new weights; set "
                    "train.max_staleness (streaming) or rollout.partial_rollout=false",
                )
            )
        if cfg.train.stale_prompts != "drop":
            out.append(
                problem(
                    "train.stale_prompts",
                    cfg.train.stale_prompts,
                    "only a stream has groups past its staleness bound to keep or retry; set "
                    "train.max_staleness (streaming) or train.stale_prompts=drop",
                )
            )
        return out
    default_retries = type(cfg.train).model_fields["max_prompt_retries"].default
    if cfg.train.max_prompt_retries != default_retries and cfg.train.stale_prompts != "retry":
        return [
            problem(
                "train.max_prompt_retries",
                cfg.train.max_prompt_retries,
                f"only train.stale_prompts=retry samples a prompt again (now "
                f"{cfg.train.stale_prompts}): set train.stale_prompts=retry, or leave "
                "train.max_prompt_retries out",
            )
        ]
    oldest = max(1, cfg.train.total_steps - 1)  # step t trains with the policy after t - 1
    if bound > oldest:
        return [
            problem(
                "train.max_staleness",
                bound,
                f"a run of train.total_steps={cfg.train.total_steps} never trains on a group "
                f"more than {oldest} policies behind, so a larger bound drops no fewer groups "
                "and only lets the stream start groups no step takes (a thread and rows each, "
                f"in the rollout host): set train.max_staleness to at most {oldest}",
            )
        ]
    why = [
        (
            cfg.train.rollout_lag > 0,
            "train.rollout_lag",
            "streaming replaces the fixed lag: set train.rollout_lag=0",
        ),
        (
            cfg.algorithm.rollout_correction == "none",
            "algorithm.rollout_correction",
            "samples come from older policies, so the loss needs importance weights: set "
            "algorithm.rollout_correction=token, sequence or geometric",
        ),
        (
            cfg.rollout.max_sample_batches > 1,
            "rollout.max_sample_batches",
            "dynamic sampling draws whole batches; a stream hands over groups: set "
            "rollout.max_sample_batches=1",
        ),
    ]
    return [
        problem("train.max_staleness", bound, f"with {key}: {fix}, or train.max_staleness=null")
        for bad, key, fix in why
        if bad
    ]
