"""The agent loop with the job's rollout settings: what training and validation both sample
with (``trainer.loop.engines.rollout_host``, ``trainer.loop.engines.validation_rollouts``)."""

from __future__ import annotations

from trainer.config.schema import Config


def run_config_rollouts(
    engine,
    tokenizer,
    env_factory,
    items,
    cfg: Config,
    *,
    n,
    sampling,
    seed,
    step,
    env_slots=None,
    agent_workers=None,
):
    """``rollout.agent_loop.run_rollouts`` with the job's ``rollout.*`` settings: ``n`` samples
    per prompt, ``sampling``, the request ``seed`` stream and ``step`` are the caller's
    (training and validation differ there and only there); ``env_slots``: environment-call
    slots shared with the other rollouts running at once (a stream's groups);
    ``agent_workers``: the host's ``rollout.agent_workers.AgentWorkers`` (``rollout.agent_workers``
    > 0), which run the agent loops with environments of their own (``env_factory`` and
    ``env_slots`` are then theirs)."""
    from rollout.agent_loop import run_rollouts

    roll = cfg.rollout
    settings = dict(
        n=n,
        max_turns=roll.max_turns,
        step_wise=roll.step_wise,
        merge_stepwise=roll.merge_stepwise,
        max_input_len=roll.max_input_len,
        max_new_tokens=roll.max_new_tokens,
        sampling=sampling,
        seed=seed,
        step=step,
        stop_strings=tuple(roll.stop_strings),
        env_timeout_s=roll.env_timeout_s,
        deterministic=cfg.run.deterministic,
    )
    if agent_workers is not None:
        return agent_workers.rollouts(engine, tokenizer, items, **settings)
    return run_rollouts(
        engine,
        tokenizer,
        env_factory,
        items,
        env_concurrency=cfg.env_call_slots(),
        env_slots=env_slots,
        **settings,
    )
