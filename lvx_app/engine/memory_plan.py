"""Memory plan of one chat session on a video, from the model's real shapes: what each rank keeps
and the peak of each stage, in bytes (projected, not measured).

The one memory estimate of lvx: `memory_plan` sizes a session, from the per-token and per-copy sizes
below (`weight_bytes`, `features_bytes`, `visual_kv_bytes`, `text_kv_bytes`), which every other
estimate reads too: `--kv-mode auto` compares the plan's peak with the memory the process can use
(`kv_choice`), the question cap sizes a question's prefill (`prefill_bytes`, read by `limits`), the
group-fit check sizes a rank's weights (`weight_bytes`, read by `runtime/fit`), and
`scripts/memory_plan.py` builds the time plan and the largest-video tables on the plan. Every
size is read through `ModelConfig` (the video prompt's positions per frame included), parameter
counts from the family's model built on the `meta` device (no memory, no weights); every other
term is the size of a tensor the code as it stands allocates, named after where it is made:

- weights: the whole model on every rank (`Session.__init__` loads vision tower, projector and
  language model);
- E: this rank's features (frames, visual tokens, H) (`ingest`); kept only with
  `--kv-mode recompute`;
- visual K/V: per cross layer, `visual_kv` writes K and V into buffers of their own: 2 * heads *
  head size values per visual token, in the cross layers' own geometry (`cross_kv_heads`,
  `cross_head_dim`), which need not be the text layers';
- its transient: one chunk of frames (the config's `visual_kv_chunk_bytes` of float32 work) at a
  time: `rms_norm` in float32 (two float32 copies of the chunk), then the projection, then K's
  float32 rotation (mPLUG-Owl3's MI-RoPE; an upper bound for a family whose keys are not rotated);
- text K/V: only the layers that keep any (`text_kv_layers`); `TextKVCache` buffers hold 1/8 more
  tokens than they must (`kv_capacity`), so a question and its answer usually fit without a copy;
  with several ranks it is replicated after the video prompt's sharded prefill
  (`ShardedAttention.replicate`: the gathered slices and the new cache live next to the local slice
  for a moment), so every rank holds the whole;
- prefill: the whole local video prompt in one forward (SwiGLU's three (S, I) tensors live) and, in
  each cross layer, `attn_fwd`'s packed query copy, float32 accumulators and two media-mask tiles'
  band masks;
- vision tower: `encode_images` runs 16 frames at a time, each as the tower's
  `vision_tokens_per_frame` tokens (empty tiles and padding included);
- header features: a family whose rows before the first frame attend to more than the frames'
  K/V (`header_visual_tokens_per_frame`: Llama-3.2-Vision's every tile, the empty ones included)
  keeps those features of this rank's frames in host memory (`host`; on a CPU device they count
  in the stages) from the encode (`ShardEncoder`) until those rows are prefilled
  (`HeaderAttention`: the frames' K/V, then one chunk of frames' header K/V of one cross layer at
  a time on the device), then drops them.

With several ranks every video-sized term but the text K/V is split evenly (frames, prompt rows,
visible keys per ring round) and the weights are not; only the one-rank formula is checked against a
measurement (`plan_gpu.py --check-rss`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from lvx_app.engine.header_prefill import header_chunk_frames
from lvx_kernels.masks import MIN_TILE_CUDA, Q_TILE, min_tile
from lvx_models.api import ModelConfig, family_for_config, kv_capacity

GB = 1e9


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
    # float32 work of one chunk of frames while K/V are made (None: the config's)
    visual_kv_chunk_bytes: int | None = None
    # the video prompt's tokens before the first frame and positions per frame: the model's, which
    # every plan sets (`for_model`); a bare Workload's are mPLUG-Owl3's
    header_tokens: int = 18
    positions_per_frame: int = 5

    @property
    def frames(self) -> int:
        return int(round(self.minutes * 60 * self.fps))

    @property
    def prompt_tokens(self) -> int:
        return self.header_tokens + self.positions_per_frame * self.frames

    def for_model(self, config: ModelConfig) -> "Workload":
        """This workload with `config`'s video prompt."""
        return replace(
            self,
            header_tokens=config.prompt_header_tokens,
            positions_per_frame=config.prompt_positions_per_frame,
        )


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# ---- the sizes every estimate reads --------------------------------------------------------------
def weight_bytes(parameters: int, dtype_bytes: int) -> int:
    """One rank's copy of the model's weights."""
    return parameters * dtype_bytes


def features_bytes(cfg: ModelConfig, frames: int, dtype_bytes: int) -> int:
    """The visual features E of `frames` frames (what `--kv-mode recompute` keeps)."""
    return frames * cfg.visual_tokens_per_frame * cfg.visual_feature_size * dtype_bytes


def header_features_bytes(cfg: ModelConfig, frames: int, dtype_bytes: int) -> int:
    """The header features of `frames` frames (the keys the rows before the first frame see
    beyond the frames' own), held from their encode until those rows are prefilled (0 for a
    family whose header rows see only the frames' K/V)."""
    extra = max(0, cfg.header_visual_tokens_per_frame - cfg.visual_tokens_per_frame)
    return frames * extra * cfg.hidden_size * dtype_bytes


def visual_kv_bytes(cfg: ModelConfig, tokens: int, dtype_bytes: int) -> int:
    """One cross layer's visual K and V of `tokens` visual tokens, in its own head geometry."""
    return tokens * 2 * cfg.cross_kv_heads * cfg.cross_head_dim * dtype_bytes


def text_kv_bytes(cfg: ModelConfig, tokens: int, dtype_bytes: int) -> int:
    """Every layer's text K and V of `tokens` tokens (the layers that keep any)."""
    return cfg.text_kv_layers * tokens * 2 * cfg.num_key_value_heads * cfg.head_dim * dtype_bytes


@dataclass(frozen=True)
class PrefillShape:
    """What a prefill of a question meets on one rank."""

    world: int  # ranks the question is split over
    position: int  # text tokens already in the conversation
    element_bytes: int  # bytes per activation element (the model dtype)


def prefill_bytes(n: int, cfg: ModelConfig, shape: PrefillShape) -> int:
    """An upper estimate of one rank's memory for prefilling `n` more question tokens: the layers'
    activations and the text K/V they add grow linearly, and a ring step's score (or additive
    mask) block of the local queries against one rank's share of the text keys, fp32 per head,
    with the conversation."""
    local = -(-n // shape.world)
    b = shape.element_bytes
    linear = local * (4 * cfg.hidden_size + 3 * cfg.intermediate_size) * b
    keys = -(-(shape.position + n) // shape.world)
    scores = cfg.num_attention_heads * local * keys * 4
    return linear + text_kv_bytes(cfg, local, b) + scores


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


def param_counts(config: ModelConfig) -> ParamCounts:
    """The parameters of the model `config` describes, by part, counted by its family on the meta
    device (nothing is allocated)."""
    return ParamCounts(**family_for_config(config).parameter_counts(config))


RESIDENT = ("weights", "features E", "visual K/V", "text K/V")  # what a rank keeps between turns


# What a GPU process holds beyond the plan's live tensors. PyTorch's caching allocator reserves
# more than is allocated (blocks rounded up to its segment sizes, freed blocks of one stage's sizes
# that the next cannot reuse): ALLOCATOR_OVERHEAD of the peak. The libraries' workspaces (cuBLAS's
# per stream, cuDNN's and flash's split-KV accumulators of a decoded token): WORKSPACE_BYTES. And
# MARGIN_BYTES, so that a plan a few percent short still fits.
ALLOCATOR_OVERHEAD = 0.08
WORKSPACE_BYTES = 512 * 2**20
MARGIN_BYTES = 2 * 2**30


def reserved_bytes(peak: int) -> int:
    """What PyTorch's allocator and the libraries reserve on a GPU for a plan's `peak` of live
    tensors (the allocator's overhead and the workspaces)."""
    return int(peak * (1 + ALLOCATOR_OVERHEAD)) + WORKSPACE_BYTES


def headroom(peak: int) -> int:
    """Bytes a GPU must have beyond `peak` for the plan to hold: the reserve and the margin."""
    return reserved_bytes(peak) - peak + MARGIN_BYTES


@dataclass
class MemoryPlan:
    """Per-rank bytes: what stays resident, the transient of each stage, and the peak over
    stages."""

    resident: dict[str, int]
    # stage -> peak bytes during it (resident included)
    stages: dict[str, int] = field(default_factory=dict)
    # what the host holds for a while beside a GPU (the header features), by name
    host: dict[str, int] = field(default_factory=dict)

    @property
    def peak(self) -> int:
        return max(self.stages.values())

    @property
    def reserved(self) -> int:
        """The peak PyTorch reserves on a GPU for this plan (`reserved_bytes`)."""
        return reserved_bytes(self.peak)

    @property
    def peak_stage(self) -> str:
        return max(self.stages, key=self.stages.get)


def _visual_kv_transient(
    cfg: ModelConfig, tokens: int, b: int, chunk_bytes: int | None = None
) -> int:
    """Peak extra bytes, besides the K/V buffers, while one hyper layer's K/V are made from `tokens`
    visual tokens (`visual_kv`: one chunk of frames, `chunk_bytes` of float32 work, at a time)."""
    h, kd = cfg.visual_feature_size, cfg.cross_kv_heads * cfg.cross_head_dim
    kvw = 2 * kd  # a visual token's K and V values
    p, chunk_bytes = cfg.visual_tokens_per_frame, chunk_bytes or cfg.visual_kv_chunk_bytes
    chunk = min(tokens, max(1, chunk_bytes // (p * h * 8)) * p)
    norm = 2 * 4 * h  # rms_norm: the float32 copy and its normalised float32 product
    project = h * b + kvw * b  # the normed input and the projection's output
    # K in float32, its rotate-half and products; cos, sin
    rope = kvw * b + 4 * 4 * kd + 2 * 4 * cfg.cross_head_dim
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


def _cross_groups(cfg: ModelConfig) -> int:
    """Query heads of a cross layer per visual K/V head: the rows a token packs into."""
    return cfg.cross_attention_heads // cfg.cross_kv_heads


def band_tiles(
    cfg: ModelConfig, rows: int, keys: int, tile: int = MIN_TILE_CUDA
) -> list[tuple[int, int]]:
    """(packed rows, band keys) of each media-mask tile over the video prompt's first `rows` tokens.

    Token t sees the frames whose placeholder starts at or before t; a tile's band is the frames
    some of its rows see and others do not (capped by the `keys` this rank holds), its rows those
    that see at least one frame. Tiles are cut as `masks.tile_plans` cuts them: after `tile` tokens
    (the device's `min_tile`) where the frames seen change, at most Q_TILE."""
    p, frames = cfg.visual_tokens_per_frame, _ceil_div(keys, cfg.visual_tokens_per_frame)
    header, per = cfg.prompt_header_tokens, cfg.prompt_positions_per_frame

    def q_vis(t: int) -> int:
        return max(0, min(frames, (t - header) // per + 1))

    tiles, t0 = [], 0
    while t0 < rows:
        t1 = min(rows, t0 + tile)
        while t1 < min(rows, t0 + Q_TILE) and q_vis(t1) == q_vis(t1 - 1):
            t1 += 1
        seeing = t1 - max(t0, header)  # the header's tokens see no frame
        band = min(keys, (q_vis(t1 - 1) - q_vis(t0)) * p)
        if seeing > 0 and band > 0:
            tiles.append((seeing * _cross_groups(cfg), band))
        t0 = t1
    return tiles


def visual_masked_share(config: ModelConfig, work: Workload) -> float:
    """The share of the video prompt's visual attention (query rows x keys) in masked tiles, the
    frames' band, which runs on the memory-efficient kernel: `band_tiles` of one rank over all the
    keys seen (token t sees every frame placed at or before it). Several ranks cut the same bands
    among them: their share is within a few percent of it (`planned_masked_share`)."""
    p, h, per = (
        config.visual_tokens_per_frame,
        config.prompt_header_tokens,
        config.prompt_positions_per_frame,
    )
    frames, rows = work.frames, work.for_model(config).prompt_tokens
    tiles = band_tiles(config, rows, frames * p, min_tile(work.device))
    seen = frames * (rows - h) - per * frames * (frames - 1) // 2  # (token, frame seen) pairs
    total = _cross_groups(config) * p * seen
    return sum(r * k for r, k in tiles) / total if total else 0.0


def live_band_masks(tiles: list[tuple[int, int]]) -> int:
    """Bytes of the bool band masks alive at once: a tile's and the next one's (`masks.lone_plan`
    plans one ahead)."""
    sizes = [r * k for r, k in tiles]
    return max((a + b for a, b in zip(sizes, sizes[1:])), default=sum(sizes))


def _attention_transient(
    cfg: ModelConfig, rows: int, keys: int, b: int, masked: bool, tile: int = MIN_TILE_CUDA
) -> int:
    """Peak extra bytes of one `attn_fwd` of `rows` local query tokens against `keys` visible local
    visual keys.

    It packs the query groups into rows (one copy of q; K/V are never copied) and, when a tile is
    split, merges the parts into float32 accumulators. Tiles are planned as they run, so at most two
    bool band masks live together (a tile's and the next one's); the running band adds its additive
    bias and negated mask."""
    q_bytes = rows * cfg.cross_attention_heads * cfg.cross_head_dim
    if not masked:
        return 2 * q_bytes * b  # the packed copy and the output
    tiles = band_tiles(cfg, rows, keys, tile)
    masks = live_band_masks(tiles)
    running = max((r * k for r, k in tiles), default=0) * (1 + b)
    return q_bytes * (b + 4) + masks + running


def _layer_transient(
    cfg: ModelConfig, rows: int, keys: int, b: int, masked: bool, tile: int = MIN_TILE_CUDA
) -> int:
    """Peak extra bytes of one decoder layer over `rows` local tokens: its SwiGLU, or its visual
    attention."""
    qkv = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim
    # SwiGLU + residual stream
    mlp = rows * (3 * cfg.intermediate_size * b + (3 * cfg.hidden_size + qkv) * b)
    return max(mlp, _attention_transient(cfg, rows, keys, b, masked, tile))


def _vision_transient(cfg: ModelConfig, batch: int, b: int) -> int:
    """Peak extra bytes of one `encode_images` batch (a frame is one image or tile): pixels, a
    tower layer's activations over the tokens the tower runs (`vision_tokens_per_frame`) beside
    the layers' outputs it keeps for the projector (a tower whose output is wider than its layers
    concatenates them), the projector's over the tokens a frame keeps."""
    t, tower = cfg.visual_tokens_per_frame, cfg.vision_tokens_per_frame
    pixels = batch * cfg.frame_channels * cfg.frame_size**2 * b
    kept = cfg.vision_output_size - cfg.vision_hidden_size
    width = 4 * cfg.vision_hidden_size + 2 * cfg.vision_intermediate_size + kept
    return pixels + batch * max(tower * width, t * (kept + 2 * cfg.visual_feature_size)) * b


def memory_plan(
    config: ModelConfig, work: Workload, counts: ParamCounts | None = None
) -> MemoryPlan:
    # long: one line per tensor the engine keeps, summed in the order they appear
    """Per-rank memory of `work`: resident tensors and the peak of each stage (load, prefill,
    question, decode)."""
    cfg, b, work = config, work.dtype_bytes, work.for_model(config)
    counts = counts or param_counts(cfg)
    frames = _ceil_div(work.frames, work.ranks)
    vis_tokens = frames * cfg.visual_tokens_per_frame
    n_hyper = len(cfg.cross_layer_indices)
    prompt = _ceil_div(work.prompt_tokens, work.ranks)
    e = features_bytes(cfg, frames, b)
    kv_layer = visual_kv_bytes(cfg, vis_tokens, b)
    text_kv = lambda tokens: text_kv_bytes(cfg, tokens, b)  # noqa: E731
    # a layer's K/V buffers and one chunk's work
    kv_transient = kv_layer + _visual_kv_transient(cfg, vis_tokens, b, work.visual_kv_chunk_bytes)
    resident = {"weights": weight_bytes(counts.total, b)}
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
    base, host = resident["weights"], {"header features": header_features_bytes(cfg, frames, b)}
    header = host["header features"] if work.device == "cpu" else 0
    stages = {
        "encode": base + e + header + _vision_transient(cfg, work.vision_batch, b),
        # the last hyper layer's K/V are made while the others' are kept (cache) or while nothing
        # else is (recompute)
        "visual K/V": base
        + e
        + header
        + ((n_hyper - 1) * kv_layer if work.kv_mode == "cache" else 0)
        + kv_transient,
    }
    kept = sum(resident.values()) - resident["text K/V"]
    if host["header features"]:  # one chunk of frames' K/V of one cross layer at a time
        extra = cfg.header_visual_tokens_per_frame - cfg.visual_tokens_per_frame
        keys = min(frames, header_chunk_frames(cfg)) * extra
        made = visual_kv_bytes(cfg, keys, b) + _visual_kv_transient(cfg, keys, b)
        # beside the frames' K/V of the layer (made now with --kv-mode recompute)
        stages["header prefill"] = (
            kept + header + kv_make + made + text_kv(kv_capacity(work.header_tokens))
        )
    # the last rows see every frame of this rank's shard
    visible = work.frames * cfg.visual_tokens_per_frame // work.ranks
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
    growing = text_kv(asked[0]) + text_kv(asked[1]) // cfg.text_kv_layers
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
    return MemoryPlan(resident=resident, stages=stages, host=host)
