"""What every model family's forward hands its attention, and the text cache they all keep.

A forward calls its attention through `AttentionHooks` it is given (the engine's sharded attention,
the evidence recorder's, finetuning's), with the forward's step (`step.feed`, `step.visual`: a
`VisualStep`, `step.cache`) and the calling layer's index; a family builds its visual inputs as
`VisualInputs` (each cross layer's K/V of the frames this process holds and the media mask). Every
attention call returns (out, lse) in the layout q (B, L, heads, D), k/v (B, S, kv_heads, D) -> out
(B, L, heads, D), lse float32 (B, heads, L).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, NamedTuple, Optional, Protocol

import torch

from lvx_kernels.feed import Feed
from lvx_kernels.kernels import attention
from lvx_kernels.masks import Indices, MaskIndex, device_tensor


class ForwardStep(Protocol):
    """What an attention hook may read of the forward that calls it (each family's step has more,
    for its own layers)."""

    feed: Feed  # how the ranks feed this forward's tokens
    visual: Any  # a `VisualStep` in a layer that attends to the frames, else None
    cache: Any  # the text cache this forward extends (a `TextKVCache`), or None


# called as text(q, k, v, step, layer) -> (out, lse): causal self-attention over the text cache
TextAttn = Callable[..., tuple[torch.Tensor, torch.Tensor]]
# called as visual(q, step, layer) -> (out, lse): attention to the layer's visual K/V
# (`step.visual.kv[layer]`) under the media mask (`step.visual.q_vis`, `step.visual.k_frame`,
# `step.visual.window`)
VisualAttn = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def default_text_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step, layer: int):
    """Local text self-attention: lvx_kernels.kernels.attention, causal bottom-right
    aligned, with the step's ALiBi slopes where its family has them (`step.alibi`)."""
    return attention(q, k, v, causal=True, alibi=getattr(step, "alibi", None))


def default_visual_attn(q: torch.Tensor, step, layer: int):
    """Local masked cross-attention to the layer's visual keys: query t sees key s iff k_frame[s] <
    q_vis[t] (and q_vis[t] - window <= k_frame[s] with a window)."""
    vis = step.visual
    k, v = vis.kv[layer]
    return attention(q, k, v, q_vis=vis.q_vis, k_frame=vis.k_frame, window=vis.window)


@dataclass
class AttentionHooks:
    """The two attention callables every layer uses. Swap them to distribute attention
    (the engine's sharded attention); every rank must call `visual` in every hyper layer, also with
    an empty visual shard."""

    text: TextAttn = default_text_attn
    visual: VisualAttn = default_visual_attn


# Fewest tokens of room a text K/V buffer gets beyond what it must hold when it grows (tests shrink
# it).
MIN_KV_ROOM = 256


def kv_capacity(needed: int) -> int:
    """Buffer length for `needed` cached tokens: 1/8 more (at least MIN_KV_ROOM), so a question and
    its answer fit after the video prompt without a copy, and each copy buys room for many tokens
    (O(1) amortised)."""
    return needed + max(needed // 8, MIN_KV_ROOM)


class _LayerKV:
    """One layer's cached K/V, (B, S, kv_heads, D), in a buffer that grows by an eighth (no copy per
    token; doubling would keep two video prompts' worth of an hour's cache for the rest of the
    session)."""

    def __init__(self) -> None:
        self.k: Optional[torch.Tensor] = None
        self.v: Optional[torch.Tensor] = None
        self.length = 0

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n = self.length + k.shape[1]
        if (
            self.k is None
            or n > self.k.shape[1]
            or self.k.dtype != k.dtype
            or self.k.device != k.device
        ):
            self._grow(kv_capacity(n), k, v)
        self.k[:, self.length : n] = k
        self.v[:, self.length : n] = v
        self.length = n
        return self.k[:, :n], self.v[:, :n]

    def _grow(self, cap: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """New buffers of `cap` tokens, like k and v, holding what is cached."""
        new_k = k.new_empty((k.shape[0], cap, *k.shape[2:]))
        new_v = v.new_empty((v.shape[0], cap, *v.shape[2:]))
        if self.length:
            new_k[:, : self.length] = self.k[:, : self.length]
            new_v[:, : self.length] = self.v[:, : self.length]
        self.k, self.v = new_k, new_v

    def reserve(self, more: int) -> None:
        """Room for `more` tokens past the cached ones now, so they append in place (buffers that
        stay put, as a captured decode step needs)."""
        if self.k is not None and self.length + more > self.k.shape[1]:
            self._grow(self.length + more, self.k, self.v)


class TextKVCache:
    """Text K/V of every decoder layer (hyper layers included; visual K/V are never stored here).

    Keys are stored already rotated at their absolute positions. `length` is the number of cached
    tokens, which is also the position of the next token when positions are the default 0, 1, 2, ...
    The cache is for inference (stored tensors are detached copies).
    """

    def __init__(self, num_layers: int):
        self.layers = [_LayerKV() for _ in range(num_layers)]

    @property
    def length(self) -> int:
        return min(l.length for l in self.layers)

    def update(
        self, layer_idx: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append this forward's K/V of one layer; return all of that layer's K/V (views)."""
        if k.requires_grad or v.requires_grad:
            k, v = k.detach(), v.detach()
        return self.layers[layer_idx].append(k, v)

    def layer_kv(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every layer's cached (k, v), (B, length, kv_heads, D) views; `update` of an empty cache
        restores them."""
        return [(l.k[:, : l.length], l.v[:, : l.length]) for l in self.layers]

    def reserve(self, more: int) -> None:
        """Room in every layer's buffer for `more` tokens past the cached ones."""
        for l in self.layers:
            l.reserve(more)

    def count_written(self, tokens: int = 1) -> None:
        """Count `tokens` more cached tokens that a step outside `update` wrote in place after the
        cached ones (a decode step on buffers that stay put)."""
        for l in self.layers:
            l.length += tokens

    def truncate(self, length: int) -> None:
        """Forget every token from `length` on (e.g. to drop a turn)."""
        for l in self.layers:
            l.length = min(l.length, length)


class LazyVisualKV(Mapping):
    """layer -> (k, v) made on every access from one copy of E (`features`), nothing cached:
    `project(layer, features)` is the layer's K/V, differentiable w.r.t. E and the layer's weights
    (finetuning remakes them in its backward from the same two)."""

    def __init__(
        self,
        project: Callable[[int, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
        features: torch.Tensor,
        layers: list[int],
    ):
        self.project, self.features, self.layers = project, features, list(layers)

    def __getitem__(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        if layer not in self.layers:
            raise KeyError(layer)
        return self.project(layer, self.features)

    def __iter__(self) -> Iterator[int]:
        return iter(self.layers)

    def __len__(self) -> int:
        return len(self.layers)


class FrameFeatures(NamedTuple):
    """What a family's `encode_frames` gives for frames: their visual features E (N, T, H), of
    which the resident visual K/V are made, and the header features (N, T', H) the rows before the
    first frame attend to besides E (None: none). Llama-3.2-Vision opens those rows to every tile
    of every frame, so its header features are the empty tiles': held only while they prefill."""

    features: torch.Tensor
    header_features: Optional[torch.Tensor] = None


@dataclass
class VisualInputs:
    """The visual side of a request, as one process (rank) holds it.

    kv:           hyper layer index (0-based) -> (k, v), each (1, S_kv, n_kv, hd) for this rank's
                  frames; any Mapping works (a dict of precomputed K/V, or a lazy mapping that
                  recomputes them from E).
    k_frame:      (1, S_kv) int64, global frame index of each local visual key (`Indices` when
                  the host knows them, so the kernels plan from the host).
    media_starts: (N_total,) int64, placeholder start token index of EVERY frame of the request (all
                  ranks'), sorted; it defines which frames each token sees (`Indices` when the host
                  knows them: a forward's q_vis is then known there too).
    window:       how many of the latest frames it may see a token sees (None: every one; 1: the
                  latest frame before it). The app's choice (`--media-attention`), never a family's.
    """

    kv: Mapping[int, tuple[torch.Tensor, torch.Tensor]]
    k_frame: MaskIndex
    media_starts: MaskIndex
    window: int | None = None

    @property
    def num_frames(self) -> int:
        return int(device_tensor(self.media_starts).numel())


@dataclass
class VisualStep:
    """VisualInputs bound to one forward's tokens: adds q_vis (B, L) int64 (`Indices` when the host
    knows it)."""

    kv: Mapping[int, tuple[torch.Tensor, torch.Tensor]]
    k_frame: MaskIndex
    q_vis: MaskIndex
    # every rank's q_vis on the host (rank order) in a sharded forward, when the host knows them
    q_vis_every: tuple[torch.Tensor, ...] | None = None
    window: int | None = None  # `VisualInputs.window`


# which frames each row sees, from the rows' positions and every frame's start: (1, L) -> (1, L)
VisibleFrames = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def local_frames(
    n: int, p: int, media_starts, frame_ids, device: torch.device
) -> tuple[Indices, torch.Tensor, Indices]:
    """(every frame's start, known on the host too; the `n` local frames' global ids on the host,
    default 0..n-1; each of their `p` keys' frame index) for a family's `prepare_visual`."""
    starts = Indices.of_host(torch.as_tensor(media_starts, dtype=torch.int64, device="cpu"), device)
    ids = torch.arange(n) if frame_ids is None else frame_ids
    ids_host = torch.as_tensor(ids, dtype=torch.int64, device="cpu")
    if ids_host.numel() != n:
        raise ValueError(f"{n} local frames but {ids_host.numel()} frame ids")
    k_frame = Indices.of_host(ids_host.repeat_interleave(p).view(1, n * p), device)
    return starts, ids_host, k_frame


def frames_kv(
    make_kv: Callable[[int, torch.Tensor], Any], e_local: torch.Tensor, layers, precompute: bool
) -> Mapping[int, Any]:
    """Every cross layer's K/V of the frames E a process holds, for a family's `prepare_visual`:
    made now without autograd (`precompute`: inference), or when a layer runs, from E
    (`LazyVisualKV`: finetuning with recompute). `make_kv(layer, e)` -> (k, v)."""
    if not precompute:
        return LazyVisualKV(make_kv, e_local, layers)
    with torch.no_grad():
        return {l: make_kv(l, e_local) for l in layers}


def frames_visual(
    make_kv: Callable[[int, torch.Tensor], Any],
    e_local: torch.Tensor,
    layers,
    media_starts,
    frame_ids,
    precompute: bool,
) -> VisualInputs:
    """The `VisualInputs` of the frames E (n, p, d) a process holds, each frame one media whose
    cross layers read its p keys (`local_frames`, `frames_kv`): a family's `prepare_visual`."""
    n, p, _ = e_local.shape
    starts, _, k_frame = local_frames(n, p, media_starts, frame_ids, e_local.device)
    kv = frames_kv(make_kv, e_local, layers, precompute)
    return VisualInputs(kv=kv, k_frame=k_frame, media_starts=starts)


def forward_positions(
    input_ids: torch.Tensor, positions: Optional[torch.Tensor], cache
) -> tuple[torch.Tensor, int]:
    """(the positions (1, L) of a forward's tokens on their device, where the cache ends): those
    given, else the ones that continue the cache."""
    start = cache.length if cache is not None else 0
    if positions is None:
        positions = torch.arange(start, start + input_ids.shape[1], device=input_ids.device)
    return positions.to(input_ids.device).view(1, -1), start


def known_q_vis(
    q_vis: torch.Tensor,
    positions: Optional[torch.Tensor],
    start: int,
    media_starts,
    visible: VisibleFrames,
    sees_own_start: bool,
) -> MaskIndex:
    """A forward's q_vis with what the host knows of it, so the attention plans its tiles without
    reading the device: rows after every frame's start (at it too when `sees_own_start`: a
    question, a decoded token) see every frame; positions given on the host give every value; on
    the device, nothing."""
    if not isinstance(media_starts, Indices) or media_starts.values is None:
        return q_vis
    if positions is None:
        last = media_starts.high
        if last is not None and (start > last or (start == last and sees_own_start)):
            frames = int(media_starts.values.numel())
            return Indices(q_vis, low=frames, high=frames)
        positions = torch.arange(start, start + q_vis.shape[1]).view(1, -1)
    if positions.device.type != "cpu":
        return q_vis
    return Indices(q_vis, values=visible(positions.view(1, -1), media_starts.values))


def every_rank_q_vis(feed: Feed, media_starts, visible: VisibleFrames):
    """Every rank's q_vis on the host in a sharded forward whose feed holds every rank's positions
    (so a ring round reads no received mask from the device), else None."""
    if feed.positions is None or not isinstance(media_starts, Indices):
        return None
    if media_starts.values is None:
        return None
    return tuple(visible(p, media_starts.values) for p in feed.positions)


def bind_visual(
    visual: Optional[VisualInputs],
    batch: int,
    positions: torch.Tensor,
    given: Optional[torch.Tensor],
    start: int,
    feed: Feed,
    visible: VisibleFrames,
    sees_own_start: bool,
) -> Optional[VisualStep]:
    """A forward's `VisualStep`: `visual` bound to the rows at `positions` (1, L) (`given`: the
    positions the caller gave, None when they continue the cache from `start`), with what the host
    knows of each row's frames; None without frames. Every family's forward binds it here."""
    if visual is None or visual.num_frames == 0:
        return None
    if batch != 1:
        raise ValueError("visual inputs need batch size 1 (one request per forward)")
    starts = visual.media_starts
    q_vis = visible(positions, device_tensor(starts))
    q_vis = known_q_vis(q_vis, given, start, starts, visible, sees_own_start)
    every = every_rank_q_vis(feed, starts, visible)
    return VisualStep(visual.kv, visual.k_frame, q_vis, every, visual.window)
