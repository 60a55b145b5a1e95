"""Backend adapters: the block kernels behind `attn_fwd` / `attn_bwd`, chosen per call at run time.

Backends, picked per call (`backend=None`), or forced with `backend=` / the
LVX_ATTN_BACKEND environment variable (a forced backend that cannot run a
given call, e.g. flash with a mask, falls back to the automatic choice):
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
CPU -> cpu; float64 -> math. The CUDA adapters other than "efficient" were
written from the published signatures: one that rejects our arguments falls
back (exactly) to "efficient" from then on, with one warning.

dlse (the gradient w.r.t. lse) on the aten backward ops: they compute
D = rowsum(dO * O) themselves, so dlse enters by augmenting the head
dimension: q' = [q, 0], k' = [k, 0], v' = [v, 1, 0..], out' = [O, 0],
dout' = [dO, dlse, 0..] (`AUG_COLS` extra columns keep head_dim a multiple of
8); the extra gradient columns are dropped.
"""

from __future__ import annotations

import inspect
import os
import warnings
from typing import Callable, TypeVar

import torch
import torch.nn.functional as F

from lvx_app.attention.masks import causal_visibility
from lvx_app.attention.merge import NEG_INF, acc_dtype

AUG_COLS = 8  # extra head-dim columns used to carry dlse through the aten backward ops

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


def choose_backend(backend: str | None, q: torch.Tensor, has_mask: bool, head_dim: int) -> str:
    """The backend for one call: the forced one (argument, then LVX_ATTN_BACKEND) if it can run it, else the automatic one."""
    want = backend or os.environ.get("LVX_ATTN_BACKEND") or None
    if want is not None and can_run(want, q, has_mask, head_dim):
        return want
    if q.dtype == torch.float64:
        return "math"
    if q.device.type == "cuda":
        for name in ("flash_attn", "flash", "efficient"):
            if can_run(name, q, has_mask, head_dim):
                return name
        return "math"
    if q.device.type == "cpu" and can_run("cpu", q, has_mask, head_dim):
        return "cpu"
    return "math"


def can_run(name: str, q: torch.Tensor, has_mask: bool, head_dim: int) -> bool:
    """Whether backend `name` takes a call on q's device and dtype, with or without a mask, at this head_dim."""
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


# ----------------------------------------------------------------------------- adapters
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
        s = s.masked_fill(~causal_visibility(s.shape[-2], s.shape[-1], 0, s.device), NEG_INF)
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


def _heads_first(q, k, v):
    """(q, k, v) in the (B, H, S, D) layout the aten SDPA ops take, K/V heads repeated to Hq; and the group size."""
    g = q.shape[2] // k.shape[2]
    return q.transpose(1, 2), _repeat_kv(k, g).transpose(1, 2), _repeat_kv(v, g).transpose(1, 2), g


def _efficient_fwd(q, k, v, scale, mask, causal):
    qt, kt, vt, _ = _heads_first(q, k, v)
    o, lse, _seed, _off = torch.ops.aten._scaled_dot_product_efficient_attention(
        qt, kt, vt, _cuda_bias(mask, q), True, 0.0, causal, scale=scale
    )
    return o.transpose(1, 2), lse[..., : q.shape[1]].float()


def _efficient_bwd(dout, q, k, v, out, lse, scale, mask, causal):
    qt, kt, vt, g = _heads_first(q, k, v)
    sq = q.shape[1]
    lse_p = F.pad(lse.float(), (0, -(-sq // 32) * 32 - sq)).contiguous()
    dummy = torch.zeros((), dtype=torch.int64, device=q.device)
    dq, dk, dv, _db = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        dout.transpose(1, 2), qt, kt, vt, _cuda_bias(mask, q), out.transpose(1, 2), lse_p, dummy, dummy, 0.0,
        [True, True, True, False], causal, scale=scale,
    )
    return dq.transpose(1, 2), _sum_groups(dk.transpose(1, 2), g), _sum_groups(dv.transpose(1, 2), g)


def _flash_fwd(q, k, v, scale, mask, causal):
    assert mask is None
    qt, kt, vt, _ = _heads_first(q, k, v)
    res = torch.ops.aten._scaled_dot_product_flash_attention(qt, kt, vt, 0.0, causal, False, scale=scale)
    return res[0].transpose(1, 2), res[1].float()


def _flash_bwd(dout, q, k, v, out, lse, scale, mask, causal):
    assert mask is None
    qt, kt, vt, g = _heads_first(q, k, v)
    # dropout is 0, so the philox state is never read; pass placeholders of the forward's kind.
    rng = torch.zeros(2, dtype=torch.uint64, device=q.device)
    unused = torch.empty(0, dtype=torch.uint64, device=q.device)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout.transpose(1, 2), qt, kt, vt, out.transpose(1, 2), lse.float().contiguous(), None, None, q.shape[1],
        k.shape[1], 0.0, causal, rng, unused, scale=scale,
    )
    return dq.transpose(1, 2), _sum_groups(dk.transpose(1, 2), g), _sum_groups(dv.transpose(1, 2), g)


def _cudnn_fwd(q, k, v, scale, mask, causal):
    qt, kt, vt, _ = _heads_first(q, k, v)
    res = torch.ops.aten._scaled_dot_product_cudnn_attention(
        qt, kt, vt, _cuda_bias(mask, q), True, 0.0, causal, False, scale=scale
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
        dout=dout, q=q, k=k, v=v, out=out, softmax_lse=lse.float().contiguous(), dq=dq, dk=dk, dv=dv, dropout_p=0.0,
        softmax_scale=scale, causal=causal, window_size=(-1, -1), window_size_left=-1, window_size_right=-1, softcap=0.0,
        alibi_slopes=None, deterministic=False, rng_state=None,
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



# ----------------------------------------------------------------------------- dispatch with fallback

_broken: set[tuple[str, str]] = set()  # CUDA (direction, backend) pairs that raised once; then "efficient"
_UNVERIFIED = {"fwd": ("flash", "flash_attn", "cudnn"), "bwd": ("flash", "flash_attn")}  # cudnn's bwd is "efficient"
_DIRECTION = {"fwd": "forward", "bwd": "backward"}

_T = TypeVar("_T")


def _with_fallback(direction: str, be: str, q: torch.Tensor, has_mask: bool, run: Callable[[str], _T]) -> _T:
    """`run(be)`; an unverified CUDA backend that rejects our arguments is marked broken (one
    warning) and this call and every later one run exactly on "efficient" (or "math") instead."""
    if be not in _UNVERIFIED[direction]:
        return run(be)
    if (direction, be) not in _broken:
        try:
            return run(be)
        except (RuntimeError, TypeError) as exc:
            _broken.add((direction, be))
            warnings.warn(f"attention {_DIRECTION[direction]} on {be!r} failed ({exc}); using 'efficient'", stacklevel=3)
    return run("efficient" if can_run("efficient", q, has_mask, q.shape[-1]) else "math")


def kernel_fwd(be, q, k, v, scale, mask, causal):
    """One block forward on backend `be` (non-empty slice): (out, lse) as the adapters above."""
    return _with_fallback("fwd", be, q, mask is not None, lambda name: _FWD[name](q, k, v, scale, mask, causal))


def kernel_bwd(be, dout, q, k, v, out, lse, dlse, scale, mask, causal, kv_aug=None):
    """One block backward on a non-empty slice; lse finite (dead rows already zeroed)."""
    return _with_fallback(
        "bwd", be, q, mask is not None,
        lambda name: _kernel_bwd_on(name, dout, q, k, v, out, lse, dlse, scale, mask, causal, kv_aug),
    )


def augment_kv(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V with the extra head-dim columns that carry dlse through the aten backward ops:
    k' = [k, 0..], v' = [v, 1, 0..]. Build once per shard and pass as `attn_bwd(kv_aug=...)`
    when the same K/V is used for many backward calls (the LV-XAttn ring), so no round copies it."""
    zk = k.new_zeros(*k.shape[:-1], AUG_COLS)
    v1 = v.new_zeros(*v.shape[:-1], AUG_COLS)
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
    dl = dout.new_zeros(*dout.shape[:-1], AUG_COLS)
    dl[..., 0] = dlse.transpose(1, 2).to(dt)
    dq, dk, dv = _BWD[be](
        torch.cat([dout, dl], -1),
        torch.cat([q, q.new_zeros(*q.shape[:-1], AUG_COLS)], -1),
        ka,
        va,
        torch.cat([out, torch.zeros_like(dl)], -1),
        lse,
        scale,
        mask,
        causal,
    )
    return dq[..., :d], dk[..., :d], dv[..., :d]
