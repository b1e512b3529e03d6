"""Who a training worker is (``WorkerSpec``): its role, rank and the typed job config."""

from __future__ import annotations

from dataclasses import dataclass

from trainer.config_schema import Config, CriticConfig, TrainConfig

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
