"""CPU stand-ins for the CUDA attention ops in `backends.KERNEL_OPS`, with the real signatures and
output conventions.

Each stand-in takes the arguments the real op takes (aten: (B, H, S, D); flash-attn:
(B, S, H, D)), checks what the real kernel would reject (K/V heads, dtype, head_dim, bias
shape and row alignment, lse padding, packed rows of out in the efficient backward),
computes in float64 by the math path and returns outputs in the real layout: efficient's
lse padded to a multiple of 32, cudnn's with a trailing 1, flash-attn's padded to 128,
9-tuples where aten returns them. Every call is recorded
(op name, q/k/v/bias shapes, K storage) so tests can assert what reached the ops.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Iterator

import torch

from lvx_kernels import backends

PAD = float("inf")  # what the padded lse tail holds: garbage the adapters must slice off


@dataclass
class Call:
    op: str
    q: tuple
    k: tuple
    v: tuple
    bias: tuple | None
    k_storage: int


@dataclass
class Recorder:
    calls: list[Call] = field(default_factory=list)

    def add(self, op, q, k, v, bias=None):
        self.calls.append(
            Call(
                op,
                tuple(q.shape),
                tuple(k.shape),
                tuple(v.shape),
                None if bias is None else tuple(bias.shape),
                k.untyped_storage().data_ptr(),
            )
        )

    def ops(self) -> set[str]:
        return {c.op for c in self.calls}


def _scores(q, k, bias, causal, scale):
    """(B,H,Sq,Sk) float64 scores of (B,H,S,D) inputs; causal is top-left, as the aten ops take
    it."""
    if k.shape[1] != q.shape[1]:
        raise RuntimeError(f"stand-in: K/V heads {k.shape[1]} != query heads {q.shape[1]}")
    s = (
        q.double()
        @ k.double().transpose(-1, -2)
        * (1 / math.sqrt(q.shape[-1]) if scale is None else scale)
    )
    if bias is not None:
        s = s + bias.double()
    if causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
    return s


def _fwd(q, k, v, bias, causal, scale):
    s = _scores(q, k, bias, causal, scale)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse.unsqueeze(-1)).nan_to_num(0.0)
    return (p @ v.double()).to(q.dtype), lse.float()


def _bwd(do, q, k, v, out, lse, bias, causal, scale):
    s = _scores(q, k, bias, causal, scale)
    sc = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    p = torch.exp(s - lse.double().unsqueeze(-1))
    do64 = do.double()
    ds = p * (do64 @ v.double().transpose(-1, -2) - (do64 * out.double()).sum(-1, keepdim=True))
    return (
        ((ds @ k.double()) * sc).to(q.dtype),
        ((ds.transpose(-1, -2) @ q.double()) * sc).to(k.dtype),
        (p.transpose(-1, -2) @ do64).to(v.dtype),
    )


def _check_bias(bias, q, k):
    if bias is not None:
        assert bias.shape == (q.shape[0], q.shape[1], q.shape[2], k.shape[2]), bias.shape
        assert bias.stride(-2) % 16 == 0, "mem-efficient kernels need 16-element aligned bias rows"


def _half(q):
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise RuntimeError("stand-in: flash kernels take fp16/bf16 only")


def _check_cudnn(q, k, bias):
    """What cuDNN attention refuses: other dtypes than fp16/bf16, head_dim over 128, and a bias
    other than (B, 1, Sq, Sk) (PyTorch's own path never sends one expanded over heads)."""
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise RuntimeError("stand-in: cuDNN attention takes fp16/bf16 only")
    if q.shape[-1] > 128:
        raise RuntimeError(f"stand-in: cuDNN attention takes head_dim <= 128, not {q.shape[-1]}")
    if bias is not None and tuple(bias.shape) != (q.shape[0], 1, q.shape[2], k.shape[2]):
        raise RuntimeError(f"stand-in: cuDNN takes a (B, 1, Sq, Sk) bias, not {tuple(bias.shape)}")


def _check_packed_out(out):
    """The mem-efficient backward reads out with packed (B, S, H, D) rows whatever its strides."""
    b, h, s, d = out.shape
    assert out.transpose(1, 2).stride()[1:] == (h * d, d, 1), (
        f"mem-efficient backward needs out's rows packed, got strides {out.stride()}"
    )


def _pad(lse, mult):
    n = -(-lse.shape[-1] // mult) * mult
    return torch.cat([lse, lse.new_full((*lse.shape[:-1], n - lse.shape[-1]), PAD)], -1)


def install(rec: Recorder) -> dict:
    """The stand-ins, as the KERNEL_OPS entries they replace, recording into `rec`."""

    def efficient_fwd(
        q, k, v, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False, *, scale=None
    ):
        rec.add("efficient_fwd", q, k, v, attn_bias)
        _check_bias(attn_bias, q, k)
        o, lse = _fwd(q, k, v, attn_bias, is_causal, scale)
        return (
            o,
            _pad(lse, 32),
            torch.zeros((), dtype=torch.int64),
            torch.zeros((), dtype=torch.int64),
        )

    def efficient_bwd(
        grad_out,
        q,
        k,
        v,
        attn_bias,
        out,
        logsumexp,
        seed,
        offset,
        dropout_p,
        grad_input_mask,
        is_causal=False,
        *,
        scale=None,
    ):
        rec.add("efficient_bwd", q, k, v, attn_bias)
        _check_bias(attn_bias, q, k)
        _check_packed_out(out)
        assert logsumexp.shape[-1] % 32 == 0 and logsumexp.shape[-1] >= q.shape[2], (
            "lse must come padded to 32"
        )
        return (
            *_bwd(
                grad_out, q, k, v, out, logsumexp[..., : q.shape[2]], attn_bias, is_causal, scale
            ),
            None,
        )

    def flash_fwd(q, k, v, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
        rec.add("flash_fwd", q, k, v)
        _half(q)
        o, lse = _fwd(q, k, v, None, is_causal, scale)
        return (
            o,
            lse,
            None,
            None,
            q.shape[2],
            k.shape[2],
            torch.zeros(2, dtype=torch.int64),
            torch.empty(0),
            torch.empty(0),
        )

    def flash_bwd(
        grad_out,
        q,
        k,
        v,
        out,
        logsumexp,
        cum_q,
        cum_k,
        max_q,
        max_k,
        dropout_p,
        is_causal,
        rng,
        unused,
        *,
        scale=None,
    ):
        rec.add("flash_bwd", q, k, v)
        _half(q)
        assert logsumexp.shape == q.shape[:3] and (max_q, max_k) == (q.shape[2], k.shape[2])
        return _bwd(grad_out, q, k, v, out, logsumexp, None, is_causal, scale)

    def flash_varlen_fwd(
        q,
        k,
        v,
        cum_seq_q,
        cum_seq_k,
        max_q,
        max_k,
        dropout_p,
        is_causal,
        return_debug_mask,
        *,
        scale=None,
        seqused_k=None,
        **_rest,
    ):
        """aten's flash forward in its variable-length form: q (Tq, Hq, D) and k/v (Tk, Hkv, D)
        rows of every sequence packed; sequence b's queries cum_seq_q[b]:cum_seq_q[b + 1] see the
        keys from cum_seq_k[b], the first seqused_k[b] of them when given. Query heads may be a
        multiple of K/V heads (native GQA). lse (Hq, Tq)."""
        rec.add("flash_varlen_fwd", q, k, v)
        _half(q)
        assert cum_seq_q.dtype == cum_seq_k.dtype == torch.int32, "cumulative lengths are int32"
        assert seqused_k is None or seqused_k.dtype == torch.int32, "seqused_k is int32"
        if q.shape[1] % k.shape[1]:
            raise RuntimeError("stand-in: query heads must be a multiple of K/V heads")
        g = q.shape[1] // k.shape[1]
        out, lse = torch.empty_like(q), q.new_empty(q.shape[1], q.shape[0], dtype=torch.float32)
        for b in range(cum_seq_q.numel() - 1):
            q0, q1 = int(cum_seq_q[b]), int(cum_seq_q[b + 1])
            k0, k1 = int(cum_seq_k[b]), int(cum_seq_k[b + 1])
            if seqused_k is not None:
                k1 = k0 + int(seqused_k[b])
            assert q1 - q0 <= max_q and k1 - k0 <= max_k
            kb, vb = (t[k0:k1].repeat_interleave(g, 1).transpose(0, 1)[None] for t in (k, v))
            o, l_ = _fwd(q[q0:q1].transpose(0, 1)[None], kb, vb, None, is_causal, scale)
            out[q0:q1], lse[:, q0:q1] = o[0].transpose(0, 1), l_[0]
        return out, lse, torch.zeros(2, dtype=torch.int64), torch.empty(0), torch.empty(0)

    def cudnn_fwd(
        q,
        k,
        v,
        attn_bias,
        compute_log_sumexp,
        dropout_p=0.0,
        is_causal=False,
        return_debug_mask=False,
        *,
        scale=None,
    ):
        rec.add("cudnn_fwd", q, k, v, attn_bias)
        _check_cudnn(q, k, attn_bias)
        o, lse = _fwd(q, k, v, attn_bias, is_causal, scale)
        return o, lse.unsqueeze(-1), None, None, q.shape[2], k.shape[2], None, None, None

    def fa_fwd(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, return_attn_probs=False):
        rec.add("fa_fwd", q, k, v)
        _half(q)
        assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1, (
            "flash-attn needs the last dim contiguous"
        )
        o, lse = _fwd(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, causal, softmax_scale
        )
        return o.transpose(1, 2), _pad(lse, 128), None

    def fa_bwd(*, dout, q, k, v, out, softmax_lse, dq, dk, dv, softmax_scale, causal, **_rest):
        rec.add("fa_bwd", q, k, v)
        _half(q)
        t = [x.transpose(1, 2) for x in (dout, q, k, v, out)]
        for dst, src in zip((dq, dk, dv), _bwd(*t, softmax_lse, None, causal, softmax_scale)):
            dst.copy_(src.transpose(1, 2))

    return {
        "efficient_fwd": efficient_fwd,
        "efficient_bwd": efficient_bwd,
        "flash_fwd": flash_fwd,
        "flash_bwd": flash_bwd,
        "cudnn_fwd": cudnn_fwd,
        "flash_varlen_fwd": flash_varlen_fwd,
        "fa_fwd": fa_fwd,
        "fa_bwd": fa_bwd,
    }


def on_stand_ins(monkeypatch, flash_attn: bool) -> Iterator[Recorder]:
    """A fixture's body: CPU tensors count as CUDA, flash-attn as installed when `flash_attn`, every
    CUDA op is a recording stand-in, and a rejected call that would fall back fails instead."""
    rec = Recorder()
    monkeypatch.setattr(backends, "_on_cuda", lambda q: True)
    monkeypatch.setattr(backends, "_flash_attn", (lambda: object()) if flash_attn else lambda: None)
    monkeypatch.setattr(backends, "_broken", {})
    for name, fn in install(rec).items():
        monkeypatch.setitem(backends.KERNEL_OPS, name, fn)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield rec
