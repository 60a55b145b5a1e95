"""`--kv-mode auto`: keep the visual K/V resident (cache) when the memory plan's peak for this video
fits the memory the process can use, else recompute them from the features in every forward.

The memory the process can use is what the device has free, plus what PyTorch holds reserved but
unused (its caching allocator hands that out before asking the device), plus what the video being
replaced holds (it is freed before the new one's K/V are made). The plan's peak is compared with it
as growth: the plan's peak less what the plan says is already there when the choice is made (the
weights and this video's features), plus the headroom a GPU needs beyond the plan's tensors (the
allocator's reserve over them, the libraries' workspaces and a margin: `memory_plan.headroom`).
Every figure of the choice travels with it (`as_dict`), so `/stats`, the API, `lvx info` and the
acceptance report show why a mode was chosen.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from lvx_app.engine.memory_plan import (
    GB,
    ParamCounts,
    Workload,
    features_bytes,
    headroom,
    memory_plan,
    param_counts,
)
from lvx_models.api import ModelConfig


@dataclass(frozen=True)
class DeviceMemory:
    """What the device and PyTorch's allocator say, in bytes."""

    free: int  # free on the device (outside this process's reserve)
    total: int
    reserved: int  # held by PyTorch's caching allocator
    allocated: int  # in live tensors

    @property
    def reserved_unused(self) -> int:
        """What the allocator holds but no tensor uses: handed out before the device is asked."""
        return self.reserved - self.allocated


def cuda_memory(device: torch.device) -> DeviceMemory:
    """The only CUDA calls of the choice (tests stand in for this function)."""
    free, total = torch.cuda.mem_get_info(device)
    return DeviceMemory(
        free=int(free),
        total=int(total),
        reserved=int(torch.cuda.memory_reserved(device)),
        allocated=int(torch.cuda.memory_allocated(device)),
    )


@dataclass(frozen=True)
class KvChoice:
    """The mode a load runs in, how it was decided, and (auto on a GPU) the figures it compared."""

    mode: str  # cache | recompute
    how: str  # asked | auto
    memory: DeviceMemory | None = None
    replaced: int = 0  # bytes the replaced video held
    plan_peak: int = 0  # the plan's peak for this video in cache mode (per rank)
    planned_growth: int = 0  # that peak less the plan's weights and features
    headroom: int = 0  # kept free beyond the growth (`memory_plan.headroom`)

    @property
    def usable(self) -> int:
        m = self.memory
        return 0 if m is None else m.free + m.reserved_unused + self.replaced

    def as_dict(self) -> dict[str, object]:
        out: dict[str, object] = {"mode": self.mode, "how": self.how}
        if self.memory is None:
            if self.how == "auto":
                out["why"] = "not a GPU: the K/V stay in host memory"
            return out
        m = self.memory
        out.update(
            {
                "free GB": round(m.free / GB, 2),
                "reserved unused GB": round(m.reserved_unused / GB, 2),
                "replaced video GB": round(self.replaced / GB, 2),
                "usable GB": round(self.usable / GB, 2),
                "plan peak GB": round(self.plan_peak / GB, 2),
                "planned growth GB": round(self.planned_growth / GB, 2),
                "headroom GB": round(self.headroom / GB, 2),
                "device total GB": round(m.total / GB, 2),
            }
        )
        return out

    def line(self) -> str:
        """One line for a table: the mode and, for auto on a GPU, the figures behind it."""
        if self.memory is None:
            return f"{self.mode} ({'asked' if self.how == 'asked' else 'auto, not a GPU'})"
        return (
            f"{self.mode} (auto: plan needs {self.planned_growth / GB:.1f} GB more and "
            f"{self.headroom / GB:.1f} GB headroom, "
            f"{self.usable / GB:.1f} GB usable: {self.memory.free / GB:.1f} free, "
            f"{self.memory.reserved_unused / GB:.1f} reserved unused, "
            f"{self.replaced / GB:.1f} from the replaced video)"
        )


def choose_kv_mode(
    asked: str,
    config: ModelConfig,
    frames: int,
    ranks: int,
    dtype_bytes: int,
    device: torch.device,
    replaced: int = 0,
    counts: ParamCounts | None = None,
    read_memory: Callable[[torch.device], DeviceMemory] = cuda_memory,
) -> KvChoice:
    """`asked` unless it is auto; auto on a GPU: cache when the plan's growth for `frames` frames
    split over `ranks` and its headroom fit the usable memory, else recompute; auto off a GPU:
    cache."""
    if asked != "auto":
        return KvChoice(asked, "asked")
    if device.type != "cuda":
        return KvChoice("cache", "auto")
    work = Workload(minutes=frames / 60, ranks=ranks, dtype_bytes=dtype_bytes)
    plan = memory_plan(config, work, counts or param_counts(config))
    features = features_bytes(config, -(-frames // ranks), dtype_bytes)
    growth = plan.peak - plan.resident["weights"] - features
    spare = headroom(plan.peak)
    choice = KvChoice("cache", "auto", read_memory(device), replaced, plan.peak, growth, spare)
    return choice if growth + spare <= choice.usable else replace(choice, mode="recompute")
