"""The typed job config's sections about where and how a job runs: its run directory and
records (``run``), and the Ray cluster or the one process it runs in (``ray``). The other
sections and the whole ``Config`` are in ``trainer.config.schema``."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, Field, field_validator

from trainer.config.schema_base import SECTION as _SECTION

_HOST_PORT = re.compile(r"^[A-Za-z0-9_.\-\[\]:]+:(\d{1,5})$")


class RunConfig(BaseModel):
    """The run directory, checkpoints and records."""

    model_config = _SECTION

    dir: str = Field("runs/tiny", description="run directory (config, metrics, checkpoints)")
    save_every: int = Field(0, ge=0, description="steps between checkpoints; 0 = only at the end")
    resume: str = Field(
        "auto",
        description="auto or latest (the latest checkpoint in run.dir if any), never, step_<N> "
        "(that checkpoint in run.dir) or the path of a step_<N> checkpoint directory",
    )
    deterministic: bool = Field(
        False, description="deterministic kernels and seeds (slower; for parity checks)"
    )
    record_rollouts: bool = Field(
        False, description="save each step's rollout batch for replay (parity checks)"
    )
    fingerprint_every: int = Field(
        1,
        ge=0,
        description="steps between parameter checksums in fingerprint.jsonl (written every step); 0 = never",
    )
    max_env_error_fraction: float = Field(
        0.5,
        ge=0,
        le=1,
        description="a step whose rollout loses more than this fraction of its trajectories to "
        "environment faults stops the run (exit 1, before that step's checkpoint); 1 = never",
    )
    max_nonfinite_steps: int = Field(
        3,
        ge=1,
        description="optimizer steps in a row skipped for a non-finite loss or grad norm that "
        "stop the run (exit 1)",
    )
    max_restarts: int = Field(
        2,
        ge=0,
        description="times a run starts its workers again and resumes from its last checkpoint "
        "(or its start) after a process of the job died, an object it held was lost with it, "
        "a collective broke or a call passed its time limit; 0 = stop at the first such "
        "fault (exit 1)",
    )
    collective_timeout_s: float = Field(
        600.0,
        gt=0,
        description="seconds a collective may wait for a peer before it fails (the process "
        "group's timeout, and the device library's watchdog through the HAL); a worker call's "
        "own limit is this plus what the call's budgets allow",
    )
    time_limit_scale: float = Field(
        1.0,
        gt=0,
        description="factor on every worker call's budget (rollout, update, validation, "
        "checkpoint save and load, weight push, start-up; trainer/loop/plan/call_limits.py), "
        "which follows the model's bytes and the measured throughput; raise it on slow "
        "storage or links, lower it to call hangs sooner",
    )
    overwrite: bool = Field(
        False,
        description="allow run.resume=never (and crossrl probe --out) on a directory that holds "
        "a run; its metrics and newer checkpoints are then replaced",
    )
    val_every: int = Field(
        0, ge=0, description="steps between validations on data.val_source; 0 = never"
    )
    val_before_train: bool = Field(
        False, description="validate once before the first step of a fresh run (step 0)"
    )
    loggers: list[Literal["jsonl", "tensorboard", "wandb"]] = Field(
        default_factory=lambda: ["jsonl"],
        description="where metrics go: jsonl (metrics.jsonl, always required), tensorboard "
        "(<run.dir>/tensorboard), wandb (honours WANDB_MODE=offline)",
    )
    wandb_project: str = Field("crossrl", description="wandb project name (run.loggers: wandb)")

    @field_validator("dir", "resume")
    @classmethod
    def _not_empty(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("must not be empty")
        return value


class RayConfig(BaseModel):
    """Where the Ray workers run."""

    model_config = _SECTION

    address: str | None = Field(
        None, description="null: start a local Ray; auto or host:port: join a running cluster"
    )
    placement_timeout_s: float = Field(
        300.0, gt=0, description="seconds to wait for devices before failing"
    )
    num_cpus: int | None = Field(
        None, ge=1, description="CPUs of a local Ray (null = all); ignored when joining"
    )
    connect_timeout_s: float = Field(
        60.0, gt=0, description="seconds to wait for the cluster at ray.address before failing"
    )
    object_store_gb: float | None = Field(
        None,
        ge=0.08,
        description="GB (1e9 bytes, at least 0.08: Ray's minimum) of a local Ray's object "
        "store, which holds the weight snapshots of engines on devices of their own "
        "(train.rollout_lag + 1 of them); null = Ray's default: 30 % of the memory available at "
        "start-up, at most 200 GB (and at most /dev/shm's free space when that is over 10 GB); "
        "ignored when joining (ray.address)",
    )
    in_process: bool | Literal["auto"] = Field(
        "auto",
        description="run the workers in the driver's process, without Ray: auto = when the job "
        "is one CPU rank (device cpu, train.dp_size 1, the hf engine, no ray.address); true "
        "insists (an error names what stops it); false = always Ray",
    )

    @field_validator("address")
    @classmethod
    def _address(cls, value: str | None) -> str | None:
        if value is None or value == "auto":
            return value
        match = _HOST_PORT.match(value.removeprefix("ray://"))
        if not match or not 1 <= int(match.group(1)) <= 65535:
            raise ValueError("must be null, auto or host:port (port 1-65535)")
        return value
