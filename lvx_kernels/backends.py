"""Backend adapters: the block kernels behind `attn_fwd` / `attn_bwd`, chosen per call at run time.

Backends, picked per call (`backend=None`), or forced with `backend=` / the
run's `--attn-backend` (`ModelConfig.attn_backend`, handed to `prefer_backend` once
when a rank sets up; a forced backend that cannot run a given call, e.g. flash with
a mask, falls back to the automatic choice):
- "flash_attn": the flash-attn package (CUDA, fp16/bf16, no mask).
- "flash": aten._scaled_dot_product_flash_attention (CUDA, fp16/bf16, no mask).
- "efficient": aten._scaled_dot_product_efficient_attention (CUDA, any mask
  as an additive bias; lse comes padded to a multiple of 32 and is sliced).
- "cudnn": aten._scaled_dot_product_cudnn_attention forward (fp16/bf16, head_dim
  up to 128; the mask goes in as a (B, 1, Sq, Sk) bias, heads broadcast as PyTorch's
  own path passes it; lse has a trailing 1 that is squeezed); its backward runs on
  "efficient" (block backward only needs the final out/lse, so this is exact).
- "cpu": aten._scaled_dot_product_flash_attention_for_cpu and its backward op
  (float additive mask in the query dtype; causal only where top-left ==
  bottom-right; never called with Sk == 0, which SIGFPE-kills the process;
  the backward of bf16/fp16 runs in float32).
- "math": plain torch in float32 (float64 for float64 inputs); always works,
  takes grouped-query heads natively (einsum over (Hkv, G), no K/V copy).
Automatic choice: CUDA -> flash_attn/flash without mask, else efficient;
CPU -> cpu; float64 -> math. The CUDA adapters other than "efficient" were
written from the published signatures: one that rejects our arguments (shape,
dtype, argument list) falls back (exactly) to "efficient" from then on, with one
`BackendFallbackWarning`; running out of memory or a device fault is raised, never
taken for a rejection. `kernel_tally()` records which kernel ran each call and
every fallback, so benchmarks can say what they timed.

GQA: `attn_fwd` / `attn_bwd` pack the query groups into rows (`gqa`), so the aten and flash-attn
adapters get as many query heads as K/V heads and pass the caller's K/V slices as views;
`_heads_first` refuses unpacked queries.

Every aten / flash-attn kernel call goes through one table, `KERNEL_OPS`
(op name -> function with the op's own signature). The CUDA-only functions and
how each is tested without a GPU:
- `_efficient_fwd`, `_efficient_bwd`, `_flash_fwd`, `_flash_bwd`, `_cudnn_fwd`,
  `_fa_fwd`, `_fa_bwd`, `_cuda_bias`: run on CPU in tests/test_cuda_adapters_cpu.py
  with the KERNEL_OPS entries replaced by float64 stand-ins that keep each op's
  signature, layouts, lse padding and alignment checks (tests/cuda_standins.py);
  the stand-ins record every call's shapes.
- the KERNEL_OPS entries themselves (the real ops): the CUDA-marked tests in
  tests/test_attention_kernels.py, on a GPU only.

dlse (the gradient w.r.t. lse) on the aten backward ops: they compute
D = rowsum(dO * O) themselves and use O nowhere else, so in bf16 and float32
dlse goes into the O they are given: O' = O - dlse * dO / |dO|^2 has
rowsum(dO * O') = D - dlse, and head_dim stays the model's (a row whose dO is
zero gets dO = tau * e_0 and O' = -(dlse / tau) * e_0, exact up to tau in dP;
`fold_dlse`). In fp16, whose range cannot hold dlse / tau, it enters by
augmenting the head dimension: q' = [q, 0], k' = [k, 0], v' = [v, 1, 0..],
out' = [O, 0], dout' = [dO, dlse, 0..] (`AUG_COLS` extra columns keep head_dim
a multiple of 8); the extra gradient columns are dropped.
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Iterator, TypeVar

import torch
import torch.nn.functional as F

from lvx_kernels.backend_names import ATTN_BACKENDS
from lvx_kernels.masks import causal_visibility
from lvx_kernels.merge import NEG_INF, acc_dtype

AUG_COLS = 8  # extra head-dim columns used to carry dlse through the aten backward ops
CUDNN_MAX_HEAD_DIM = 128  # cuDNN attention takes up to 128 everywhere (more on some GPUs only)

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


# backends the engine never picks on its own and whose device faults poison the process's CUDA
# context for every later call: listed after the others, so a check that walks them runs them last
RISKY_BACKENDS = ("cudnn",)


def available_backends(device: torch.device | str | None = None) -> list[str]:
    """Backends usable on `device` (default: CUDA when available, else CPU), best first and the
    risky ones (`RISKY_BACKENDS`) after every other but the math reference."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    names: list[str] = []
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return ["math"]
        if _flash_attn() is not None:
            names.append("flash_attn")
        names += ["flash", "efficient"]
        if hasattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention"):
            names.append("cudnn")
    elif device.type == "cpu":
        names.append("cpu")
    names.append("math")
    return names


def _on_cuda(q: torch.Tensor) -> bool:
    """Whether q is on a CUDA device (the CPU tests of the CUDA adapters say yes here)."""
    return q.device.type == "cuda"


# the run's --attn-backend ("auto" or a backend every call prefers), set once by `prefer_backend`
_preferred = ["auto"]


def prefer_backend(name: str) -> str:
    """Make `name` (`--attn-backend`: "auto" or a backend) the run's choice for every kernel call
    that names none; called once as a rank sets up. Returns the choice it replaces."""
    if name not in ATTN_BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; use one of {ATTN_BACKENDS}")
    before, _preferred[0] = _preferred[0], name
    return before


def choose_backend(backend: str | None, q: torch.Tensor, has_mask: bool, head_dim: int) -> str:
    """The backend for one call: the forced one (argument, then the run's `--attn-backend`) if it
    can run it, else the automatic one."""
    want = backend or (None if _preferred[0] == "auto" else _preferred[0])
    if want is not None and can_run(want, q, has_mask, head_dim):
        return want
    if q.dtype == torch.float64:
        return "math"
    if _on_cuda(q):
        for name in ("flash_attn", "flash", "efficient"):
            if can_run(name, q, has_mask, head_dim):
                return name
        return "math"
    if q.device.type == "cpu" and can_run("cpu", q, has_mask, head_dim):
        return "cpu"
    return "math"


def can_run(name: str, q: torch.Tensor, has_mask: bool, head_dim: int) -> bool:
    """Whether backend `name` takes a call on q's device and dtype, with or without a mask, at this
    head_dim."""
    half = q.dtype in (torch.float16, torch.bfloat16)
    cuda = _on_cuda(q)
    if name == "math":
        return True
    if name == "cpu":
        return q.device.type == "cpu" and q.dtype in (torch.float32, torch.float16, torch.bfloat16)
    if name == "flash_attn":
        return (
            cuda
            and half
            and not has_mask
            and head_dim % 8 == 0
            and head_dim <= 256
            and _flash_attn() is not None
        )
    if name == "flash":
        return cuda and half and not has_mask and head_dim % 8 == 0 and head_dim <= 256
    if name == "cudnn":  # cuDNN attention is fp16/bf16 only
        return cuda and half and head_dim % 8 == 0 and head_dim <= CUDNN_MAX_HEAD_DIM
    if name == "efficient":
        return (
            cuda and q.dtype in (torch.float32, torch.float16, torch.bfloat16) and head_dim % 8 == 0
        )
    raise ValueError(
        f"unknown attention backend {name!r}; choose from {available_backends(q.device)}"
    )


# ----------------------------------------------------------------------------- adapters
# All take q (B,Sq,Hq,D), k/v (B,Sk,Hkv,D) with Sq, Sk > 0, a bool visibility mask (B,Sq,Sk) or
# None, and `causal` = native top-left causal (only used with Sq == Sk). Forward returns (out
# (B,Sq,Hq,D) q dtype, lse (B,Hq,Sq) fp32). Rows that see nothing are fixed up by the caller.
# Backward gets lse with -inf already replaced by 0.


def _grouped(x: torch.Tensor, hkv: int) -> torch.Tensor:
    """(B, S, Hkv·G, D) -> (B, S, Hkv, G, D): query heads i·G … i·G+G−1 share K/V head i (a view, no
    copy)."""
    b, s, h, d = x.shape
    return x.reshape(b, s, hkv, h // hkv, d)


def _math_scores(q, k, scale, mask, causal):
    """Scores (B, Hkv, G, Sq, Sk) in the accumulation dtype, -inf where hidden."""
    ct = acc_dtype(q)
    s = torch.einsum("bqhgd,bkhd->bhgqk", _grouped(q.to(ct), k.shape[2]), k.to(ct)) * scale
    if mask is not None:
        s = s.masked_fill(~mask[:, None, None], NEG_INF)
    if causal:
        s = s.masked_fill(~causal_visibility(s.shape[-2], s.shape[-1], 0, s.device), NEG_INF)
    return s


def _math_fwd(q, k, v, scale, mask, causal):
    s = _math_scores(q, k, scale, mask, causal)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(lse > NEG_INF, lse, torch.zeros_like(lse)).unsqueeze(-1))
    out = torch.einsum("bhgqk,bkhd->bqhgd", p, v.to(s.dtype)).reshape(q.shape).to(q.dtype)
    lse = lse.reshape(q.shape[0], q.shape[2], q.shape[1])
    return out, lse if q.dtype == torch.float64 else lse.float()


def _math_bwd(dout, q, k, v, out, lse, dlse, scale, mask, causal):
    b, sq, hq, _ = q.shape
    hkv = k.shape[2]
    s = _math_scores(q, k, scale, mask, causal)
    ct = s.dtype
    # lse finite here (caller replaced -inf rows)
    p = torch.exp(s - lse.to(ct).reshape(s.shape[:-1]).unsqueeze(-1))
    do = _grouped(dout.to(ct), hkv)  # (B,Sq,Hkv,G,D)
    dp = torch.einsum("bqhgd,bkhd->bhgqk", do, v.to(ct))
    dd = torch.einsum("bqhgd,bqhgd->bhgq", do, _grouped(out.to(ct), hkv)).unsqueeze(-1)
    if dlse is not None:
        dd = dd - dlse.to(ct).reshape(s.shape[:-1]).unsqueeze(-1)
    ds = p * (dp - dd)
    dq = torch.einsum("bhgqk,bkhd->bqhgd", ds, k.to(ct)).reshape(q.shape) * scale
    dk = torch.einsum("bhgqk,bqhgd->bkhd", ds, _grouped(q.to(ct), hkv)) * scale
    dv = torch.einsum("bhgqk,bqhgd->bkhd", p, do)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _additive(mask: torch.Tensor, dtype, align: int = 1) -> torch.Tensor:
    """(B,Sq,Sk) bool -> (B,1,Sq,Sk) additive float mask; last dim storage padded to `align`."""
    b, sq, sk = mask.shape
    skp = -(-sk // align) * align
    base = torch.zeros(b, 1, sq, skp, dtype=dtype, device=mask.device)
    bias = base[..., :sk]
    bias.masked_fill_(~mask.unsqueeze(1), NEG_INF)
    return bias


# ----------------------------------------------------------------------------- the op table
# Every aten / flash-attn kernel call goes through KERNEL_OPS, so tests can swap the CUDA ops for
# CPU stand-ins with the same signatures and run the adapters on CPU.


def _aten(name: str) -> Callable:
    """The aten op `name`, looked up when called (an op missing from this torch build fails then,
    not at import)."""
    return lambda *args, **kw: getattr(torch.ops.aten, name)(*args, **kw)


def _fa_forward(*args, **kw):
    return _flash_attn().flash_attn_func(*args, **kw)


def _fa_backward(**kw):
    fn = _flash_attn()._flash_attn_backward
    # absorbs the 2.5 .. 2.8 API drift; from 2.6 the function is a torch custom op whose Python
    # signature lives on `_init_fn` (as ring-flash-attn does)
    params = inspect.signature(getattr(fn, "_init_fn", fn)).parameters
    return fn(**{name: val for name, val in kw.items() if name in params})


KERNEL_OPS: dict[str, Callable] = {
    "cpu_fwd": _aten("_scaled_dot_product_flash_attention_for_cpu"),
    "cpu_bwd": _aten("_scaled_dot_product_flash_attention_for_cpu_backward"),
    "efficient_fwd": _aten("_scaled_dot_product_efficient_attention"),
    "efficient_bwd": _aten("_scaled_dot_product_efficient_attention_backward"),
    "flash_fwd": _aten("_scaled_dot_product_flash_attention"),
    "flash_bwd": _aten("_scaled_dot_product_flash_attention_backward"),
    "cudnn_fwd": _aten("_scaled_dot_product_cudnn_attention"),
    "flash_varlen_fwd": _aten("_flash_attention_forward"),
    "fa_fwd": _fa_forward,
    "fa_bwd": _fa_backward,
}


def _cpu_fwd(q, k, v, scale, mask, causal):
    attn_mask = None if mask is None else _additive(mask, q.dtype)
    o, lse = KERNEL_OPS["cpu_fwd"](
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        0.0,
        causal,
        attn_mask=attn_mask,
        scale=scale,
    )
    return o.transpose(1, 2), lse.float()


def _cpu_bwd(dout, q, k, v, out, lse, scale, mask, causal):
    if q.dtype != torch.float32:
        # the op's bf16/fp16 backward loses more than the tests allow once query groups are packed
        # into rows (the 4-rank ring test crossed its bf16 tolerance): the CPU backward runs in
        # float32
        grads = _cpu_bwd(*(t.float() for t in (dout, q, k, v, out)), lse, scale, mask, causal)
        return tuple(g.to(q.dtype) for g in grads)
    attn_mask = None if mask is None else _additive(mask, q.dtype)
    dq, dk, dv = KERNEL_OPS["cpu_bwd"](
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
    """The mem-efficient kernel's bias: (B, H, Sq, Sk), heads broadcast with stride 0, rows
    16-element aligned (as PyTorch's own SDPA path expands it)."""
    if mask is None:
        return None
    b, sq, sk = mask.shape
    return _additive(mask, q.dtype, align=16).expand(b, q.shape[2], sq, sk)


def _cudnn_bias(mask, q):
    """cuDNN's bias: (B, 1, Sq, Sk) unexpanded, as PyTorch's own path passes it (a stride-0 head
    dimension is not a layout cuDNN is asked for there)."""
    return None if mask is None else _additive(mask, q.dtype, align=16)


def _heads_first(q, k, v):
    """(q, k, v) in the (B, H, S, D) layout the aten SDPA ops take (views); query groups must arrive
    packed."""
    if q.shape[2] != k.shape[2]:
        raise ValueError(
            f"the CUDA adapters take packed query groups (q {q.shape[2]} heads, K/V {k.shape[2]}): "
            "use attn_fwd"
        )
    return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)


def _efficient_fwd(q, k, v, scale, mask, causal):
    qt, kt, vt = _heads_first(q, k, v)
    o, lse, _seed, _off = KERNEL_OPS["efficient_fwd"](
        qt, kt, vt, _cuda_bias(mask, q), True, 0.0, causal, scale=scale
    )
    return o.transpose(1, 2), lse[..., : q.shape[1]].float()


def _efficient_bwd(dout, q, k, v, out, lse, scale, mask, causal):
    qt, kt, vt = _heads_first(q, k, v)
    sq = q.shape[1]
    lse_p = F.pad(lse.float(), (0, -(-sq // 32) * 32 - sq)).contiguous()
    dummy = torch.zeros((), dtype=torch.int64, device=q.device)
    # the kernel reads out with packed (B, S, H, D) rows whatever its strides: pack it (and dout)
    dq, dk, dv, _db = KERNEL_OPS["efficient_bwd"](
        dout.contiguous().transpose(1, 2),
        qt,
        kt,
        vt,
        _cuda_bias(mask, q),
        out.contiguous().transpose(1, 2),
        lse_p,
        dummy,
        dummy,
        0.0,
        [True, True, True, False],
        causal,
        scale=scale,
    )
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


def _flash_fwd(q, k, v, scale, mask, causal):
    assert mask is None
    qt, kt, vt = _heads_first(q, k, v)
    res = KERNEL_OPS["flash_fwd"](qt, kt, vt, 0.0, causal, False, scale=scale)
    return res[0].transpose(1, 2), res[1].float()


def _flash_bwd(dout, q, k, v, out, lse, scale, mask, causal):
    assert mask is None
    qt, kt, vt = _heads_first(q, k, v)
    # dropout is 0, so the philox state is never read; pass placeholders of the forward's kind.
    rng = torch.zeros(2, dtype=torch.uint64, device=q.device)
    unused = torch.empty(0, dtype=torch.uint64, device=q.device)
    dq, dk, dv = KERNEL_OPS["flash_bwd"](
        dout.transpose(1, 2),
        qt,
        kt,
        vt,
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
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


def _cudnn_fwd(q, k, v, scale, mask, causal):
    qt, kt, vt = _heads_first(q, k, v)
    res = KERNEL_OPS["cudnn_fwd"](
        qt, kt, vt, _cudnn_bias(mask, q), True, 0.0, causal, False, scale=scale
    )
    b, sq, h, _ = q.shape
    return res[0].transpose(1, 2), res[1].float().reshape(b, h, sq)


def _last_dim_dense(x: torch.Tensor) -> torch.Tensor:
    """flash-attn needs only the last dim contiguous: a K/V slice of the resident shard goes in as a
    view."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _fa_fwd(q, k, v, scale, mask, causal):
    assert mask is None
    out, lse, _ = KERNEL_OPS["fa_fwd"](
        *(_last_dim_dense(t) for t in (q, k, v)),
        0.0,
        softmax_scale=scale,
        causal=causal,
        return_attn_probs=True,
    )
    return out, lse[..., : q.shape[1]].float()


def _fa_bwd(dout, q, k, v, out, lse, scale, mask, causal):
    assert mask is None
    q, k, v, out, dout = (t.contiguous() for t in (q, k, v, out, dout))
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    KERNEL_OPS["fa_bwd"](
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


# ----------------------------------------------------------------------------- dispatch with
# fallback

# CUDA (direction, backend) pairs whose op rejected our arguments once -> the op's error line;
# "efficient" runs their calls from then on
_broken: dict[tuple[str, str], str] = {}
# cudnn's bwd is "efficient"
_UNVERIFIED = {"fwd": ("flash", "flash_attn", "cudnn"), "bwd": ("flash", "flash_attn")}
_KERNEL = {("bwd", "cudnn"): "efficient"}  # the kernel a backend's direction really runs
_DIRECTION = {"fwd": "forward", "bwd": "backward"}
# errors any kernel would hit as well: raised, never taken for an op rejecting our arguments
_DEVICE_ERRORS = tuple(
    e for e in (torch.cuda.OutOfMemoryError, getattr(torch, "AcceleratorError", None)) if e
)

_T = TypeVar("_T")


class BackendFallbackWarning(UserWarning):
    """An attention backend rejected a call and another kernel ran it (exactly, but not the one
    asked for)."""


@dataclass(eq=False)  # each tally is its own record, whatever it holds
class KernelTally:
    """What ran inside `kernel_tally()`: calls per "direction kernel" (e.g. "bwd efficient"), and
    each fallback ("fwd cudnn -> efficient: why") with its count."""

    calls: Counter = field(default_factory=Counter)
    fallbacks: Counter = field(default_factory=Counter)

    def ran(self, direction: str) -> list[str]:
        """The kernels that ran calls in `direction` ("fwd" or "bwd"), sorted."""
        return sorted({key.split(" ", 1)[1] for key in self.calls if key.startswith(direction)})


_tallies: list[KernelTally] = []


_SDPA = F.scaled_dot_product_attention


def _counted_sdpa(*args, **kwargs):
    """PyTorch's own attention, as the vision towers call it (`F.scaled_dot_product_attention`),
    counted in every open tally as "fwd sdpa" (PyTorch picks its kernel)."""
    _note("fwd", "sdpa")
    return _SDPA(*args, **kwargs)


@contextlib.contextmanager
def kernel_tally() -> Iterator[KernelTally]:
    """Record every block kernel call made inside the block (nested tallies all see them), and
    every call of PyTorch's own attention (the vision towers', which call it directly): while a
    tally is open `F.scaled_dot_product_attention` counts its calls."""
    tally = KernelTally()
    _tallies.append(tally)
    F.scaled_dot_product_attention = _counted_sdpa
    try:
        yield tally
    finally:
        _tallies.remove(tally)
        if not _tallies:
            F.scaled_dot_product_attention = _SDPA


def _note(direction: str, kernel: str, fallback: str | None = None) -> None:
    for tally in _tallies:
        tally.calls[f"{direction} {kernel}"] += 1
        if fallback is not None:
            tally.fallbacks[f"{direction} {fallback}"] += 1


def _rejects_arguments(exc: BaseException) -> bool:
    """Whether an op's error says it does not take this call (shape, dtype, argument list), rather
    than that the device ran out of memory or faulted."""
    text = str(exc)
    return not isinstance(exc, _DEVICE_ERRORS) and not any(
        word in text for word in ("out of memory", "CUDA error")
    )


def _first_try(direction: str, be: str, run: Callable[[str], _T]) -> tuple[bool, _T | None]:
    """(True, `run(be)`), or (False, None) when `be` is marked broken in `direction` or its op
    rejects our arguments now (then marked broken, with one warning)."""
    if (direction, be) in _broken:
        return False, None
    try:
        result = run(be)
    except (RuntimeError, TypeError) as exc:
        if not _rejects_arguments(exc):
            raise
        why = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        _broken[(direction, be)] = why
        warnings.warn(
            f"attention {_DIRECTION[direction]} on {be!r} failed ({why}); using 'efficient'",
            BackendFallbackWarning,
            stacklevel=4,
        )
        return False, None
    _note(direction, be)
    return True, result


def _with_fallback(
    direction: str, be: str, q: torch.Tensor, has_mask: bool, run: Callable[[str], _T]
) -> _T:
    """`run(be)`; an unverified CUDA backend whose op rejects our arguments is marked broken (one
    warning) and this call and every later one run exactly on "efficient" (or "math") instead."""
    if be not in _UNVERIFIED[direction]:
        result = run(be)
        _note(direction, _KERNEL.get((direction, be), be))
        return result
    ran, result = _first_try(direction, be, run)
    if ran:
        return result
    alt = "efficient" if can_run("efficient", q, has_mask, q.shape[-1]) else "math"
    result = run(alt)
    _note(direction, alt, f"{be} -> {alt}: {_broken[(direction, be)]}")
    return result


def kernel_fwd(be, q, k, v, scale, mask, causal):
    """One block forward on backend `be` (non-empty slice): (out, lse) as the adapters above."""
    return _with_fallback(
        "fwd", be, q, mask is not None, lambda name: _FWD[name](q, k, v, scale, mask, causal)
    )


def bounds_keys(q: torch.Tensor, head_dim: int) -> bool:
    """Whether this torch build and device run one decoded token's attention mask-free up to a
    device-side key count (`kernel_fwd_upto`): aten's flash kernel with `seqused_k`, CUDA only."""
    if not can_run("flash", q, False, head_dim):
        return False
    schema = torch.ops.aten._flash_attention_forward.default._schema
    return any(arg.name == "seqused_k" for arg in schema.arguments)


def _flash_varlen_fwd(q, k, v, used, scale):
    """q (B, 1, Hq, D) against the first `used[b]` keys of (k, v) (B, S, Hkv, D): aten's flash
    kernel in its variable-length form, every row's key span [b·S, b·S + S) of which the kernel
    reads `used[b]`. The query heads go in unpacked, one row each: with a single query row and
    more query than K/V heads flash swaps the query groups into rows and splits the keys among
    thread blocks (its decode path), as the eager step's call does."""
    b, sq, hq, d = q.shape
    sk = k.shape[1]
    dev = q.device
    cum_q = torch.arange(0, b + 1, dtype=torch.int32, device=dev) * sq
    cum_k = torch.arange(0, b + 1, dtype=torch.int32, device=dev) * sk
    res = KERNEL_OPS["flash_varlen_fwd"](
        q.reshape(b * sq, hq, d),
        k.reshape(b * sk, *k.shape[2:]),
        v.reshape(b * sk, *v.shape[2:]),
        cum_q,
        cum_k,
        sq,
        sk,
        0.0,
        False,
        False,
        scale=scale,
        seqused_k=used,
    )
    # varlen lse is (Hq, B·Sq) (older builds: (B, Hq, Sq)); both hold B·Sq rows per head
    lse = res[1].reshape(-1, b, sq).transpose(0, 1) if res[1].dim() == 2 else res[1]
    return res[0].view(b, sq, hq, d), lse.float()


def kernel_fwd_upto(q, k, v, used, scale, masked: Callable[[str], _T]) -> _T:
    """One decoded token's (out, lse) against the first `used` keys (a (B,) int32 tensor on the
    device) mask-free (`bounds_keys`); the kernel reads only those keys and no shape depends on
    `used`, so a CUDA graph captures it once for every length. If the op rejects our arguments
    (marked broken, one warning) `masked(name)` runs it on backend `name` instead, then and every
    later call, each noted as a fallback (so a tally open while a graph is captured sees it)."""
    ran, result = _first_try(
        "fwd", "flash_varlen", lambda _: _flash_varlen_fwd(q, k, v, used, scale)
    )
    if ran:
        return result
    alt = "efficient" if can_run("efficient", q, True, q.shape[-1]) else "math"
    note_not_taken(f"fwd flash_varlen -> {alt}: {_broken[('fwd', 'flash_varlen')]}")
    return masked(alt)


def note_not_taken(fallback: str) -> None:
    """Count, in every open tally, a call that did not run on the kernel it was meant for
    (`fallback`: "direction kernel -> the one that ran: why")."""
    for tally in _tallies:
        tally.fallbacks[fallback] += 1


def kernel_bwd(be, dout, q, k, v, out, lse, dlse, scale, mask, causal, kv_aug=None):
    """One block backward on a non-empty slice; lse finite (dead rows already zeroed)."""
    return _with_fallback(
        "bwd",
        be,
        q,
        mask is not None,
        lambda name: _kernel_bwd_on(
            name, dout, q, k, v, out, lse, dlse, scale, mask, causal, kv_aug
        ),
    )


def augment_kv(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V with the extra head-dim columns that carry dlse through the aten backward ops:
    k' = [k, 0..], v' = [v, 1, 0..]. Build once per shard and pass as `attn_bwd(kv_aug=...)`
    when the same K/V is used for many backward calls (the LV-XAttn ring), so no round copies it."""
    zk = k.new_zeros(*k.shape[:-1], AUG_COLS)
    v1 = v.new_zeros(*v.shape[:-1], AUG_COLS)
    v1[..., 0] = 1
    return torch.cat([k, zk], -1), torch.cat([v, v1], -1)


# the dtypes whose range holds `fold_dlse`'s O' (fp16 augments the head dimension instead)
FOLDS_DLSE = (torch.bfloat16, torch.float32)
FOLD_TAU = 2.0**-40  # dO of a row whose dO is zero, in `fold_dlse`


def augments_head_dim(dtype: torch.dtype) -> bool:
    """Whether a backward with dlse on an aten/flash-attn kernel widens head_dim by AUG_COLS."""
    return dtype not in FOLDS_DLSE and dtype != torch.float64


def fold_dlse(
    dout: torch.Tensor, out: torch.Tensor, dlse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dO', O') in dout's dtype with rowsum(dO' * O') = rowsum(dO * O) - dlse, so a backward op
    that computes D itself takes dlse without a wider head_dim. dO' = dO except on rows where it is
    zero (tau * e_0 there)."""
    do, o = dout.float(), out.float()
    dl = dlse.float().transpose(1, 2).unsqueeze(-1)  # (B, S, H, 1)
    norm2 = (do * do).sum(-1, keepdim=True)
    zero = norm2 == 0
    e0 = torch.zeros_like(do)
    e0[..., 0] = FOLD_TAU
    do = torch.where(zero, e0, do)
    norm2 = norm2.masked_fill(zero, FOLD_TAU**2)
    o = o.masked_fill(zero, 0) - dl * do / norm2
    return do.to(dout.dtype), o.to(dout.dtype)


def _kernel_bwd_on(be, dout, q, k, v, out, lse, dlse, scale, mask, causal, kv_aug=None):
    if be == "math":
        return _math_bwd(dout, q, k, v, out, lse, dlse, scale, mask, causal)
    dt = q.dtype
    dout = dout.to(dt)
    out = out.to(dt)
    if dlse is not None and not augments_head_dim(dt):
        dout, out = fold_dlse(dout, out, dlse)
        dlse = None
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
