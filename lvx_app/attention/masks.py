"""Mask planning: which query rows and keys of a block a kernel must see, and with which mask.

- `causal=True` is bottom-right aligned like flash-attn: query i sees key j iff
  j <= i + (Sk - Sq).
- Media mask: `q_vis` (B, Sq) int = how many frames query t may see;
  `k_frame` (B, Sk) int = frame index of key s; visible iff k_frame < q_vis.
- Both may be combined. Work that is fully hidden is skipped: queries are
  processed in tiles of `Q_TILE` rows (media mask only) and each tile is
  trimmed to the first..last query that sees something and the first..last key
  that some query sees (with frame-sorted keys that is the visible prefix), so
  hidden tiles never reach a kernel; only partially visible tiles get a mask.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch

#: Query rows per tile when a media mask is present (tests shrink it).
Q_TILE = 256


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


def _plan_causal(t0: int, t1: int, sk: int, coff: int, batch: int, device) -> TilePlan | None:
    """Causal only: rows i with i + coff < 0 see nothing; every key up to t1-1+coff is seen."""
    q0 = max(t0, -coff)
    k1 = min(sk, t1 - 1 + coff + 1)
    if q0 >= t1 or k1 <= 0:
        return None
    off = coff + q0  # slice-local offset: key j visible to local row i iff j <= i + off
    nq, nk = t1 - q0, k1
    if off >= nk - 1:
        return TilePlan(q0, t1, 0, k1, None, False, None)
    if off == 0 and nq == nk:
        return TilePlan(q0, t1, 0, k1, None, True, None)
    vis = causal_visibility(nq, nk, off, device).unsqueeze(0).expand(batch, nq, nk)
    return TilePlan(q0, t1, 0, k1, vis, False, None)


def _plan_media(t0: int, t1: int, q_vis, k_frame, q_vis_cpu, k_frame_cpu, device) -> TilePlan | None:
    """Media mask only: every decision is taken on small CPU copies (no device syncs);
    only the dense mask of a partially visible tile is built on the device."""
    qv_c, kf_c = q_vis_cpu[:, t0:t1], k_frame_cpu
    rs = _span((qv_c > kf_c.amin(1, keepdim=True)).any(0))
    cs = _span((kf_c < qv_c.amax(1, keepdim=True)).any(0))
    if rs is None or cs is None:
        return None
    (r0, r1), (k0, k1) = rs, cs
    qv_c, kf_c = qv_c[:, r0:r1], kf_c[:, k0:k1]
    if bool((kf_c.amax(1) < qv_c.amin(1)).all()):
        return TilePlan(t0 + r0, t0 + r1, k0, k1, None, False, None)
    dead = qv_c <= kf_c.amin(1, keepdim=True)  # (B, rows): sees no key of the slice
    vis = k_frame[:, k0:k1].unsqueeze(1) < q_vis[:, t0 + r0 : t0 + r1].unsqueeze(2)
    return TilePlan(t0 + r0, t0 + r1, k0, k1, vis, False, dead.to(device) if bool(dead.any()) else None)


def _plan_media_causal(t0: int, t1: int, sk: int, coff: int, q_vis, k_frame, device) -> TilePlan | None:
    """Media mask and causal together: one dense visibility of the tile, trimmed to what is seen."""
    qv = q_vis[:, t0:t1]
    full = (k_frame.unsqueeze(1) < qv.unsqueeze(2)) & causal_visibility(t1 - t0, sk, coff + t0, device)
    rs = _span(full.any(2).any(0))
    cs = _span(full.any(1).any(0))
    if rs is None or cs is None:
        return None
    (r0, r1), (k0, k1) = rs, cs
    vis = full[:, r0:r1, k0:k1]
    dead = ~vis.any(2)
    return TilePlan(t0 + r0, t0 + r1, k0, k1, vis, False, dead if bool(dead.any()) else None)


def _plan_tile(t0, t1, sk, coff, q_vis, k_frame, q_vis_cpu, k_frame_cpu, batch, device) -> TilePlan | None:
    """Plan query rows [t0, t1) against all sk keys. coff: causal offset (j <= i + coff) or None.

    q_vis / k_frame: int64 on the device; *_cpu: the same on the CPU."""
    if t1 <= t0 or sk == 0:
        return None
    if q_vis is None and coff is None:
        return TilePlan(t0, t1, 0, sk, None, False, None)
    if q_vis is None:
        return _plan_causal(t0, t1, sk, coff, batch, device)
    if coff is None:
        return _plan_media(t0, t1, q_vis, k_frame, q_vis_cpu, k_frame_cpu, device)
    return _plan_media_causal(t0, t1, sk, coff, q_vis, k_frame, device)


def _tiles(sq: int, tiled: bool) -> list[tuple[int, int]]:
    if not tiled or sq <= Q_TILE:
        return [(0, sq)]
    return [(t, min(sq, t + Q_TILE)) for t in range(0, sq, Q_TILE)]


def tile_plans(q: torch.Tensor, k: torch.Tensor, causal: bool, q_vis, k_frame) -> Iterator[TilePlan]:
    """The plans of every query tile of (q, k) that sees at least one key, in row order."""
    sq, sk = q.shape[1], k.shape[1]
    coff = (sk - sq) if causal else None
    qv_c = kf_c = None
    if q_vis is not None and sq and sk:
        q_vis = q_vis.to(device=q.device, dtype=torch.long)
        k_frame = k_frame.to(device=q.device, dtype=torch.long)
        qv_c, kf_c = q_vis.cpu(), k_frame.cpu()
    for t0, t1 in _tiles(sq, q_vis is not None):
        p = _plan_tile(t0, t1, sk, coff, q_vis, k_frame, qv_c, kf_c, q.shape[0], q.device)
        if p is not None:
            yield p
