"""One agent worker's process (``rollout.agent_workers``): the agent loops of its share of the
trajectories, their environments and reward calls, with its turns relayed to the engines of
the process that started it (``rollout.agent_workers.AgentWorkers``).

It holds its own tokenizer and builds its own environments from the job's ``rollout.env``
spec (``AgentContext``); the environment calls of every rollout it runs at once share its
part of ``rollout.env_concurrency`` (one first-in-first-out queue, ``EnvSlots``). The
messages, all tuples whose first item names them:

- from the host: ``("build", job, prompts, groups, settings)`` (build the environments of
  groups ``groups``, answer ``ready`` with the groups of the trajectories still live),
  ``("roll", job)``, ``("reply", job, call, result, error)`` (a turn's result, or the
  exception the host's engine raised for it), ``("cancel", job)``, ``("stop",)``;
- to the host: ``("ready", job, groups)``, ``("generate", job, call, request, key)``,
  ``("leave", job, group)``, ``("done", job, trajectories)`` (without their environments) and
  ``("failed", job, error)``.

The process ends at ``stop`` or when its pipe to the host closes (the host is gone).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import threading
from dataclasses import dataclass

from rollout.agent_loop import RolloutContext, RolloutSettings, roll_trajectories, trajectories
from rollout.env_calls import EnvCalls
from rollout.env_slots import EnvSlots

__all__ = ["AgentContext", "sendable_error", "serve_agent_loops"]


@dataclass(frozen=True)
class AgentContext:
    """What an agent worker builds its rollouts from: the ``tokenizer`` (pickled with the
    job), the environment spec and keyword arguments (``rollout.env``, ``rollout.env_kwargs``)
    and the reward function (``reward.function``, ``reward.timeout_s``; None: the env's own)."""

    tokenizer: object
    env: str
    env_kwargs: dict
    reward_function: str | None = None
    reward_timeout_s: float = 60.0

    def env_factory(self, reward_workers: int):
        """The environment factory, as the host's ``rollout.envs.bind_env`` builds it, with
        ``reward_workers`` threads for a reward function's calls."""
        from rollout.envs import bind_env
        from rollout.rewards import RewardFunction

        reward_fn = None
        if self.reward_function is not None:
            reward_fn = RewardFunction(
                self.reward_function, timeout_s=self.reward_timeout_s, max_workers=reward_workers
            )
        return bind_env(self.env, self.env_kwargs, reward_fn)


def sendable_error(exc: BaseException) -> BaseException:
    """``exc`` if it survives pickling as itself, else a ``RuntimeError`` with its line."""
    import pickle

    try:
        back = pickle.loads(pickle.dumps(exc))
    except Exception:  # noqa: BLE001 - any unpicklable exception is sent as its text
        back = None
    if type(back) is type(exc) and str(back) == str(exc):
        return exc
    return RuntimeError(f"{type(exc).__name__}: {exc}")


class _Relay:
    """The agent loop's front (``generate`` / ``leave``) for one job: turns go to the host."""

    def __init__(self, job: int, send, calls: dict[int, asyncio.Future]) -> None:
        self.job, self.send, self.calls = job, send, calls
        self._ids = itertools.count()

    async def generate(self, request, key: int):
        call = next(self._ids)
        future = self.calls[call] = asyncio.get_running_loop().create_future()
        self.send(("generate", self.job, call, request, key))
        try:
            return await future
        finally:
            self.calls.pop(call, None)

    def leave(self, group: int) -> None:
        self.send(("leave", self.job, group))


@dataclass
class _Job:
    trajs: list
    ctx: RolloutContext
    settings: RolloutSettings
    calls: dict = dataclasses.field(default_factory=dict)
    task: asyncio.Task | None = None


class _Worker:
    """The process's jobs, on its event loop (every method runs there)."""

    def __init__(self, conn, context: AgentContext, env_slots: int) -> None:
        self.conn, self.context = conn, context
        self.tokenizer = context.tokenizer
        self.env_slots = env_slots
        self.env_factory = context.env_factory(env_slots)
        self.slots = EnvSlots(env_slots)
        self.jobs: dict[int, _Job] = {}
        self._send_lock = threading.Lock()
        self.stopped = asyncio.Event()

    def send(self, message: tuple) -> None:
        with self._send_lock:
            self.conn.send(message)

    def handle(self, message: tuple) -> None:
        kind = message[0]
        if kind == "stop":
            self.stopped.set()
        elif kind == "build":
            self._build(*message[1:])
        elif kind == "roll":
            job = self.jobs.get(message[1])
            if job is not None:
                job.task = asyncio.ensure_future(self._roll(message[1], job))
        elif kind == "reply":
            _, job_id, call, result, error = message
            job = self.jobs.get(job_id)
            future = None if job is None else job.calls.get(call)
            if future is not None and not future.done():
                if error is None:
                    future.set_result(result)
                else:
                    future.set_exception(error)
        elif kind == "cancel":
            job = self.jobs.pop(message[1], None)
            if job is not None and job.task is not None:
                job.task.cancel()

    def _build(
        self, job_id: int, prompts: list, groups: list[int], settings: RolloutSettings
    ) -> None:
        try:
            mine = set(groups)
            _, ctx = settings.prepare(self.tokenizer, self.env_slots)
            trajs = [
                t
                for t in trajectories(prompts, settings.n, self.env_factory, mine.__contains__)
                if t.uid in mine
            ]
        except Exception as exc:  # noqa: BLE001 - said to the host, which raises it
            self.send(("failed", job_id, sendable_error(exc)))
            return
        self.jobs[job_id] = _Job(trajs, ctx, settings)
        self.send(("ready", job_id, [t.item.index for t in trajs if not t.done]))

    async def _roll(self, job_id: int, job: _Job) -> None:
        env_calls = EnvCalls(self.env_slots, job.settings.env_timeout_s, self.slots)
        relay = _Relay(job_id, self.send, job.calls)
        try:
            await roll_trajectories([t for t in job.trajs if not t.done], job.ctx, relay, env_calls)
        except asyncio.CancelledError:
            return  # the host gave the job up: nothing to say
        except BaseException as exc:  # noqa: BLE001 - the engine's error, back to the host
            self.send(("failed", job_id, sendable_error(exc)))
            return
        finally:
            env_calls.close()
            self.jobs.pop(job_id, None)
        self.send(("done", job_id, [dataclasses.replace(t, env=None) for t in job.trajs]))


def serve_agent_loops(conn, context: AgentContext, env_slots: int) -> None:
    """An agent worker process's main: serve the host's jobs until ``stop`` or until the pipe
    to the host closes (module docstring)."""

    async def main() -> None:
        loop = asyncio.get_running_loop()
        worker = _Worker(conn, context, env_slots)

        def read() -> None:
            while True:
                try:
                    message = conn.recv()
                except (EOFError, OSError):  # the host is gone
                    message = ("stop",)
                loop.call_soon_threadsafe(worker.handle, message)
                if message[0] == "stop":
                    return

        threading.Thread(target=read, name="agent-worker-pipe", daemon=True).start()
        await worker.stopped.wait()
        for job in worker.jobs.values():
            if job.task is not None:
                job.task.cancel()
        worker.slots.close()

    asyncio.run(main())
