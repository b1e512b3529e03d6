"""Where each step's rollout comes from: the run's one stream-or-lag decision.

``rollout_pipeline(job)`` decides it, once per start-up (``trainer.loop.start.launch``), and
returns the object every later question goes to:

- streamed (``train.max_staleness`` set, not replaying): a ``StreamingPipeline``
  (``trainer.loop.schedule.streaming``), colocated engines or engines of their own;
- engines on devices of their own, not streamed: the fixed-lag ``RolloutPipeline``
  (``train.rollout_lag``, ``trainer.loop.schedule.pipeline``);
- colocated engines, not streamed: None; each step samples its own rollout, in the step
  (``Trainer._rollout``).

``start_pipeline`` then starts it with the weights the run starts from. Nothing else reads
``train.max_staleness`` at run time: the stream hands its bound to the rollout host
(``StreamingHost.stream_start``), and the controller asks the pipeline (``take``, ``hold``,
``release``, ``after_update``, ``ahead``).
"""

from __future__ import annotations

from trainer.loop.cluster.group import wait_all

__all__ = ["record_dir", "rollout_pipeline", "start_pipeline"]


def record_dir(job, *, streamed: bool = False) -> str | None:
    """Where the rollouts are recorded (``run.record_rollouts``; always for a ``streamed``
    run, which only its recording replays), or None."""
    return str(job.run_dir / "rollouts") if job.cfg.run.record_rollouts or streamed else None


def rollout_pipeline(job):
    """The pipeline of ``job``'s rollouts for the run's mode (module docstring): a
    ``StreamingPipeline``, a ``RolloutPipeline`` or None. A replay (``job.replay_dir``)
    reads the steps as recorded, so it never streams."""
    from trainer.loop.schedule.pipeline import RolloutPipeline
    from trainer.loop.schedule.streaming import StreamingPipeline

    train = job.cfg.train
    if train.max_staleness and job.replay_dir is None:
        return StreamingPipeline(
            job.rollout,
            train.max_staleness,
            record_dir(job, streamed=True),
            # a step waits for its groups, up to as long as a rollout may take
            timeout_s=job.limits.queued_s(1),
        )
    if not job.layout.separate:
        return None
    return RolloutPipeline(
        job.rollout,
        train.rollout_lag,
        train.total_steps,
        record_dir(job),
        # A recording has no steps past the run's end to keep in a checkpoint.
        horizon=train.total_steps if job.replay_dir is not None else None,
        # a rollout waits behind those queued before it (the lag) and a validation
        timeout_s=job.limits.queued_s(train.rollout_lag + 1),
    )


def start_pipeline(job) -> None:
    """Start ``job.pipeline`` with the weights the run starts from. Colocated engines (a
    stream) hold them already (the run's first, or the resumed ones: ``launch.resume``
    synced them). Engines on devices of their own start from their own at step 0, from a
    snapshot of the resumed ones after a resume, and take the rollouts the saved run had
    sampled ahead (``RolloutPipeline.resume``); they validate the first weights in the
    pipeline (``run.val_before_train``), queued before the first rollouts."""
    pipeline, first = job.pipeline, job.start_step + 1
    if not job.layout.separate:
        pipeline.start(first)
        return
    from trainer.loop.weights.driver import snapshot_weights

    weights = None
    if job.start_step:
        snapshot = snapshot_weights(job)
        weights = None if snapshot is None else [job.start_step, *snapshot]
    if job.resumed_from is not None:
        from trainer.records.checkpoint.pending import read_pending_rollouts

        # The steps the saved run had sampled ahead, with weights the checkpoint lacks.
        consumed = pipeline.resume(read_pending_rollouts(job.resumed_from))
        if consumed is not None:
            wait_all(
                [job.rollout.set_prompts_consumed.remote(consumed)],
                ["rollout host"],
                timeout_s=job.limits.setup_s,
                what="rollout.set_prompts_consumed",
            )
    validate = job.cfg.run.val_before_train and job.start_step == 0
    pipeline.start(first, weights, validate=validate)
