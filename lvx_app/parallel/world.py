"""The ranks a run uses, resolved once and passed beside the config.

`--gpus` and `--ranks` say what the user asked for (either may be left to the machine); the `World`
says what the run got: how many ranks, and whether each has a GPU. The config stays as the user gave
it, so what a rank or a log shows of it is what was asked.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class World:
    """How many ranks a run has and how many GPUs they use (0: CPU ranks; else one GPU each)."""

    ranks: int = 1
    gpus: int = 0

    def __post_init__(self) -> None:
        if self.ranks < 1 or self.gpus not in (0, self.ranks):
            raise ValueError(f"a world has 1 or more ranks and 0 GPUs or one per rank: {self}")

    @property
    def cuda(self) -> bool:
        """Whether the ranks run on GPUs."""
        return self.gpus > 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> World:
        return cls(**data)

    @classmethod
    def of_torchrun(cls, gpus: int | None) -> World:
        """The world of a group torchrun described in the environment (one the user started, on
        several machines): its WORLD_SIZE ranks, on GPUs when `--gpus` asks for them."""
        ranks = int(os.environ.get("WORLD_SIZE", "1"))
        return cls(ranks, ranks if gpus else 0)
