"""The multi-turn agent loop: environments x engine -> training rows.

``run_rollouts`` runs every trajectory of a step as its own asyncio task: generate a turn, step
its environment, generate the next turn, while the other trajectories go on. Turns reach the
engine through ``rollout/engines/serving/batcher.py``, which sends the requests waiting at that moment
to ``engine.generate`` in one call on a worker thread. Environment ``reset``/``step`` run on a
thread pool (or on the event loop when they are ``async def`` or the env is ``inline``), at most
``env_concurrency`` at once, each bounded by ``env_timeout_s`` (``rollout/env_calls.py``). A turn's request seed is ``stable_seed(seed, step,
prompt, sample, turn)`` and rows come out in trajectory order, so what a trajectory samples
never depends on which one finished first. It emits either one row per trajectory
(``step_wise=False``) or one row per turn (``step_wise=True``; the rows and metrics of the
trajectories are built in ``rollout/trajectories.py``), following DESIGN.md:

a. step-wise: the chat history is re-tokenized FIRST and only then checked against
   ``max_input_len``; a turn whose prompt is longer is not generated and the trajectory ends
   (``rollout/truncated_trajectories``).
b. a turn that did not end with EOS (length cut, or another stop token) gets an EOS appended so
   the chat stays well-formed; that EOS is in ``response_ids`` with mask 0 and logprob 0.
c. a step row's response is the tokens generated in that turn only; the observation that
   followed goes into the next turn's prompt. The engine is asked for ``max_new_tokens - 1``
   tokens, so a response including an appended EOS is at most ``max_new_tokens`` tokens and
   every step row at most ``max_input_len + max_new_tokens`` tokens.

Rewards: a trajectory's ``score`` is the reward of its LAST env step (an env reports its
outcome there, see ``rollout/envs/base.py``; 0 if no step happened). It is copied to every
step row and placed in ``token_rewards`` on the last generated (mask 1) token of the last row;
every other token reward is 0. Each row keeps its own env reward as ``step_reward``.

Env faults (an exception in the constructor, ``reset`` or ``step``, a call that runs past
``env_timeout_s``, a non-string observation, a reward that is not a finite real number inside
the env's ``reward_range``, a ``done`` that is not a bool) end that trajectory with score 0; its rows so far are KEPT (so GRPO groups keep
their size and the failure counts as a bad outcome) and ``rollout/env_errors`` counts it. Each
fault's text (with the offending value) is kept in ``RolloutOutput.faults`` with its trajectory
id, so the trainer can show why when too many trajectories fault (``fault_summary``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from batching import Row
from rollout.engines.base import Engine, GenerationRequest, SamplingParams
from rollout.engines.serving.batcher import RequestBatcher
from rollout.env_calls import (
    EnvCalls,
    EnvTimeout,
    check_step,
    fault_text,
    first_messages,
    reward_extras,
)
from rollout.env_slots import EnvSlots
from rollout.envs import reward_range_of
from rollout.envs.prompts import PromptItem
from rollout.rewards import RewardError
from rollout.seeding import stable_seed
from rollout.tokenizer import chat_token_ids, eos_token_ids
from rollout.trajectories import Trajectory, Turn, rollout_metrics, rows_of


@dataclass
class RolloutOutput:
    """Rows for the trainer plus ``rollout/*`` metrics (floats), and ``faults``: one
    ``(trajectory_id, text)`` per trajectory an environment fault ended, in trajectory order."""

    rows: list[Row]
    metrics: dict[str, float]
    faults: list[tuple[int, str]] = field(default_factory=list)


def _observation_ids(tokenizer, messages: list[dict], obs: str) -> list[int]:
    """Tokens the chat template puts after the assistant's EOS and around the observation, up to
    and including the next generation prompt (whole-trajectory mode)."""
    before = chat_token_ids(tokenizer, messages, add_generation_prompt=False)
    after = chat_token_ids(
        tokenizer, messages + [{"role": "user", "content": obs}], add_generation_prompt=True
    )
    if after[: len(before)] != before:
        # Templates that rewrite earlier turns: measure the delta on a neutral history instead.
        base = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
        before = chat_token_ids(tokenizer, base, add_generation_prompt=False)
        after = chat_token_ids(
            tokenizer, base + [{"role": "user", "content": obs}], add_generation_prompt=True
        )
    eos = set(eos_token_ids(tokenizer))
    last_eos = max((i for i, t in enumerate(before) if t in eos), default=len(before) - 1)
    return before[last_eos + 1 :] + after[len(before) :]


def run_rollouts(
    engine: Engine,
    tokenizer,
    env_factory: Callable[..., object],
    prompts: Sequence[PromptItem | int],
    *,
    # the rollout.* settings: no defaults here, the config schema states them once
    n: int,
    max_turns: int,
    step_wise: bool,
    merge_stepwise: bool,
    max_input_len: int,
    max_new_tokens: int,
    sampling: SamplingParams | None = None,
    seed: int = 0,
    step: int = 0,
    stop_strings: Sequence[str] = (),
    env_timeout_s: float | None = None,
    env_concurrency: int = 64,
    deterministic: bool = True,
    env_slots: EnvSlots | None = None,
) -> RolloutOutput:
    """Roll out ``n`` trajectories per prompt for up to ``max_turns`` turns.

    ``prompts``: ``PromptItem``s (or plain env seeds); the n samples of prompt j form GRPO group
    ``uid = j`` and get ``trajectory_id = j * n + sample``. ``max_input_len`` (tokens) bounds
    every generation prompt; ``max_new_tokens`` (tokens) bounds every turn's response including
    an appended EOS. ``sampling`` supplies temperature / top-p / top-k / extra stop tokens.
    Request seeds are ``stable_seed(seed, step, prompt index, sample, turn)``.
    ``stop_strings`` end a turn at the first token whose text completes one of them (the
    string stays in the response, what follows is dropped, and the turn is closed by an
    appended, untrained EOS: rule b); handled here, so every engine behaves the same.

    Each trajectory is its own asyncio task (see the module docstring). ``env_timeout_s``
    (seconds, None = no limit) bounds each ``reset``/``step`` call; ``env_concurrency`` caps
    the env calls running at once; ``env_slots``: slots shared with rollouts running at the
    same time on other threads (``rollout.env_calls.EnvCalls``: a streamed run's groups share
    ``rollout.env_concurrency``). ``deterministic``: engine calls hold every live
    trajectory's turn (lockstep calls, logprobs repeat bit for bit); False: the engine takes
    whatever waits whenever it is free (``rollout/engines/serving/batcher.py``). Rows come out in
    trajectory order either way. Runs its own event loop (on a helper thread when the caller's
    thread already runs one).
    """
    settings = RolloutSettings(
        n=n,
        max_turns=max_turns,
        step_wise=step_wise,
        merge_stepwise=merge_stepwise,
        max_input_len=max_input_len,
        max_new_tokens=max_new_tokens,
        sampling=sampling,
        seed=seed,
        step=step,
        stop_strings=tuple(stop_strings),
        env_timeout_s=env_timeout_s,
    )
    params, ctx = settings.prepare(tokenizer, env_concurrency)
    trajs = trajectories(prompts, n, env_factory)

    async def roll_all() -> None:
        batcher = RequestBatcher(engine, params, waves=deterministic)
        env_calls = EnvCalls(env_concurrency, env_timeout_s, env_slots)
        live = [t for t in trajs if not t.done]
        batcher.join([t.item.index for t in live])
        try:
            await roll_trajectories(live, ctx, batcher, env_calls)
        finally:
            env_calls.close()
            batcher.close()

    _run_coroutine(roll_all)
    return collect(trajs, step_wise=step_wise, merge=merge_stepwise)


@dataclass(frozen=True)
class RolloutSettings:
    """A rollout's ``rollout.*`` settings, as ``run_rollouts`` takes them (its docstring says
    what each means); what an agent worker is sent (``rollout.agent_workers``)."""

    n: int
    max_turns: int
    step_wise: bool
    merge_stepwise: bool
    max_input_len: int  # tokens
    max_new_tokens: int  # tokens
    sampling: SamplingParams | None = None
    seed: int = 0
    step: int = 0
    stop_strings: tuple[str, ...] = ()
    env_timeout_s: float | None = None

    def prepare(self, tokenizer, env_concurrency: int) -> tuple[SamplingParams, RolloutContext]:
        """Every turn's engine settings (``turn_params``, which checks them) and the context
        the trajectory tasks share."""
        params = turn_params(
            tokenizer,
            self.sampling,
            n=self.n,
            max_turns=self.max_turns,
            max_new_tokens=self.max_new_tokens,
            max_input_len=self.max_input_len,
            env_timeout_s=self.env_timeout_s,
            env_concurrency=env_concurrency,
        )
        ctx = RolloutContext.of(
            tokenizer,
            params,
            stop_strings=self.stop_strings,
            max_turns=self.max_turns,
            step_wise=self.step_wise,
            max_input_len=self.max_input_len,
            seed=self.seed,
            step=self.step,
        )
        return params, ctx


def prompt_items(prompts: Sequence[PromptItem | int]) -> list[PromptItem]:
    """``prompts`` as ``PromptItem``s: a plain env seed at position i is prompt i."""
    return [
        p if isinstance(p, PromptItem) else PromptItem(index=i, seed=int(p))
        for i, p in enumerate(prompts)
    ]


def turn_params(
    tokenizer,
    sampling: SamplingParams | None,
    *,
    n: int,
    max_turns: int,
    max_new_tokens: int,
    max_input_len: int,
    env_timeout_s: float | None,
    env_concurrency: int,
) -> SamplingParams:
    """Every turn's engine settings (``sampling`` with ``max_new_tokens - 1`` tokens, the
    tokenizer's EOS among the stop tokens), after checking the ``rollout.*`` settings."""
    if n < 1:
        raise ValueError(f"rollout.n={n}: must be >= 1 sample per prompt")
    if max_turns < 1:
        raise ValueError(f"rollout.max_turns={max_turns}: must be >= 1")
    if max_new_tokens < 2:
        raise ValueError(
            f"rollout.max_new_tokens={max_new_tokens}: must be >= 2 (one token is reserved for "
            "the EOS that closes a turn)"
        )
    if max_input_len < 1:
        raise ValueError(f"rollout.max_input_len={max_input_len}: must be >= 1 token")
    if env_timeout_s is not None and not env_timeout_s > 0:
        raise ValueError(
            f"rollout.env_timeout_s={env_timeout_s!r}: must be > 0 seconds (null: no limit)"
        )
    if env_concurrency < 1:
        raise ValueError(f"rollout.env_concurrency={env_concurrency}: must be >= 1 env call")
    sampling = sampling or SamplingParams()
    eos_ids = eos_token_ids(tokenizer)
    if not eos_ids:
        raise ValueError("the tokenizer has no eos_token; the agent loop needs one to end turns")
    stops = tuple(dict.fromkeys(eos_ids + tuple(sampling.stop_token_ids)))
    return dataclasses.replace(sampling, max_new_tokens=max_new_tokens - 1, stop_token_ids=stops)


def trajectories(
    prompts: Sequence[PromptItem | int],
    n: int,
    env_factory: Callable[..., object],
    built: Callable[[int], bool] = lambda uid: True,
) -> list[Trajectory]:
    """The ``n`` trajectories of every prompt (group ``uid = j`` of prompt j, ``trajectory_id
    = j * n + sample``), with their environments built, in trajectory order (a factory may
    count or share state), for the groups ``built`` names; a constructor's fault ends its
    trajectory. The others are left without an environment (another process builds them:
    ``rollout.agent_workers``)."""
    items = prompt_items(prompts)
    trajs = [
        Trajectory(uid=j, trajectory_id=j * n + k, item=item, sample=k)
        for j, item in enumerate(items)
        for k in range(n)
    ]
    for t in trajs:
        if not built(t.uid):
            continue
        try:
            t.env = env_factory(**t.item.env_kwargs)
            t.reward_range = reward_range_of(t.env)
        except Exception as exc:  # noqa: BLE001 - any env fault ends only this trajectory
            t.error, t.done = fault_text("constructor", exc), True
    return trajs


async def roll_trajectories(
    live: list[Trajectory], ctx: RolloutContext, front, env_calls: EnvCalls
) -> None:
    """Roll every trajectory of ``live`` as its own task; ``front`` takes their turns
    (``generate(request, key)``, and ``leave(group)`` as each ends: a ``RequestBatcher``, or
    its relay in an agent worker). An engine failure stops the others and is raised."""
    tasks = [asyncio.create_task(_roll_one(t, ctx, front, env_calls)) for t in live]
    try:
        await asyncio.gather(*tasks)
    except BaseException:  # an engine failure: stop the other trajectories, re-raise it
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def collect(trajs: list[Trajectory], *, step_wise: bool, merge: bool) -> RolloutOutput:
    """The rollout's rows in trajectory order, its metrics and its faults."""
    rows: list[Row] = []
    for t in trajs:
        rows.extend(rows_of(t, step_wise=step_wise, merge=merge))
    faults = [(t.trajectory_id, t.error) for t in trajs if t.error is not None]
    return RolloutOutput(rows=rows, metrics=rollout_metrics(trajs, rows), faults=faults)


def _keep_routes(t: Trajectory, turn: Turn, routes, *, whole: bool) -> None:
    """A mixture's engine routing for ``turn`` (``rollout.trajectories.stitched_routes`` reads
    it). Whole mode: each turn's request extends the last, whose routes already cover the
    tokens up to where they end, so only the new ones are kept."""
    if routes is None:
        return
    start = 0
    if whole:
        last = next((x for x in reversed(t.turns) if x.routes is not None), None)
        if last is not None:
            start = min(last.routes_from + len(last.routes), len(routes))
    turn.routes, turn.routes_from = routes[start:], start


@dataclass(frozen=True)
class RolloutContext:
    """What every trajectory task of one rollout shares (read-only)."""

    tokenizer: object
    eos: int
    stop_strings: tuple[str, ...]
    max_turns: int
    step_wise: bool
    max_input_len: int  # tokens
    seed: int
    step: int
    #: chat -> its prompt token ids: the n samples of a prompt start from the same chat, so
    #: the template is rendered once per prompt, not once per sample
    _rendered: dict = field(default_factory=dict)

    @classmethod
    def of(cls, tokenizer, params: SamplingParams, **settings) -> RolloutContext:
        """The context of a rollout whose turns are sampled with ``params`` (``turn_params``);
        ``settings``: ``stop_strings``, ``max_turns``, ``step_wise``, ``max_input_len``,
        ``seed``, ``step``."""
        stop_strings = tuple(settings.pop("stop_strings"))
        return cls(
            tokenizer=tokenizer, eos=params.stop_token_ids[0], stop_strings=stop_strings, **settings
        )

    def chat_ids(self, messages: list[dict]) -> list[int]:
        """``chat_token_ids`` of ``messages`` with the generation prompt (a fresh list)."""
        key = tuple((m["role"], m["content"]) for m in messages)
        ids = self._rendered.get(key)
        if ids is None:
            ids = self._rendered[key] = chat_token_ids(self.tokenizer, messages)
        return list(ids)


def _run_coroutine(make: Callable[[], Awaitable[None]]) -> None:
    """Run ``make()`` to completion on a fresh event loop (a helper thread's when this thread
    already runs one, e.g. inside an async Ray actor or a notebook)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        asyncio.run(make())
        return
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rollout") as helper:
        helper.submit(lambda: asyncio.run(make())).result()


async def _roll_one(t: Trajectory, ctx: RolloutContext, front, env_call: EnvCalls) -> None:
    """One trajectory: reset, then (generate a turn -> env step) until done, truncated, faulty
    or out of turns. Faults are recorded on ``t``; only an engine failure raises."""
    tokenizer = ctx.tokenizer
    try:
        try:
            t.messages = first_messages(await env_call(t.env.reset, t.item.seed))
        except Exception as exc:  # noqa: BLE001 - any env fault ends only this trajectory
            t.error, t.done = fault_text("reset", exc), True
            t.timed_out = isinstance(exc, EnvTimeout)
            return
        if not ctx.step_wise:
            t.seq = ctx.chat_ids(t.messages)
        for turn in range(ctx.max_turns):
            # Rule a: re-tokenize the history first, then check the length.
            prompt = ctx.chat_ids(t.messages) if ctx.step_wise else list(t.seq)
            if len(prompt) > ctx.max_input_len:
                t.truncated, t.done = True, True
                return
            req_seed = stable_seed(ctx.seed, ctx.step, t.item.index, t.sample, turn)
            request = GenerationRequest(prompt_ids=prompt, seed=req_seed, group=t.item.index)
            res = await front.generate(request, key=t.trajectory_id)
            gen, lps = list(res.token_ids), [float(x) for x in res.logprobs]
            vers = res.extra.get("versions")  # a streamed engine's (rollout.streaming)
            vers = None if vers is None else list(vers)
            if ctx.stop_strings:
                cut = stop_string_cut(tokenizer, gen, ctx.stop_strings)
                gen, lps = gen[:cut], lps[:cut]
                vers = None if vers is None else vers[:cut]
            mask = [1] * len(gen)
            if not gen or gen[-1] != ctx.eos:  # rule b: close the turn with an untrained EOS
                gen, lps, mask = gen + [ctx.eos], lps + [0.0], mask + [0]
                vers = None if vers is None else vers + [-1]
            text = tokenizer.decode(gen[:-1], skip_special_tokens=True)
            record = Turn(
                prompt_ids=prompt, response_ids=gen, mask=mask, logprobs=lps, versions=vers
            )
            _keep_routes(t, record, res.extra.get("routed_experts"), whole=not ctx.step_wise)
            t.turns.append(record)
            t.messages.append({"role": "assistant", "content": text})
            try:
                obs, reward, done, info = check_step(
                    await env_call(t.env.step, text), t.reward_range
                )
            except Exception as exc:  # noqa: BLE001 - any env fault ends only this trajectory
                t.error, t.done = fault_text(f"step {turn}", exc), True
                t.reward_error = isinstance(exc, RewardError)
                t.timed_out = isinstance(exc, EnvTimeout)
                return
            record.reward = reward
            if done:
                t.done = True
                t.reward_extra = reward_extras(info.get("reward_extra"))
                return
            t.messages.append({"role": "user", "content": obs})
            if not ctx.step_wise:
                record.obs_ids = _observation_ids(tokenizer, t.messages[:-1], obs)
                t.seq = prompt + gen + record.obs_ids
    finally:
        front.leave(t.item.index)


def stop_string_cut(tokenizer, token_ids: list[int], stop_strings: Sequence[str]) -> int:
    """Number of tokens to keep: the shortest prefix whose text contains a stop string, or all
    of them when none occurs. Binary search over prefixes (containment only grows with the
    prefix), so a long response costs O(log n) decodes, not O(n)."""

    def hit(k: int) -> bool:
        text = tokenizer.decode(token_ids[:k], skip_special_tokens=False)
        return any(stop in text for stop in stop_strings)

    if not token_ids or not hit(len(token_ids)):
        return len(token_ids)
    lo, hi = 1, len(token_ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if hit(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo
