"""The job ``bench peer`` gives both trainers: its sizes, its prompt file, its reward, and the
settings of each trainer derived from one ``PeerJob``.

The task is the recall environment's first turn on its own: the prompt ``say NN`` (two random
digits), the reward ``match_credit(reply, "NN")``. Both trainers read the same jsonl rows
(``write_prompts``) and score through the same function (``recall_reward``, verl's signature,
which crossrl calls as ``reward.function``; ``trl_recall_reward`` adapts TRL's signature to it).

Nothing here imports TRL: the TRL child (``bench.peer_trl``) builds its ``GRPOConfig`` from
``trl_config_kwargs``, and the tests compare those values with ``crossrl_overrides`` without it.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path

from rollout.envs.base import match_credit
from rollout.files import atomic_write_text

__all__ = [
    "CPU_JOBS",
    "JOBS",
    "PeerJob",
    "crossrl_overrides",
    "model_path",
    "recall_reward",
    "settings_table",
    "trl_config_kwargs",
    "trl_recall_reward",
    "write_prompts",
]

#: Rows of the prompt file; 100 distinct prompts, so rows repeat (as the env's generator does).
PROMPT_ROWS = 1024


@dataclass(frozen=True)
class PeerJob:
    """One GRPO job, in the units both trainers share. ``max_new_tokens`` is crossrl's
    response horizon, which keeps one token for the closing EOS: both trainers sample at most
    ``max_new_tokens - 1`` tokens (TRL's ``max_completion_length``)."""

    name: str
    model: str  # builtin:tiny | builtin:small
    steps: int  # training steps (one rollout each); --quick uses quick_steps
    quick_steps: int
    prompts_per_step: int = 16
    samples_per_prompt: int = 8
    prompts_per_mini_batch: int = 8  # one optimizer step each
    max_new_tokens: int = 4  # tokens, closing EOS included
    lr: float = 3e-3
    seed: int = 1
    warmup_steps: int = 0
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    clip_low: float = 0.2
    clip_high: float = 0.2
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    ppo_epochs: int = 1
    threads: int = 2  # torch threads of each side's compute processes
    # Where and how both sides run (the CPU jobs' defaults, or a GPU job's):
    device: str = "cpu"  # cpu | cuda
    engine: str = "hf"  # crossrl's rollout.engine; "vllm": TRL's vLLM too, both colocated
    param_dtype: str = "float32"  # compute dtype over fp32 master weights (TRL: bf16 or not)
    memory_fraction: float = 0.3  # the device share of vLLM on both sides (vllm only)
    activation_checkpointing: bool = False  # both sides' gradient checkpointing

    @property
    def samples_per_mini_batch(self) -> int:
        """Rows (samples) per optimizer step: TRL's ``per_device_train_batch_size``."""
        return self.prompts_per_mini_batch * self.samples_per_prompt

    @property
    def mini_batches_per_step(self) -> int:
        """Optimizer steps per training step: TRL's ``steps_per_generation``."""
        return self.prompts_per_step // self.prompts_per_mini_batch


#: The settings: the default job's sizes, and the 19M-parameter model with longer answers
#: (lr 1e-4 for ``small`` moves its reward within 5 steps, docs/benchmarks.md), on the CPU; and
#: ``gpu-1.5b``, the GPU issue's tier 2: Qwen2.5-1.5B's shape with random weights
#: (``random:<shape>``, written once by ``model_path``), vLLM colocated on both sides with sleep
#: mode, bf16 compute over fp32 master weights, gradient checkpointing, 255 sampled tokens.
JOBS: dict[str, PeerJob] = {
    "default": PeerJob("default", "builtin:tiny", steps=20, quick_steps=4),
    "small": PeerJob(
        "small",
        "builtin:small",
        steps=5,
        quick_steps=2,
        prompts_per_step=32,
        prompts_per_mini_batch=16,
        max_new_tokens=16,
        lr=1e-4,
    ),
    "gpu-1.5b": PeerJob(
        "gpu-1.5b",
        "random:qwen2.5-1.5b",
        steps=5,
        quick_steps=3,
        prompts_per_step=16,
        samples_per_prompt=8,
        prompts_per_mini_batch=8,
        max_new_tokens=256,
        lr=1e-6,
        threads=8,
        device="cuda",
        engine="vllm",
        param_dtype="bfloat16",
        memory_fraction=0.3,
        activation_checkpointing=True,
    ),
}
#: The jobs ``bench peer`` runs when none is named: those of the CPU.
CPU_JOBS = [name for name, job in JOBS.items() if job.device == "cpu"]


def model_path(job: PeerJob) -> str:
    """``model.path`` of ``job`` for both sides: a builtin name as it is; ``random:<shape>``
    (a published shape, ``rollout.models.SHAPES``) as a local directory of random weights for
    the job's seed, written once (bf16 on disk, like published checkpoints) under
    ``$CROSSRL_PEER_MODELS`` (default ``~/.cache/crossrl/peer-models``)."""
    import os

    if not job.model.startswith("random:"):
        return job.model
    from rollout.models import write_random_model

    shape = job.model.split(":", 1)[1]
    root = Path(os.environ.get("CROSSRL_PEER_MODELS", "~/.cache/crossrl/peer-models"))
    directory = root.expanduser() / f"{shape}-seed{job.seed}"
    if not (directory / "config.json").is_file():
        directory.parent.mkdir(parents=True, exist_ok=True)
        write_random_model(directory, shape, seed=job.seed, dtype="bfloat16")
    return str(directory)


def write_prompts(path: str | Path, *, seed: int = 1, rows: int = PROMPT_ROWS) -> Path:
    """Write the prompt file both trainers read: ``rows`` jsonl records
    ``{"prompt": "say 42", "answer": "42"}``, the digits drawn from ``seed``. Written
    atomically; returns the path."""
    rng = random.Random(seed)
    lines = []
    for _ in range(rows):
        digits = f"{rng.randrange(100):02d}"
        lines.append(json.dumps({"prompt": f"say {digits}", "answer": digits}))
    path = Path(path)
    atomic_write_text(path, "\n".join(lines) + "\n")
    return path


def read_prompts(path: str | Path) -> list[dict]:
    """The records of a ``write_prompts`` file."""
    text = Path(path).read_text(encoding="utf-8")
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def recall_reward(data_source: str, solution_str: str, ground_truth, extra_info=None) -> float:
    """verl's signature (crossrl's ``reward.function=bench.peer:recall_reward``): partial
    credit in [0, 1] for answering ``ground_truth`` with ``solution_str`` (``match_credit``)."""
    return match_credit(solution_str, str(ground_truth))


def _completion_text(completion) -> str:
    """TRL hands a conversational completion as ``[{"role": "assistant", "content": ...}]``."""
    if isinstance(completion, list):
        return "".join(str(m.get("content", "")) for m in completion)
    return str(completion)


def trl_recall_reward(prompts, completions, answer, **kwargs) -> list[float]:
    """TRL's reward signature (``answer`` is the dataset column of the same name): the same
    score as ``recall_reward`` for each completion."""
    return [
        recall_reward("", _completion_text(c), truth, {})
        for c, truth in zip(completions, answer, strict=True)
    ]


def crossrl_overrides(
    job: PeerJob, *, steps: int, data_file: str | Path, model: str | None = None
) -> list[str]:
    """``crossrl train`` overrides (on the CPU default job) that run ``job`` for ``steps``
    steps on ``data_file``; ``run.dir`` is the caller's. ``model``: ``model.path`` (default
    ``job.model``: ``model_path`` makes a ``random:`` one)."""
    engine = [f"rollout.memory_fraction={job.memory_fraction}"] if job.engine == "vllm" else []
    return [
        f"device={job.device}",
        f"seed={job.seed}",
        f"model.path={model or job.model}",
        f"model.dtype={job.param_dtype}",
        f"data.source={data_file}",
        f"rollout.engine={job.engine}",
        *engine,
        "rollout.env=single_turn",
        "reward.function=bench.peer:recall_reward",
        f"rollout.n={job.samples_per_prompt}",
        "rollout.max_turns=1",
        f"rollout.max_new_tokens={job.max_new_tokens}",
        f"rollout.temperature={job.temperature}",
        f"rollout.top_p={job.top_p}",
        f"rollout.top_k={job.top_k}",
        "algorithm.adv_estimator=grpo",
        "algorithm.norm_adv_by_std=true",
        "algorithm.loss_agg=token-mean",
        f"algorithm.clip_ratio_low={job.clip_low}",
        f"algorithm.clip_ratio_high={job.clip_high}",
        "algorithm.kl_coef=0.0",
        "algorithm.use_kl_loss=false",
        "algorithm.entropy_coef=0.0",
        f"train.batch_size={job.prompts_per_step}",
        f"train.mini_batch_size={job.prompts_per_mini_batch}",
        "train.dp_size=1",
        "train.max_tokens_per_micro_batch=null",  # one forward per optimizer step, like TRL's
        f"train.total_steps={steps}",
        f"train.lr={job.lr}",
        f"train.warmup_steps={job.warmup_steps}",
        "train.lr_schedule=constant",
        f"train.weight_decay={job.weight_decay}",
        f"train.grad_clip={job.grad_clip}",
        f"train.ppo_epochs={job.ppo_epochs}",
        f"train.param_dtype={job.param_dtype}",
        f"train.activation_checkpointing={str(job.activation_checkpointing).lower()}",
        "run.resume=never",
        "run.save_every=0",
    ]


def trl_config_kwargs(job: PeerJob, *, steps: int, output_dir: str | Path) -> dict:
    """Keyword arguments of TRL's ``GRPOConfig`` for the same job as ``crossrl_overrides``:
    one generation of ``prompts_per_step x samples_per_prompt`` rows feeds
    ``mini_batches_per_step`` optimizer steps of ``samples_per_mini_batch`` rows each. A vLLM
    job runs TRL's vLLM colocated in the trainer's process, sleeping while it trains, with the
    same share of the device as crossrl's engine."""
    vllm = {}
    if job.engine == "vllm":
        vllm = {
            "vllm_mode": "colocate",
            "vllm_gpu_memory_utilization": job.memory_fraction,
            "vllm_enable_sleep_mode": True,
            "vllm_tensor_parallel_size": 1,
        }
    return {
        "output_dir": str(output_dir),
        "seed": job.seed,
        "max_steps": steps * job.mini_batches_per_step,  # optimizer steps
        "num_generations": job.samples_per_prompt,
        "per_device_train_batch_size": job.samples_per_mini_batch,
        "gradient_accumulation_steps": 1,
        "steps_per_generation": job.mini_batches_per_step,
        "num_iterations": job.ppo_epochs,
        "max_completion_length": job.max_new_tokens - 1,
        "temperature": job.temperature,
        "top_p": job.top_p,
        "top_k": job.top_k,
        "beta": 0.0,
        "scale_rewards": "group",
        # bnpo divides each optimizer step's summed token losses by that step's own loss
        # tokens (at gradient_accumulation_steps=1): crossrl's token-mean. TRL's default, dapo,
        # divides by the generation batch's tokens / steps_per_generation instead.
        "loss_type": "bnpo",
        "epsilon": job.clip_low,
        "epsilon_high": job.clip_high,
        "entropy_coef": 0.0,
        "mask_truncated_completions": False,
        "importance_sampling_level": "token",
        "max_grad_norm": job.grad_clip,
        "learning_rate": job.lr,
        "lr_scheduler_type": "constant",
        "warmup_steps": job.warmup_steps,
        "weight_decay": job.weight_decay,
        "optim": "adamw_torch",
        "adam_beta1": 0.9,
        "adam_beta2": 0.999,
        "adam_epsilon": 1e-8,
        # GRPOConfig's default is True; crossrl's is off on the CPU jobs
        "gradient_checkpointing": job.activation_checkpointing,
        "bf16": job.param_dtype == "bfloat16",
        "fp16": False,
        "use_cpu": job.device == "cpu",
        "use_vllm": job.engine == "vllm",
        **vllm,
        "pad_to_multiple_of": None,
        "shuffle_dataset": True,
        "remove_unused_columns": False,
        "dataloader_num_workers": 0,
        "report_to": "none",
        "save_strategy": "no",
        "logging_steps": 1,
        "log_completions": False,
        "disable_tqdm": True,
    }


#: (what, crossrl key, TRL field, how to read one from the other) for ``settings_table``.
_PAIRS = [
    ("model weights", "model.path", None, "same safetensors directory (rollout.models)"),
    ("samples per prompt", "rollout.n", "num_generations", "equal"),
    ("prompts per step", "train.batch_size", None, "TRL: generation batch / num_generations"),
    ("rows per optimizer step", None, "per_device_train_batch_size", "train.mini_batch_size x n"),
    ("optimizer steps per step", None, "steps_per_generation", "batch_size / mini_batch_size"),
    ("sampled tokens, at most", "rollout.max_new_tokens", "max_completion_length", "crossrl - 1"),
    ("clip low / high", "algorithm.clip_ratio_low", "epsilon", "equal (high: epsilon_high)"),
    ("loss aggregation", "algorithm.loss_agg", "loss_type", "token-mean = bnpo at grad accum 1"),
    ("advantages", "algorithm.norm_adv_by_std", "scale_rewards", "group std (n-1)"),
    ("learning rate", "train.lr", "learning_rate", "equal, constant, no warm-up"),
    ("grad clip", "train.grad_clip", "max_grad_norm", "equal"),
]


def settings_table(job: PeerJob, *, steps: int, data_file: str, output_dir: str) -> dict:
    """Every setting of both sides for the results JSON: ``job`` (the shared sizes),
    ``crossrl`` (the overrides as a dict), ``trl`` (the GRPOConfig kwargs), ``pairs`` (how the
    main ones map) and ``differences`` (what cannot be made equal)."""
    overrides = dict(
        o.split("=", 1) for o in crossrl_overrides(job, steps=steps, data_file=data_file)
    )
    return {
        "job": asdict(job),
        "crossrl": overrides,
        "trl": trl_config_kwargs(job, steps=steps, output_dir=output_dir),
        "pairs": [list(p) for p in _PAIRS],
        "differences": DIFFERENCES,
    }


#: What differs between the two sides even so (listed in the output and the docs).
DIFFERENCES = [
    "GRPO std epsilon: crossrl 1e-6, TRL 1e-4 (changes advantages only for near-equal groups)",
    "dual clip: crossrl bounds the ratio at clip_ratio_c=3 for negative advantages; TRL has none",
    "a completion cut at the horizon: crossrl appends an untrained EOS token (in the forward, "
    "not in the loss); TRL leaves it unterminated",
    "crossrl-only work inside a step: weight sync to the rollout engine, a parameter checksum "
    "(run.fingerprint_every=1), run.deterministic=true (the default job's)",
    "TRL generates all rows in one padded transformers generate; crossrl's HF engine in one "
    "padded batch too (up to 256 requests), each request drawing from its own seeded sampler",
    "prompt order: each side shuffles the same rows with its own seeded sampler",
    "vLLM jobs: TRL corrects the engine/trainer log-prob mismatch with its own importance "
    "sampling (vllm_importance_sampling_correction, its default); crossrl with its own keys",
]
