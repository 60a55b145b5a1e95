"""Whether a worker group fits the machine, asked before any rank starts: every rank is a process
with its own copy of the model (and, on CPU, its weights in host memory), so a group too large for
the memory is refused in one line with the number of ranks that fits, instead of the kernel's
out-of-memory killer taking the group, the server, or whatever else runs.

The figures are what one rank measured on CPU with the tiny checkpoint: the rank process about
155 MiB unshared, its decode forkserver about 150 MiB, its resource tracker and a decode worker
about 15 MiB; the torchrun agent of a group about 150 MiB. The model's weights come on top, once per
rank, in the dtype the ranks load them in, sized as the memory plan sizes them
(`memory_plan.weight_bytes`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from lvx_app.devices import default_dtype, resolve_dtype
from lvx_app.engine.memory_plan import weight_bytes
from lvx_app.engine.records import EngineError
from lvx_app.parallel.world import World
from lvx_models.api import family_of, weight_shapes

GiB = 2**30
RANK_BYTES = 330 * 2**20  # one rank without its weights: its process, decoder and helpers
GROUP_BYTES = 150 * 2**20  # the torchrun agent of a group
HEADROOM = 0.1  # of the available memory left to the rest of the machine (1 GiB at least)


def usable(available: int) -> int:
    """What a group may take of `available` bytes: the rest stays for the system and the
    processes already running, which the kernel would otherwise kill."""
    return available - max(GiB, int(available * HEADROOM))


def available_memory_bytes() -> int:
    """Memory this machine can still give without swapping: MemAvailable, or less under a cgroup's
    limit."""
    available = _meminfo_available()
    limit = _cgroup_room()
    return min(available, limit) if limit is not None else available


def _meminfo_available() -> int:
    with open("/proc/meminfo", encoding="ascii") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise OSError("no MemAvailable in /proc/meminfo")


def _cgroup_room() -> int | None:
    """What this process's cgroup (v2) may still take, when it has a limit."""
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit == "max":
            return None
        used = int(Path("/sys/fs/cgroup/memory.current").read_text())
        return max(0, int(limit) - used)
    except (OSError, ValueError):
        return None


def weight_elements(model_path: str) -> int:
    """The checkpoint's parameters (the shapes of the files its family loads, `weight_files`:
    headers, no weights read); 0 for a hub id that is not downloaded yet (then only the ranks
    themselves are counted)."""
    folder = Path(model_path).expanduser()
    if not folder.is_dir():
        return 0
    try:
        files = family_of(folder).weight_files(folder)
        return sum(math.prod(shape) for shape in weight_shapes(files).values())
    except Exception:  # noqa: BLE001 - the load says what is wrong with a broken checkpoint
        return 0


@dataclass(frozen=True)
class GroupNeeds:
    """What one group asks of the machine."""

    ranks: int
    weight_bytes: int  # one copy of the model, in the ranks' dtype

    def host_bytes(self, cuda: bool) -> int:
        """Host memory of the whole group: CPU ranks keep their weights there, GPU ranks on
        their GPU."""
        per_rank = RANK_BYTES + (0 if cuda else self.weight_bytes)
        return GROUP_BYTES * (self.ranks > 1) + self.ranks * per_rank

    def ranks_that_fit(self, available: int, cuda: bool) -> int:
        per_rank = RANK_BYTES + (0 if cuda else self.weight_bytes)
        return max(0, (usable(available) - GROUP_BYTES) // per_rank)


def check_group_fits(
    needs: GroupNeeds, cuda: bool, available: int, gpu_free: list[int] | None = None
) -> None:
    """Refuse (EngineError, one line) a group whose ranks do not fit `available` host memory, or
    whose model does not fit the free memory of one of its GPUs (`gpu_free`, bytes per GPU)."""
    if needs.ranks > 1 and needs.host_bytes(cuda) > usable(available):
        fit = needs.ranks_that_fit(available, cuda)
        each = RANK_BYTES + (0 if cuda else needs.weight_bytes)
        kind = "GPU" if cuda else "CPU"
        advice = (
            f"use --{'gpus' if cuda else 'ranks'} {fit} or fewer"
            if fit > 1
            else "use one rank (--ranks 1), or free memory"
        )
        raise EngineError(
            f"{needs.ranks} {kind} ranks need about {needs.host_bytes(cuda) / GiB:.1f} GiB of "
            f"memory ({each / GiB:.2f} GiB each) but {available / GiB:.1f} GiB is available, "
            f"{usable(available) / GiB:.1f} GiB of it for lvx: {advice}"
        )
    for index, free in enumerate(gpu_free or []):
        if needs.weight_bytes > free:
            raise EngineError(
                f"the model's weights take {needs.weight_bytes / GiB:.1f} GiB on every GPU but GPU "
                f"{index} has {free / GiB:.1f} GiB free: free it, or choose GPUs with room "
                "(CUDA_VISIBLE_DEVICES)"
            )


def group_needs(model_path: str, dtype_name: str, world: World) -> GroupNeeds:
    """What `world`'s ranks will take for the checkpoint at `model_path` in `dtype_name`."""
    device = "cuda" if world.cuda else "cpu"
    try:
        dtype = resolve_dtype(dtype_name, device, ("float32", "bfloat16", "float16"))
    except ValueError:
        dtype = default_dtype(device)  # the ranks say what is wrong with it
    return GroupNeeds(world.ranks, weight_bytes(weight_elements(model_path), dtype.itemsize))


def refuse_what_does_not_fit(model_path: str, dtype_name: str, world: World) -> None:
    """`check_group_fits` on this machine: its available memory and its GPUs' free memory."""
    needs = group_needs(model_path, dtype_name, world)
    gpu_free = gpu_free_bytes(world.gpus) if world.cuda else None
    check_group_fits(needs, world.cuda, available_memory_bytes(), gpu_free)


def gpu_free_bytes(gpus: int) -> list[int] | None:
    """Free memory of GPUs 0..gpus-1 as the driver (NVML) reports it, without making a CUDA
    context in this process on each of them; None where NVML cannot be asked (then each rank's
    own out-of-memory line says it)."""
    try:
        return [
            torch.cuda.get_device_properties(i).total_memory - torch.cuda.device_memory_used(i)
            for i in range(gpus)
        ]
    except Exception:  # noqa: BLE001 - no NVML (pynvml) here: the check is skipped
        return None
