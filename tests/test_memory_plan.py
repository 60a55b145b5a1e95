"""The memory and time plan (scripts/memory_plan.py): parameter counts from the meta device equal a
real model's, the terms scale as the tensors they name, the largest-video search is tight, and the
formula agrees with the measured peak RSS of the model code on this CPU within 15%
(scripts/plan_gpu.py --check-rss)."""

from __future__ import annotations

import json
import sys
from dataclasses import replace

import pytest

from lvx_app.engine.memory_plan import band_tiles
from lvx_models.mplug_owl3.config import Owl3Config
from lvx_models.mplug_owl3.modeling import Owl3Model
from lvx_models.mplug_owl3.tiny import tiny_config
from scripts import plan_gpu
from scripts.memory_plan import (
    GB,
    Rates,
    Workload,
    kernel_calls,
    largest_minutes,
    largest_video,
    memory_plan,
    param_counts,
    planned_masked_share,
    positions_minutes,
    time_plan,
    visual_masked_share,
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

    from lvx_app.engine.memory_plan import _text_buffer
    from lvx_models import steps as kv_room

    monkeypatch.setattr(kv_room, "MIN_KV_ROOM", room)
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


def test_the_plans_attention_runs_on_the_kernels_the_backend_choice_picks(monkeypatch) -> None:
    """bf16 on a GPU the automatic choice takes flash (flash-attn or aten's) for a call without a
    mask and the memory-efficient kernel for one with a mask, never cuDNN: the time plan's
    attention runs at those rates, the video prompt's masked band at the second."""
    import torch

    from lvx_kernels import backends

    monkeypatch.setattr(backends, "_on_cuda", lambda q: True)
    q = torch.empty(1, 1, 4, 128, dtype=torch.bfloat16)
    for installed in (None, object()):
        monkeypatch.setattr(backends, "_flash_attn", lambda: installed)
        assert backends.choose_backend(None, q, False, 128) in ("flash", "flash_attn")
        assert backends.choose_backend(None, q, True, 128) == "efficient"
    cfg, rates = Owl3Config(), Rates(flash_flops=300e12, efficient_flops=100e12)
    work = Workload(minutes=10)
    prefill = time_plan(cfg, work, rates)["video-prompt prefill"]
    at, masked = (prefill[k] * 1e12 for k in ("attention_tflop", "masked_attention_tflop"))
    assert 0 < masked < at / 10
    seconds = (
        prefill["matmul_tflop"] * 1e12 / rates.matmul_flops
        + (at - masked) / rates.flash_flops
        + masked / rates.efficient_flops
        + prefill["hbm_gb"] * GB / rates.hbm_bytes
    )
    assert prefill["seconds"] == pytest.approx(seconds, rel=1e-9)
    question = time_plan(cfg, work, rates)["question prefill (TTFT)"]
    assert question["masked_attention_tflop"] == 0  # a question sees every frame


@pytest.mark.parametrize("ranks", [1, 8])
def test_the_masked_share_is_the_planners(ranks) -> None:
    """The time plan's closed form of the masked band's share against the attention's own tile
    planner, on the busiest and the last rank."""
    cfg, work = Owl3Config(), Workload(minutes=10, ranks=ranks)
    share = visual_masked_share(cfg, work)
    for rank in (0, ranks - 1):
        assert planned_masked_share(cfg, work, rank) == pytest.approx(share, rel=0.12)


def test_the_largest_video_is_set_by_memory_or_by_the_models_positions() -> None:
    """7B at 1 fps on one 78 GiB GPU: resident K/V run out of memory first; recomputed K/V would
    fit longer than the 32,768 trained positions hold, and lvx refuses one frame more with the
    line its load says."""
    from lvx_app.engine.limits import TURN_ROOM, video_prompt_too_long

    cfg = Owl3Config()
    counts = param_counts(cfg)
    budget = 78 * 2**30
    cache = largest_video(cfg, Workload(minutes=1, kv_mode="cache"), budget, counts)
    recompute = largest_video(cfg, Workload(minutes=1, kv_mode="recompute"), budget, counts)
    assert cache["set by"] == "memory" and cache["largest min"] == cache["memory limit min"]
    assert "ran out of GPU memory" in cache["past it lvx says"]
    assert recompute["set by"] == "positions"
    assert recompute["memory limit min"] > recompute["positions limit min"]
    frames = round(positions_minutes(cfg) * 60)
    assert 18 + 5 * frames + TURN_ROOM <= cfg.max_position_embeddings
    assert 18 + 5 * (frames + 1) + TURN_ROOM > cfg.max_position_embeddings
    one_more = Workload(minutes=(frames + 1) / 60)
    line = video_prompt_too_long(one_more.prompt_tokens, frames + 1, 32_768, frames)
    assert recompute["past it lvx says"] == line
    assert positions_minutes(cfg, fps=2) == pytest.approx(positions_minutes(cfg) / 2, abs=1 / 60)


@pytest.mark.parametrize("markdown", [False, True], ids=["terminal", "markdown"])
def test_plan_gpu_prints_every_table_and_writes_its_json(tmp_path, capsys, markdown) -> None:
    """`python3 scripts/plan_gpu.py` as docs/gpu.md gives it: every table in the terminal (or as
    Markdown), the same figures as JSON."""
    argv = ["--json", str(tmp_path / "plan.json"), *(["--markdown"] if markdown else [])]
    plan_gpu.main(argv)
    printed = capsys.readouterr().out
    for title in ("projected memory per rank", "projected largest video", "projected times"):
        assert title in printed
    assert ("| minutes |" in printed) == markdown
    data = json.loads((tmp_path / "plan.json").read_text())
    assert {"memory", "largest", "times_60min", "kernel_calls_60min"} <= set(data)


class _CrossHeads:
    """mPLUG-Owl3 7B's sizes with cross layers of their own head geometry: 8 K/V heads of 96
    beside the text layers' 4 of 128."""

    cross_kv_heads, cross_head_dim = 8, 96

    def __init__(self, base: Owl3Config):
        self.base = base

    def __getattr__(self, name: str):
        return getattr(self.base, name)


def test_visual_kv_is_sized_by_the_cross_layers_own_heads() -> None:
    from lvx_models.surface import ModelConfig, protocol_gaps

    base = Owl3Config()
    cfg = _CrossHeads(base)
    assert not protocol_gaps(cfg, ModelConfig)
    counts = param_counts(base)
    work = Workload(minutes=10)
    plan, same = memory_plan(cfg, work, counts), memory_plan(base, work, counts)
    tokens = work.frames * 729
    # 4 hyper layers; K and V, (tokens, 8*96) each, bf16
    assert plan.resident["visual K/V"] == 4 * tokens * 2 * 8 * 96 * 2
    assert same.resident["visual K/V"] == 4 * tokens * 2 * 4 * 128 * 2
    # the text K/V keep the text layers' 4 heads of 128
    assert plan.resident["text K/V"] == same.resident["text K/V"]
    assert plan.resident["text K/V"] % (cfg.text_kv_layers * 2 * 4 * 128 * 2) == 0
    assert plan.stages["visual K/V"] > same.stages["visual K/V"]


class _OwnCrossGeometry(_CrossHeads):
    """mPLUG-Owl3 7B's sizes with cross layers as OpenFlamingo's: 8 query heads on 8 K/V heads of
    64, made from visual features 1,024 wide (the text layers keep 28 query / 4 K/V heads of 128,
    width 3,584)."""

    cross_attention_heads, cross_kv_heads, cross_head_dim = 8, 8, 64
    visual_feature_size = 1024


def test_the_cross_layers_queries_and_features_are_sized_by_their_own_geometry() -> None:
    from lvx_models.surface import ModelConfig, protocol_gaps

    base = Owl3Config()
    cfg = _OwnCrossGeometry(base)
    assert not protocol_gaps(cfg, ModelConfig)
    counts = param_counts(base)
    work = Workload(minutes=10, kv_mode="recompute")
    plan, same = memory_plan(cfg, work, counts), memory_plan(base, work, counts)
    assert plan.resident["features E"] == work.frames * 729 * 1024 * 2
    assert same.resident["features E"] == work.frames * 729 * 3584 * 2
    # a token packs one row per query head of a K/V head: 1 here, 7 in the 7B's own layers
    ours, its = band_tiles(cfg, 2000, 40 * 729), band_tiles(base, 2000, 40 * 729)
    assert [k for _, k in ours] == [k for _, k in its]
    assert [7 * r for r, _ in ours] == [r for r, _ in its]
    assert plan.stages["video prefill"] < same.stages["video prefill"]
