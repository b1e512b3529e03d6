"""Peer: the same GRPO job run by crossrl and by TRL's GRPOTrainer, step time side by side.

    crossrl bench peer [--quick]        # needs the bench extra: pip install -e '.[bench]'
    python -m bench.peer [--quick] [--jobs default,small] [--repeats N] [--steps N]

Two settings (``bench.peer_task.JOBS``): ``default`` (builtin:tiny, the default job's sizes)
and ``small`` (the 19M-parameter builtin:small, 32 prompts x 8 samples x 16 tokens). For each,
crossrl (``python -m trainer.cli train``) and TRL (``python -m bench.peer_trl``) run as child
processes, interleaved (crossrl, TRL, crossrl, TRL, ...; 3 runs each, 1 with --quick), on the
same prompt file, model weights, tokenizer and reward function, both with 2 torch threads.

Per side: the median seconds per training step and per phase over every run's steps after its
first (warm-up), steps during which other processes used the CPU dropped (``bench.peer_load``);
start-up seconds (launch -> first step starts); and the mean reward per step. crossrl's step
start is read from metrics.jsonl as it grows (the line's arrival minus its ``timing/step_s``).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.peer_load import LOADED_CORES, OutsideLoad
from bench.peer_task import (
    CPU_JOBS,
    JOBS,
    PeerJob,
    crossrl_overrides,
    model_path,
    recall_reward,
    settings_table,
)

__all__ = ["PHASES", "TRL_MISSING", "format_table", "recall_reward", "run", "summarise_side"]

#: The one line ``crossrl bench peer`` prints (exit 2) when TRL is not installed.
TRL_MISSING = (
    "crossrl bench peer: TRL is not installed (it is only a benchmark dependency); "
    "install the bench extra: pip install -c constraints-cpu.txt -e '.[bench]'"
)
#: Phases compared, as (key, label); ``sync_s`` is crossrl's alone.
PHASES = (
    ("rollout_s", "rollout (sample + reward)"),
    ("old_logprobs_s", "old log-probs"),
    ("update_s", "update (2 mini-batches)"),
    ("sync_s", "weight sync (crossrl only)"),
)
REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 1800  # one child run, seconds
POLL_S = 0.05


def trl_available() -> bool:
    """Whether TRL (the bench extra) is importable."""
    return importlib.util.find_spec("trl") is not None


def _child_env() -> dict[str, str]:
    path = os.environ.get("PYTHONPATH", "")
    return dict(
        os.environ,
        PYTHONPATH=f"{REPO}{os.pathsep}{path}" if path else str(REPO),
        RAY_AUTH_MODE=os.environ.get("RAY_AUTH_MODE", "disabled"),
    )


def _launch(cmd: list[str], log_path: Path, on_poll=None, env: dict | None = None) -> float:
    """Run ``cmd`` to its end, output into ``log_path``; call ``on_poll()`` every ``POLL_S``;
    ``env``: more environment for it. Returns the wall time (``time.time()``) of the launch;
    RuntimeError with the log's tail when it fails."""
    with open(log_path, "w", encoding="utf-8") as log:
        launched = time.time()
        child_env = {**_child_env(), **(env or {})}
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=child_env)
        while proc.poll() is None:
            if on_poll:
                on_poll()
            if time.time() - launched > TIMEOUT_S:
                proc.kill()
                proc.wait()
                break
            time.sleep(POLL_S)
    if on_poll:
        on_poll()
    if proc.returncode != 0:
        tail = log_path.read_text(encoding="utf-8", errors="replace")[-2000:]
        raise RuntimeError(f"{' '.join(cmd[1:4])} ... failed (exit {proc.returncode}):\n{tail}")
    return launched


def run_crossrl(job: PeerJob, steps: int, data: Path, workdir: Path) -> dict:
    """One crossrl run: per-step timings (wall ``start``/``end`` too) and ``startup_s``."""
    run_dir = workdir / "run"
    metrics = run_dir / "metrics.jsonl"
    seen: list[tuple[float, dict]] = []
    buffer = {"text": "", "offset": 0}

    def poll() -> None:  # each line is written whole and fsynced: note when it arrives
        try:
            with open(metrics, encoding="utf-8") as f:
                f.seek(buffer["offset"])
                chunk = f.read()
        except FileNotFoundError:
            return
        now = time.time()
        buffer["offset"] += len(chunk.encode("utf-8"))
        text = buffer["text"] + chunk
        *lines, buffer["text"] = text.split("\n")
        seen.extend((now, json.loads(line)) for line in lines if line.strip())

    cmd = [sys.executable, "-m", "trainer.cli", "train", f"run.dir={run_dir}"]
    cmd += crossrl_overrides(job, steps=steps, data_file=data, model=model_path(job))
    launched = _launch(cmd, workdir / "crossrl.log", poll)
    out = []
    for arrived, rec in seen:
        if "timing/step_s" not in rec:
            continue
        out.append(
            {
                "step": rec["step"],
                "start": arrived - rec["timing/step_s"],
                "end": arrived,
                "step_s": rec["timing/step_s"],
                "rollout_s": rec.get("timing/rollout_s", 0.0),
                "old_logprobs_s": rec.get("timing/prepare_s", 0.0),
                "update_s": rec.get("timing/update_s", 0.0),
                "sync_s": rec.get("timing/sync_s", 0.0),
                "reward_mean": rec.get("reward/mean"),
            }
        )
    if not out:
        raise RuntimeError(f"crossrl wrote no timed step to {metrics}")
    return {"steps": out, "startup_s": out[0]["start"] - launched}


def run_trl(job: PeerJob, steps: int, data: Path, workdir: Path) -> dict:
    """One TRL run (``bench.peer_trl``): its per-step timings and ``startup_s``."""
    from rollout.models import model_directory
    from rollout.tokenizer import tokenizer_dir
    from trainer.loop.cluster.group import free_port

    model = model_path(job)
    result_path = workdir / "trl.json"
    cmd = [sys.executable, "-m", "bench.peer_trl", "--job", job.name, "--steps", str(steps)]
    cmd += ["--data", str(data), "--workdir", str(workdir), "--out", str(result_path)]
    cmd += ["--model-dir", str(model_directory(model, job.seed))]
    cmd += ["--tokenizer-dir", str(tokenizer_dir(model)), "--threads", str(job.threads)]
    # TRL's colocated vLLM runs under torch.distributed's launcher variables, one rank here
    env = {}
    if job.engine == "vllm":
        env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
        env["MASTER_PORT"] = str(free_port())
    launched = _launch(cmd, workdir / "trl.log", env=env)
    result = json.loads(result_path.read_text(encoding="utf-8"))
    if not result["steps"]:
        raise RuntimeError(f"TRL run timed no step; see {workdir / 'trl.log'}")
    result["startup_s"] = result["steps"][0]["start"] - launched
    result["interpreter_s"] = result["process_started"] - launched
    return result


def summarise_side(runs: list[dict], load: OutsideLoad | None = None) -> dict:
    """Medians of one side over its runs (each ``{"steps": [...], "startup_s"}``): the first
    step of each run dropped, then steps during which other processes used more than
    ``LOADED_CORES`` cores (all kept when that would leave fewer than 3)."""
    steady = [s for r in runs for s in r["steps"][1:]] or [s for r in runs for s in r["steps"]]
    for s in steady:
        s["outside_cores"] = load.cores(s["start"], s["end"]) if load else None
    quiet = [s for s in steady if (s["outside_cores"] or 0.0) <= LOADED_CORES]
    kept = quiet if len(quiet) >= 3 else steady
    phases = {key: statistics.median(s[key] for s in kept) for key, _ in PHASES if key in kept[0]}
    curves = [[s["reward_mean"] for s in r["steps"]] for r in runs]
    length = min(len(c) for c in curves)
    return {
        "runs": len(runs),
        "steps_measured": len(steady),
        "steps_kept": len(kept),
        "loaded_steps_kept": len(kept) != len(quiet),
        "step_s": statistics.median(s["step_s"] for s in kept),
        "phases_s": phases,
        "startup_s": [r["startup_s"] for r in runs],
        "startup_median_s": statistics.median(r["startup_s"] for r in runs),
        "reward_curves": curves,
        "reward_mean_curve": [statistics.fmean(c[i] for c in curves) for i in range(length)],
    }


def _tokens_of_prompts(job: PeerJob, data: Path) -> list[int]:
    """Distinct prompt lengths (tokens) crossrl sends: the row's prompt as the user's message
    in the tokenizer's chat template (TRL reports its own in its result)."""
    from bench.peer_task import read_prompts
    from rollout.tokenizer import chat_token_ids, load_tokenizer

    tok = load_tokenizer(model_path(job))
    rows = read_prompts(data)
    return sorted(
        {len(chat_token_ids(tok, [{"role": "user", "content": r["prompt"]}])) for r in rows}
    )


def run_job(job: PeerJob, *, steps: int, repeats: int, workdir: Path, echo=print) -> dict:
    """Both sides of one setting, interleaved ``repeats`` times; see ``summarise_side``."""
    from bench.peer_task import write_prompts
    from rollout.models import model_directory

    data = write_prompts(workdir / "prompts.jsonl", seed=job.seed)
    model_directory(model_path(job), job.seed)  # weights written now, before any clock runs
    sides: dict[str, list[dict]] = {"crossrl": [], "trl": []}
    with OutsideLoad() as load:
        for r in range(repeats):
            for side, fn in (("crossrl", run_crossrl), ("trl", run_trl)):
                here = workdir / f"{side}-{r}"
                here.mkdir()
                t0 = time.perf_counter()
                sides[side].append(fn(job, steps, data, here))
                echo(f"  {job.name}: {side} run {r + 1}/{repeats} {time.perf_counter() - t0:.0f} s")
        summary = {side: summarise_side(runs, load) for side, runs in sides.items()}
    cx, trl = summary["crossrl"], summary["trl"]
    return {
        "steps": steps,
        "repeats": repeats,
        "order": [s for _ in range(repeats) for s in ("crossrl", "trl")],
        "prompt_tokens": {
            "crossrl": _tokens_of_prompts(job, data),
            "trl": sides["trl"][0]["prompt_tokens"],
        },
        "threads": {
            "crossrl": "cpu_count // dp_size per worker",
            "trl": sides["trl"][0]["torch_threads"],
        },
        "crossrl": cx,
        "trl": trl,
        "ratio_step": cx["step_s"] / trl["step_s"],
        "ratio_phases": {
            k: cx["phases_s"][k] / trl["phases_s"][k]
            for k in cx["phases_s"]
            if k in trl["phases_s"] and trl["phases_s"][k] > 0
        },
        "ratio_startup": cx["startup_median_s"] / trl["startup_median_s"],
        "settings": settings_table(job, steps=steps, data_file=str(data), output_dir="<workdir>"),
        "runs_raw": sides,
    }


def run(
    quick: bool = False,
    *,
    jobs: list[str] | None = None,
    steps: int | None = None,
    repeats: int | None = None,
    echo=print,
) -> dict:
    """Every setting in ``jobs`` (default: the CPU's, ``CPU_JOBS``): ``{"trl_version", "jobs": {name:
    run_job(...)}}``. ``steps``/``repeats`` override the job's (--quick: its quick_steps, 1)."""
    if not trl_available():
        raise RuntimeError(TRL_MISSING)
    names = jobs or list(CPU_JOBS)
    out: dict = {"trl_version": importlib.metadata.version("trl"), "quick": quick, "jobs": {}}
    with tempfile.TemporaryDirectory(prefix="crossrl-bench-peer-") as tmp:
        for name in names:
            job = JOBS[name]
            n = steps or (job.quick_steps if quick else job.steps)
            here = Path(tmp) / name
            here.mkdir()
            out["jobs"][name] = run_job(
                job, steps=n, repeats=repeats or (1 if quick else 3), workdir=here, echo=echo
            )
    return out


def _row(label: str, a: float | None, b: float | None, fmt: str = "{:10.3f}") -> str:
    cell = lambda v: fmt.format(v) if v is not None else f"{'-':>10s}"  # noqa: E731
    ratio = f"{a / b:9.2f}x" if a is not None and b else f"{'':10s}"
    return f"{label:30s}{cell(a)}{cell(b)}{ratio}"


def format_table(res: dict) -> str:
    """One block per setting: medians by phase, start-up, steps kept, the reward curves."""
    lines = [f"crossrl vs TRL {res['trl_version']} GRPOTrainer on the same job"]
    for name, r in res["jobs"].items():
        job, cx, trl = r["settings"]["job"], r["crossrl"], r["trl"]
        toks = r["prompt_tokens"]
        same = "both" if toks["crossrl"] == toks["trl"] else f"crossrl {toks['crossrl']}, TRL"
        lines += [
            "",
            f"{name}: {job['model']}, {job['prompts_per_step']} prompts x "
            f"{job['samples_per_prompt']} samples, {job['max_new_tokens'] - 1} sampled tokens "
            f"at most, {job['prompts_per_step'] // job['prompts_per_mini_batch']} optimizer "
            f"steps/step, lr {job['lr']:g}; {r['steps']} steps x {r['repeats']} runs each, "
            f"interleaved; prompt tokens {same} {toks['trl']}",
            f"{'median seconds':30s}{'crossrl':>10s}{'TRL':>10s}{'crossrl/TRL':>12s}",
            _row("step", cx["step_s"], trl["step_s"]),
        ]
        for key, label in PHASES:
            lines.append(_row(f"  {label}", cx["phases_s"].get(key), trl["phases_s"].get(key)))
        lines.append(
            _row(
                "start-up (launch -> step 1)",
                cx["startup_median_s"],
                trl["startup_median_s"],
                "{:10.1f}",
            )
        )
        for side, s in (("crossrl", cx), ("TRL", trl)):
            loaded = " (too few quiet: loaded steps kept)" if s["loaded_steps_kept"] else ""
            lines.append(
                f"  {side}: {s['steps_kept']}/{s['steps_measured']} steps kept (after step 1 of "
                f"each run; > {LOADED_CORES} outside cores dropped){loaded}; start-up "
                + ", ".join(f"{v:.1f}" for v in s["startup_s"])
                + " s"
            )
        lines.append("mean reward per step (mean of runs):")
        for side, s in (("crossrl", cx), ("TRL", trl)):
            lines.append(f"  {side:8s}" + " ".join(f"{v:.3f}" for v in s["reward_mean_curve"]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.peer``: print the table, write the results JSON; exit 2 without TRL."""
    parser = argparse.ArgumentParser(
        prog="python -m bench.peer", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--quick", action="store_true", help="1 run each, fewer steps")
    parser.add_argument(
        "--jobs", default=",".join(CPU_JOBS), help=f"comma list of {', '.join(JOBS)}"
    )
    parser.add_argument("--steps", type=int, default=None, help="training steps per run")
    parser.add_argument("--repeats", type=int, default=None, help="runs of each trainer")
    parser.add_argument("--out", default="bench-peer.json", help="results JSON")
    args = parser.parse_args(argv)
    jobs = [j for j in args.jobs.split(",") if j]
    bad = [j for j in jobs if j not in JOBS]
    if bad:
        print(
            f"python -m bench.peer: --jobs {bad[0]!r} unknown; choose from {', '.join(JOBS)}",
            file=sys.stderr,
        )
        return 2
    if not trl_available():
        print(TRL_MISSING, file=sys.stderr)
        return 2
    from bench.machine import describe_machine, machine_line
    from rollout.files import atomic_write_text

    machine = describe_machine()
    print(f"machine: {machine_line(machine)}")
    res = run(args.quick, jobs=jobs, steps=args.steps, repeats=args.repeats)
    print(format_table(res))
    atomic_write_text(Path(args.out), json.dumps({"machine": machine, **res}, indent=1) + "\n")
    print(f"results: {Path(args.out).resolve()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
