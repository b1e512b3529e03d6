"""A whole run: start Ray and the trainer, loop over steps, log, checkpoint, stop cleanly.

The step itself (rollout -> update -> sync) is
``trainer.loop.schedule.controller.Trainer.train_step``; this module owns what surrounds it: the run
directory's config.yaml, signals, the exit status.
"""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainer.config import Config

if TYPE_CHECKING:
    from trainer.loop.schedule.controller import Trainer
    from trainer.loop.start.restarts import Restarts

#: What the driver imports once Ray is up: the controller and the worker classes Ray pickles
#: (torch, FSDP, transformers). Imported in the background while Ray starts; the checks
#: before Ray need none of them.
DRIVER_MODULES = (
    "trainer.loop.schedule.controller",
    "trainer.loop.ranks.policy",
    "trainer.loop.ranks.critic",
    "trainer.loop.engines.rollout_host",
    "trainer.records.metrics",
)


def write_run_config(
    cfg: Config,
    run_dir: Path,
    deterministic: dict[str, str],
    kernels: dict[str, dict[str, str]] | None = None,
) -> None:
    """``config.yaml``: the resolved config, plus the deterministic settings the workers
    applied and the kernel each role's ops ran (``hal.kernels``; as comments, so the file
    still loads as a config)."""
    from rollout.files import atomic_write_text

    lines = [cfg.to_yaml().rstrip("\n")]
    if deterministic:
        lines.append("# run.deterministic applied on every worker:")
        lines += [f"#   {key}={value}" for key, value in sorted(deterministic.items())]
    if kernels:
        lines.append("# kernels (train.kernels), per role, as its ranks chose them:")
        for role, ops in kernels.items():
            lines.append(f"#   {role}: " + ", ".join(f"{op}={name}" for op, name in ops.items()))
    atomic_write_text(run_dir / "config.yaml", "\n".join(lines) + "\n")


class StopRequests:
    """SIGINT / SIGTERM handling for a run (a scheduler's stop is a SIGTERM).

    The first signal asks the loop to stop after the current step (and its checkpoint, if one
    is due): a flag, not an exception, because Ray's own waits may swallow a
    KeyboardInterrupt raised inside them. A second signal abandons the step at once. Either
    way Ray shuts down, ``latest`` names the last whole checkpoint, and the exit status is
    128 + the signal number (130 for SIGINT, 143 for SIGTERM). ``ray.init`` installs its own
    SIGTERM handler, so ``install`` runs again once Ray is up.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopRequests:
        self.install()
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def install(self) -> None:
        """(Re-)install the handlers; the first call remembers the ones to restore on exit."""
        for sig in self.SIGNALS:
            previous = signal.signal(sig, self._handle)
            self._previous.setdefault(sig, previous)

    def _handle(self, signum, frame) -> None:  # noqa: ARG002
        if self.signum is not None:
            raise KeyboardInterrupt(f"signal {signum} again: abandoning the step")
        self.signum = signum
        print(
            f"crossrl: signal {signum}: stopping after this step (again to stop now)",
            file=sys.stderr,
        )

    def check(self) -> None:
        """Raise KeyboardInterrupt if a stop was asked for."""
        if self.signum is not None:
            raise KeyboardInterrupt(f"signal {self.signum}")

    @property
    def exit_status(self) -> int:
        """128 + the signal that stopped the run (130 when none was seen: a Ctrl-C that Python
        turned into KeyboardInterrupt before the handler was in place)."""
        return 128 + (self.signum or signal.SIGINT)


def run_training(
    cfg: Config,
    *,
    replay_dir: str | None = None,
    save_checkpoints: bool = True,
    command: str = "train",
) -> int:
    """Run a whole job; returns the process exit status (0 done, 1 failed or stopped by a
    health gate, 2 bad input found before start-up, 130/143 stopped by SIGINT/SIGTERM).

    Before Ray starts: ``trainer.loop.start.preflight`` checks every input, then the run directory
    is locked (``trainer.records.run_dir``) and a fresh start may not overwrite a run in it without
    ``run.overwrite``. ``replay_dir``: train on recorded rollouts (``step_<N>.npz``) instead of
    sampling (the parity probe, which also passes ``save_checkpoints=False``: a probe of a 7B
    job should not write tens of GB). ``command`` names the CLI command in messages.
    """
    from trainer.loop.cluster.group import RayConnectError
    from trainer.loop.cluster.startup import CLOCK
    from trainer.loop.start.preflight import PreflightError, preflight
    from trainer.records.run_dir import RunDirError, RunDirLock, overwrite_problem

    CLOCK.start_run()
    run_dir = Path(cfg.run.dir)
    try:
        cfg = _resolve_auto_sizes(cfg, command)
        preflight(cfg, command=command, replay=replay_dir is not None)
        CLOCK.done("preflight")
        with RunDirLock(run_dir, command) as lock:
            if lock.took_over:
                print(
                    f"crossrl {command}: took over the stale lock of pid "
                    f"{lock.took_over.get('pid')} (no longer running)",
                    file=sys.stderr,
                )
            problem = overwrite_problem(
                run_dir, resume=cfg.run.resume, overwrite=cfg.run.overwrite, command=command
            )
            if problem:
                raise RunDirError(problem)
            CLOCK.done("run_dir")
            return _run(cfg, run_dir, replay_dir, save_checkpoints, command)
    except (PreflightError, RunDirError, RayConnectError) as err:
        print(f"crossrl {command}: {err}", file=sys.stderr)
        return 2


def _resolve_auto_sizes(cfg: Config, command: str) -> Config:
    """``cfg`` with its ``auto`` sizes chosen by the memory budget of this machine
    (``trainer.loop.plan.auto_sizes``), said in one line; a budget that cannot be made (a
    bad environment setting it reads, a model it cannot count) is the preflight's to report."""
    from trainer.loop.plan.auto_sizes import resolve_auto_sizes
    from trainer.loop.plan.layout import LayoutError
    from trainer.loop.start.preflight import PreflightError

    try:
        cfg, sized = resolve_auto_sizes(cfg)
    except (LayoutError, ValueError) as err:
        raise PreflightError(" ".join(str(err).split())) from None
    if sized:
        print(f"crossrl {command}: {sized}", file=sys.stderr)
    return cfg


def _run(
    cfg: Config, run_dir: Path, replay_dir: str | None, save_checkpoints: bool, command: str
) -> int:
    """Start Ray and the trainer, train, and shut everything down again."""
    from trainer.loop.cluster.group import start_ray
    from trainer.loop.cluster.startup import CLOCK, import_in_background
    from trainer.loop.plan.layout import LayoutError, local_ray_cpus, runs_in_process

    try:
        in_process = runs_in_process(cfg)
    except LayoutError as err:  # ray.in_process=true on a job that needs Ray
        print(f"crossrl {command}: {err}", file=sys.stderr)
        return 2
    with StopRequests() as stop:
        imports = import_in_background(DRIVER_MODULES)  # while Ray starts, mostly waiting
        started_ray = False
        if not in_process:
            started_ray = start_ray(
                cfg.ray.address,
                num_cpus=local_ray_cpus(cfg),
                connect_timeout_s=cfg.ray.connect_timeout_s,
                object_store_bytes=(
                    None if cfg.ray.object_store_gb is None else int(cfg.ray.object_store_gb * 1e9)
                ),
            )
            stop.install()  # ray.init replaced the SIGTERM handler
            CLOCK.done("ray_init")
        imports.join()
        CLOCK.done("driver_imports")
        try:
            return _attempts(cfg, run_dir, replay_dir, save_checkpoints, command, stop, in_process)
        finally:
            if started_ray:
                import ray

                ray.shutdown()


def _attempts(
    cfg: Config,
    run_dir: Path,
    replay_dir: str | None,
    save_checkpoints: bool,
    command: str,
    stop: StopRequests,
    in_process: bool,
) -> int:
    """Start the trainer and train; after a fault a restart gets past (a process or object
    lost, a collective broken, a time limit passed: ``trainer.loop.start.restarts``), start again
    and resume, at most ``run.max_restarts`` times. Returns the exit status."""
    from trainer.loop.cluster.startup import CLOCK
    from trainer.loop.plan.call_limits import CallLimits
    from trainer.loop.plan.layout import LayoutError
    from trainer.loop.schedule.controller import Trainer
    from trainer.loop.schedule.health import HealthError
    from trainer.loop.start import launch
    from trainer.loop.start.restarts import Restarts, as_worker_failure
    from trainer.records.checkpoint import CheckpointError

    restarts = Restarts(cfg.run.max_restarts, run_dir)
    limits = CallLimits.for_config(cfg)  # what the run learns (throughputs, hangs) stays
    attempt = cfg  # a restart resumes from this run's last checkpoint
    while True:
        trainer = Trainer(attempt, run_dir, replay_dir=replay_dir, limits=limits)
        try:
            launch.start(trainer)
            if not restarts.done:
                write_run_config(cfg, run_dir, trainer.deterministic_settings, trainer.kernels)
                CLOCK.done("config_yaml")
            started = time.monotonic()
            stream: dict[str, float] = {}
            rewards = _train_loop(
                cfg,
                trainer,
                run_dir,
                stop,
                restarts,
                save_checkpoints=save_checkpoints,
                stream=stream,
            )
            print(
                closing_summary(
                    command,
                    run_dir,
                    first_step=trainer.start_step + 1,
                    total_steps=cfg.train.total_steps,
                    rewards=rewards,
                    wall_s=time.monotonic() - started,
                    restarts=[r.summary() for r in restarts.done],
                    stream=stream,
                ),
                file=sys.stderr,
            )
            return 0
        except (HealthError, CheckpointError) as err:
            print(f"crossrl {command}: {err}", file=sys.stderr)
            return 1
        except LayoutError as err:  # the cluster joined cannot hold the job
            print(f"crossrl {command}: {err}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            print(
                f"crossrl {command}: interrupted; the last whole checkpoint stays `latest`",
                file=sys.stderr,
            )
            return stop.exit_status
        except Exception as raised:  # a worker's fault (Ray's errors too), decided below
            err = as_worker_failure(raised, trainer)
            if err is None:  # not a worker's: crossrl's own error, with its traceback
                raise
            restart = None if in_process else restarts.take(err)
            if restart is None:
                print(f"crossrl {command}: {restarts.refused(err, in_process)}", file=sys.stderr)
                return 1
            print(
                f"crossrl {command}: {err}\n  {restart.cause}: restarting the workers "
                f"({len(restarts.done)} of run.max_restarts={cfg.run.max_restarts})",
                file=sys.stderr,
            )
            if err.kind == "hung" and err.limit:  # never into the same limit again
                print(f"  {limits.grow(err.limit)}", file=sys.stderr)
            attempt = restarts.config(cfg)
        finally:
            trainer.shutdown()


#: A streamed run's per-step counts that the closing summary adds up.
STREAM_TOTALS = (
    "stream/groups_dropped",
    "stream/groups_aborted",
    "stream/groups_given_up",
    "stream/tokens_discarded",
    "stream/tokens_generated",
)


def closing_summary(
    command: str,
    run_dir: Path,
    *,
    first_step: int,
    total_steps: int,
    rewards: list[float],
    wall_s: float,
    restarts: list[str] | None = None,
    stream: dict[str, float] | None = None,
) -> str:
    """The lines ``crossrl train`` ends with: what this process ran (steps ``first_step`` to
    ``total_steps``; ``rewards``: each step's ``reward/mean``), the wall time in seconds, the
    restarts on the way (``restarts``: a line each), a streamed run's groups and tokens
    thrown away (``stream``: ``STREAM_TOTALS`` summed over the steps), where the run
    directory is, and what to run next."""
    ran = len(rewards)
    if ran:
        what = (
            f"steps {first_step}-{first_step + ran - 1} of {total_steps}, {wall_s:.1f} s of training; "
            f"reward/mean {rewards[0]:.3f} (step {first_step}) -> {rewards[-1]:.3f} "
            f"(step {first_step + ran - 1})"
        )
    else:
        what = f"nothing left to run: all {total_steps} steps were done before (resumed)"
    if command == "probe":
        nxt = f"compare it with another run: crossrl parity RUN_A {run_dir}"
    else:
        nxt = f"crossrl plot {run_dir}    crossrl export {run_dir} OUT_DIR"
    lines = [f"crossrl {command}: done, {what}"]
    lines += [f"  {line}" for line in restarts or []]
    if stream:
        made = stream.get("stream/tokens_generated", 0.0)
        gone = stream.get("stream/tokens_discarded", 0.0)
        share = f" ({gone / made:.1%} of {made:,.0f} generated)" if made else ""
        quit_ = stream.get("stream/groups_given_up", 0.0)  # train.max_prompt_retries
        given_up = f" ({quit_:.0f} prompts given up after their retries)" if quit_ else ""
        lines.append(
            f"  stream: {stream.get('stream/groups_dropped', 0.0):.0f} groups dropped, "
            f"{stream.get('stream/groups_aborted', 0.0):.0f} aborted{given_up}, "
            f"{gone:,.0f} tokens discarded{share}"
        )
    lines += [f"  run directory: {run_dir}", f"  next: {nxt}"]
    return "\n".join(lines)


def _train_loop(
    cfg: Config,
    trainer: Trainer,
    run_dir: Path,
    stop: StopRequests,
    restarts: Restarts,
    *,
    save_checkpoints: bool,
    stream: dict[str, float] | None = None,
) -> list[float]:
    """Steps from where the trainer starts to ``train.total_steps``: train, log, checkpoint;
    ``restarts`` is told which step runs, and after a restart its record goes on the first
    line. Returns each step's ``reward/mean``, in step order; ``stream`` gets the steps'
    ``STREAM_TOTALS`` summed."""
    from trainer.loop.cluster.startup import CLOCK, log_summary
    from trainer.loop.schedule.backlog import Backlog
    from trainer.loop.schedule.health import checkpoint_veto
    from trainer.loop.schedule.validation import validation_due
    from trainer.records.metrics import FingerprintLogger, MetricsLogger

    total = cfg.train.total_steps
    with (
        MetricsLogger.for_run(cfg, run_dir, start_step=trainer.start_step) as log,
        FingerprintLogger(run_dir, start_step=trainer.start_step) as fp_log,
    ):
        CLOCK.done("loggers")
        rewards: list[float] = []
        # A lagged run's validations and checkpoints finish while later steps train.
        with Backlog(log) as backlog:
            if cfg.run.val_before_train and trainer.start_step == 0:
                backlog.add_line(0, {}, trainer.validate(0))
                CLOCK.done("validation")
            if trainer.start_step < total and not restarts.done:
                log_summary()
            restart = restarts.resumed(trainer.start_step)
            for step in range(trainer.start_step + 1, total + 1):
                stop.check()  # a signal during start-up or the previous step ends the run here
                restarts.current_step = step
                metrics, fingerprint = trainer.train_step(step)
                if restart is not None:  # the first line after a restart records it
                    metrics.update(restart.metrics())
                    restart = None
                rewards.append(float(metrics.get("reward/mean", float("nan"))))
                for key in STREAM_TOTALS if stream is not None else ():
                    if key in metrics:
                        stream[key] = stream.get(key, 0.0) + float(metrics[key])
                metrics.update(CLOCK.metrics())  # the first step of this process only
                validation = trainer.validate(step) if validation_due(cfg, step) else None
                backlog.add_line(step, metrics, validation)
                fp_log.log(step, fingerprint)
                due = step == total or (cfg.run.save_every and step % cfg.run.save_every == 0)
                veto = checkpoint_veto(metrics) if save_checkpoints and due else None
                if veto:
                    print(f"crossrl: {veto}", file=sys.stderr)
                elif save_checkpoints and due:
                    backlog.add_checkpoint(trainer.save_checkpoint(step))
    return rewards
