"""The lse gradient without a wider head_dim: in bf16 and float32 the backward ops get dlse folded
into the O they are given (`backends.fold_dlse`), so finetuning's backward runs at the model's
head_dim (128 at 7B, not 136); fp16 keeps the extra columns. Exact against the float64 reference,
also on a row whose dO is zero while its dlse is not."""

from __future__ import annotations

import pytest
import torch
from attn_reference import reference_attention

from lvx_kernels import backends
from lvx_kernels.kernels import attn_bwd, attn_fwd

D = 16
# float32: the kernels' own; bf16: the inputs' rounding (O' is given to the op in bf16)
TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2}


def _head_dims(monkeypatch) -> list[int]:
    """The head_dim of every CPU backward kernel call."""
    seen, real = [], backends._BWD["cpu"]

    def spy(dout, q, *rest):
        seen.append(q.shape[-1])
        return real(dout, q, *rest)

    monkeypatch.setitem(backends._BWD, "cpu", spy)
    return seen


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dlse_reaches_the_backward_op_at_the_models_head_dim(dtype, monkeypatch):
    seen = _head_dims(monkeypatch)
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, s, h, D, generator=g) for s, h in ((7, 4), (11, 2), (11, 2)))
    q_vis = torch.tensor([[0, 1, 2, 3, 3, 2, 1]])
    k_frame = torch.arange(11).view(1, -1) // 3
    qq, kk, vv = (t.double().requires_grad_() for t in (q, k, v))
    ro, rl = reference_attention(qq, kk, vv, q_vis=q_vis, k_frame=k_frame)
    w = torch.randn(ro.shape, generator=g, dtype=torch.float64)
    u = torch.randn(rl.shape, generator=g, dtype=torch.float64)
    w[:, 4] = 0  # a row whose dO is zero and whose dlse is not
    fin = torch.isfinite(rl)
    ((ro * w).sum() + (torch.where(fin, rl, 0) * u).sum()).backward()
    q, k, v = (t.to(dtype) for t in (q, k, v))
    out, lse = attn_fwd(q, k, v, q_vis=q_vis, k_frame=k_frame, backend="cpu")
    dlse = (u * fin).float()
    grads = attn_bwd(w.to(dtype), q, k, v, out, lse, q_vis=q_vis, k_frame=k_frame, dlse=dlse)
    for got, want in zip(grads, (qq.grad, kk.grad, vv.grad)):
        torch.testing.assert_close(got.double(), want, atol=TOL[dtype], rtol=TOL[dtype])
    assert seen and set(seen) == {D}, seen


def test_fp16_still_widens_the_head_dim():
    assert backends.augments_head_dim(torch.float16)
    assert not any(map(backends.augments_head_dim, (torch.bfloat16, torch.float32, torch.float64)))
