"""Block attention kernels: `attn_fwd` / `attn_bwd` return and consume (out, lse).

Layout everywhere is (batch, seq, heads, head_dim), like flash-attn. K/V may
have fewer heads than Q (GQA, Hq % Hkv == 0). `lse` is (batch, heads, seq),
natural log, float32 (float64 for float64 inputs). A query that sees no key
(fully masked, or Sk == 0) gets out = 0 and lse = -inf, so it merges as a no-op.

Masks
- `causal=True` is bottom-right aligned like flash-attn: query i sees key j iff
  j <= i + (Sk - Sq).
- Media mask: `q_vis` (B, Sq) int = how many frames query t may see;
  `k_frame` (B, Sk) int = frame index of key s; visible iff k_frame < q_vis.
- Both may be combined. Work that is fully hidden is skipped: queries are
  processed in tiles of `Q_TILE` rows (media mask only) and each tile is
  trimmed to the first..last query that sees something and the first..last key
  that some query sees (with frame-sorted keys that is the visible prefix), so
  hidden tiles never reach a kernel; only partially visible tiles get a mask.

Backends, picked per call at run time (`backend=None`), or forced with
`backend=` / the LVX_ATTN_BACKEND environment variable (a forced backend that
cannot run a given call, e.g. flash with a mask, falls back to the automatic
choice):
- "flash_attn": the flash-attn package (CUDA, fp16/bf16, no mask).
- "flash": aten._scaled_dot_product_flash_attention (CUDA, fp16/bf16, no mask).
- "efficient": aten._scaled_dot_product_efficient_attention (CUDA, any mask
  as an additive bias; lse comes padded to a multiple of 32 and is sliced).
- "cudnn": aten._scaled_dot_product_cudnn_attention forward (lse has a trailing
  1 that is squeezed); its backward runs on "efficient" (block backward only
  needs the final out/lse, so this is exact).
- "cpu": aten._scaled_dot_product_flash_attention_for_cpu and its backward op
  (float additive mask in the query dtype; causal only where top-left ==
  bottom-right; never called with Sk == 0, which SIGFPE-kills the process).
- "math": plain torch in float32 (float64 for float64 inputs); always works.
Automatic choice: CUDA -> flash_attn/flash without mask, else efficient;
CPU -> cpu; float64 -> math.

Gradients: `attn_bwd` returns (dq, dk, dv) in the dtypes of q, k, v; dk/dv
have Hkv heads (query-head groups summed). `dlse` (the gradient w.r.t. lse)
is supported on every backend: dS = P * (dP - D + dlse), D = rowsum(dO * O).
The aten backward ops compute D themselves, so dlse enters by augmenting the
head dimension: q' = [q, 0], k' = [k, 0], v' = [v, 1, 0..], out' = [O, 0],
dout' = [dO, dlse, 0..] (8 extra columns to keep head_dim a multiple of 8);
the extra gradient columns are dropped.
"""

from __future__ import annotations

import inspect
import math
import os
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lvx_app.attention.merge import acc_dtype

NEG_INF = float("-inf")

#: Query rows per tile when a media mask is present (tests shrink it).
Q_TILE = 256

_AUG = 8  # extra head-dim columns used to carry dlse through the aten backward ops

_flash_attn_cache: list = []


def _flash_attn():
    """The flash_attn.flash_attn_interface module, or None when not importable."""
    if not _flash_attn_cache:
        try:
            import flash_attn.flash_attn_interface as fa  # type: ignore

            _flash_attn_cache.append(fa)
        except Exception:  # noqa: BLE001 - optional fast path
            _flash_attn_cache.append(None)
    return _flash_attn_cache[0]


def available_backends(device: torch.device | str | None = None) -> list[str]:
    """Backends usable on `device` (default: CUDA when available, else CPU), best first."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    names: list[str] = []
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return ["math"]
        if _flash_attn() is not None:
            names.append("flash_attn")
        aten = torch.ops.aten
        if hasattr(aten, "_scaled_dot_product_cudnn_attention"):
            names.append("cudnn")
        names += ["flash", "efficient"]
    elif device.type == "cpu":
        names.append("cpu")
    names.append("math")
    return names


# --------------------------------------------------------------------------- masks / planning


@dataclass
class _Plan:
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


def _causal_vis(nq: int, nk: int, off: int, device) -> torch.Tensor:
    """(nq, nk) bool: key j visible to query i iff j <= i + off."""
    i = torch.arange(nq, device=device).unsqueeze(1)
    j = torch.arange(nk, device=device).unsqueeze(0)
    return j <= i + off


def _plan(t0, t1, sk, coff, q_vis, k_frame, q_vis_cpu, k_frame_cpu, batch, device) -> _Plan | None:
    """Plan query rows [t0, t1) against all sk keys. coff: causal offset (j <= i + coff) or None.

    q_vis / k_frame: int64 on the device; *_cpu: the same on the CPU."""
    if t1 <= t0 or sk == 0:
        return None
    if q_vis is None and coff is None:
        return _Plan(t0, t1, 0, sk, None, False, None)
    if q_vis is None:
        # causal only: rows i with i + coff < 0 see nothing; every key up to t1-1+coff is seen.
        q0 = max(t0, -coff)
        k1 = min(sk, t1 - 1 + coff + 1)
        if q0 >= t1 or k1 <= 0:
            return None
        off = coff + q0  # slice-local offset: key j visible to local row i iff j <= i + off
        nq, nk = t1 - q0, k1
        if off >= nk - 1:
            return _Plan(q0, t1, 0, k1, None, False, None)
        if off == 0 and nq == nk:
            return _Plan(q0, t1, 0, k1, None, True, None)
        vis = _causal_vis(nq, nk, off, device).unsqueeze(0).expand(batch, nq, nk)
        return _Plan(q0, t1, 0, k1, vis, False, None)
    if coff is None:
        # Media mask only: every decision is taken on small CPU copies (no device syncs);
        # only the dense mask of a partially visible tile is built on the device.
        qv_c, kf_c = q_vis_cpu[:, t0:t1], k_frame_cpu
        rs = _span((qv_c > kf_c.amin(1, keepdim=True)).any(0))
        cs = _span((kf_c < qv_c.amax(1, keepdim=True)).any(0))
        if rs is None or cs is None:
            return None
        (r0, r1), (k0, k1) = rs, cs
        qv_c, kf_c = qv_c[:, r0:r1], kf_c[:, k0:k1]
        if bool((kf_c.amax(1) < qv_c.amin(1)).all()):
            return _Plan(t0 + r0, t0 + r1, k0, k1, None, False, None)
        dead = qv_c <= kf_c.amin(1, keepdim=True)  # (B, rows): sees no key of the slice
        vis = k_frame[:, k0:k1].unsqueeze(1) < q_vis[:, t0 + r0 : t0 + r1].unsqueeze(2)
        return _Plan(t0 + r0, t0 + r1, k0, k1, vis, False, dead.to(device) if bool(dead.any()) else None)
    qv = q_vis[:, t0:t1]
    full = (k_frame.unsqueeze(1) < qv.unsqueeze(2)) & _causal_vis(t1 - t0, sk, coff + t0, device)
    rs = _span(full.any(2).any(0))
    cs = _span(full.any(1).any(0))
    if rs is None or cs is None:
        return None
    (r0, r1), (k0, k1) = rs, cs
    vis = full[:, r0:r1, k0:k1]
    dead = ~vis.any(2)
    return _Plan(t0 + r0, t0 + r1, k0, k1, vis, False, dead if bool(dead.any()) else None)


def _tiles(sq: int, tiled: bool):
    if not tiled or sq <= Q_TILE:
        return [(0, sq)]
    return [(t, min(sq, t + Q_TILE)) for t in range(0, sq, Q_TILE)]


# --------------------------------------------------------------------------- backend choice


def _choose(backend: str | None, q: torch.Tensor, has_mask: bool, head_dim: int) -> str:
    want = backend or os.environ.get("LVX_ATTN_BACKEND") or None
    if want is not None and _can_run(want, q, has_mask, head_dim):
        return want
    if q.dtype == torch.float64:
        return "math"
    if q.device.type == "cuda":
        for name in ("flash_attn", "flash", "efficient"):
            if _can_run(name, q, has_mask, head_dim):
                return name
        return "math"
    if q.device.type == "cpu" and _can_run("cpu", q, has_mask, head_dim):
        return "cpu"
    return "math"


def _can_run(name: str, q: torch.Tensor, has_mask: bool, head_dim: int) -> bool:
    half = q.dtype in (torch.float16, torch.bfloat16)
    cuda = q.device.type == "cuda"
    if name == "math":
        return True
    if name == "cpu":
        return q.device.type == "cpu" and q.dtype in (torch.float32, torch.float16, torch.bfloat16)
    if name == "flash_attn":
        return cuda and half and not has_mask and head_dim % 8 == 0 and head_dim <= 256 and _flash_attn() is not None
    if name == "flash":
        return cuda and half and not has_mask and head_dim % 8 == 0 and head_dim <= 256
    if name in ("efficient", "cudnn"):
        return cuda and q.dtype in (torch.float32, torch.float16, torch.bfloat16) and head_dim % 8 == 0
    raise ValueError(f"unknown attention backend {name!r}; choose from {available_backends(q.device)}")


# --------------------------------------------------------------------------- backend kernels
# All take q (B,Sq,Hq,D), k/v (B,Sk,Hkv,D) with Sq, Sk > 0, a bool visibility mask
# (B,Sq,Sk) or None, and `causal` = native top-left causal (only used with Sq == Sk).
# Forward returns (out (B,Sq,Hq,D) q dtype, lse (B,Hq,Sq) fp32). Rows that see nothing
# are fixed up by the caller. Backward gets lse with -inf already replaced by 0.


def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=2)


def _sum_groups(dx: torch.Tensor, groups: int) -> torch.Tensor:
    if groups == 1:
        return dx
    b, s, h, d = dx.shape
    return dx.view(b, s, h // groups, groups, d).sum(3)


def _math_scores(q, k, scale, mask, causal):
    ct = acc_dtype(q)
    g = q.shape[2] // k.shape[2]
    qf = q.to(ct).transpose(1, 2)
    kf = _repeat_kv(k, g).to(ct).transpose(1, 2)
    s = torch.matmul(qf, kf.transpose(-1, -2)) * scale  # (B,H,Sq,Sk)
    if mask is not None:
        s = s.masked_fill(~mask.unsqueeze(1), NEG_INF)
    if causal:
        s = s.masked_fill(~_causal_vis(s.shape[-2], s.shape[-1], 0, s.device), NEG_INF)
    return s


def _math_fwd(q, k, v, scale, mask, causal):
    g = q.shape[2] // k.shape[2]
    s = _math_scores(q, k, scale, mask, causal)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(lse > NEG_INF, lse, torch.zeros_like(lse)).unsqueeze(-1))
    vf = _repeat_kv(v, g).to(s.dtype).transpose(1, 2)
    out = torch.matmul(p, vf).transpose(1, 2).to(q.dtype)
    return out, lse if q.dtype == torch.float64 else lse.float()


def _math_bwd(dout, q, k, v, out, lse, dlse, scale, mask, causal):
    g = q.shape[2] // k.shape[2]
    s = _math_scores(q, k, scale, mask, causal)
    ct = s.dtype
    p = torch.exp(s - lse.to(ct).unsqueeze(-1))  # lse finite here (caller replaced -inf rows)
    do = dout.to(ct).transpose(1, 2)  # (B,H,Sq,D)
    vf = _repeat_kv(v, g).to(ct).transpose(1, 2)
    kf = _repeat_kv(k, g).to(ct).transpose(1, 2)
    qf = q.to(ct).transpose(1, 2)
    dp = torch.matmul(do, vf.transpose(-1, -2))
    dd = (do * out.to(ct).transpose(1, 2)).sum(-1, keepdim=True)
    if dlse is not None:
        dd = dd - dlse.to(ct).unsqueeze(-1)
    ds = p * (dp - dd)
    dq = torch.matmul(ds, kf) * scale
    dk = torch.matmul(ds.transpose(-1, -2), qf) * scale
    dv = torch.matmul(p.transpose(-1, -2), do)
    dq = dq.transpose(1, 2).to(q.dtype)
    dk = _sum_groups(dk.transpose(1, 2), g).to(k.dtype)
    dv = _sum_groups(dv.transpose(1, 2), g).to(v.dtype)
    return dq, dk, dv


def _additive(mask: torch.Tensor, dtype, align: int = 1) -> torch.Tensor:
    """(B,Sq,Sk) bool -> (B,1,Sq,Sk) additive float mask; last dim storage padded to `align`."""
    b, sq, sk = mask.shape
    skp = -(-sk // align) * align
    base = torch.zeros(b, 1, sq, skp, dtype=dtype, device=mask.device)
    bias = base[..., :sk]
    bias.masked_fill_(~mask.unsqueeze(1), NEG_INF)
    return bias


def _cpu_fwd(q, k, v, scale, mask, causal):
    attn_mask = None if mask is None else _additive(mask, q.dtype)
    o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, causal, attn_mask=attn_mask, scale=scale
    )
    return o.transpose(1, 2), lse.float()


def _cpu_bwd(dout, q, k, v, out, lse, scale, mask, causal):
    attn_mask = None if mask is None else _additive(mask, q.dtype)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout.transpose(1, 2),
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        out.transpose(1, 2),
        lse.float().contiguous(),
        0.0,
        causal,
        attn_mask=attn_mask,
        scale=scale,
    )
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


def _cuda_bias(mask, q):
    if mask is None:
        return None
    b, sq, sk = mask.shape
    # mem-efficient kernels want the bias row stride 16-element aligned; heads broadcast.
    return _additive(mask, q.dtype, align=16).expand(b, q.shape[2], sq, sk)


def _efficient_fwd(q, k, v, scale, mask, causal):
    g = q.shape[2] // k.shape[2]
    o, lse, _seed, _off = torch.ops.aten._scaled_dot_product_efficient_attention(
        q.transpose(1, 2),
        _repeat_kv(k, g).transpose(1, 2),
        _repeat_kv(v, g).transpose(1, 2),
        _cuda_bias(mask, q),
        True,
        0.0,
        causal,
        scale=scale,
    )
    return o.transpose(1, 2), lse[..., : q.shape[1]].float()


def _efficient_bwd(dout, q, k, v, out, lse, scale, mask, causal):
    g = q.shape[2] // k.shape[2]
    sq = q.shape[1]
    lse_p = F.pad(lse.float(), (0, -(-sq // 32) * 32 - sq)).contiguous()
    dummy = torch.zeros((), dtype=torch.int64, device=q.device)
    dq, dk, dv, _db = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        dout.transpose(1, 2),
        q.transpose(1, 2),
        _repeat_kv(k, g).transpose(1, 2),
        _repeat_kv(v, g).transpose(1, 2),
        _cuda_bias(mask, q),
        out.transpose(1, 2),
        lse_p,
        dummy,
        dummy,
        0.0,
        [True, True, True, False],
        causal,
        scale=scale,
    )
    return dq.transpose(1, 2), _sum_groups(dk.transpose(1, 2), g), _sum_groups(dv.transpose(1, 2), g)


def _flash_fwd(q, k, v, scale, mask, causal):
    assert mask is None
    g = q.shape[2] // k.shape[2]
    res = torch.ops.aten._scaled_dot_product_flash_attention(
        q.transpose(1, 2),
        _repeat_kv(k, g).transpose(1, 2),
        _repeat_kv(v, g).transpose(1, 2),
        0.0,
        causal,
        False,
        scale=scale,
    )
    return res[0].transpose(1, 2), res[1].float()


def _flash_bwd(dout, q, k, v, out, lse, scale, mask, causal):
    assert mask is None
    g = q.shape[2] // k.shape[2]
    # dropout is 0, so the philox state is never read; pass placeholders of the forward's kind.
    rng = torch.zeros(2, dtype=torch.uint64, device=q.device)
    unused = torch.empty(0, dtype=torch.uint64, device=q.device)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout.transpose(1, 2),
        q.transpose(1, 2),
        _repeat_kv(k, g).transpose(1, 2),
        _repeat_kv(v, g).transpose(1, 2),
        out.transpose(1, 2),
        lse.float().contiguous(),
        None,
        None,
        q.shape[1],
        k.shape[1],
        0.0,
        causal,
        rng,
        unused,
        scale=scale,
    )
    return dq.transpose(1, 2), _sum_groups(dk.transpose(1, 2), g), _sum_groups(dv.transpose(1, 2), g)


def _cudnn_fwd(q, k, v, scale, mask, causal):
    g = q.shape[2] // k.shape[2]
    res = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q.transpose(1, 2),
        _repeat_kv(k, g).transpose(1, 2),
        _repeat_kv(v, g).transpose(1, 2),
        _cuda_bias(mask, q),
        True,
        0.0,
        causal,
        False,
        scale=scale,
    )
    b, sq, h, _ = q.shape
    return res[0].transpose(1, 2), res[1].float().reshape(b, h, sq)


def _fa_fwd(q, k, v, scale, mask, causal):
    assert mask is None
    fa = _flash_attn()
    out, lse, _ = fa.flash_attn_func(
        q.contiguous(), k.contiguous(), v.contiguous(), 0.0, softmax_scale=scale, causal=causal, return_attn_probs=True
    )
    return out, lse[..., : q.shape[1]].float()


def _fa_bwd(dout, q, k, v, out, lse, scale, mask, causal):
    assert mask is None
    fa = _flash_attn()
    q, k, v, out, dout = (t.contiguous() for t in (q, k, v, out, dout))
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    args = dict(
        dout=dout,
        q=q,
        k=k,
        v=v,
        out=out,
        softmax_lse=lse.float().contiguous(),
        dq=dq,
        dk=dk,
        dv=dv,
        dropout_p=0.0,
        softmax_scale=scale,
        causal=causal,
        window_size=(-1, -1),
        window_size_left=-1,
        window_size_right=-1,
        softcap=0.0,
        alibi_slopes=None,
        deterministic=False,
        rng_state=None,
    )
    fn = fa._flash_attn_backward
    # absorbs the 2.5 .. 2.8 API drift; from 2.6 the function is a torch custom op whose
    # Python signature lives on `_init_fn` (as ring-flash-attn does)
    params = inspect.signature(getattr(fn, "_init_fn", fn)).parameters
    fn(**{name: val for name, val in args.items() if name in params})
    return dq, dk, dv


_FWD = {
    "math": _math_fwd,
    "cpu": _cpu_fwd,
    "efficient": _efficient_fwd,
    "flash": _flash_fwd,
    "cudnn": _cudnn_fwd,
    "flash_attn": _fa_fwd,
}
_BWD = {
    "cpu": _cpu_bwd,
    "efficient": _efficient_bwd,
    "cudnn": _efficient_bwd,
    "flash": _flash_bwd,
    "flash_attn": _fa_bwd,
}


_broken: set[str] = set()  # CUDA (direction, backend) pairs that raised once; then "efficient"
_UNVERIFIED = ("flash", "flash_attn", "cudnn")


def _kernel_fwd(be, q, k, v, scale, mask, causal):
    if be in _UNVERIFIED:
        # Written from the published signatures but not run here: if a call rejects our
        # arguments, fall back (exactly) to the efficient kernel from then on.
        if ("fwd", be) not in _broken:
            try:
                return _FWD[be](q, k, v, scale, mask, causal)
            except (RuntimeError, TypeError) as exc:
                _broken.add(("fwd", be))
                warnings.warn(f"attention forward on {be!r} failed ({exc}); using 'efficient'", stacklevel=2)
        be = "efficient" if _can_run("efficient", q, mask is not None, q.shape[-1]) else "math"
    return _FWD[be](q, k, v, scale, mask, causal)


def _kernel_bwd(be, dout, q, k, v, out, lse, dlse, scale, mask, causal, kv_aug=None):
    """One block backward on a non-empty slice; lse finite (dead rows already zeroed)."""
    if be in ("flash", "flash_attn"):  # (cudnn's backward already runs on "efficient")
        if ("bwd", be) not in _broken:
            try:
                return _kernel_bwd_on(be, dout, q, k, v, out, lse, dlse, scale, mask, causal, kv_aug)
            except (RuntimeError, TypeError) as exc:
                _broken.add(("bwd", be))
                warnings.warn(f"attention backward on {be!r} failed ({exc}); using 'efficient'", stacklevel=2)
        be = "efficient" if _can_run("efficient", q, mask is not None, q.shape[-1]) else "math"
    return _kernel_bwd_on(be, dout, q, k, v, out, lse, dlse, scale, mask, causal, kv_aug)


def augment_kv(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V with the extra head-dim columns that carry dlse through the aten backward ops:
    k' = [k, 0..], v' = [v, 1, 0..]. Build once per shard and pass as `attn_bwd(kv_aug=...)`
    when the same K/V is used for many backward calls (the LV-XAttn ring), so no round copies it."""
    zk = k.new_zeros(*k.shape[:-1], _AUG)
    v1 = v.new_zeros(*v.shape[:-1], _AUG)
    v1[..., 0] = 1
    return torch.cat([k, zk], -1), torch.cat([v, v1], -1)


def _kernel_bwd_on(be, dout, q, k, v, out, lse, dlse, scale, mask, causal, kv_aug=None):
    if be == "math":
        return _math_bwd(dout, q, k, v, out, lse, dlse, scale, mask, causal)
    dt = q.dtype
    dout = dout.to(dt)
    out = out.to(dt)
    if dlse is None:
        return _BWD[be](dout, q, k, v, out, lse, scale, mask, causal)
    d = q.shape[-1]
    ka, va = augment_kv(k, v) if kv_aug is None else kv_aug
    dl = dout.new_zeros(*dout.shape[:-1], _AUG)
    dl[..., 0] = dlse.transpose(1, 2).to(dt)
    dq, dk, dv = _BWD[be](
        torch.cat([dout, dl], -1),
        torch.cat([q, q.new_zeros(*q.shape[:-1], _AUG)], -1),
        ka,
        va,
        torch.cat([out, torch.zeros_like(dl)], -1),
        lse,
        scale,
        mask,
        causal,
    )
    return dq[..., :d], dk[..., :d], dv[..., :d]


# --------------------------------------------------------------------------- public API


def check_inputs(q, k, v, q_vis=None, k_frame=None) -> None:
    """Raise a one-line ValueError for shapes the kernels (and the rings) cannot take."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("q, k, v must be (batch, seq, heads, head_dim)")
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"shape mismatch: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if k.shape[2] == 0 or q.shape[2] % k.shape[2]:
        raise ValueError(f"query heads ({q.shape[2]}) must be a multiple of key/value heads ({k.shape[2]})")
    if (q_vis is None) != (k_frame is None):
        raise ValueError("q_vis and k_frame go together (media mask): pass both or neither")
    if q_vis is not None:
        if tuple(q_vis.shape) != tuple(q.shape[:2]) or tuple(k_frame.shape) != tuple(k.shape[:2]):
            raise ValueError(
                f"q_vis must be (batch, Sq) = {tuple(q.shape[:2])} and k_frame (batch, Sk) = {tuple(k.shape[:2])}; "
                f"got {tuple(q_vis.shape)} and {tuple(k_frame.shape)}"
            )


def _resolve_scale(scale, q):
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)


def _plans(q, k, causal, q_vis, k_frame):
    sq, sk = q.shape[1], k.shape[1]
    coff = (sk - sq) if causal else None
    qv_c = kf_c = None
    if q_vis is not None and sq and sk:
        q_vis = q_vis.to(device=q.device, dtype=torch.long)
        k_frame = k_frame.to(device=q.device, dtype=torch.long)
        qv_c, kf_c = q_vis.cpu(), k_frame.cpu()
    for t0, t1 in _tiles(sq, q_vis is not None):
        p = _plan(t0, t1, sk, coff, q_vis, k_frame, qv_c, kf_c, q.shape[0], q.device)
        if p is not None:
            yield p


def attn_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float | None = None,
    causal: bool = False,
    q_vis: torch.Tensor | None = None,
    k_frame: torch.Tensor | None = None,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q against (k, v): returns (out (B,Sq,Hq,D) in q's dtype, lse (B,Hq,Sq) float32).

    No autograd (see `attention`); fully hidden or empty blocks never reach a kernel."""
    check_inputs(q, k, v, q_vis, k_frame)
    b, sq, hq, d = q.shape
    scale = _resolve_scale(scale, q)
    plans = list(_plans(q, k, causal, q_vis, k_frame))
    out = lse = None
    if not (len(plans) == 1 and plans[0].q0 == 0 and plans[0].q1 == sq):
        out = q.new_zeros(b, sq, hq, d)
        lse = torch.full((b, hq, sq), NEG_INF, dtype=acc_dtype(q), device=q.device)
    for p in plans:
        be = _choose(backend, q, p.mask is not None, d)
        o, l_ = _kernel_fwd(be, q[:, p.q0 : p.q1], k[:, p.k0 : p.k1], v[:, p.k0 : p.k1], scale, p.mask, p.causal)
        l_ = l_.to(acc_dtype(q))
        if p.dead is not None:
            o = o.masked_fill(p.dead[:, :, None, None], 0)
            l_ = l_.masked_fill(p.dead[:, None, :], NEG_INF)
        if out is None:
            return o.contiguous(), l_.contiguous()
        out[:, p.q0 : p.q1] = o
        lse[:, :, p.q0 : p.q1] = l_
    return out, lse


def attn_bwd(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    scale: float | None = None,
    causal: bool = False,
    q_vis: torch.Tensor | None = None,
    k_frame: torch.Tensor | None = None,
    dlse: torch.Tensor | None = None,
    backend: str | None = None,
    kv_aug: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of attention given the (possibly globally merged) out and lse.

    `out` / `lse` may be the final merged values over more keys than `k` (ring
    backward): the result is then this block's exact share of dq and the exact
    dk, dv. `dlse` (B,Hq,Sq) is the gradient w.r.t. lse (optional). Rows with
    lse = -inf get zero gradients. `kv_aug`: `augment_kv(k, v)`, reused when
    dlse is given (optional). Returns (dq, dk, dv) in q's, k's, v's dtypes;
    dk, dv have Hkv heads.
    """
    check_inputs(q, k, v, q_vis, k_frame)
    d = q.shape[-1]
    scale = _resolve_scale(scale, q)
    sq, sk = q.shape[1], k.shape[1]

    def one(p: _Plan):
        rows, ks = slice(p.q0, p.q1), slice(p.k0, p.k1)
        l_ = lse[:, :, rows].to(acc_dtype(q))
        dl = None if dlse is None else dlse[:, :, rows]
        # rows with lse = -inf (saw nothing anywhere) must give zero grads: give the kernel a
        # finite lse and zero upstream grads there (no host sync, so no `if dead.any()`)
        dead = ~(l_ > NEG_INF)
        l_ = l_.masked_fill(dead, 0.0)
        do = dout[:, rows].masked_fill(dead.transpose(1, 2).unsqueeze(-1), 0)
        dl = None if dl is None else dl.masked_fill(dead, 0.0)
        be = _choose(backend, q, p.mask is not None, d + (_AUG if dl is not None else 0))
        aug = None if kv_aug is None else (kv_aug[0][:, ks], kv_aug[1][:, ks])
        return _kernel_bwd(be, do, q[:, rows], k[:, ks], v[:, ks], out[:, rows], l_, dl, scale, p.mask, p.causal, aug)

    plans = list(_plans(q, k, causal, q_vis, k_frame))
    if len(plans) == 1 and (plans[0].q0, plans[0].q1, plans[0].k0, plans[0].k1) == (0, sq, 0, sk):
        gq, gk, gv = one(plans[0])  # the whole block in one call: no scatter, no accumulators
        return gq.to(q.dtype), gk.to(k.dtype), gv.to(v.dtype)
    dq = torch.zeros_like(q)
    # several query tiles add into the same keys: accumulate in float32
    dk = torch.zeros(k.shape, dtype=acc_dtype(k), device=k.device)
    dv = torch.zeros(v.shape, dtype=acc_dtype(v), device=v.device)
    for p in plans:
        gq, gk, gv = one(p)
        dq[:, p.q0 : p.q1] = gq
        dk[:, p.k0 : p.k1] += gk
        dv[:, p.k0 : p.k1] += gv
    return dq, dk.to(k.dtype), dv.to(v.dtype)


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale, causal, q_vis, k_frame, backend):
        out, lse = attn_fwd(q, k, v, scale=scale, causal=causal, q_vis=q_vis, k_frame=k_frame, backend=backend)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (scale, causal, q_vis, k_frame, backend)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        scale, causal, q_vis, k_frame, backend = ctx.args
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dk, dv = attn_bwd(
            dout, q, k, v, out, lse, scale=scale, causal=causal, q_vis=q_vis, k_frame=k_frame, dlse=dlse,
            backend=backend,
        )
        return dq, dk, dv, None, None, None, None, None


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float | None = None,
    causal: bool = False,
    q_vis: torch.Tensor | None = None,
    k_frame: torch.Tensor | None = None,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Single-device attention, differentiable through both outputs: returns (out, lse).

    The default for models/: the backward uses the matching kernel's backward with the
    saved (out, lse), and the lse gradient (G2 layers merge through it) is exact."""
    return _Attention.apply(q, k, v, scale, causal, q_vis, k_frame, backend)
