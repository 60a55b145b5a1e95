"""Attention with ALiBi (MPT's text attention): head h adds slope_h * (key position - query
position) to its scores. No fused kernel here takes the bias, so this is the dense path: the scores
of a block of query rows at a time (bounded memory), in float32 (float64 for float64 inputs), the
(out, lse) of `kernels.attn_fwd` and the gradients of `kernels.attn_bwd`.

The positions are the ones the mask is made of, so a block of a sharded attention adds the same
bias one process does: with a media mask the text causality of a sharded forward (query position
= q_vis - 1, key position = k_frame, visible iff k_frame < q_vis); with `causal` alone the
bottom-right alignment (query i at position i + Sk - Sq, key j at j); with `used` (one decoded
token against the first `used` keys of a buffer) the query at used - 1. Masks combine as in
`masks`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lvx_kernels.masks import MaskIndex, device_tensor
from lvx_kernels.merge import acc_dtype

# most scores (rows x keys x heads) one block of query rows computes at once
SCORES_PER_BLOCK = 2**24


def _positions(
    q: Tensor, k: Tensor, causal: bool, q_vis, k_frame, used: Tensor | None
) -> tuple[Tensor, Tensor, Tensor | None]:
    """(query positions (B, Sq), key positions (B, Sk), visible (B, Sq, Sk) or None: all)."""
    b, sq, sk, dev = q.shape[0], q.shape[1], k.shape[1], q.device
    keys = torch.arange(sk, device=dev).expand(b, sk)
    if used is not None:
        qpos = (used.to(dev, torch.int64) - 1).view(b, 1).expand(b, sq)
        return qpos, keys, (keys < used.view(b, 1).to(dev))[:, None, :].expand(b, sq, sk)
    if q_vis is not None:
        qv, kf = device_tensor(q_vis).to(dev, torch.int64), device_tensor(k_frame).to(dev)
        seen = kf.to(torch.int64)[:, None, :] < qv[:, :, None]
        if causal:
            seen = seen & _causal(sq, sk, dev)[None]
        return qv - 1, kf.to(torch.int64), seen
    if not causal:
        raise ValueError("ALiBi needs the query positions: pass causal=True or a media mask")
    qpos = (torch.arange(sq, device=dev) + sk - sq).expand(b, sq)
    return qpos, keys, _causal(sq, sk, dev)[None].expand(b, sq, sk)


def _causal(sq: int, sk: int, dev) -> Tensor:
    return torch.arange(sk, device=dev)[None, :] <= torch.arange(sq, device=dev)[:, None] + sk - sq


def _scores(q, k, slopes, scale, qpos, kpos, seen) -> Tensor:
    """Biased, masked scores (B, H, rows, Sk) in the accumulation dtype; K/V heads repeated."""
    ct = acc_dtype(q)
    g = q.shape[2] // k.shape[2]
    kk = k.repeat_interleave(g, dim=2) if g > 1 else k
    s = torch.einsum("bqhd,bkhd->bhqk", q.to(ct), kk.to(ct)) * scale
    rel = (kpos[:, None, :] - qpos[:, :, None]).to(ct)  # (B, rows, Sk)
    s = s + slopes.to(s.device, ct).view(1, -1, 1, 1) * rel[:, None]
    if seen is not None:
        s = s.masked_fill(~seen[:, None], float("-inf"))
    return s


def _blocks(q: Tensor, k: Tensor):
    rows = max(1, SCORES_PER_BLOCK // max(1, k.shape[1] * q.shape[2]))
    return [slice(i, min(i + rows, q.shape[1])) for i in range(0, q.shape[1], rows)]


def alibi_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    slopes: Tensor,
    scale: float,
    causal: bool = False,
    q_vis: MaskIndex | None = None,
    k_frame: MaskIndex | None = None,
    used: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """(out (B, Sq, Hq, D) in q's dtype, lse (B, Hq, Sq)); a row that sees no key: 0 and -inf."""
    qpos, kpos, seen = _positions(q, k, causal, q_vis, k_frame, used)
    ct = acc_dtype(q)
    g = q.shape[2] // k.shape[2]
    vv = (v.repeat_interleave(g, dim=2) if g > 1 else v).to(ct)
    outs, lses = [], []
    for r in _blocks(q, k):
        rows_seen = None if seen is None else seen[:, r]
        s = _scores(q[:, r], k, slopes, scale, qpos[:, r], kpos, rows_seen)
        lse = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - lse.masked_fill(lse == float("-inf"), 0)[..., None])
        outs.append(torch.einsum("bhqk,bkhd->bqhd", p, vv))
        lses.append(lse)
    return torch.cat(outs, dim=1).to(q.dtype), torch.cat(lses, dim=2)


def alibi_bwd(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    slopes: Tensor,
    scale: float,
    causal: bool = False,
    q_vis: MaskIndex | None = None,
    k_frame: MaskIndex | None = None,
    dlse: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of `alibi_fwd` given out and lse (possibly merged over more keys than k: then
    this block's share of dq and its exact dk, dv), dlse the gradient of lse (optional)."""
    qpos, kpos, seen = _positions(q, k, causal, q_vis, k_frame, None)
    ct = acc_dtype(q, k, v)
    g = q.shape[2] // k.shape[2]
    kk, vv = ((t.repeat_interleave(g, dim=2) if g > 1 else t).to(ct) for t in (k, v))
    dq = torch.zeros(q.shape, dtype=ct, device=q.device)
    dk, dv = torch.zeros(kk.shape, dtype=ct, device=k.device), torch.zeros_like(vv)
    for r in _blocks(q, k):
        rows_seen = None if seen is None else seen[:, r]
        s = _scores(q[:, r], k, slopes, scale, qpos[:, r], kpos, rows_seen)
        l_ = lse[:, :, r].to(ct)
        dead = ~(l_ > float("-inf"))
        p = torch.exp(s - l_.masked_fill(dead, 0)[..., None]).masked_fill(dead[..., None], 0)
        do = dout[:, r].to(ct)
        dv += torch.einsum("bhqk,bqhd->bkhd", p, do)
        dp = torch.einsum("bqhd,bkhd->bhqk", do, vv)
        rowsum = (do * out[:, r].to(ct)).sum(-1).transpose(1, 2)  # (B, H, rows)
        extra = 0 if dlse is None else dlse[:, :, r].to(ct).masked_fill(dead, 0)[..., None]
        ds = p * (dp - rowsum[..., None] + extra)
        dq[:, r] = torch.einsum("bhqk,bkhd->bqhd", ds, kk) * scale
        dk += torch.einsum("bhqk,bqhd->bkhd", ds, q[:, r].to(ct)) * scale
    if g > 1:
        dk, dv = (t.unflatten(2, (k.shape[2], g)).sum(3) for t in (dk, dv))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
