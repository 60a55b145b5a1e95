"""Memory and time plan of one chat session on a long video, from the model's real shapes (all
figures projected).

The engine decides what each rank keeps, so the plan lives beside it. Parameter counts come from
building
`Owl3Model` on the `meta` device (no memory, no weights); every other term is the size of a tensor
the code as it stands allocates, named after where it is made:

- weights: the whole model on every rank (`Session.__init__` loads vision tower, projector and
  language model);
- E: this rank's features (frames, 729, H) (`ingest`); kept only with `--kv-mode recompute`;
- visual K/V: per hyper layer, `visual_kv` writes K (MI-RoPE'd) and V into buffers of their own: 2 *
  n_kv * d values per visual token;
- its transient: one chunk of frames (`VISUAL_KV_CHUNK_BYTES` of float32 work) at a time: `rms_norm`
  in float32 (two float32 copies of the chunk), then the projection, then K's float32 rotation;
- text K/V: `TextKVCache` buffers hold 1/8 more tokens than they must (`kv_capacity`), so a question
  and its answer usually fit without a copy; with several ranks it is replicated after the video
  prompt's sharded prefill (`ShardedAttention.replicate`: the gathered slices and the new cache live
  next to the local slice for a moment), so every rank holds the whole;
- prefill: the whole local video prompt in one forward (SwiGLU's three (S, I) tensors live) and, in
  each hyper layer, `attn_fwd`'s packed query copy, float32 accumulators and two media-mask tiles'
  band masks;
- vision tower: `encode_images` runs 16 images at a time.

With several ranks every video-sized term but the text K/V is split evenly (frames, prompt rows,
visible keys per ring round) and the weights are not; only the one-rank formula is checked against a
measurement (`plan_gpu.py --check-rss`).

Times are FLOPs / measured H100 rates (bf16 matmul, cuDNN attention with lse) plus bytes read / HBM
bandwidth, added without overlap; communication and CPU video decoding are not in them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from lvx_app.attention.masks import (
    MIN_TILE_CUDA,
    Q_TILE,
    Indices,
    TilePlan,
    min_tile,
    pack_vis,
    tile_plans,
)
from lvx_app.defaults import DEFAULT_LAYOUT
from lvx_app.engine.limits import frames_that_fit, video_prompt_too_long
from lvx_app.parallel.layout import owned, rank_tokens
from lvx_models.mplug_owl3.config import Owl3Config
from lvx_models.mplug_owl3.hyper import VISUAL_KV_CHUNK_BYTES
from lvx_models.mplug_owl3.modeling import Owl3Model
from lvx_models.mplug_owl3.qwen2 import kv_capacity

GB = 1e9
PROMPT_HEADER_TOKENS = (
    18  # chat template tokens before the first frame placeholder (bench_chat.py uses the same)
)
PLACEHOLDER_TOKENS = (
    5  # ids per <|image|> placeholder in the released tokenizers (reference mplug_owl3.md §5)
)


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


@dataclass(frozen=True)
class Workload:
    """One session: a video at `fps` for `minutes`, split over `ranks`, one question and its
    answer."""

    minutes: float
    fps: float = 1.0
    ranks: int = 1
    # cache (resident visual K/V) | recompute (--kv-mode recompute: keep E, recompute K/V)
    kv_mode: str = "cache"
    dtype_bytes: int = 2  # bf16 on GPU, 4 for the CPU's float32
    device: str = "cuda"  # whose attention tiles (`masks.min_tile`)
    question_tokens: int = 24
    answer_tokens: int = 256
    vision_batch: int = 16  # images per `encode_images` batch
    visual_kv_chunk_bytes: int = VISUAL_KV_CHUNK_BYTES  # float32 work of one `visual_kv` chunk

    @property
    def frames(self) -> int:
        return int(round(self.minutes * 60 * self.fps))

    @property
    def prompt_tokens(self) -> int:
        return PROMPT_HEADER_TOKENS + PLACEHOLDER_TOKENS * self.frames


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class ParamCounts:
    """Parameter counts by part, read from the meta-device model."""

    # the tower as built: embeddings and the layers that run (all but the checkpoint's last)
    vision: int
    projector: int
    language: int  # decoder layers, norms, embeddings, lm_head
    embedding: int  # embed_tokens (a lookup: no FLOPs)

    @property
    def total(self) -> int:
        return self.vision + self.projector + self.language


def param_counts(config: Owl3Config) -> ParamCounts:
    """Count the parameters of `Owl3Model(config)` built on the meta device (nothing is
    allocated)."""
    with torch.device("meta"):
        model = Owl3Model(config)

    def count(module: torch.nn.Module) -> int:
        return sum(p.numel() for p in module.parameters()) + sum(
            b.numel() for b in module.buffers()
        )

    return ParamCounts(
        vision=count(model.vision_model),
        projector=count(model.vision2text_model),
        language=count(model.language_model),
        embedding=model.language_model.model.embed_tokens.weight.numel(),
    )


RESIDENT = ("weights", "features E", "visual K/V", "text K/V")  # what a rank keeps between turns


@dataclass
class MemoryPlan:
    """Per-rank bytes: what stays resident, the transient of each stage, and the peak over
    stages."""

    resident: dict[str, int]
    # stage -> peak bytes during it (resident included)
    stages: dict[str, int] = field(default_factory=dict)

    @property
    def peak(self) -> int:
        return max(self.stages.values())

    @property
    def peak_stage(self) -> str:
        return max(self.stages, key=self.stages.get)


def _visual_kv_transient(
    cfg: Owl3Config, tokens: int, b: int, chunk_bytes: int = VISUAL_KV_CHUNK_BYTES
) -> int:
    """Peak extra bytes, besides the K/V buffers, while one hyper layer's K/V are made from `tokens`
    visual tokens (`visual_kv`: one chunk of frames, `chunk_bytes` of float32 work, at a time)."""
    h, kvw, kd = (
        cfg.hidden_size,
        2 * cfg.num_key_value_heads * cfg.head_dim,
        cfg.num_key_value_heads * cfg.head_dim,
    )
    p = cfg.vision.num_patches
    chunk = min(tokens, max(1, chunk_bytes // (p * h * 8)) * p)
    norm = 2 * 4 * h  # rms_norm: the float32 copy and its normalised float32 product
    project = h * b + kvw * b  # the normed input and the projection's output
    # K in float32, its rotate-half and products; cos, sin
    rope = kvw * b + 4 * 4 * kd + 2 * 4 * cfg.head_dim
    return chunk * max(norm, project, rope)


def _text_buffer(prompt: int, question: int, answer: int) -> tuple[int, int]:
    """(tokens each layer's text K/V buffer holds after the prompt, the question in one forward and
    `answer` tokens one at a time; the buffer's length before its last growth, or 0), as `_LayerKV`
    grows: to `kv_capacity`."""
    cap, before = kv_capacity(prompt), 0
    if prompt + question > cap:
        before, cap = cap, kv_capacity(prompt + question)
    while prompt + question + answer > cap:  # a decoded token one past the buffer
        before, cap = cap, kv_capacity(cap + 1)
    return cap, before


def band_tiles(
    cfg: Owl3Config, rows: int, keys: int, tile: int = MIN_TILE_CUDA
) -> list[tuple[int, int]]:
    """(packed rows, band keys) of each media-mask tile over the video prompt's first `rows` tokens.

    Token t sees the frames whose placeholder starts at or before t; a tile's band is the frames
    some of its rows see and others do not (capped by the `keys` this rank holds), its rows those
    that see at least one frame. Tiles are cut as `masks.tile_plans` cuts them: after `tile` tokens
    (the device's `min_tile`) where the frames seen change, at most Q_TILE."""
    p, frames = cfg.vision.num_patches, _ceil_div(keys, cfg.vision.num_patches)

    def q_vis(t: int) -> int:
        return max(0, min(frames, (t - PROMPT_HEADER_TOKENS) // PLACEHOLDER_TOKENS + 1))

    tiles, t0 = [], 0
    while t0 < rows:
        t1 = min(rows, t0 + tile)
        while t1 < min(rows, t0 + Q_TILE) and q_vis(t1) == q_vis(t1 - 1):
            t1 += 1
        seeing = t1 - max(t0, PROMPT_HEADER_TOKENS)  # the header's tokens see no frame
        band = min(keys, (q_vis(t1 - 1) - q_vis(t0)) * p)
        if seeing > 0 and band > 0:
            tiles.append((seeing * cfg.num_kv_groups, band))
        t0 = t1
    return tiles


def visual_masked_share(config: Owl3Config, work: Workload) -> float:
    """The share of the video prompt's visual attention (query rows x keys) in masked tiles, the
    frames' band, which runs on the memory-efficient kernel: `band_tiles` of one rank over all the
    keys seen (token t sees every frame placed at or before it). Several ranks cut the same bands
    among them: their share is within a few percent of it (`planned_masked_share`)."""
    p, h, per = config.vision.num_patches, PROMPT_HEADER_TOKENS, PLACEHOLDER_TOKENS
    frames, rows = work.frames, work.prompt_tokens
    tiles = band_tiles(config, rows, frames * p, min_tile(work.device))
    seen = frames * (rows - h) - per * frames * (frames - 1) // 2  # (token, frame seen) pairs
    total = config.num_kv_groups * p * seen
    return sum(r * k for r, k in tiles) / total if total else 0.0


def live_band_masks(tiles: list[tuple[int, int]]) -> int:
    """Bytes of the bool band masks alive at once: a tile's and the next one's (`masks.lone_plan`
    plans one ahead)."""
    sizes = [r * k for r, k in tiles]
    return max((a + b for a, b in zip(sizes, sizes[1:])), default=sum(sizes))


def _attention_transient(
    cfg: Owl3Config, rows: int, keys: int, b: int, masked: bool, tile: int = MIN_TILE_CUDA
) -> int:
    """Peak extra bytes of one `attn_fwd` of `rows` local query tokens against `keys` visible local
    visual keys.

    It packs the query groups into rows (one copy of q; K/V are never copied) and, when a tile is
    split, merges the parts into float32 accumulators. Tiles are planned as they run, so at most two
    bool band masks live together (a tile's and the next one's); the running band adds its additive
    bias and negated mask."""
    q_bytes = rows * cfg.num_attention_heads * cfg.head_dim
    if not masked:
        return 2 * q_bytes * b  # the packed copy and the output
    tiles = band_tiles(cfg, rows, keys, tile)
    masks = live_band_masks(tiles)
    running = max((r * k for r, k in tiles), default=0) * (1 + b)
    return q_bytes * (b + 4) + masks + running


def _layer_transient(
    cfg: Owl3Config, rows: int, keys: int, b: int, masked: bool, tile: int = MIN_TILE_CUDA
) -> int:
    """Peak extra bytes of one decoder layer over `rows` local tokens: its SwiGLU, or its visual
    attention."""
    qkv = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim
    # SwiGLU + residual stream
    mlp = rows * (3 * cfg.intermediate_size * b + (3 * cfg.hidden_size + qkv) * b)
    return max(mlp, _attention_transient(cfg, rows, keys, b, masked, tile))


def _vision_transient(cfg: Owl3Config, batch: int, b: int) -> int:
    """Peak extra bytes of one `encode_images` batch: pixels, a SigLIP layer's activations, the
    projector's."""
    v, t = cfg.vision, cfg.vision.num_patches
    pixels = batch * v.num_channels * v.image_size**2 * b
    layer = batch * t * (4 * v.hidden_size + 2 * v.intermediate_size) * b
    return pixels + max(layer, batch * t * 2 * cfg.hidden_size * b)


def memory_plan(
    config: Owl3Config, work: Workload, counts: ParamCounts | None = None
) -> MemoryPlan:
    # long: one line per tensor the engine keeps, summed in the order they appear
    """Per-rank memory of `work`: resident tensors and the peak of each stage (load, prefill,
    question, decode)."""
    cfg, b = config, work.dtype_bytes
    counts = counts or param_counts(cfg)
    frames = _ceil_div(work.frames, work.ranks)
    vis_tokens = frames * cfg.vision.num_patches
    n_hyper = len(cfg.hyper_layer_indices)
    prompt = _ceil_div(work.prompt_tokens, work.ranks)
    kd = cfg.num_key_value_heads * cfg.head_dim
    e = vis_tokens * cfg.hidden_size * b
    kv_layer = vis_tokens * 2 * kd * b
    text_kv = lambda tokens: cfg.num_hidden_layers * tokens * 2 * kd * b  # noqa: E731
    # a layer's K/V buffers and one chunk's work
    kv_transient = kv_layer + _visual_kv_transient(cfg, vis_tokens, b, work.visual_kv_chunk_bytes)
    resident = {"weights": counts.total * b}
    if work.kv_mode == "recompute":
        resident["features E"] = e
        # each hyper layer recomputes its K/V when it runs
        kv_in_use, kv_make = (kv_layer, kv_transient)
    else:
        resident["visual K/V"] = n_hyper * kv_layer
        kv_in_use, kv_make = 0, 0
    whole = work.prompt_tokens  # the text K/V cache is replicated on every rank
    asked = _text_buffer(whole, work.question_tokens, 0)
    answered = _text_buffer(whole, work.question_tokens, work.answer_tokens)
    resident["text K/V"] = text_kv(answered[0])
    base = resident["weights"]
    stages = {
        "encode": base + e + _vision_transient(cfg, work.vision_batch, b),
        # the last hyper layer's K/V are made while the others' are kept (cache) or while nothing
        # else is (recompute)
        "visual K/V": base
        + e
        + ((n_hyper - 1) * kv_layer if work.kv_mode == "cache" else 0)
        + kv_transient,
    }
    kept = sum(resident.values()) - resident["text K/V"]
    # the last rows see every frame of this rank's shard
    visible = work.frames * cfg.vision.num_patches // work.ranks
    local = text_kv(kv_capacity(prompt))
    stages["video prefill"] = (
        kept
        + local
        + max(
            _layer_transient(cfg, prompt, visible, b, True, min_tile(work.device)) + kv_in_use,
            kv_make,
            text_kv(prompt) + text_kv(whole) + text_kv(kv_capacity(whole)),
        )
    )
    # a growing layer's old buffer too
    growing = text_kv(asked[0]) + text_kv(asked[1]) // cfg.num_hidden_layers
    stages["question"] = (
        kept
        + growing
        + max(
            _layer_transient(cfg, work.question_tokens, visible, b, masked=False) + kv_in_use,
            kv_make,
        )
    )
    stages["decode"] = sum(resident.values()) + max(
        _layer_transient(cfg, 1, visible, b, masked=False) + kv_in_use, kv_make
    )
    return MemoryPlan(resident=resident, stages=stages)


def largest_minutes(
    config: Owl3Config, work: Workload, budget_bytes: float, counts: ParamCounts | None = None
) -> float:
    """The longest video (minutes, whole frames at `work.fps`) whose planned peak fits
    `budget_bytes` per rank."""
    counts = counts or param_counts(config)

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


def positions_minutes(config: Owl3Config, fps: float = 1.0) -> float:
    """The longest video (minutes, whole frames at `fps`) whose prompt leaves room for a question in
    the positions the model was trained on (`max_position_embeddings`): each frame costs its
    placeholder's positions, its visual tokens none. lvx refuses a longer one at load."""
    context = int(config.max_position_embeddings)
    return frames_that_fit(context, PROMPT_HEADER_TOKENS, 0, PLACEHOLDER_TOKENS) / 60 / fps


def largest_video(
    config: Owl3Config, work: Workload, budget_bytes: float, counts: ParamCounts | None = None
) -> dict:
    """The largest video `work`'s mode takes at `work.fps` on a rank of `budget_bytes`: the memory
    limit, the positions limit, the smaller, and the line lvx says one frame past it."""
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
    config: Owl3Config,
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
    cfg, b, n = config, work.dtype_bytes, work.ranks
    counts = counts or param_counts(cfg)
    v, t = cfg.vision, cfg.vision.num_patches
    hq, d, layers, n_hyper = (
        cfg.num_attention_heads,
        cfg.head_dim,
        cfg.num_hidden_layers,
        len(cfg.hyper_layer_indices),
    )
    kv_cols = 2 * cfg.num_key_value_heads * d
    s_kv, prompt, q = work.frames * t, work.prompt_tokens, work.question_tokens
    # every non-embedding parameter is one multiply-add per token
    lm_matmul = counts.language - counts.embedding
    vision_frame = (
        2 * (counts.vision + counts.projector) * t + 4 * t * t * v.hidden_size * v.num_used_layers
    )
    # v_kv_proj over every visual token, all hyper layers
    make_kv = 2 * s_kv * cfg.hidden_size * kv_cols * n_hyper

    def prefill(rows: int, before: int) -> tuple[float, float]:
        """(matmul, attention) FLOPs of `rows` new tokens after `before` cached ones."""
        text = 4 * hq * d * layers * (rows * before + rows * rows / 2)
        # the video prompt's rows see a growing prefix of frames
        seen = s_kv * rows if before else s_kv * rows / 2
        return 2 * lm_matmul * rows, text + 4 * hq * d * n_hyper * seen

    recompute = make_kv if work.kv_mode == "recompute" else 0
    if masked_share is None:
        masked_share = visual_masked_share(cfg, work)
    p_mm, p_at = prefill(prompt, 0)
    # the video prompt's visual attention in masked tiles (the frames' band) runs on the
    # memory-efficient kernel; all else on flash (text: causal squares and whole blocks)
    p_masked = 4 * hq * d * n_hyper * s_kv * prompt / 2 * masked_share
    q_mm, q_at = prefill(q, prompt)
    # a decode step: every rank runs the same one-token step on its replicated weights and its share
    # of the keys
    decode_bytes = (
        lm_matmul * b + (n_hyper * s_kv * kv_cols * b + layers * (prompt + q) * kv_cols * b) / n
    )
    if work.kv_mode == "recompute":
        decode_bytes += s_kv * cfg.hidden_size * b * n_hyper / n  # E read once per hyper layer
    # (matmul, attention, of it on the memory-efficient kernel, bytes read) FLOPs and bytes
    stages = {
        "ingest (vision tower + projector)": (vision_frame * work.frames / n, 0.0, 0.0, 0.0),
        "visual K/V": ((make_kv if work.kv_mode == "cache" else 0) / n, 0.0, 0.0, 0.0),
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
            4 * hq * d * (n_hyper * s_kv + layers * (prompt + q)) / n,
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
    out["tokens/s"] = 1.0 / out["decode step"]["seconds"]
    return out


def plan_rows(
    config: Owl3Config, minutes: list[float], ranks: list[int], modes: list[str]
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


def _planned(cfg: Owl3Config, q_vis: torch.Tensor, k_frame: torch.Tensor, tile: int) -> list:
    """`masks.tile_plans` of one query block (its tokens' q_vis) against one key shard (its
    k_frame), on meta tensors with host copies: what a GPU kernel call of this shape would run."""
    g, h, d = cfg.num_kv_groups, cfg.num_key_value_heads, cfg.head_dim
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


def _ring_rounds(config: Owl3Config, work: Workload, rank: int, layout: str):
    """The tile size, and per ring round on `rank` of the video-prompt prefill: (the round's query
    positions, their frames seen under G2, this rank's own positions, its frames' k_frame)."""
    n, p = work.ranks, config.vision.num_patches
    tile = min_tile(work.device)
    starts = PROMPT_HEADER_TOKENS + PLACEHOLDER_TOKENS * torch.arange(work.frames)
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
    config: Owl3Config, work: Workload, rank: int, layout: str = DEFAULT_LAYOUT
) -> KernelCalls:
    """Kernel calls per layer on `rank` for `work` (the video prompt sharded in `layout`, frames
    travelling with their placeholders, G2 visibility), planned for `work.device`'s tiles. A ring
    round's query block is another rank's tokens; its keys are this rank's own text tokens (text
    attention: key position < query position + 1) or frames (visual)."""
    cfg = config
    tile, rounds = _ring_rounds(cfg, work, rank, layout)
    k_frame = rounds[0][3]
    text = visual = (0, 0)
    for block, seen, own, _ in rounds:
        text = tuple(map(sum, zip(text, _tally(_planned(cfg, block + 1, own, tile)))))
        visual = tuple(map(sum, zip(visual, _tally(_planned(cfg, seen, k_frame, tile)))))
    tokens = work.prompt_tokens
    # a decoded token: causal text attention over the whole cache, and every frame visible
    g, h, d = cfg.num_kv_groups, cfg.num_key_value_heads, cfg.head_dim
    one = torch.empty(1, g, h, d, device="meta")
    cache = torch.empty(1, tokens + work.question_tokens + 1, h, d, device="meta")
    decode_text = len(list(tile_plans(one, cache, True, None, None, g)))
    decode_visual = len(_planned(cfg, torch.tensor([work.frames]), k_frame, tile))
    return KernelCalls(*text, *visual, decode_text, decode_visual)


def planned_masked_share(
    config: Owl3Config, work: Workload, rank: int = 0, layout: str = DEFAULT_LAYOUT
) -> float:
    """The share of the video prompt's visual attention (query rows x keys) on `rank` that its
    tiles run with a mask, from the attention's own planner (seconds at an hour; the time plan
    takes `visual_masked_share`, its closed form)."""
    tile, rounds = _ring_rounds(config, work, rank, layout)
    area = masked = 0
    for _, seen, _, k_frame in rounds:
        for p in _planned(config, seen, k_frame, tile):
            cells = (p.q1 - p.q0) * (p.k1 - p.k0)
            area += cells
            masked += cells if p.mask is not None else 0
    return masked / area if area else 0.0
