"""``bench.stream_engine``'s output: the ratios between the modes that ran, the shapes it
runs, a table per shape and the least favourable ratios over them."""

from __future__ import annotations

__all__ = ["RATIOS", "SHAPES", "format_table", "least_favourable", "ratios", "shape_of"]

#: (numerator mode, denominator mode) of each ratio reported where both ran.
RATIOS = (
    ("batched", "serial"),
    ("batched", "ceiling"),
    ("served", "ceiling"),
    ("served", "batched"),
    ("served-async", "ceiling"),
    ("served-async", "served"),
    ("served-async", "batched"),
)


def ratios(rate: dict[str, float]) -> dict[str, float]:
    """``<a>_over_<b>``: mode a's tokens per second over mode b's, for each pair that ran."""
    return {
        f"{a}_over_{b}".replace("-", "_"): rate[a] / rate[b]
        for a, b in RATIOS
        if a in rate and b in rate
    }


def _shape_words(result: dict) -> str:
    """How the table's first line names the shape."""
    if result.get("tool_wait_ms"):
        return (
            f" (long tail: {result['turns_asked']} turns asked, mixed budgets, tool waits of "
            f"median {result['tool_wait_ms']:g} ms)"
        )
    return " (mixed budgets)" if result.get("mixed") else ""


def format_table(result: dict) -> str:
    """One line per mode (tokens per second, seconds per set, requests per engine call, turn
    wait), then every ratio between modes that ran."""
    lines = [
        f"{result['groups']} groups x n {result['n']} x {result['turns']} turns x "
        f"{result['new_tokens']} new tokens{_shape_words(result)}, "
        f"{result['replicas']} replica(s), {result['engine']} engine on "
        f"{result.get('model', 'builtin:tiny')}, median of {result['repeats']} (alternating)",
        "| mode | generated tokens / s | seconds per set | requests per call | turn wait median, p99 |",
        "|---|---|---|---|---|",
    ]
    per_call = {"batched": result.get("requests_per_call")}
    for name in ("served", "served-async"):
        per_call[name] = result.get(f"requests_per_{name.replace('-', '_')}_batch")
    for name, rate in result["tokens_per_s"].items():
        size = per_call.get(name)
        wait = result.get(f"{name.replace('-', '_')}_wait_ms")
        waited = "-" if wait is None else f"{wait['median']:.1f} ms, {wait['p99']:.1f} ms"
        lines.append(
            f"| {name} | {rate:,.0f} | {result['seconds_per_set'][name]:.2f} | "
            f"{'-' if size is None else f'{size:.1f}'} | {waited} |"
        )
    ratios = [
        f"{a} / {b}: {result[key]:.2f}"
        for a, b in RATIOS
        if (key := f"{a}_over_{b}".replace("-", "_")) in result
    ]
    lines.append("; ".join(ratios))
    return "\n".join(lines)


#: shape -> (mixed budgets, long-tail turns and tool waits): what ``--shapes`` runs.
SHAPES = {"even": (False, False), "mixed": (True, False), "longtail": (True, True)}


def shape_of(result: dict) -> str:
    """The name in ``SHAPES`` of the shape ``result`` ran."""
    key = (bool(result["mixed"]), bool(result.get("tool_wait_ms")))
    return next(name for name, shape in SHAPES.items() if shape == key)


def least_favourable(results: list[dict]) -> str:
    """The lowest served / ceiling and served / batched (the same through AsyncLLM) over
    ``results``, each with its shape."""
    lines = []
    for key in (
        "served_over_ceiling",
        "served_over_batched",
        "served_async_over_ceiling",
        "served_async_over_batched",
    ):
        have = [r for r in results if key in r]
        if have:
            worst = min(have, key=lambda r: r[key])
            name = key.replace("_over_", " / ").replace("_", "-")
            lines.append(f"least favourable {name}: {worst[key]:.2f} ({shape_of(worst)})")
    return "\n".join(lines)
