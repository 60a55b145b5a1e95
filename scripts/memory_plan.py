"""Memory and time plan of one chat session on a long video, from the model's real shapes (all
figures projected).

The memory terms are the engine's own plan (`lvx_app/engine/memory_plan.py`, which `--kv-mode auto`
reads); this module adds the time plan, the largest-video search and the kernel-call tally.

Times are FLOPs / measured H100 rates (bf16 matmul, cuDNN attention with lse) plus bytes read / HBM
bandwidth, added without overlap; communication and CPU video decoding are not in them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from lvx_app.defaults import DEFAULT_LAYOUT
from lvx_app.engine.limits import frames_that_fit, video_prompt_too_long
from lvx_app.engine.memory_plan import (
    GB,
    RESIDENT,
    ParamCounts,
    Workload,
    memory_plan,
    param_counts,
    visual_masked_share,
)
from lvx_app.parallel.layout import owned, rank_tokens
from lvx_kernels.masks import Indices, TilePlan, min_tile, pack_vis, tile_plans
from lvx_models.api import ModelConfig


@dataclass(frozen=True)
class Rates:
    """H100 rates the projections use: FLOP/s and bytes/s, attention per kernel that the automatic
    backend choice picks (`backends.choose_backend`, bf16 on CUDA): flash (flash-attn, else aten's
    flash) for every call without a mask, the memory-efficient kernel for a call with one. cuDNN
    is never picked automatically, so its rate is not used. Flash's is FlashAttention-2's forward on
    an H100 (about 35% of its 989 dense bf16 TFLOP/s, as the FlashAttention-3 paper reports); the
    memory-efficient kernel's is taken as half of it, unmeasured: `scripts/gpu_acceptance.py`
    measures both (`kernels_7b.json`)."""

    matmul_flops: float = 780e12
    flash_flops: float = 350e12
    efficient_flops: float = 175e12
    hbm_bytes: float = 3e12
    # copies from pageable host memory to the GPU (the header features), unmeasured: about 40%
    # of PCIe Gen5 x16's 64 GB/s
    host_bytes: float = 25e9


def largest_minutes(
    config: ModelConfig, work: Workload, budget_bytes: float, counts: ParamCounts | None = None
) -> float:
    """The longest video (minutes, whole frames at `work.fps`) whose planned peak fits
    `budget_bytes` per rank."""
    counts, work = counts or param_counts(config), work.for_model(config)

    def fits(frames: int) -> bool:
        return (
            memory_plan(config, replace(work, minutes=frames / 60 / work.fps), counts).peak
            <= budget_bytes
        )

    if not fits(1):
        return 0.0
    lo, hi = 1, 2
    while fits(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo / 60 / work.fps


def positions_minutes(config: ModelConfig, fps: float = 1.0) -> float:
    """The longest video (minutes, whole frames at `fps`) whose prompt leaves room for a question in
    the positions the model was trained on (`max_position_embeddings`): each frame costs its
    placeholder's positions, its visual tokens none. lvx refuses a longer one at load."""
    context, per = int(config.max_position_embeddings), config.prompt_positions_per_frame
    return frames_that_fit(context, config.prompt_header_tokens, 0, per) / 60 / fps


def largest_video(
    config: ModelConfig, work: Workload, budget_bytes: float, counts: ParamCounts | None = None
) -> dict:
    """The largest video `work`'s mode takes at `work.fps` on a rank of `budget_bytes`: the memory
    limit, the positions limit, the smaller, and the line lvx says one frame past it."""
    work = work.for_model(config)
    memory = largest_minutes(config, work, budget_bytes, counts)
    positions = positions_minutes(config, work.fps)
    if positions <= memory:
        frames = round(positions * 60 * work.fps)
        context = int(config.max_position_embeddings)
        longer = replace(work, minutes=(frames + 1) / 60 / work.fps)
        said = video_prompt_too_long(longer.prompt_tokens, longer.frames, context, frames)
        return _largest_row(work, memory, positions, "positions", said)
    stage = memory_plan(config, replace(work, minutes=memory + 1 / 60 / work.fps), counts)
    said = (
        f"rank 0 ran out of GPU memory while {STAGE_WORDS.get(stage.peak_stage, stage.peak_stage)}"
        " (...); use more GPUs (--gpus), a lower --fps or --max-frames, or --kv-mode recompute"
    )
    return _largest_row(work, memory, positions, "memory", said)


# a memory plan's stage as the engine's out-of-memory line names it (`video_context.oom_message`)
STAGE_WORDS = {
    "encode": "encoding frames",
    "visual K/V": "making the visual K/V",
    "video prefill": "reading the prompt",
    "question": "reading the question",
    "decode": "answering",
}


def _largest_row(work: Workload, memory: float, positions: float, by: str, said: str) -> dict:
    return {
        "kv mode": work.kv_mode,
        "memory limit min": round(memory, 1),
        "positions limit min": round(positions, 1),
        "largest min": round(min(memory, positions), 1),
        "set by": by,
        "past it lvx says": said,
    }


def time_plan(
    config: ModelConfig,
    work: Workload,
    rates: Rates = Rates(),
    counts: ParamCounts | None = None,
    masked_share: float | None = None,
) -> dict:
    # long: one line per stage, in the order they run
    """Projected FLOPs, bytes and seconds per stage on each rank for `work` (the work is split
    evenly over the ranks, the weights are not: every forward reads all of them on every rank).
    Matmul, attention and memory times add up (no overlap assumed); communication is not counted.
    Attention runs at the rate of the kernel the backend choice picks (`Rates`); `masked_share`:
    the video prompt's visual attention in masked tiles (default: `visual_masked_share`)."""
    cfg, b, n, work = config, work.dtype_bytes, work.ranks, work.for_model(config)
    counts = counts or param_counts(cfg)
    t = cfg.visual_tokens_per_frame
    hq, d, layers, n_hyper = (
        cfg.num_attention_heads,
        cfg.head_dim,
        cfg.text_kv_layers,  # the layers with text attention
        len(cfg.cross_layer_indices),
    )
    kv_cols = 2 * cfg.num_key_value_heads * d
    # a cross layer's own geometry: its query width and its visual K/V columns
    xq = cfg.cross_attention_heads * cfg.cross_head_dim
    x_cols = 2 * cfg.cross_kv_heads * cfg.cross_head_dim
    s_kv, prompt, q = work.frames * t, work.prompt_tokens, work.question_tokens
    # every non-embedding parameter is one multiply-add per token
    lm_matmul = counts.language - counts.embedding
    tower = cfg.vision_tokens_per_frame  # what the tower runs a frame as (empty tiles included)
    # the header features (every tile of a Llama-3.2-Vision frame) go through the projector too
    hdr, header = cfg.header_visual_tokens_per_frame, work.header_tokens
    vision_frame = (
        2 * counts.vision * tower
        + 2 * counts.projector * max(t, hdr)
        + 4 * tower * tower * cfg.vision_hidden_size * cfg.vision_layers
    )
    # v_kv_proj over every visual token, all hyper layers
    make_kv = 2 * s_kv * cfg.visual_feature_size * x_cols * n_hyper

    def prefill(rows: int, before: int) -> tuple[float, float]:
        """(matmul, attention) FLOPs of `rows` new tokens after `before` cached ones."""
        text = 4 * hq * d * layers * (rows * before + rows * rows / 2)
        # the video prompt's rows see a growing prefix of frames
        seen = s_kv * rows if before else s_kv * rows / 2
        return 2 * lm_matmul * rows, text + 4 * xq * n_hyper * seen

    recompute = make_kv if work.kv_mode == "recompute" else 0
    if masked_share is None:
        masked_share = visual_masked_share(cfg, work)
    p_mm, p_at = prefill(prompt, 0)
    # the video prompt's visual attention in masked tiles (the frames' band) runs on the
    # memory-efficient kernel; all else on flash (text: causal squares and whole blocks)
    p_masked = 4 * xq * n_hyper * s_kv * prompt / 2 * masked_share
    q_mm, q_at = prefill(q, prompt)
    # a decode step: every rank runs the same one-token step on its replicated weights and its share
    # of the keys
    decode_bytes = (
        lm_matmul * b + (n_hyper * s_kv * x_cols * b + layers * (prompt + q) * kv_cols * b) / n
    )
    if work.kv_mode == "recompute":
        decode_bytes += s_kv * cfg.visual_feature_size * b * n_hyper / n  # E once per hyper layer
    # (matmul, attention, of it on the memory-efficient kernel, bytes read) FLOPs and bytes
    # the rows before the first frame: K/V of every frame's header features (the keys beyond its
    # own) in every hyper layer, those rows' attention to all of a frame's keys, their layers on
    # every rank; the header features are read from the host once per hyper layer
    s_hdr, s_extra = work.frames * hdr, work.frames * max(0, hdr - t)
    header_prefill = (
        (2 * s_extra * cfg.hidden_size * kv_cols * n_hyper + recompute) / n
        + 2 * lm_matmul * header,
        4 * hq * d * (n_hyper * s_hdr / n + layers * header * header / 2),
        0.0,
        lm_matmul * b,
    )
    host_read = s_extra * cfg.hidden_size * b * n_hyper / n
    stages = {
        "ingest (vision tower + projector)": (vision_frame * work.frames / n, 0.0, 0.0, 0.0),
        "visual K/V": ((make_kv if work.kv_mode == "cache" else 0) / n, 0.0, 0.0, 0.0),
        **({"header prefill": header_prefill} if hdr else {}),
        "video-prompt prefill": (
            (p_mm + recompute) / n,
            p_at / n,
            p_masked / n,
            lm_matmul * b,
        ),  # every forward reads the weights
        # a question and a decoded token see every frame: no mask, flash
        "question prefill (TTFT)": ((q_mm + recompute) / n, q_at / n, 0.0, lm_matmul * b),
        "decode step": (
            2 * lm_matmul + recompute / n,
            4 * (xq * n_hyper * s_kv + hq * d * layers * (prompt + q)) / n,
            0.0,
            decode_bytes,
        ),
    }
    out = {}
    for name, (mm, at, masked, by) in stages.items():
        seconds = (
            mm / rates.matmul_flops
            + (at - masked) / rates.flash_flops
            + masked / rates.efficient_flops
            + by / rates.hbm_bytes
        )
        out[name] = {
            "matmul_tflop": mm / 1e12,
            "attention_tflop": at / 1e12,
            "masked_attention_tflop": masked / 1e12,
            "hbm_gb": by / GB,
            "seconds": seconds,
        }
        if name == "header prefill":  # the header features come from the host
            out[name]["host_gb"] = host_read / GB
            out[name]["seconds"] += host_read / rates.host_bytes
    out["tokens/s"] = 1.0 / out["decode step"]["seconds"]
    return out


def plan_rows(
    config: ModelConfig, minutes: list[float], ranks: list[int], modes: list[str]
) -> list[dict]:
    """One row per (minutes, ranks, mode): per-rank resident GB by tensor and planned peak GB (all
    projected)."""
    counts = param_counts(config)
    rows = []
    for m in minutes:
        for n in ranks:
            for mode in modes:
                plan = memory_plan(config, Workload(minutes=m, ranks=n, kv_mode=mode), counts)
                rows.append(
                    {
                        "minutes": m,
                        "ranks": n,
                        "kv mode": mode,
                        **{f"{k} GB": round(plan.resident.get(k, 0) / GB, 1) for k in RESIDENT},
                        "peak GB": round(plan.peak / GB, 1),
                        "peak stage": plan.peak_stage,
                    }
                )
    return rows


# --------------------------------------------------------------------------------------------------
# kernel calls, from the attention's own tile planner
# --------------------------------------------------------------------------------------------------


def _planned(
    cfg: ModelConfig, q_vis: torch.Tensor, k_frame: torch.Tensor, tile: int, cross: bool = False
) -> list:
    """`masks.tile_plans` of one query block (its tokens' q_vis) against one key shard (its
    k_frame), on meta tensors with host copies: what a GPU kernel call of this shape would run;
    `cross`: in a cross layer's head geometry, else the text layers'."""
    g, h, d = cfg.num_kv_groups, cfg.num_key_value_heads, cfg.head_dim
    if cross:
        h, d = cfg.cross_kv_heads, cfg.cross_head_dim
        g = cfg.cross_attention_heads // h
    q = torch.empty(1, q_vis.numel() * g, h, d, device="meta")
    k = torch.empty(1, k_frame.numel(), h, d, device="meta")

    def on_meta(t: torch.Tensor) -> Indices:
        host = t.view(1, -1)
        return Indices(host.to("meta"), values=host)

    plans = tile_plans(q, k, False, pack_vis(on_meta(q_vis), g), on_meta(k_frame), g, tile)
    return list(plans)


def _tally(plans: list[TilePlan]) -> tuple[int, int]:
    """(kernel calls, those with a mask)."""
    return len(plans), sum(p.mask is not None for p in plans)


@dataclass(frozen=True)
class KernelCalls:
    """Attention kernel calls on one rank, counted from the plan of its tiles: per decoder layer's
    text attention and per hyper layer's visual attention in the video-prompt prefill (all ring
    rounds), and per decoded token."""

    prefill_text: int
    prefill_text_masked: int
    prefill_visual: int
    prefill_visual_masked: int
    decode_text: int
    decode_visual: int


def _ring_rounds(config: ModelConfig, work: Workload, rank: int, layout: str):
    """The tile size, and per ring round on `rank` of the video-prompt prefill: (the round's query
    positions, their frames seen under G2, this rank's own positions, its frames' k_frame)."""
    n, p, work = work.ranks, config.visual_tokens_per_frame, work.for_model(config)
    tile = min_tile(work.device)
    starts = work.header_tokens + work.positions_per_frame * torch.arange(work.frames)
    positions = [rank_tokens(work.prompt_tokens, starts, n, r, layout) for r in range(n)]
    frames = torch.tensor(owned(work.frames, n, rank, layout), dtype=torch.int64)
    k_frame = frames.repeat_interleave(p)
    rounds = []
    for t in range(n):
        block = positions[(rank - t) % n]
        seen = torch.searchsorted(starts, block, right=True)  # G2: frames placed at or before
        rounds.append((block, seen, positions[rank], k_frame))
    return tile, rounds


def kernel_calls(
    config: ModelConfig, work: Workload, rank: int, layout: str = DEFAULT_LAYOUT
) -> KernelCalls:
    """Kernel calls per layer on `rank` for `work` (the video prompt sharded in `layout`, frames
    travelling with their placeholders, G2 visibility), planned for `work.device`'s tiles. A ring
    round's query block is another rank's tokens; its keys are this rank's own text tokens (text
    attention: key position < query position + 1) or frames (visual)."""
    cfg, work = config, work.for_model(config)
    tile, rounds = _ring_rounds(cfg, work, rank, layout)
    k_frame = rounds[0][3]
    text = visual = (0, 0)
    for block, seen, own, _ in rounds:
        text = tuple(map(sum, zip(text, _tally(_planned(cfg, block + 1, own, tile)))))
        visual = tuple(map(sum, zip(visual, _tally(_planned(cfg, seen, k_frame, tile, True)))))
    tokens = work.prompt_tokens
    # a decoded token: causal text attention over the whole cache, and every frame visible
    g, h, d = cfg.num_kv_groups, cfg.num_key_value_heads, cfg.head_dim
    one = torch.empty(1, g, h, d, device="meta")
    cache = torch.empty(1, tokens + work.question_tokens + 1, h, d, device="meta")
    decode_text = len(list(tile_plans(one, cache, True, None, None, g)))
    decode_visual = len(_planned(cfg, torch.tensor([work.frames]), k_frame, tile, True))
    return KernelCalls(*text, *visual, decode_text, decode_visual)


def planned_masked_share(
    config: ModelConfig, work: Workload, rank: int = 0, layout: str = DEFAULT_LAYOUT
) -> float:
    """The share of the video prompt's visual attention (query rows x keys) on `rank` that its
    tiles run with a mask, from the attention's own planner (seconds at an hour; the time plan
    takes `visual_masked_share`, its closed form)."""
    tile, rounds = _ring_rounds(config, work, rank, layout)
    area = masked = 0
    for _, seen, _, k_frame in rounds:
        for p in _planned(config, seen, k_frame, tile, True):
            cells = (p.q1 - p.q0) * (p.k1 - p.k0)
            area += cells
            masked += cells if p.mask is not None else 0
    return masked / area if area else 0.0
