"""Row shapes of multi-turn rollouts under four row layouts (synthetic token counts, no model).

Workloads: ``search_r1`` (few turns, long retrieved-document observations) and ``swe`` (many
turns, long tool outputs). Layouts, for the same trajectories:

- ``stepwise``: one row per turn, DESIGN.md rules (history re-tokenized into the prompt, response
  = generated tokens + EOS; a turn whose prompt exceeds max_input_len is not generated).
- ``stepwise_obs_in_resp``: one row per turn but the observation that followed is left in the
  response (the bug the rules prevent): rows exceed max_input_len + max_new_tokens.
- ``whole``: one row per trajectory, observations masked in the response.
- ``merged``: step-wise rows merged while turn i's prompt + response is a token prefix of turn
  i+1's prompt; ``prefix_break`` is the chance per turn that re-tokenization breaks the prefix
  (BPE merges across the turn boundary), which starts a new row.

``python -m bench.stepwise`` prints a table; ``run(quick=False) -> dict`` returns the numbers.
"""

from __future__ import annotations

import numpy as np

#: Template tokens around one chat message (``<|im_start|>role\n ... <|im_end|>\n``).
TEMPLATE_TOKENS = 5

WORKLOADS = {
    # turns: (low, high) inclusive; lengths are (mean, std) in tokens.
    "search_r1": dict(
        prompt=(300, 50),
        turns=(2, 4),
        response=(120, 40),
        observation=(600, 150),
        max_input_len=4096,
        max_new_tokens=512,
        prefix_break=0.05,
    ),
    "swe": dict(
        prompt=(2000, 300),
        turns=(10, 40),
        response=(200, 80),
        observation=(900, 400),
        max_input_len=32768,
        max_new_tokens=1024,
        prefix_break=0.05,
    ),
}


def _len(rng: np.random.Generator, mean_std: tuple[int, int], high: int | None = None) -> int:
    value = int(round(rng.normal(*mean_std)))
    value = max(1, value)
    return min(value, high) if high is not None else value


def _trajectory(rng: np.random.Generator, spec: dict) -> list[tuple[int, int, int, bool]]:
    """Turns of one trajectory as (prompt_len, response_len, obs_len_after, prefix_ok) in tokens,
    with the step-wise truncation rule applied."""
    prompt = _len(rng, spec["prompt"]) + TEMPLATE_TOKENS + 3  # + generation prompt
    turns = []
    num_turns = int(rng.integers(spec["turns"][0], spec["turns"][1] + 1))
    for t in range(num_turns):
        if prompt > spec["max_input_len"]:
            break  # rule a: the over-long turn is not generated; its observation stays unanswered
        resp = _len(rng, spec["response"], spec["max_new_tokens"] - 1) + 1  # + EOS
        # The env ends after the last turn (no observation); else user block + next gen prompt.
        obs = 0 if t == num_turns - 1 else _len(rng, spec["observation"]) + 2 * TEMPLATE_TOKENS
        turns.append((prompt, resp, obs, bool(rng.random() >= spec["prefix_break"])))
        prompt = prompt + resp + obs
    return turns


def _layouts(trajs: list[list[tuple[int, int, int, bool]]]) -> dict[str, list[tuple[int, int]]]:
    """Per layout: (row tokens, trained tokens) of every row."""
    out: dict[str, list[tuple[int, int]]] = {
        k: [] for k in ("stepwise", "stepwise_obs_in_resp", "whole", "merged")
    }
    for turns in trajs:
        if not turns:
            continue
        out["stepwise"] += [(p + r, r) for p, r, _, _ in turns]
        out["stepwise_obs_in_resp"] += [(p + r + o, r) for p, r, o, _ in turns]
        p0 = turns[0][0]
        # The observation after the last generated turn (truncated trajectory) is not in the row.
        whole = p0 + sum(r + o for _, r, o, _ in turns) - turns[-1][2]
        out["whole"].append((whole, sum(r for _, r, _, _ in turns)))
        row_len, trained = turns[0][0] + turns[0][1], turns[0][1]
        for (p, r, _, ok), (_, _, prev_obs, _) in zip(turns[1:], turns[:-1]):
            if ok:  # prefix holds: the gap (prev_obs) and this turn join the row
                row_len, trained = row_len + prev_obs + r, trained + r
            else:
                out["merged"].append((row_len, trained))
                row_len, trained = p + r, r
        out["merged"].append((row_len, trained))
    return out


def run(quick: bool = False, seed: int = 0) -> dict:
    """Row statistics per workload and layout: rows, max/mean row tokens, packed tokens per step,
    trained tokens, and packed tokens relative to the step-wise layout."""
    rng = np.random.default_rng(seed)
    trajectories = 16 if quick else 256
    results: dict = {}
    for name, spec in WORKLOADS.items():
        trajs = [_trajectory(rng, spec) for _ in range(trajectories)]
        layouts = _layouts(trajs)
        base = sum(n for n, _ in layouts["stepwise"])
        results[name] = {
            "bound_tokens": spec["max_input_len"] + spec["max_new_tokens"],
            "trajectories": trajectories,
            "mean_turns": float(np.mean([len(t) for t in trajs])),
        }
        for layout, rows in layouts.items():
            lens = np.array([n for n, _ in rows])
            results[name][layout] = {
                "rows": len(rows),
                "max_row_tokens": int(lens.max()),
                "mean_row_tokens": float(lens.mean()),
                "packed_tokens": int(lens.sum()),
                "trained_tokens": int(sum(t for _, t in rows)),
                "packed_vs_stepwise": float(lens.sum() / base),
                "rows_over_bound": int((lens > results[name]["bound_tokens"]).sum()),
            }
    return results


def format_table(results: dict) -> str:
    """One block per workload: rows and row lengths (tokens) under each layout."""
    lines: list[str] = []
    for name, res in results.items():
        lines.append(
            f"\n{name}: {res['trajectories']} trajectories, mean {res['mean_turns']:.1f} turns, "
            f"step-row bound {res['bound_tokens']} tokens"
        )
        lines.append(
            f"{'layout':24} {'rows':>6} {'max_len':>8} {'mean_len':>9} {'packed':>10} "
            f"{'trained':>9} {'x step':>7} {'>bound':>7}"
        )
        for layout in ("stepwise", "stepwise_obs_in_resp", "whole", "merged"):
            r = res[layout]
            lines.append(
                f"{layout:24} {r['rows']:6d} {r['max_row_tokens']:8d} {r['mean_row_tokens']:9.0f} "
                f"{r['packed_tokens']:10d} {r['trained_tokens']:9d} {r['packed_vs_stepwise']:7.2f} "
                f"{r['rows_over_bound']:7d}"
            )
    return "\n".join(lines).lstrip("\n")


if __name__ == "__main__":
    print(format_table(run()))
