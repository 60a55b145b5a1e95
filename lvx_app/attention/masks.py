"""Mask planning: which query rows and keys of a block a kernel must see, and with which mask.

- `causal=True` is bottom-right aligned like flash-attn: query i sees key j iff j <= i + (Sk - Sq).
- Media mask: `q_vis` (B, Sq) int = how many frames query t may see; `k_frame` (B, Sk) int = frame
  index of key s; visible iff k_frame < q_vis.
- Both may be combined. Work that is fully hidden is skipped: queries are processed in tiles of
  `Q_TILE` tokens (media mask, or causal with packed query groups) and each tile is trimmed to the
  first..last query that sees something and the first..last key that some query sees, so hidden
  tiles never reach a kernel.
- A partly visible tile is split in two: the keys every row sees (no mask) and the band some rows
  see (a mask of tile rows x band keys only); the caller merges the two partial results with the
  log-sum-exp merge. Several plans may therefore cover the same rows, never the same (row, key)
  pair.
- Rows may be packed query groups (`gqa`): `group` rows per token, row r has the causal position r
  // group and its token's `q_vis`.
- Media-mask tiles are cut where their rows start to see another local key once they hold `MIN_TILE`
  tokens, so a tile's band spans few frames and the triangle is not computed as its rectangle. Local
  keys sorted by frame (every layout of lvx_app/parallel/layout.py) keep each row's visible keys a
  prefix.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch

# Query tokens per tile (x group rows when query groups are packed); tests shrink it.
Q_TILE = 256
# Fewest query tokens of a media-mask tile that is cut early, where its rows start to see another
# key.
MIN_TILE = 32


@dataclass
class TilePlan:
    """What to compute for one query tile: rows [q0, q1), keys [k0, k1) (absolute)."""

    q0: int
    q1: int
    k0: int
    k1: int
    mask: torch.Tensor | None  # bool (B, q1-q0, k1-k0), True = visible; None = all visible
    causal: bool  # native causal on the slice: key j visible iff j <= i (slice-local)
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


def _plan_causal(
    t0: int, t1: int, sk: int, coff: int, group: int, batch: int, device
) -> list[TilePlan]:
    """Causal only: row r (token r // group) sees keys j <= r // group + coff.

    Keys [0, lo) are seen by every row of the tile; the band [lo, hi) gets a mask of the rows that
    see some of it. One token per row with Sq == Sk keeps the native causal."""
    q0 = max(t0, -coff * group)
    hi = min(sk, (t1 - 1) // group + coff + 1)
    if q0 >= t1 or hi <= 0:
        return []
    lo = min(hi, q0 // group + coff + 1)
    if group == 1 and lo == 1 and t1 - q0 == hi:
        return [TilePlan(q0, t1, 0, hi, None, True, None)]
    parts = [TilePlan(q0, t1, 0, lo, None, False, None)] if lo > 0 else []
    if lo < hi:
        b0 = max(q0, (lo - coff) * group)  # first row that sees key lo
        pos = torch.arange(b0, t1, device=device) // group + coff
        vis = (
            (torch.arange(lo, hi, device=device).unsqueeze(0) <= pos.unsqueeze(1))
            .unsqueeze(0)
            .expand(batch, -1, -1)
        )
        parts.append(TilePlan(b0, t1, lo, hi, vis, False, None))
    return parts


def _plan_media(t0: int, t1: int, q_vis, k_frame, q_vis_cpu, k_frame_cpu, device) -> list[TilePlan]:
    """Media mask only: every decision is taken on small CPU copies (no device syncs); the keys
    every row sees go unmasked, and only the band some rows see gets a mask, built on the device."""
    qv_c, kf_c = q_vis_cpu[:, t0:t1], k_frame_cpu
    rs = _span((qv_c > kf_c.amin(1, keepdim=True)).any(0))
    cs = _span((kf_c < qv_c.amax(1, keepdim=True)).any(0))
    if rs is None or cs is None:
        return []
    (r0, r1), (k0, k1) = rs, cs
    q0, q1 = t0 + r0, t0 + r1
    qv_c = qv_c[:, r0:r1]
    kb = k0 + _leading((kf_c[:, k0:k1] < qv_c.amin(1, keepdim=True)).all(0))
    parts = [TilePlan(q0, q1, k0, kb, None, False, None)] if kb > k0 else []
    if kb < k1:
        dead = qv_c <= kf_c[:, kb:k1].amin(1, keepdim=True)  # (B, rows): sees no key of the band
        vis = k_frame[:, kb:k1].unsqueeze(1) < q_vis[:, q0:q1].unsqueeze(2)
        parts.append(
            TilePlan(q0, q1, kb, k1, vis, False, dead.to(device) if bool(dead.any()) else None)
        )
    return parts


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


def _plan_tile(
    t0, t1, sk, coff, group, q_vis, k_frame, q_vis_cpu, k_frame_cpu, batch, device
) -> list[TilePlan]:
    """Plan query rows [t0, t1) against all sk keys. coff: causal offset (j <= r // group + coff) or
    None.

    q_vis / k_frame: int64 on the device, one q_vis per row; *_cpu: the same on the CPU."""
    if t1 <= t0 or sk == 0:
        return []
    if q_vis is None and coff is None:
        return [TilePlan(t0, t1, 0, sk, None, False, None)]
    if q_vis is None:
        return _plan_causal(t0, t1, sk, coff, group, batch, device)
    if coff is None:
        return _plan_media(t0, t1, q_vis, k_frame, q_vis_cpu, k_frame_cpu, device)
    return _plan_media_causal(t0, t1, sk, coff, group, q_vis, k_frame, device)


def _tiles(rows: int, tiled: bool, group: int) -> list[tuple[int, int]]:
    step = Q_TILE * group
    if not tiled or rows <= step:
        return [(0, rows)]
    return [(t, min(rows, t + step)) for t in range(0, rows, step)]


def _media_tiles(
    rows: int, group: int, qv_c: torch.Tensor, kf_c: torch.Tensor
) -> list[tuple[int, int]]:
    """Row tiles of at most Q_TILE tokens, cut early (after MIN_TILE tokens) where the keys a token
    sees change."""
    # keys per token
    seen = torch.searchsorted(kf_c.contiguous(), qv_c[:, ::group].contiguous()).amax(0).tolist()
    tiles, t0 = [], 0
    for t in range(1, len(seen)):
        if t - t0 >= Q_TILE or (t - t0 >= MIN_TILE and seen[t] != seen[t - 1]):
            tiles.append((t0 * group, t * group))
            t0 = t
    return tiles + [(t0 * group, rows)]


def tile_plans(
    q: torch.Tensor, k: torch.Tensor, causal: bool, q_vis, k_frame, group: int = 1
) -> Iterator[TilePlan]:
    """The plans of every query tile of (q, k) that sees at least one key, in row order.

    q: (B, rows, H, D) with `group` packed rows per token (see `gqa`); q_vis: (B, rows)."""
    rows, sk = q.shape[1], k.shape[1]
    coff = (sk - rows // group) if causal else None
    qv_c = kf_c = None
    if q_vis is not None and rows and sk:
        q_vis = q_vis.to(device=q.device, dtype=torch.long)
        k_frame = k_frame.to(device=q.device, dtype=torch.long)
        qv_c, kf_c = q_vis.cpu(), k_frame.cpu()
    if qv_c is not None and not causal and int(qv_c.amin()) > int(kf_c.amax()):
        # every row sees every key (a question, a decoded token)
        yield TilePlan(0, rows, 0, sk, None, False, None)
        return
    if qv_c is not None and not causal:
        tiles = _media_tiles(rows, group, qv_c, kf_c)
    else:
        tiles = _tiles(rows, q_vis is not None or (causal and group > 1), group)
    for t0, t1 in tiles:
        yield from _plan_tile(
            t0, t1, sk, coff, group, q_vis, k_frame, qv_c, kf_c, q.shape[0], q.device
        )


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
