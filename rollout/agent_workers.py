"""Agent loops in processes of their own (``rollout.agent_workers``), so that one Python process
does not step every environment, run every reward and tokenize every turn while it also
drives the engines.

``AgentWorkers`` starts ``count`` worker processes (``rollout.agent_process``; started with
``spawn``, once, and again after one dies) and ``rollouts`` takes ``run_rollouts``' place: the
prompts' groups are dealt to the workers, each to the one with the fewest trajectories in
flight, and every turn a worker's trajectory asks for comes back here, where it goes through
the same front as in one process (``RequestBatcher``: continuous admission, or waves under
``run.deterministic``) to the engines this process drives. So the engines, their routing,
their weights and their aborts stay where they are; only the agent loops move.

What stays exact: a worker builds the same trajectories, seeds the same requests and returns
its trajectories whole, and the rows are assembled here in trajectory order, so a rollout
through workers equals the rollout in one process bit for bit under ``run.deterministic``
(waves hold every live trajectory's turn, wherever it runs). An environment factory that
counts or shares state across its calls sees only its worker's share.

Environment calls: a worker has ``env_slots // count`` of ``rollout.env_concurrency``'s slots
(the remainder to the first workers), one first-in-first-out queue for every rollout it runs
at once. A worker that dies (its environment crashed the process) fails the rollouts it was
running with one line naming it and its exit code; the next rollout starts a new one.
"""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing
import threading
from collections.abc import Sequence

from rollout.agent_loop import (
    RolloutOutput,
    RolloutSettings,
    _run_coroutine,
    collect,
    prompt_items,
)
from rollout.agent_process import AgentContext, sendable_error, serve_agent_loops
from rollout.engines.base import Engine
from rollout.engines.serving.batcher import RequestBatcher
from rollout.envs.prompts import PromptItem

__all__ = ["AgentContext", "AgentWorkerLost", "AgentWorkers"]

#: Seconds ``close`` waits for a worker to end after ``stop`` before it is killed.
STOP_WAIT_S = 5.0


class AgentWorkerLost(RuntimeError):
    """An agent worker's process ended while it ran a rollout."""


class _Process:
    """One worker process, its pipe and the thread that reads it."""

    def __init__(self, index: int, context: AgentContext, env_slots: int, route) -> None:
        spawn = multiprocessing.get_context("spawn")
        mine, theirs = spawn.Pipe()
        self.index, self.conn = index, mine
        self.process = spawn.Process(
            target=serve_agent_loops,
            args=(theirs, context, env_slots),
            name=f"agent-worker-{index}",
            daemon=True,
        )
        self.process.start()
        theirs.close()
        self.trajectories = 0  # in flight: the dealing's load
        self._send_lock = threading.Lock()
        self._route = route
        self.reader = threading.Thread(target=self._read, name=f"agent-worker-{index}-pipe")
        self.reader.daemon = True
        self.reader.start()

    def send(self, message: tuple) -> None:
        """Send ``message``; a worker already gone is told of at its reader."""
        try:
            with self._send_lock:
                self.conn.send(message)
        except (OSError, ValueError):
            pass

    def _read(self) -> None:
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                self.process.join(STOP_WAIT_S)
                self._route(self, None)
                return
            self._route(self, message)

    def alive(self) -> bool:
        return self.process.is_alive() and self.reader.is_alive()

    def stop(self) -> None:
        """Ask the process to end, then kill it if it has not within ``STOP_WAIT_S``."""
        self.send(("stop",))
        self.process.join(STOP_WAIT_S)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(STOP_WAIT_S)
        self.conn.close()


class AgentWorkers:
    """``count`` agent worker processes built from ``context`` (module docstring), sharing
    ``env_slots`` environment-call slots. Thread-safe: a stream's groups call ``rollouts`` from
    many threads at once. ``close`` when done."""

    def __init__(self, count: int, context: AgentContext, env_slots: int) -> None:
        if count < 1:
            raise ValueError(f"rollout.agent_workers={count}: must be >= 1 process here")
        if env_slots < count:
            raise ValueError(
                f"rollout.agent_workers={count} with rollout.env_concurrency={env_slots}: every "
                "worker needs one environment-call slot at least; use at most "
                f"{env_slots} workers or raise rollout.env_concurrency"
            )
        self.count, self.context = count, context
        self.shares = [env_slots // count + (i < env_slots % count) for i in range(count)]
        self.lost = 0  # worker processes that ended while running a rollout
        self._workers: list[_Process | None] = [None] * count
        self._lock = threading.Lock()
        self._jobs: dict[int, tuple[_Process, asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._ids = itertools.count()
        self._closed = False

    def _route(self, worker: _Process, message: tuple | None) -> None:
        """From ``worker``'s reader thread: ``message`` to its job's event loop; None: the
        worker is gone, and each of its jobs is told so."""
        with self._lock:
            if message is None:
                targets = [(j, job) for j, job in self._jobs.items() if job[0] is worker]
                code = worker.process.exitcode
                error = AgentWorkerLost(
                    f"rollout.agent_workers: agent worker {worker.index} (pid "
                    f"{worker.process.pid}) ended with exit code {code} while it ran a "
                    "rollout; an environment or reward function in it crashed the process"
                )
                messages = [(j, ("failed", j, error)) for j, _ in targets]
                if targets and not self._closed:
                    self.lost += 1
            else:
                job = self._jobs.get(message[1])
                targets = [] if job is None else [(message[1], job)]
                messages = [(message[1], message)]
        for (_, (_, loop, inbox)), (_, out) in zip(targets, messages, strict=False):
            try:
                loop.call_soon_threadsafe(inbox.put_nowait, out)
            except RuntimeError:  # that rollout's loop is closed: it ended meanwhile
                pass

    def start(self) -> None:
        """Start every worker process now (else the first rollout does), so that one that
        cannot start says so before the run does anything else."""
        with self._lock:
            for i in range(self.count):
                self._worker(i)

    def _worker(self, index: int) -> _Process:
        worker = self._workers[index]
        if worker is None or not worker.alive():
            worker = self._workers[index] = _Process(
                index, self.context, self.shares[index], self._route
            )
        return worker

    def _deal(self, groups: int, n: int) -> list[tuple[_Process, list[int]]]:
        """Each of ``groups`` prompt groups to the worker with the fewest trajectories in
        flight (ties: the lowest index); the workers with any, and their groups."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the agent workers are closed (the rollout host shuts down)")
            workers = [self._worker(i) for i in range(self.count)]
            dealt: dict[int, list[int]] = {}
            for j in range(groups):
                worker = min(workers, key=lambda w: (w.trajectories, w.index))
                worker.trajectories += n
                dealt.setdefault(worker.index, []).append(j)
            return [(workers[i], uids) for i, uids in sorted(dealt.items())]

    def rollouts(
        self,
        engine: Engine,
        tokenizer,
        prompts: Sequence[PromptItem | int],
        *,
        deterministic: bool = True,
        **settings,
    ) -> RolloutOutput:
        """``rollout.agent_loop.run_rollouts`` with the same settings (``settings``: the fields
        of ``RolloutSettings``), the agent loops in the workers and their turns on ``engine``
        here (module docstring); ``tokenizer``: the one the workers hold, for the engine's stop
        tokens. Raises what the engine raised for a turn, or ``AgentWorkerLost``."""
        settings = RolloutSettings(**settings)
        params, _ = settings.prepare(tokenizer, min(self.shares))
        prompts = prompt_items(prompts)
        n = settings.n
        dealt = self._deal(len(prompts), n)
        trajs: list = []

        async def roll() -> None:
            batcher = RequestBatcher(engine, params, waves=deterministic)
            loop, inbox = asyncio.get_running_loop(), asyncio.Queue()
            jobs: dict[int, _Process] = {}
            open_jobs: set[int] = set()
            serving: set[asyncio.Task] = set()
            with self._lock:
                for worker, _ in dealt:
                    job = next(self._ids)
                    jobs[job] = worker
                    self._jobs[job] = (worker, loop, inbox)
            open_jobs.update(jobs)
            try:
                for (job, worker), (_, groups) in zip(jobs.items(), dealt, strict=True):
                    worker.send(("build", job, prompts, groups, settings))
                live: list[int] = []
                for _ in jobs:
                    message = await _answer(inbox, "ready")
                    live.extend(message[2])
                batcher.join(live)
                for job, worker in jobs.items():
                    worker.send(("roll", job))
                while open_jobs:
                    message = await inbox.get()
                    kind, job = message[0], message[1]
                    if kind == "generate":
                        task = asyncio.ensure_future(_serve(batcher, jobs[job], message))
                        serving.add(task)
                        task.add_done_callback(serving.discard)
                    elif kind == "leave":
                        batcher.leave(message[2])
                    elif kind == "done":
                        trajs.extend(message[2])
                        open_jobs.discard(job)
                    elif kind == "failed":
                        raise message[2]
            finally:
                with self._lock:
                    for job, (worker, groups) in zip(jobs, dealt, strict=True):
                        self._jobs.pop(job, None)
                        worker.trajectories -= n * len(groups)
                for job in open_jobs:
                    jobs[job].send(("cancel", job))
                for task in list(serving):
                    task.cancel()
                await asyncio.gather(*serving, return_exceptions=True)
                batcher.close()

        _run_coroutine(roll)
        trajs.sort(key=lambda t: t.trajectory_id)
        return collect(trajs, step_wise=settings.step_wise, merge=settings.merge_stepwise)

    def cancel_all(self, error: BaseException) -> None:
        """End every rollout running now with ``error`` (a stream shutting down), and tell the
        workers to drop those jobs."""
        with self._lock:
            jobs = list(self._jobs.items())
        for job, (worker, loop, inbox) in jobs:
            worker.send(("cancel", job))
            try:
                loop.call_soon_threadsafe(inbox.put_nowait, ("failed", job, error))
            except RuntimeError:
                pass

    def close(self) -> None:
        """Stop the worker processes (killed when one does not end within ``STOP_WAIT_S``)."""
        with self._lock:
            self._closed = True
            workers, self._workers = self._workers, [None] * self.count
        for worker in workers:
            if worker is not None:
                worker.stop()


async def _answer(inbox: asyncio.Queue, kind: str) -> tuple:
    """The next message, which must be ``kind``; a worker's failure is raised."""
    message = await inbox.get()
    if message[0] == "failed":
        raise message[2]
    if message[0] != kind:  # pragma: no cover - the protocol's order (module docstring)
        raise RuntimeError(f"agent worker: {message[0]!r} before {kind!r}")
    return message


async def _serve(batcher: RequestBatcher, worker: _Process, message: tuple) -> None:
    """A worker's turn on the engines; its result, or the engine's error, goes back."""
    _, job, call, request, key = message
    try:
        result = await batcher.generate(request, key)
    except asyncio.CancelledError:
        raise
    except BaseException as exc:  # noqa: BLE001 - the worker's trajectory raises it
        worker.send(("reply", job, call, None, sendable_error(exc)))
        return
    worker.send(("reply", job, call, result, None))
