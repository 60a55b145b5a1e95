"""Single-process float64 attention reference for the tests (shared by every attention test).

Written independently of lvx_app (no shared mask code): the dense scores, a dense visibility mask,
softmax. Differentiable (float64 autograd), so tests get reference gradients with `.backward()`. A
query that sees no key gets out = 0 and lse = -inf, and gradients that are zero (never NaN).
"""

from __future__ import annotations

import math

import torch


def visibility(
    sq: int, sk: int, *, causal=False, q_vis=None, k_frame=None, batch=1, device=None, window=None
) -> torch.Tensor:
    """(B, Sq, Sk) bool: True where query t may see key s (`window`: only the latest `window`
    frames of the q_vis it may see)."""
    vis = torch.ones(batch, sq, sk, dtype=torch.bool, device=device)
    if causal:  # bottom-right aligned, like flash-attn
        i = torch.arange(sq, device=device)[:, None]
        j = torch.arange(sk, device=device)[None, :]
        vis = vis & (j <= i + (sk - sq))
    if q_vis is not None:
        vis = vis & (k_frame.long()[:, None, :] < q_vis.long()[:, :, None])
        if window is not None:
            vis = vis & (k_frame.long()[:, None, :] >= q_vis.long()[:, :, None] - window)
    return vis


def reference_attention(
    q, k, v, *, scale=None, causal=False, q_vis=None, k_frame=None, window=None
):
    """float64 (out (B,Sq,Hq,D), lse (B,Hq,Sq)) with autograd to q, k, v."""
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    g = hq // hkv
    q64, k64, v64 = (
        q.double(),
        k.double().repeat_interleave(g, 2),
        v.double().repeat_interleave(g, 2),
    )
    s = torch.einsum("bqhd,bkhd->bhqk", q64, k64) * scale
    vis = visibility(
        sq, sk, causal=causal, q_vis=q_vis, k_frame=k_frame, batch=b, device=q.device, window=window
    )[:, None]
    alive = vis.any(-1, keepdim=True)  # (B,1,Sq,1)
    s = s.masked_fill(~vis, float("-inf"))
    s_safe = torch.where(alive, s, torch.zeros_like(s))
    lse_safe = (
        torch.logsumexp(s_safe, -1, keepdim=True) if sk else s_safe.new_zeros(*s_safe.shape[:-1], 1)
    )
    p = torch.exp(s_safe - lse_safe) * vis
    out = torch.einsum("bhqk,bkhd->bqhd", p, v64)
    lse = torch.where(alive, lse_safe, torch.full_like(lse_safe, float("-inf"))).squeeze(-1)
    return out, lse
