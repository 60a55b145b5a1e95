"""Mask planning: which query rows and keys of a block a kernel must see, and with which mask.

- `causal=True` is bottom-right aligned like flash-attn: query i sees key j iff j <= i + (Sk - Sq).
- Media mask: `q_vis` (B, Sq) int = how many frames query t may see; `k_frame` (B, Sk) int = frame
  index of key s; visible iff k_frame < q_vis. With a `window` of w frames, only the latest w of
  them: visible iff q_vis - w <= k_frame < q_vis (w = 1: the latest frame before the query, as
  OpenFlamingo's `only_attend_immediate_media`); its tiles are cut where the keys a row sees
  change at either end (`_window_tiles`), each tile run as the keys all its rows see, unmasked,
  and masked bands on either side.
- Both may be combined. Work that is fully hidden is skipped: each query tile is trimmed to the
  first..last query that sees something and the first..last key that some query sees, so hidden
  tiles never reach a kernel.
- A partly visible tile is split in two: the keys every row sees (no mask) and the band some rows
  see (a mask of tile rows x band keys only); the caller merges the two partial results with the
  log-sum-exp merge. Several plans may therefore cover the same rows, never the same (row, key)
  pair.
- Rows may be packed query groups (`gqa`): `group` rows per token, row r has the causal position r
  // group and its token's `q_vis`.
- A causal square (each token one key more than the one before, as the diagonal block of a sharded
  text self-attention, or plain causal attention) is one native causal kernel call (`causal` plan:
  token i sees key j iff j <= i), after one unmasked call for the keys every row sees; packed
  query groups are folded into the batch for it by the kernels. No mask, no tiling.
- Media-mask tiles are cut where their rows start to see another local key once they hold
  `min_tile(device)` tokens (longer on a GPU, where every call is a launch and a merge), so a
  tile's band spans few frames and the triangle is not computed as its rectangle; a tile whose
  rows all see the same keys needs no mask and is never cut. Local keys sorted by frame (every
  layout of lvx_app/parallel/layout.py) keep each row's visible keys a prefix.
- Host copies: planning decides on the host. A q_vis or k_frame made where the host knows its
  values (the engine's positions, a video's frames) is passed as `Indices`: the tensor and what the
  host knows of it, so planning reads no device memory; a decoded token, which sees every frame, is
  planned from two integers. A plain tensor is copied to the host once per call.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterator

import torch

# Query tokens per tile (x group rows when query groups are packed) of a tile with a band mask;
# tests shrink it.
Q_TILE = 256
# Fewest query tokens of a media-mask tile that is cut early, where its rows start to see another
# key: on the CPU kernel short tiles (narrow bands) measured fastest; on a GPU each call also costs
# a launch and a merge.
MIN_TILE = 32
MIN_TILE_CUDA = 128


def min_tile(device: torch.device | str) -> int:
    """Fewest tokens of a media-mask tile cut early, for a kernel on `device`."""
    return MIN_TILE_CUDA if torch.device(device).type == "cuda" else MIN_TILE


@dataclass(frozen=True)
class Indices:
    """Integer indices on their device (a q_vis, a k_frame, the frames' placeholder starts) and
    what the host knows of them without reading the device: their smallest and largest value (None
    when unknown) and every value, on the CPU (None when unknown). The kernels take one wherever
    they take a q_vis or k_frame tensor."""

    tensor: torch.Tensor
    low: int | None = None
    high: int | None = None
    values: torch.Tensor | None = None

    @classmethod
    def of_host(cls, values: torch.Tensor, device: torch.device | str) -> "Indices":
        """`values` (on the host) on `device`, with both bounds read once here."""
        if not values.numel():
            return cls(values.to(device), values=values)
        return cls(values.to(device), int(values.min()), int(values.max()), values)

    def as_type(self, dtype: torch.dtype) -> "Indices":
        """The same indices as `dtype` (what the host knows still holds)."""
        return replace(self, tensor=self.tensor.to(dtype).contiguous())


MaskIndex = torch.Tensor | Indices  # what the kernels take as q_vis or k_frame


def device_tensor(t: MaskIndex | None) -> torch.Tensor | None:
    """The tensor of `t` on its device."""
    return t.tensor if isinstance(t, Indices) else t


def pack_vis(q_vis: MaskIndex | None, group: int) -> MaskIndex | None:
    """Each packed query row keeps its token's visible-frame count (what the host knows too)."""
    if q_vis is None or group == 1:
        return q_vis
    if not isinstance(q_vis, Indices):
        return q_vis.repeat_interleave(group, dim=1)
    values = None if q_vis.values is None else q_vis.values.repeat_interleave(group, dim=1)
    packed = q_vis.tensor.repeat_interleave(group, dim=1)
    return Indices(packed, q_vis.low, q_vis.high, values)


def _host_values(t: MaskIndex) -> torch.Tensor:
    """`t`'s values on the host: what the host knows, or one copy from the device."""
    if isinstance(t, Indices) and t.values is not None:
        return t.values.to(torch.long)
    return device_tensor(t).to(torch.long).cpu()


def sees_every_key(q_vis: MaskIndex, k_frame: MaskIndex, window: int | None = None) -> bool:
    """Whether what the host knows alone says every row sees every key (no device read)."""
    if not (isinstance(q_vis, Indices) and isinstance(k_frame, Indices)):
        return False
    known = q_vis.low is not None and k_frame.high is not None
    if not (known and q_vis.low > k_frame.high):
        return False
    return window is None or (k_frame.low is not None and q_vis.high - window <= k_frame.low)


@dataclass
class TilePlan:
    """What to compute for one query tile: rows [q0, q1), keys [k0, k1) (absolute)."""

    q0: int
    q1: int
    k0: int
    k1: int
    mask: torch.Tensor | None  # bool (B, q1-q0, k1-k0), True = visible; None = all visible
    # native causal on a square slice: the token of row r (r // group, slice-local) sees key j iff
    # j <= r // group
    causal: bool
    dead: torch.Tensor | None  # bool (B, q1-q0) rows that see no key in the slice


def _span(flags: torch.Tensor) -> tuple[int, int] | None:
    """First and one-past-last True index of a 1-D bool tensor, or None."""
    idx = torch.nonzero(flags).flatten()
    if idx.numel() == 0:
        return None
    return int(idx[0]), int(idx[-1]) + 1


def causal_visibility(nq: int, nk: int, off: int, device) -> torch.Tensor:
    """(nq, nk) bool: key j visible to query i iff j <= i + off."""
    i = torch.arange(nq, device=device).unsqueeze(1)
    j = torch.arange(nk, device=device).unsqueeze(0)
    return j <= i + off


def _leading(flags: torch.Tensor) -> int:
    """How many leading entries of a 1-D bool tensor are True."""
    return int(flags.long().cumprod(0).sum())


def _square(q0: int, q1: int, first: int, group: int) -> list[TilePlan]:
    """Rows [q0, q1) whose i-th token sees keys [0, first + i]: the keys before `first`, which
    every row sees, unmasked, and a square causal block; no mask."""
    tokens = (q1 - q0) // group
    if tokens == 1:  # one token (a decoded one) sees every key up to its own: one unmasked call
        return [TilePlan(q0, q1, 0, first + 1, None, False, None)]
    parts = [TilePlan(q0, q1, 0, first, None, False, None)] if first > 0 else []
    return parts + [TilePlan(q0, q1, first, first + tokens, None, True, None)]


def _plan_causal(t0: int, t1: int, coff: int, group: int) -> list[TilePlan]:
    """Causal only: row r (token r // group) sees keys j <= r // group + coff. The rows that see a
    key are one `_square` (tokens before -coff see none)."""
    u0 = max(t0 // group, -coff)
    if u0 * group >= t1:
        return []
    return _square(u0 * group, t1, u0 + coff, group)


def _plan_media(
    t0: int, t1: int, q_vis, k_frame, q_vis_cpu, k_frame_cpu, ordered: bool
) -> list[TilePlan]:
    """Media mask only: every decision is taken on the host copies (no device syncs); the keys
    every row sees go unmasked, and only the band some rows see gets a mask, built on the device.
    Keys sorted by frame (every row then sees a prefix of them) are bounded by a search per tile,
    so the host work does not grow with the keys (`ordered`: they are, `_ordered`)."""
    if ordered:
        bounds = _sorted_bounds(q_vis_cpu[:, t0:t1], k_frame_cpu)
    else:
        bounds = _scanned_bounds(q_vis_cpu[:, t0:t1], k_frame_cpu)
    if bounds is None:
        return []
    r0, r1, k0, kb, k1, dead = bounds
    q0, q1 = t0 + r0, t0 + r1
    parts = [TilePlan(q0, q1, k0, kb, None, False, None)] if kb > k0 else []
    if kb < k1:
        vis = k_frame[:, kb:k1].unsqueeze(1) < q_vis[:, q0:q1].unsqueeze(2)
        # rows that see no key of the band: decided on the host, marked on the device
        parts.append(TilePlan(q0, q1, kb, k1, vis, False, ~vis.any(2) if dead else None))
    return parts


Bounds = tuple[int, int, int, int, int, bool]  # rows [r0, r1), keys [k0, kb) all seen, [kb, k1)


def _ordered(kf_c: torch.Tensor) -> bool:
    """Whether every batch row's keys are sorted by frame (each query then sees a prefix)."""
    return kf_c.shape[1] < 2 or bool((kf_c[:, 1:] >= kf_c[:, :-1]).all())


def _sorted_bounds(qv_c: torch.Tensor, kf_c: torch.Tensor) -> Bounds | None:
    """`_scanned_bounds` for keys sorted by frame: a search per batch row, O(tile + log keys)."""
    rs = _span((qv_c > kf_c[:, :1]).any(0))
    if rs is None:
        return None
    r0, r1 = rs
    qv_c = qv_c[:, r0:r1]
    k1 = int(torch.searchsorted(kf_c, qv_c.amax(1, keepdim=True).contiguous()).max())
    every = torch.searchsorted(kf_c, qv_c.amin(1, keepdim=True).contiguous())
    kb = min(int(every.min()), k1)
    dead = kb < k1 and bool((qv_c <= kf_c[:, kb : kb + 1]).any())
    return r0, r1, 0, kb, k1, dead


def _scanned_bounds(qv_c: torch.Tensor, kf_c: torch.Tensor) -> Bounds | None:
    """(rows [r0, r1) of the tile that see some key; keys [k0, k1) some row sees, of which
    [k0, kb) every row sees; whether some row sees no key of [kb, k1)), from every key."""
    rs = _span((qv_c > kf_c.amin(1, keepdim=True)).any(0))
    cs = _span((kf_c < qv_c.amax(1, keepdim=True)).any(0))
    if rs is None or cs is None:
        return None
    (r0, r1), (k0, k1) = rs, cs
    qv_c = qv_c[:, r0:r1]
    kb = k0 + _leading((kf_c[:, k0:k1] < qv_c.amin(1, keepdim=True)).all(0))
    dead = kb < k1 and bool((qv_c <= kf_c[:, kb:k1].amin(1, keepdim=True)).any())
    return r0, r1, k0, kb, k1, dead


def _plan_media_causal(
    t0: int, t1: int, sk: int, coff: int, group: int, q_vis, k_frame, device
) -> list[TilePlan]:
    """Media mask and causal together: one dense visibility of the tile, trimmed to what is seen and
    split into the keys every row sees and the masked band."""
    pos = torch.arange(t0, t1, device=device) // group + coff
    full = (k_frame.unsqueeze(1) < q_vis[:, t0:t1].unsqueeze(2)) & (
        torch.arange(sk, device=device) <= pos.unsqueeze(1)
    )
    rs = _span(full.any(2).any(0))
    cs = _span(full.any(1).any(0))
    if rs is None or cs is None:
        return []
    (r0, r1), (k0, k1) = rs, cs
    vis = full[:, r0:r1, k0:k1]
    kb = _leading(vis.all(1).all(0))
    parts = [TilePlan(t0 + r0, t0 + r1, k0, k0 + kb, None, False, None)] if kb else []
    if k0 + kb < k1:
        band = vis[:, :, kb:]
        dead = ~band.any(2)
        parts.append(
            TilePlan(t0 + r0, t0 + r1, k0 + kb, k1, band, False, dead if bool(dead.any()) else None)
        )
    return parts


def _keys_seen(group: int, qv_c: torch.Tensor, kf_c: torch.Tensor) -> tuple[list[int], bool]:
    """(how many local keys each token sees, at most over the batch; whether each token sees a
    prefix of the keys and the same one in every batch row, so a run where that count grows by one
    per token is a causal square)."""
    every = torch.searchsorted(kf_c.contiguous(), qv_c[:, ::group].contiguous())
    seen = every.amax(0)
    prefix = bool((kf_c[:, 1:] >= kf_c[:, :-1]).all()) and bool((every == seen).all())
    return seen.tolist(), prefix


def _squares_from(seen: list[int], shortest: int) -> list[int]:
    """For each token, the length of the causal square starting there (each following token sees
    exactly one key more), or 0 when shorter than `shortest` or when its first token sees no key."""
    run = [1] * len(seen)
    for t in range(len(seen) - 2, -1, -1):
        if seen[t + 1] == seen[t] + 1:
            run[t] = run[t + 1] + 1
    return [n if n >= shortest and seen[t] >= 1 else 0 for t, n in enumerate(run)]


def _media_tiles(
    rows: int, group: int, qv_c: torch.Tensor, kf_c: torch.Tensor, shortest: int
) -> list[tuple[int, int, int | None]]:
    """(first row, end row, the first key of its causal square or None) of each tile: causal
    squares of at least `shortest` tokens whole; other tiles cut after `shortest` tokens where the
    keys a token sees change, and after Q_TILE tokens where the next token would give them a band
    (a tile whose rows all see the same keys runs on)."""
    seen, prefix = _keys_seen(group, qv_c, kf_c)
    squares = _squares_from(seen, shortest) if prefix else [0] * len(seen)
    tiles, t0, tokens = [], 0, len(seen)
    while t0 < tokens:
        if squares[t0]:
            t1 = t0 + squares[t0]
            tiles.append((t0 * group, t1 * group, seen[t0] - 1))
            t0 = t1
            continue
        t1 = t0 + 1
        while t1 < tokens and not squares[t1]:
            grows, long = seen[t1] != seen[t1 - 1], t1 - t0
            if (grows and long >= shortest) or (long >= Q_TILE and seen[t1] != seen[t0]):
                break
            t1 += 1
        tiles.append((t0 * group, min(t1 * group, rows), None))
        t0 = t1
    return tiles


def tile_plans(
    q: torch.Tensor,
    k: torch.Tensor,
    causal: bool,
    q_vis,
    k_frame,
    group: int = 1,
    min_tokens: int | None = None,
    window: int | None = None,
) -> Iterator[TilePlan]:
    """The plans of every query tile of (q, k) that sees at least one key, in row order.

    q: (B, rows, H, D) with `group` packed rows per token (see `gqa`); q_vis: (B, rows), packed
    with them (`pack_vis`, what the host knows too). `min_tokens`: the tiles of another device than
    q's (`min_tile`; a plan counted on the meta device). `window`: each row sees only the latest
    `window` frames of its q_vis (media mask only)."""
    rows, sk = q.shape[1], k.shape[1]
    if not rows or not sk:
        return
    coff = (sk - rows // group) if causal else None
    if q_vis is None:
        yield from (_plan_causal(0, rows, coff, group) if causal else [_whole(rows, sk)])
        return
    if not causal and sees_every_key(q_vis, k_frame, window):
        yield _whole(rows, sk)  # a question, a decoded token: decided without a device read
        return
    qv_c, kf_c = _host_values(q_vis), _host_values(k_frame)
    q_vis = device_tensor(q_vis).to(device=q.device, dtype=torch.long)
    k_frame = device_tensor(k_frame).to(device=q.device, dtype=torch.long)
    if causal:
        for t0, t1 in _tiles(rows, group):
            yield from _plan_media_causal(t0, t1, sk, coff, group, q_vis, k_frame, q.device)
        return
    above = window is None or int(qv_c.amax()) - window <= int(kf_c.amin())
    if int(qv_c.amin()) > int(kf_c.amax()) and above:
        yield _whole(rows, sk)  # every row sees every key
        return
    shortest, ordered = min_tokens or min_tile(q.device), _ordered(kf_c)
    if window is not None:
        yield from _window_plans(group, window, q_vis, k_frame, qv_c, kf_c, shortest)
        return
    for t0, t1, first in _media_tiles(rows, group, qv_c, kf_c, shortest):
        if first is not None:
            yield from _square(t0, t1, first, group)
        else:
            yield from _plan_media(t0, t1, q_vis, k_frame, qv_c, kf_c, ordered)


def _key_ranges(group: int, lo_c, qv_c, kf_c) -> tuple[list[int], ...]:
    """Per token, the keys it sees when it sees frames [lo, q_vis): (first, end) of the widest
    range over the batch rows, (first, end) of the range every batch row's token sees (for keys in
    any order, the range from its smallest to its largest seen key, and nothing every row sees)."""
    if not _ordered(kf_c):
        keys = kf_c.unsqueeze(1)
        seen = (keys >= lo_c[:, ::group, None]) & (keys < qv_c[:, ::group, None])
        index = torch.arange(kf_c.shape[1])
        first = torch.where(seen, index, kf_c.shape[1]).amin(2).amin(0)
        end = torch.maximum(first, torch.where(seen, index + 1, 0).amax(2).amax(0))
        return first.tolist(), end.tolist(), end.tolist(), end.tolist()
    kf_c = kf_c.contiguous()
    firsts = torch.searchsorted(kf_c, lo_c[:, ::group].contiguous())
    ends = torch.maximum(firsts, torch.searchsorted(kf_c, qv_c[:, ::group].contiguous()))
    wide = firsts.amin(0).tolist(), ends.amax(0).tolist()
    return *wide, firsts.amax(0).tolist(), ends.amin(0).tolist()


def _window_tiles(first: list[int], end: list[int], shortest: int) -> list[tuple[int, int]]:
    """[t0, t1) tokens of each tile of a windowed media mask: cut after `shortest` tokens where the
    keys a token sees change at either end, after Q_TILE where they differ from the tile's first
    token's (a tile whose tokens all see the same keys runs on)."""
    tiles, t0, tokens = [], 0, len(first)
    while t0 < tokens:
        t1 = t0 + 1
        while t1 < tokens:
            now, before = (first[t1], end[t1]), (first[t1 - 1], end[t1 - 1])
            long = t1 - t0
            if (now != before and long >= shortest) or (
                long >= Q_TILE and now != (first[t0], end[t0])
            ):
                break
            t1 += 1
        tiles.append((t0, t1))
        t0 = t1
    return tiles


def _window_plans(
    group: int, window: int, q_vis, k_frame, qv_c, kf_c, shortest: int
) -> Iterator[TilePlan]:
    """The plans of a media mask with a window (row r sees the keys of frames [q_vis - window,
    q_vis)): per tile, the keys every row of it sees unmasked and a masked band on either side of
    them; decided on the host, the masks built on the device."""
    first, end, core_first, core_end = _key_ranges(group, qv_c - window, qv_c, kf_c)
    for t0, t1 in _window_tiles(first, end, shortest):
        seeing = [t for t in range(t0, t1) if first[t] < end[t]]
        if not seeing:
            continue
        span = range(seeing[0], seeing[-1] + 1)
        k0, k1 = min(first[t] for t in seeing), max(end[t] for t in seeing)
        a, b = max(core_first[t] for t in span), min(core_end[t] for t in span)
        a, b = (a, b) if a < b else (k1, k1)
        r0, r1 = span[0] * group, span[-1] * group + group
        if a < b:
            yield TilePlan(r0, r1, a, b, None, False, None)
        for kb, ke in ((k0, a), (b, k1)):
            if kb >= ke:
                continue
            keys = k_frame[:, kb:ke].unsqueeze(1)
            vis = (keys >= q_vis[:, r0:r1, None] - window) & (keys < q_vis[:, r0:r1, None])
            blind = any(max(core_first[t], kb) >= min(core_end[t], ke) for t in span)
            yield TilePlan(r0, r1, kb, ke, vis, False, ~vis.any(2) if blind else None)


def _whole(rows: int, sk: int) -> TilePlan:
    return TilePlan(0, rows, 0, sk, None, False, None)


def _tiles(rows: int, group: int) -> list[tuple[int, int]]:
    step = Q_TILE * group
    return [(t, min(rows, t + step)) for t in range(0, rows, step)]


def lone_plan(plans: Iterator[TilePlan]) -> tuple[TilePlan | None, Iterator[TilePlan]]:
    """(the plan when `plans` holds exactly one, else None; every plan in order). At most the first
    two are planned ahead, and the iterator lets each go once it is taken, so a band mask lives only
    with its tile."""
    held = [p for p in (next(plans, None), next(plans, None)) if p is not None]
    lone = held[0] if len(held) == 1 else None

    def every() -> Iterator[TilePlan]:
        while held:
            yield held.pop(0)
        yield from plans

    return lone, every()
