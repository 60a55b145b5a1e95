"""`--kv-mode auto` decides from the memory the process can use (free, reserved but unused, the
replaced video) against the memory plan's peak, on a stand-in for the CUDA memory calls."""

from __future__ import annotations

import pytest
import torch

from lvx_app.engine.kv_choice import DeviceMemory, KvChoice, choose_kv_mode
from lvx_app.engine.memory_plan import GB, Workload, memory_plan, param_counts
from lvx_models.mplug_owl3.config import Owl3Config

CUDA = torch.device("cuda", 0)
CONTEXT = int(0.6 * GB)  # the CUDA context, outside PyTorch's reserve


@pytest.fixture(scope="module")
def seven_b():
    cfg = Owl3Config()
    return cfg, param_counts(cfg)


def _card(total_gb: float, allocated: int, spare: int = 2 * 10**9):
    """A stand-in for `cuda_memory`: `allocated` live, `spare` more reserved, the rest free."""
    total = int(total_gb * GB)
    reserved = allocated + spare
    memory = DeviceMemory(total - reserved - CONTEXT, total, reserved, allocated)
    return lambda device: memory


def _held_at_choice(cfg, counts, minutes: float) -> int:
    """What a rank holds when the choice is made: the weights and this video's features."""
    plan = memory_plan(cfg, Workload(minutes=minutes, kv_mode="recompute"), counts)
    return plan.resident["weights"] + plan.resident["features E"]


def test_an_hour_on_an_80_gb_card_is_cached(seven_b):
    cfg, counts = seven_b
    held = _held_at_choice(cfg, counts, 60)
    choice = choose_kv_mode(
        "auto", cfg, 3600, 1, 2, CUDA, counts=counts, read_memory=_card(80, held)
    )
    assert choice.mode == "cache", choice.line()
    assert 56 * GB < choice.plan_peak < 57 * GB  # the plan's 56.6 GB


def test_an_hour_replacing_an_hour_on_an_80_gb_card_is_cached(seven_b):
    """The K/V and text cache of the video being replaced are counted as freed: they are."""
    cfg, counts = seven_b
    cached = memory_plan(cfg, Workload(minutes=60, kv_mode="cache"), counts)
    old = cached.resident["visual K/V"] + cached.resident["text K/V"]
    held = _held_at_choice(cfg, counts, 60) + old
    card = _card(80, held)
    choice = choose_kv_mode(
        "auto", cfg, 3600, 1, 2, CUDA, replaced=old, counts=counts, read_memory=card
    )
    assert choice.mode == "cache", choice.line()
    free = card(CUDA).free
    assert 21.5 * GB > 0.5 * free  # half the free memory alone, as a rule, would recompute
    again = choose_kv_mode("auto", cfg, 3600, 1, 2, CUDA, counts=counts, read_memory=card)
    assert choice.usable - again.usable == old


def test_a_quarter_hour_on_a_24_gb_card_is_recomputed(seven_b):
    cfg, counts = seven_b
    held = _held_at_choice(cfg, counts, 15)
    card = _card(24, held, spare=int(0.3 * GB))
    choice = choose_kv_mode("auto", cfg, 900, 1, 2, CUDA, counts=counts, read_memory=card)
    assert choice.mode == "recompute", choice.line()
    figures = choice.as_dict()
    assert figures["mode"] == "recompute" and figures["how"] == "auto"
    assert figures["usable GB"] < figures["planned growth GB"]
    assert "reserved unused GB" in figures and "replaced video GB" in figures


def test_reserved_but_unused_memory_counts(seven_b):
    """The same card with the spare held in PyTorch's reserve instead of free: the same choice."""
    cfg, counts = seven_b
    held = _held_at_choice(cfg, counts, 60)
    total = int(80 * GB)
    in_reserve = DeviceMemory(
        free=int(5 * GB), total=total, reserved=total - int(5 * GB) - CONTEXT, allocated=held
    )
    choice = choose_kv_mode(
        "auto", cfg, 3600, 1, 2, CUDA, counts=counts, read_memory=lambda d: in_reserve
    )
    assert choice.mode == "cache", choice.line()


def test_asked_modes_and_the_cpu_need_no_memory_reading(seven_b):
    cfg, counts = seven_b

    def no_reading(device):
        raise AssertionError("read the GPU's memory")

    for asked in ("cache", "recompute"):
        choice = choose_kv_mode(asked, cfg, 3600, 1, 2, CUDA, read_memory=no_reading)
        assert choice == KvChoice(asked, "asked")
    on_cpu = choose_kv_mode("auto", cfg, 3600, 1, 4, torch.device("cpu"), read_memory=no_reading)
    assert on_cpu.mode == "cache" and "not a GPU" in on_cpu.as_dict()["why"]


def test_auto_keeps_the_headroom_a_gpu_needs_beyond_the_plan(seven_b):
    """The choice keeps the allocator's reserve over the plan's tensors, the libraries' workspaces
    and a margin free (`memory_plan.headroom`): a card whose usable memory holds the plan's growth
    but not that headroom recomputes; with the headroom it caches. An 80 GB card recomputes an
    hour and a half."""
    from lvx_app.engine.memory_plan import headroom

    cfg, counts = seven_b
    held = _held_at_choice(cfg, counts, 60)
    total = int(80 * GB)
    plan = memory_plan(cfg, Workload(minutes=60), counts)
    growth = plan.peak - held
    for usable, mode in ((growth + headroom(plan.peak) - 1, "recompute"),
                         (growth + headroom(plan.peak), "cache")):  # fmt: skip
        memory = DeviceMemory(usable, total, held, held)
        choice = choose_kv_mode("auto", cfg, 3600, 1, 2, CUDA, counts=counts,
                                read_memory=lambda d, m=memory: m)  # fmt: skip
        assert choice.mode == mode and choice.as_dict()["headroom GB"] > 6, choice.line()
    long = choose_kv_mode("auto", cfg, 90 * 60, 1, 2, CUDA, counts=counts,
                          read_memory=_card(80, _held_at_choice(cfg, counts, 90)))  # fmt: skip
    assert long.mode == "recompute" and "GB headroom" in long.line(), long.line()
