"""Attention in float64 at real shapes, to check the kernels against: written apart from
`lvx_app.attention` (no shared mask or tile code), chunked over the keys so that tens of thousands
of them fit, on the inputs' own device.

Inputs are the kernels' own (bf16 ones upcast exactly), so what differs is the kernels' arithmetic
alone. A query row that sees no key gets out = 0 and lse = -inf. Grouped-query heads follow Qwen2:
query head h reads K/V head h // (Hq / Hkv).
"""

from __future__ import annotations

import torch
from torch import Tensor

CHUNK_KEYS = 4096


def _scores(q: Tensor, k: Tensor, scale: float, visible: Tensor | None) -> Tensor:
    """(B, Hq, Sq, Sk) float64 scores of q (B, Sq, Hq, D) against k (B, Sk, Hkv, D); hidden ones
    -inf."""
    g = q.shape[2] // k.shape[2]
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double().repeat_interleave(g, 2)) * scale
    return s if visible is None else s.masked_fill(~visible[:, None], float("-inf"))


def _visible(q_vis: Tensor | None, k_frame: Tensor | None, rows: Tensor, keys: slice, window=None):
    """(B, rows, keys) bool: whether a row's visible frames hold a key's frame (None: all); with a
    `window`, only its latest `window` frames."""
    if q_vis is None:
        return None
    frame, seen = k_frame[:, keys].long()[:, None, :], q_vis[:, rows].long()[:, :, None]
    return (frame < seen) & (frame >= seen - window) if window is not None else frame < seen


def forward64(
    q, k, v, scale: float, q_vis=None, k_frame=None, rows: Tensor | None = None, window=None
):
    """(out (B, R, Hq, D), lse (B, Hq, R)) in float64 for the query rows `rows` (default: all),
    online over chunks of keys (`window`: the media mask's, as the kernels take it)."""
    rows = torch.arange(q.shape[1], device=q.device) if rows is None else rows
    qr = q[:, rows]
    g = q.shape[2] // k.shape[2]
    b, r, hq, d = qr.shape
    lse = torch.full((b, hq, r), float("-inf"), dtype=torch.float64, device=q.device)
    acc = torch.zeros(b, hq, r, d, dtype=torch.float64, device=q.device)
    for k0 in range(0, k.shape[1], CHUNK_KEYS):
        keys = slice(k0, min(k0 + CHUNK_KEYS, k.shape[1]))
        s = _scores(qr, k[:, keys], scale, _visible(q_vis, k_frame, rows, keys, window))
        new = torch.logaddexp(lse, torch.logsumexp(s, -1))
        seen = torch.isfinite(new)
        old = torch.where(seen, torch.exp(lse - torch.where(seen, new, 0)), 0)
        p = torch.where(seen[..., None], torch.exp(s - torch.where(seen, new, 0)[..., None]), 0)
        vv = v[:, keys].double().repeat_interleave(g, 2)
        acc = acc * old[..., None] + torch.einsum("bhqk,bkhd->bhqd", p, vv)
        lse = new
    return acc.permute(0, 2, 1, 3), lse


def grads64(dout, q, k, v, out64, lse64, scale: float, rows: Tensor, keys: Tensor):
    """float64 (dq of the query rows `rows`, dk and dv of the keys `keys`) of sum(out * dout), no
    mask, from the float64 forward of every row (out64, lse64)."""
    g = q.shape[2] // k.shape[2]
    dd = (dout.double() * out64).sum(-1).transpose(1, 2)  # (B, Hq, Sq): D = rowsum(dO * O)

    def dscores(qx, kx, vx, dox, lsex, ddx):
        p = torch.exp(_scores(qx, kx, scale, None) - lsex[..., None])
        dp = torch.einsum("bqhd,bkhd->bhqk", dox.double(), vx.double().repeat_interleave(g, 2))
        return p, p * (dp - ddx[..., None])

    dq = torch.zeros(q.shape[0], len(rows), q.shape[2], q.shape[3], dtype=torch.float64)
    dq = dq.to(q.device)
    for k0 in range(0, k.shape[1], CHUNK_KEYS):
        ks = slice(k0, min(k0 + CHUNK_KEYS, k.shape[1]))
        _, ds = dscores(q[:, rows], k[:, ks], v[:, ks], dout[:, rows], lse64[..., rows],
                        dd[..., rows])  # fmt: skip
        kk = k[:, ks].double().repeat_interleave(g, 2)
        dq += torch.einsum("bhqk,bkhd->bqhd", ds, kk) * scale
    p, ds = dscores(q, k[:, keys], v[:, keys], dout, lse64, dd)
    fold = (q.shape[0], len(keys), k.shape[2], g, q.shape[3])  # query heads back onto K/V heads
    dk = (torch.einsum("bhqk,bqhd->bkhd", ds, q.double()) * scale).reshape(fold).sum(3)
    dv = torch.einsum("bhqk,bqhd->bkhd", p, dout.double()).reshape(fold).sum(3)
    return dq, dk, dv


# What a kernel's result may differ from float64 by. Output: its RMS error over the reference's RMS
# (a bf16 kernel's whole error, output rounding included, measured 1.7e-3 to 2.3e-3 on CPU at 7B
# head shapes; weights scaled by 1.01 give 1e-2, each 1% up or down and renormalised 6.7e-3), and
# its largest error over the largest value (a coarse guard). Log-sum-exp: absolute (a softmax sum 1%
# off moves it by log(1.01) = 0.00995).
OUT_RMS_TOLERANCE = {torch.bfloat16: 4e-3, torch.float16: 2e-3, torch.float32: 1e-5}
OUT_MAX_TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 1e-2, torch.float32: 1e-4}
LSE_TOLERANCE = 5e-3
# queries are drawn this many times a unit Gaussian, so scores q.k/sqrt(d) have this spread and the
# softmax is peaked (a unit spread over thousands of keys is near-uniform and hides weight errors)
PEAK = 3.0


def errors(got: Tensor, want: Tensor) -> dict:
    """Largest difference, absolute and over the reference's largest magnitude, and the RMS
    difference over the reference's RMS; for lse the finite entries only, and whether -inf falls
    exactly where the reference has it."""
    got, want = got.detach().double(), want.detach().double()
    finite = torch.isfinite(want)
    same_inf = bool(torch.equal(torch.isfinite(got), finite))
    diff = (got - want).abs().masked_fill(~finite, 0)
    kept = want.masked_fill(~finite, 0)
    biggest = float(kept.abs().max()) if want.numel() else 0.0
    worst = float(diff.max()) if diff.numel() else 0.0
    nan = bool(torch.isnan(got).any())
    relative = worst / biggest if biggest else worst
    ref_rms = float(kept.pow(2).mean().sqrt()) if want.numel() else 0.0
    rms = float(diff.pow(2).mean().sqrt()) if diff.numel() else 0.0
    return {"max_abs": worst, "max_ref": biggest, "relative": relative, "nan": nan,
            "same_inf": same_inf, "rms_relative": rms / ref_rms if ref_rms else rms}  # fmt: skip
