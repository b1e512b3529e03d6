"""Who a training worker is (``WorkerSpec``): its role, rank and the typed job config."""

from __future__ import annotations

from dataclasses import dataclass

from trainer.config.schema import Config, CriticConfig, TrainConfig

ROLES = ("actor", "reference", "critic")


@dataclass(frozen=True)
class WorkerSpec:
    """Who a worker is. What it does comes from the typed job config it carries (pydantic
    models pickle into Ray as they are), read where it is used: nothing is copied."""

    role: str  # one of ROLES
    rank: int  # data-parallel rank, 0 .. cfg.train.dp_size - 1
    cfg: Config
    threads: int = 1  # CPU threads of this process

    def __post_init__(self) -> None:
        assert self.role in ROLES, self.role  # programming error: roles are fixed here
        assert 0 <= self.rank < self.cfg.train.dp_size, (self.rank, self.cfg.train.dp_size)

    @property
    def world_size(self) -> int:
        """Data-parallel ranks of this role (``train.dp_size``)."""
        return self.cfg.train.dp_size

    @property
    def sharded(self) -> bool:
        """Whether this rank's model goes under FSDP2 or stays a plain module.

        FSDP2 is needed when there is something to shard (``train.dp_size`` > 1) and when it
        does more than shard: ``train.param_offload`` (its CPU-offload policy) or a
        ``train.param_dtype`` / ``train.reduce_dtype`` other than the float32 master weights
        (its mixed-precision policy). Otherwise, at one rank, it only adds a copy and hooks
        around every forward and backward, and gives the plain module's numbers.
        """
        train = self.cfg.train
        return (
            self.world_size > 1
            or train.param_offload
            or train.param_dtype != "float32"
            or train.reduce_dtype != "float32"
        )

    @property
    def trainable(self) -> bool:
        """The reference model is frozen; actor and critic train."""
        return self.role != "reference"

    @property
    def model_path(self) -> str:
        """The critic starts from ``model.critic_path`` when set; everyone else from
        ``model.path``."""
        model = self.cfg.model
        return (model.critic_path or model.path) if self.role == "critic" else model.path

    @property
    def optim(self) -> CriticConfig | TrainConfig:
        """The section holding this role's lr, warm-up, weight decay and grad clip."""
        return self.cfg.critic if self.role == "critic" else self.cfg.train
