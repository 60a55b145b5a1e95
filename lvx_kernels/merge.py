"""The one log-sum-exp merge of two partial attention results.

A partial result over a subset of keys is (out, lse): out = softmax-weighted average of those keys'
values (B, S, H, D) and lse = log of the softmax denominator (B, H, S), natural log. "No visible
key" is (0, -inf) and merges as a no-op. Everything is done in float32 with plain torch ops, so
autograd works through both outputs; -inf on one or both sides never produces NaN, in forward or
backward (every exp/log only ever sees finite, safe values and `torch.where` picks between finite
branches).
"""

from __future__ import annotations

import torch

NEG_INF = float("-inf")


def acc_dtype(*ts: torch.Tensor) -> torch.dtype:
    """Accumulation dtype for partial results: float32, or float64 when any input is float64 (so
    float64 runs stay exact end to end)."""
    return torch.float64 if any(t.dtype == torch.float64 for t in ts) else torch.float32


def _weights(lse_a: torch.Tensor, lse_b: torch.Tensor, ct: torch.dtype):
    """Return (w_a, w_b, lse) with w = exp(lse_x - lse), NaN-free, in dtype `ct`."""
    lse_a = lse_a.to(ct)
    lse_b = lse_b.to(ct)
    fin_a = lse_a > NEG_INF
    fin_b = lse_b > NEG_INF
    any_fin = fin_a | fin_b
    la = torch.where(fin_a, lse_a, torch.zeros_like(lse_a))
    lb = torch.where(fin_b, lse_b, torch.zeros_like(lse_b))
    # Any shift gives the same value; detaching it keeps the gradient exact and simple.
    m = torch.where(fin_a & fin_b, torch.maximum(la, lb), torch.where(fin_a, la, lb)).detach()
    ea = torch.where(fin_a, torch.exp(la - m), torch.zeros_like(la))
    eb = torch.where(fin_b, torch.exp(lb - m), torch.zeros_like(lb))
    s = torch.where(any_fin, ea + eb, torch.ones_like(ea))  # >= 1 where any side is finite
    lse = torch.where(any_fin, m + torch.log(s), torch.full_like(m, NEG_INF))
    return ea / s, eb / s, lse


def _hs(w: torch.Tensor) -> torch.Tensor:
    """(B, H, S) weight -> (B, S, H, 1) to scale an output."""
    return w.transpose(1, 2).unsqueeze(-1)


def merge(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor):
    """Merge two partial results over disjoint key sets: returns (out, lse), both float32 (float64
    if any input is float64).

    out_*: (B, S, H, D); lse_*: (B, H, S). Differentiable through all four inputs.
    """
    ct = acc_dtype(out_a, lse_a, out_b, lse_b)
    w_a, w_b, lse = _weights(lse_a, lse_b, ct)
    out = _hs(w_a) * out_a.to(ct) + _hs(w_b) * out_b.to(ct)
    return out, lse


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dtype else t.to(dtype)


def merge_seen(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> torch.Tensor:
    """`merge`'s out where every row of part a saw a key (lse_a finite, as a text query sees
    itself): the same arithmetic in fewer ops, since only b may be -inf (exp(-inf) is an exact 0,
    and its gradient too). Float32 (float64 if any input is), differentiable."""
    ct = acc_dtype(out_a, lse_a, out_b, lse_b)
    lse_a, lse_b = _as(lse_a, ct), _as(lse_b, ct)
    m = torch.maximum(lse_a, lse_b)
    if m.requires_grad:  # any shift gives the same value; a detached one keeps the gradient simple
        m = m.detach()
    e_a, e_b = torch.exp(lse_a - m), torch.exp(lse_b - m)
    s = e_a + e_b
    return _hs(e_a / s) * _as(out_a, ct) + _hs(e_b / s) * _as(out_b, ct)


@torch.no_grad()
def merge_(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor):
    """In-place accumulate: (out, lse) <- merge((out, lse), (block_out, block_lse)).

    `out` (float32, (B, S, H, D)) and `lse` (float32, (B, H, S)) are updated in place and returned.
    No autograd (use inside a custom Function / ring loop).
    """
    w_a, w_b, new_lse = _weights(lse, block_lse, acc_dtype(out, lse, block_out, block_lse))
    out.mul_(_hs(w_a).to(out.dtype)).add_((_hs(w_b) * block_out.to(w_b.dtype)).to(out.dtype))
    lse.copy_(new_lse)
    return out, lse


def merge_many(outs: torch.Tensor, lses: torch.Tensor, dim: int = 0):
    """Merge N partials stacked along `dim` of both tensors: outs (.., B, S, H, D), lses (.., B, H,
    S).

    Exact, NaN-free (all -inf gives (0, -inf)); float32 results. Used by decode.
    """
    ct = acc_dtype(outs, lses)
    outs = outs.movedim(dim, 0).to(ct)
    lses = lses.movedim(dim, 0).to(ct)
    fin = lses > NEG_INF
    safe = torch.where(fin, lses, torch.zeros_like(lses))
    m = torch.where(fin, safe, torch.full_like(safe, NEG_INF)).amax(0)
    any_fin = m > NEG_INF
    m = torch.where(any_fin, m, torch.zeros_like(m)).detach()
    e = torch.where(fin, torch.exp(safe - m), torch.zeros_like(safe))
    s = e.sum(0)
    s = torch.where(any_fin, s, torch.ones_like(s))
    lse = torch.where(any_fin, m + torch.log(s), torch.full_like(m, NEG_INF))
    w = (e / s).transpose(-1, -2).unsqueeze(-1)  # (N, B, S, H, 1)
    return (w * outs).sum(0), lse
