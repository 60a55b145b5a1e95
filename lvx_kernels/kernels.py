"""Block attention, the public API: `attn_fwd` / `attn_bwd` return and consume (out, lse);
`attention` is both as autograd.

Layout everywhere is (batch, seq, heads, head_dim), like flash-attn. K/V may have fewer heads than Q
(GQA, Hq % Hkv == 0). `lse` is (batch, heads, seq), natural log, float32 (float64 for float64
inputs). A query that sees no key (fully masked, or Sk == 0) gets out = 0 and lse = -inf, so it
merges as a no-op. The masks (`causal`, the media mask `q_vis` / `k_frame`, narrowed to the latest
`window` frames when one is given) and how hidden work is skipped are in `masks`; the kernels and
how one is picked per call in `backends`.

GQA: the query heads of each K/V head are packed into rows (`gqa`), so every kernel runs on the
unrepeated K/V. Gradients: `attn_bwd` returns (dq, dk, dv) in the dtypes of q, k, v; dk/dv have Hkv
heads. `dlse` (the gradient w.r.t. lse) is supported on every backend: dS = P * (dP - D + dlse), D =
rowsum(dO * O).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from lvx_kernels.alibi import alibi_bwd, alibi_fwd
from lvx_kernels.backends import (
    AUG_COLS,
    augments_head_dim,
    bounds_keys,
    choose_backend,
    kernel_bwd,
    kernel_fwd,
    kernel_fwd_upto,
    note_not_taken,
)
from lvx_kernels.gqa import (
    broadcast_kv,
    fold,
    fold_lse,
    pack_lse,
    pack_rows,
    unfold,
    unfold_lse,
    unpack_lse,
    unpack_rows,
)
from lvx_kernels.masks import (
    MaskIndex,
    TilePlan,
    device_tensor,
    lone_plan,
    pack_vis,
    sees_every_key,
    tile_plans,
)
from lvx_kernels.merge import NEG_INF, acc_dtype, merge_


def check_inputs(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_vis: MaskIndex | None = None,
    k_frame: MaskIndex | None = None,
    window: int | None = None,
    alibi: Tensor | None = None,
) -> None:
    """Raise a one-line ValueError for shapes the kernels (and the rings) cannot take."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("q, k, v must be (batch, seq, heads, head_dim)")
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(
            f"shape mismatch: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if k.shape[2] == 0 or q.shape[2] % k.shape[2]:
        raise ValueError(
            f"query heads ({q.shape[2]}) must be a multiple of key/value heads ({k.shape[2]})"
        )
    if (q_vis is None) != (k_frame is None):
        raise ValueError("q_vis and k_frame go together (media mask): pass both or neither")
    if window is not None and (q_vis is None or isinstance(window, bool) or window < 1):
        raise ValueError(f"a window ({window!r}) is a media mask's: 1 frame or more, with q_vis")
    if window is not None and alibi is not None:
        raise ValueError("ALiBi is a text attention's bias and a window a visual mask's: not both")
    if q_vis is not None:
        q_vis, k_frame = device_tensor(q_vis), device_tensor(k_frame)
        if tuple(q_vis.shape) != tuple(q.shape[:2]) or tuple(k_frame.shape) != tuple(k.shape[:2]):
            raise ValueError(
                f"q_vis must be (batch, Sq) = {tuple(q.shape[:2])} and k_frame (batch, Sk) = "
                f"{tuple(k.shape[:2])}; "
                f"got {tuple(q_vis.shape)} and {tuple(k_frame.shape)}"
            )


def _resolve_scale(scale: float | None, q: Tensor) -> float:
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)


def attn_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    scale: float | None = None,
    causal: bool = False,
    q_vis: MaskIndex | None = None,
    k_frame: MaskIndex | None = None,
    backend: str | None = None,
    alibi: Tensor | None = None,
    window: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Attention of q against (k, v): returns (out (B,Sq,Hq,D) in q's dtype, lse (B,Hq,Sq) float32).

    No autograd (see `attention`); fully hidden or empty blocks never reach a kernel. `alibi`:
    (Hq,) slopes of an ALiBi bias at the positions the mask is made of (the dense path; a text
    attention's, so never with a window). `window`: each query sees only the latest `window` of
    the frames its q_vis lets it see."""
    check_inputs(q, k, v, q_vis, k_frame, window, alibi)
    b, sq, hq, d = q.shape
    g = hq // k.shape[2]
    scale = _resolve_scale(scale, q)
    if alibi is not None:
        return alibi_fwd(q, k, v, alibi, scale, causal, q_vis, k_frame)
    if sq == 1 and k.shape[1] and (q_vis is None or sees_every_key(q_vis, k_frame, window)):
        return _one_token_fwd(q, k, v, scale, backend, g)
    qp = pack_rows(q, g)
    vis = pack_vis(q_vis, g)
    # planned as they run
    lone, plans = lone_plan(tile_plans(qp, k, causal, vis, k_frame, group=g, window=window))
    if lone is not None and lone.q0 == 0 and lone.q1 == sq * g:
        o, l_ = _run_fwd(lone, qp, k, v, scale, backend, g)
        return unpack_rows(o, g).contiguous(), unpack_lse(l_, g).contiguous()
    ct = acc_dtype(q)
    out = torch.zeros(qp.shape, dtype=ct, device=q.device)  # partial results of a row merge here
    lse = torch.full((b, qp.shape[2], sq * g), NEG_INF, dtype=ct, device=q.device)
    for p in plans:
        merge_(
            out[:, p.q0 : p.q1], lse[:, :, p.q0 : p.q1], *_run_fwd(p, qp, k, v, scale, backend, g)
        )
    return unpack_rows(out, g).to(q.dtype), unpack_lse(lse, g)


def attn_fwd_upto(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    used: Tensor,
    *,
    scale: float | None = None,
    backend: str | None = None,
    alibi: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """One decoded token's attention against the first `used` keys of (k, v), `used` a (B,) int32
    tensor on their device; (out, lse) as `attn_fwd`. Nothing is planned or read on the host and no
    shape depends on `used`, so a decode step on buffers of a fixed size is captured as one CUDA
    graph that holds for every length.

    Where a mask-free call would get a flash kernel (`bounds_keys`: CUDA, fp16/bf16) the key count
    is the kernel's own bound (flash's `seqused_k`): it reads the used keys only, split among
    thread blocks as eager decoding's call is, where a mask over the whole reserved buffer would
    send the call to the memory-efficient kernel, a handful of thread blocks scanning every
    reserved key. A bucketed slice of the buffer was not taken: its shape changes with the length,
    and each bucket would need a graph of its own. Elsewhere (CPU, float32/float64, or a forced
    backend that takes masks) one masked call, the mask built on the device; where flash would
    run the call but this torch's op has no key count, the masked call is counted as a fallback
    (`kernel_tally`)."""
    check_inputs(q, k, v)
    if q.shape[1] != 1:
        raise ValueError(f"attn_fwd_upto takes one query token, got {q.shape[1]}")
    scale = _resolve_scale(scale, q)
    if alibi is not None:  # the query at position used - 1 (the dense path, masked on the device)
        return alibi_fwd(q, k, v, alibi, scale, used=used)
    d = q.shape[-1]
    if choose_backend(backend, q, False, d) in ("flash", "flash_attn"):
        if bounds_keys(q, d):
            return kernel_fwd_upto(
                q, k, v, used, scale, lambda name: _masked_upto(q, k, v, used, scale, name)
            )
        note_not_taken("fwd flash_varlen -> masked: this torch's flash op takes no seqused_k")
    return _masked_upto(q, k, v, used, scale, backend)


def _masked_upto(
    q: Tensor, k: Tensor, v: Tensor, used: Tensor, scale: float, backend: str | None
) -> tuple[Tensor, Tensor]:
    """`attn_fwd_upto` as one masked kernel call over the whole buffer (keys past `used` hidden)."""
    g = q.shape[2] // k.shape[2]
    qp = pack_rows(q, g)
    seen = torch.arange(k.shape[1], device=k.device) < used.view(-1, 1)
    mask = seen.view(q.shape[0], 1, -1).expand(-1, qp.shape[1], -1)
    plan = TilePlan(0, qp.shape[1], 0, k.shape[1], mask, False, None)
    o, l_ = _run_fwd(plan, qp, k, v, scale, backend, g)
    return unpack_rows(o, g), unpack_lse(l_, g)


def _one_token_fwd(
    q: Tensor, k: Tensor, v: Tensor, scale: float, backend: str | None, g: int
) -> tuple[Tensor, Tensor]:
    """One query token that sees every key (a decoded token): one unmasked kernel call, its query
    groups packed into rows by views (for one token the packed layout is q's own)."""
    b, _, hq, d = q.shape
    qp = q.reshape(b, hq // g, g, d).transpose(1, 2)  # (B, G, Hkv, D), as `pack_rows`
    o, l_ = kernel_fwd(choose_backend(backend, qp, False, d), qp, k, v, scale, None, False)
    ct = acc_dtype(q)
    return o.transpose(1, 2).reshape(b, 1, hq, d), (l_ if l_.dtype == ct else l_.to(ct)).reshape(
        b, hq, 1
    )


def _run_fwd(
    p: TilePlan, qp: Tensor, k: Tensor, v: Tensor, scale: float, backend: str | None, g: int
) -> tuple[Tensor, Tensor]:
    """One tile's (out, lse float32-or-wider) from its kernel, rows that see nothing zeroed."""
    d = qp.shape[-1]
    be = choose_backend(backend, qp, p.mask is not None, d)
    q, k, v = qp[:, p.q0 : p.q1], k[:, p.k0 : p.k1], v[:, p.k0 : p.k1]
    if p.causal and g > 1:  # a causal square: the query groups go to the batch, K/V broadcast
        o, l_ = kernel_fwd(
            be, fold(q, g), *(broadcast_kv(t, g, be) for t in (k, v)), scale, None, True
        )
        o, l_ = unfold(o, g), unfold_lse(l_, g)
    else:
        o, l_ = kernel_fwd(be, q, k, v, scale, p.mask, p.causal)
    l_ = l_.to(acc_dtype(qp))
    if p.dead is not None:
        o = o.masked_fill(p.dead[:, :, None, None], 0)
        l_ = l_.masked_fill(p.dead[:, None, :], NEG_INF)
    return o, l_


def attn_bwd(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    *,
    scale: float | None = None,
    causal: bool = False,
    q_vis: MaskIndex | None = None,
    k_frame: MaskIndex | None = None,
    dlse: Tensor | None = None,
    backend: str | None = None,
    kv_aug: tuple[Tensor, Tensor] | None = None,
    alibi: Tensor | None = None,
    window: int | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    # long: one backward per kernel tile, kept beside attn_fwd's tiling for reading
    """Gradients of attention given the (possibly globally merged) out and lse.

    `out` / `lse` may be the final merged values over more keys than `k` (ring
    backward): the result is then this block's exact share of dq and the exact
    dk, dv. `dlse` (B,Hq,Sq) is the gradient w.r.t. lse (optional). Rows with
    lse = -inf get zero gradients. `kv_aug`: `augment_kv(k, v)`, reused when
    dlse is given (optional). `window`: as `attn_fwd`'s. Returns (dq, dk, dv)
    in q's, k's, v's dtypes; dk, dv have Hkv heads.
    """
    check_inputs(q, k, v, q_vis, k_frame, window, alibi)
    d = q.shape[-1]
    g = q.shape[2] // k.shape[2]
    scale = _resolve_scale(scale, q)
    if alibi is not None:
        return alibi_bwd(dout, q, k, v, out, lse, alibi, scale, causal, q_vis, k_frame, dlse)
    qp, dop, outp, lsep = pack_rows(q, g), pack_rows(dout, g), pack_rows(out, g), pack_lse(lse, g)
    dlp = None if dlse is None else pack_lse(dlse, g)
    rows_all, sk = qp.shape[1], k.shape[1]
    widened = dlp is not None and augments_head_dim(q.dtype)  # dlse as extra head_dim columns

    def one(p: TilePlan):
        rows, ks = slice(p.q0, p.q1), slice(p.k0, p.k1)
        l_ = lsep[:, :, rows].to(acc_dtype(q))
        dl = None if dlp is None else dlp[:, :, rows]
        # rows with lse = -inf (saw nothing anywhere) must give zero grads: give the kernel a finite
        # lse and zero upstream grads there (no host sync, so no `if dead.any()`)
        dead = ~(l_ > NEG_INF)
        l_ = l_.masked_fill(dead, 0.0)
        do = dop[:, rows].masked_fill(dead.transpose(1, 2).unsqueeze(-1), 0)
        dl = None if dl is None else dl.masked_fill(dead, 0.0)
        be = choose_backend(backend, qp, p.mask is not None, d + (AUG_COLS if widened else 0))
        aug = None if kv_aug is None else (kv_aug[0][:, ks], kv_aug[1][:, ks])
        args = (do, qp[:, rows], k[:, ks], v[:, ks], outp[:, rows], l_, dl)
        if p.causal and g > 1:
            return _folded_bwd(be, args, aug, scale, g)
        return kernel_bwd(be, *args, scale, p.mask, p.causal, aug)

    # planned as they run
    vis = pack_vis(q_vis, g)
    lone, plans = lone_plan(tile_plans(qp, k, causal, vis, k_frame, group=g, window=window))
    if lone is not None and (lone.q0, lone.q1, lone.k0, lone.k1) == (0, rows_all, 0, sk):
        gq, gk, gv = one(lone)  # the whole block in one call: no scatter, no accumulators
        return unpack_rows(gq, g).to(q.dtype), gk.to(k.dtype), gv.to(v.dtype)
    # several plans add into the same rows (a tile's unmasked part and its band) and keys:
    # accumulate in float32
    dq = torch.zeros(qp.shape, dtype=acc_dtype(q), device=q.device)
    dk = torch.zeros(k.shape, dtype=acc_dtype(k), device=k.device)
    dv = torch.zeros(v.shape, dtype=acc_dtype(v), device=v.device)
    for p in plans:
        gq, gk, gv = one(p)
        dq[:, p.q0 : p.q1] += gq
        dk[:, p.k0 : p.k1] += gk
        dv[:, p.k0 : p.k1] += gv
    return unpack_rows(dq, g).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _folded_bwd(be: str, args: tuple, aug, scale: float, g: int) -> tuple[Tensor, Tensor, Tensor]:
    """The backward of a causal square with packed query groups: the groups go to the batch (as in
    `_run_fwd`), and each K/V gradient is the sum of its groups' (float32)."""
    do, q, k, v, out, lse, dl = args
    kv = [broadcast_kv(t, g, be) for t in (k, v)]
    aug = None if aug is None else tuple(broadcast_kv(t, g, be) for t in aug)
    dl = None if dl is None else fold_lse(dl, g)
    dq, dk, dv = kernel_bwd(
        be, fold(do, g), fold(q, g), *kv, fold(out, g), fold_lse(lse, g), dl, scale, None, True, aug
    )
    ct = acc_dtype(k)
    return unfold(dq, g), *(t.view(-1, g, *t.shape[1:]).to(ct).sum(1) for t in (dk, dv))


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale, causal, q_vis, k_frame, backend, alibi, window):
        out, lse = attn_fwd(
            q,
            k,
            v,
            scale=scale,
            causal=causal,
            q_vis=q_vis,
            k_frame=k_frame,
            backend=backend,
            alibi=alibi,
            window=window,
        )
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (scale, causal, q_vis, k_frame, backend, alibi, window)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        scale, causal, q_vis, k_frame, backend, alibi, window = ctx.args
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dk, dv = attn_bwd(
            dout,
            q,
            k,
            v,
            out,
            lse,
            scale=scale,
            causal=causal,
            q_vis=q_vis,
            k_frame=k_frame,
            dlse=dlse,
            backend=backend,
            alibi=alibi,
            window=window,
        )
        return dq, dk, dv, None, None, None, None, None, None, None


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    scale: float | None = None,
    causal: bool = False,
    q_vis: MaskIndex | None = None,
    k_frame: MaskIndex | None = None,
    backend: str | None = None,
    alibi: Tensor | None = None,
    window: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Single-device attention, differentiable through both outputs: returns (out, lse).

    The default for models/: the backward uses the matching kernel's backward with the saved (out,
    lse), and the lse gradient (G2 layers merge through it) is exact."""
    return _Attention.apply(q, k, v, scale, causal, q_vis, k_frame, backend, alibi, window)
