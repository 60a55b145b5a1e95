"""The memory and time plan (scripts/memory_plan.py): parameter counts from the meta device equal a
real model's, the terms scale as the tensors they name, the largest-video search is tight, and the
formula agrees with the measured peak RSS of the model code on this CPU within 15%
(scripts/plan_gpu.py --check-rss)."""

from __future__ import annotations

import sys
from dataclasses import replace

import pytest

from lvx_models.mplug_owl3.config import Owl3Config
from lvx_models.mplug_owl3.modeling import Owl3Model
from lvx_models.mplug_owl3.tiny import tiny_config
from scripts import plan_gpu
from scripts.memory_plan import (
    GB,
    Workload,
    kernel_calls,
    largest_minutes,
    memory_plan,
    param_counts,
    time_plan,
)


def test_meta_counts_equal_a_real_model() -> None:
    cfg = tiny_config("g2")
    model = Owl3Model(cfg)
    counts = param_counts(cfg)
    real = sum(p.numel() for p in model.parameters()) + sum(b.numel() for b in model.buffers())
    assert counts.total == real
    assert counts.language == sum(p.numel() for p in model.language_model.parameters())
    assert counts.vision == sum(p.numel() for p in model.vision_model.parameters())


def test_7b_terms_are_the_tensor_sizes() -> None:
    cfg = Owl3Config()
    counts = param_counts(cfg)
    hour = memory_plan(cfg, Workload(minutes=60, kv_mode="recompute"), counts)
    assert hour.resident["weights"] == 2 * counts.total
    # DESIGN: an hour of bf16 features is ~18.8 GB
    assert hour.resident["features E"] == 3600 * 729 * 3584 * 2
    cached = memory_plan(cfg, Workload(minutes=60, kv_mode="cache"), counts)
    # 4 hyper layers; K and V, (tokens, 4*128) each, in buffers of their own
    assert cached.resident["visual K/V"] == 4 * 3600 * 729 * 2 * 4 * 128 * 2
    eight = memory_plan(cfg, Workload(minutes=60, kv_mode="cache", ranks=8), counts)
    assert eight.resident["visual K/V"] == cached.resident["visual K/V"] // 8
    assert eight.peak < cached.peak and cached.peak == max(cached.stages.values())


def test_largest_video_is_tight() -> None:
    cfg = Owl3Config()
    counts = param_counts(cfg)
    budget = 78 * 2**30
    for mode in ("cache", "recompute"):
        work = Workload(minutes=1, kv_mode=mode)
        minutes = largest_minutes(cfg, work, budget, counts)
        assert 0 < minutes < 180
        assert memory_plan(cfg, replace(work, minutes=minutes), counts).peak <= budget
        assert memory_plan(cfg, replace(work, minutes=minutes + 1 / 60), counts).peak > budget


def test_time_plan_decode_reads_weights_and_keys() -> None:
    cfg = Owl3Config()
    counts = param_counts(cfg)
    one = time_plan(cfg, Workload(minutes=60), counts=counts)
    weights = (counts.language - counts.embedding) * 2
    visual = 4 * 3600 * 729 * 2 * 4 * 128 * 2
    # every layer's text K/V of the prompt and the question
    text = 28 * (18 + 5 * 3600 + 24) * 2 * 4 * 128 * 2
    assert one["decode step"]["hbm_gb"] == pytest.approx((weights + visual + text) / GB, rel=1e-6)
    eight = time_plan(cfg, Workload(minutes=60, ranks=8), counts=counts)
    # weights replicated
    assert eight["decode step"]["hbm_gb"] == pytest.approx(
        (weights + (visual + text) / 8) / GB, rel=1e-6
    )
    for key in (
        "matmul_tflop",
        "attention_tflop",
    ):  # the prompt's work splits over the ranks, the weight reads do not
        assert eight["video-prompt prefill"][key] == pytest.approx(
            one["video-prompt prefill"][key] / 8
        )
    assert (
        eight["video-prompt prefill"]["hbm_gb"]
        == one["video-prompt prefill"]["hbm_gb"]
        == pytest.approx(weights / GB)
    )
    recompute = time_plan(cfg, Workload(minutes=60, kv_mode="recompute"), counts=counts)
    # every token recomputes 4 layers' K/V from E
    assert recompute["tokens/s"] < one["tokens/s"] / 5


@pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="reads /proc and glibc's malloc settings"
)
@pytest.mark.slow
def test_formula_matches_measured_peak_rss_on_cpu() -> None:
    for row in plan_gpu.check_rss():
        assert abs(row["error"]) <= plan_gpu.RSS_TOLERANCE, row


@pytest.mark.parametrize(
    "prompt,question,answer,room", [(300, 24, 10, 256), (40, 24, 30, 4), (160, 30, 2, 4)]
)
def test_planned_text_buffer_is_the_one_the_cache_grows(
    monkeypatch, prompt, question, answer, room
) -> None:
    """The plan's text K/V buffer follows `_LayerKV`: a real cache fed a prompt, a question, then
    one token at a time ends with the buffer the plan names (with the growth before it)."""
    import torch

    from lvx_models.mplug_owl3 import qwen2
    from scripts.memory_plan import _text_buffer

    monkeypatch.setattr(qwen2, "MIN_KV_ROOM", room)
    model = Owl3Model(tiny_config("g2")).eval()
    cache = model.new_cache()
    lengths = []
    with torch.no_grad():
        for start, n in [(0, prompt), (prompt, question)] + [
            (prompt + question + i, 1) for i in range(answer)
        ]:
            model(
                torch.zeros(1, n, dtype=torch.int64),
                cache=cache,
                positions=torch.arange(start, start + n)[None],
            )
            if not lengths or lengths[-1] != cache.layers[0].k.shape[1]:
                lengths.append(cache.layers[0].k.shape[1])
    assert _text_buffer(prompt, question, answer) == (
        lengths[-1],
        lengths[-2] if len(lengths) > 1 else 0,
    )


def test_kernel_calls_per_layer_at_an_hour_on_8_ranks_from_the_plan() -> None:
    """7B, one hour at 1 fps on 8 ranks (zigzag), counted by the attention's own planner: a text
    layer's ring is one call per round (the rank's own tokens are one causal square, each other
    block sees all or none of its keys), a hyper layer's a few band tiles a round; a decoded token
    is one call per layer."""
    calls = kernel_calls(Owl3Config(), Workload(minutes=60, ranks=8), rank=3)
    assert (calls.prefill_text, calls.prefill_text_masked) == (8, 0)
    assert calls.prefill_visual <= 48 and calls.prefill_visual_masked <= 20, calls
    assert (calls.decode_text, calls.decode_visual) == (1, 1)
