"""Block kernels (attn_fwd / attn_bwd / attention) and the log-sum-exp merge vs the float64
reference."""

import contextlib
import math
import warnings

import pytest
import torch
from attn_reference import reference_attention

from lvx_kernels import backends, kernels, masks
from lvx_kernels.backends import available_backends
from lvx_kernels.gqa import pack_lse, pack_rows, unpack_lse, unpack_rows
from lvx_kernels.kernels import attention, attn_bwd, attn_fwd
from lvx_kernels.merge import merge, merge_, merge_many

NEG_INF = float("-inf")
CPU_BACKENDS = ["cpu", "math"]
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}
# lse in half precision, absolute: the reference takes the same rounded inputs, so only the kernel's
# float32 arithmetic differs; a 1% error of the softmax sum (log 1.01 = 0.00995) is caught
LSE_TOL = 5e-3

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@contextlib.contextmanager
def no_fallback():
    """A kernel falling back to another is an error inside, and nothing inside inherits a backend
    that an earlier call in this process marked broken."""
    broken, backends._broken = backends._broken, {}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", backends.BackendFallbackWarning)
            yield
        assert not backends._broken, f"backends fell back: {sorted(backends._broken)}"
    finally:
        backends._broken = broken


@pytest.fixture(autouse=True)
def _cuda_tests_hide_no_fallback(request):
    """The CUDA tests check the kernel they name: one that falls back to another fails."""
    if request.node.get_closest_marker("cuda") is None:
        yield
        return
    with no_fallback():
        yield


def _inputs(
    b, sq, sk, hq, hkv, d, dtype=torch.float32, device="cpu", seed=0, frames=4, media=False
):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, s, h, d, generator=g) for s, h in ((sq, hq), (sk, hkv), (sk, hkv)))
    q_vis = k_frame = None
    if media:
        k_frame = torch.sort(torch.randint(0, frames, (b, sk), generator=g), 1).values
        q_vis = torch.randint(0, frames + 1, (b, sq), generator=g)  # 0 -> the row sees nothing
        q_vis[:, :1] = 0
        q_vis, k_frame = q_vis.to(device), k_frame.to(device)
    return q.to(device, dtype), k.to(device, dtype), v.to(device, dtype), q_vis, k_frame


def _reference(q, k, v, **kw):
    qq, kk, vv = (t.detach().cpu().double().requires_grad_() for t in (q, k, v))
    kw = {n: (x.cpu() if torch.is_tensor(x) else x) for n, x in kw.items()}
    out, lse = reference_attention(qq, kk, vv, **kw)
    g = torch.Generator().manual_seed(7)
    w = torch.randn(out.shape, generator=g, dtype=torch.float64)
    u = torch.randn(lse.shape, generator=g, dtype=torch.float64)
    fin = torch.isfinite(lse)
    ((out * w).sum() + (torch.where(fin, lse, 0) * u).sum()).backward()
    return out, lse, w, u * fin, (qq.grad, kk.grad, vv.grad)


def _close(name, got, want, tol):
    got = got.detach().cpu().double()
    assert got.shape == want.shape, (name, got.shape, want.shape)
    assert not torch.isnan(got).any(), f"{name} has NaN"
    err = (got - want).abs().max().item() if got.numel() else 0.0
    scale = max(1.0, want.abs().max().item() if want.numel() else 1.0)
    assert err <= tol * scale, f"{name}: max error {err:.3g} > {tol:g} x {scale:.3g}"


def _check_lse(lse, ref_lse, tol):
    """lse against the reference, `tol` absolute (lse grows with the keys: no relative scale)."""
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse.cpu()), fin), (
        "rows that see nothing must have lse = -inf, others finite"
    )
    assert (lse.cpu()[~fin] == NEG_INF).all()
    err = (torch.where(fin, lse.cpu().double(), 0) - torch.where(fin, ref_lse.detach(), 0)).abs()
    worst = err.max().item() if err.numel() else 0.0
    assert worst <= tol, f"lse: max error {worst:.3g} > {tol:g}"


SHAPES = [  # b, sq, sk, hq, hkv, d
    (2, 5, 7, 8, 2, 16),
    (1, 9, 4, 4, 4, 8),
    (2, 6, 6, 8, 2, 16),
    (1, 1, 13, 8, 2, 8),
    (2, 5, 0, 8, 2, 8),  # empty K/V shard
    (2, 0, 5, 8, 2, 8),  # no queries
]


def _run_case(shape, dtype, backend, causal, media, device="cpu", scale=None):
    q, k, v, q_vis, k_frame = _inputs(*shape, dtype=dtype, device=device, media=media)
    kw = dict(scale=scale, causal=causal, q_vis=q_vis, k_frame=k_frame)
    ro, rl, w, u, (gq, gk, gv) = _reference(q, k, v, **kw)
    out, lse = attn_fwd(q, k, v, backend=backend, **kw)
    tol = TOL[dtype]
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert out.shape == q.shape and lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    _close("out", out, ro, tol)
    _check_lse(lse, rl, 1e-5 if dtype == torch.float32 else LSE_TOL)
    dq, dk, dv = attn_bwd(
        w.to(device, dtype),
        q,
        k,
        v,
        out,
        lse,
        dlse=u.to(device, torch.float32),
        backend=backend,
        **kw,
    )
    assert dq.dtype == dtype and dk.shape == k.shape and dv.shape == v.shape
    _close("dq", dq, gq, tol)
    _close("dk", dk, gk, tol)
    _close("dv", dv, gv, tol)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("media", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_fwd_bwd_fp32_matches_reference(backend, causal, media, shape):
    _run_case(shape, torch.float32, backend, causal, media)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("causal,media", [(False, False), (True, True), (False, True)])
def test_fwd_bwd_bf16_matches_reference(backend, causal, media):
    _run_case((2, 7, 11, 8, 2, 16), torch.bfloat16, backend, causal, media, scale=0.3)


def test_float64_is_exact():
    q, k, v, q_vis, k_frame = _inputs(2, 6, 9, 8, 2, 8, dtype=torch.float64, media=True)
    ro, rl, w, u, grads = _reference(q, k, v, q_vis=q_vis, k_frame=k_frame)
    out, lse = attn_fwd(q, k, v, q_vis=q_vis, k_frame=k_frame)
    assert lse.dtype == torch.float64
    _close("out", out, ro, 1e-12)
    _check_lse(lse, rl, 1e-12)
    for got, want in zip(
        attn_bwd(w, q, k, v, out, lse, q_vis=q_vis, k_frame=k_frame, dlse=u), grads
    ):
        _close("grad", got, want, 1e-12)


def _kernel_calls(backend: str, monkeypatch) -> list:
    """4-token tiles, and a list that records (rows, keys, masked) of every forward kernel call of
    `backend`."""
    monkeypatch.setattr(masks, "Q_TILE", 4)
    calls = []
    real = backends._FWD[backend]

    def spy(q, k, v, scale, mask, causal):
        calls.append((q.shape[1], k.shape[1], mask is not None))
        return real(q, k, v, scale, mask, causal)

    monkeypatch.setitem(backends._FWD, backend, spy)
    return calls


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_tiles_skip_hidden_work_and_stay_exact(backend, monkeypatch):
    """Q_TILE rows per tile: hidden tiles never reach a kernel, keys are trimmed to the visible
    range."""
    calls = _kernel_calls(backend, monkeypatch)
    b, sq, sk = 1, 16, 24
    q, k, v, _, _ = _inputs(b, sq, sk, 8, 2, 8)
    k_frame = (torch.arange(sk) // 4).unsqueeze(0)  # 4 keys per frame, 6 frames
    # first tile sees nothing
    q_vis = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1, 2, 2, 2, 2, 6, 6, 0, 3]])
    ro, rl, w, u, grads = _reference(q, k, v, q_vis=q_vis, k_frame=k_frame)
    out, lse = attn_fwd(q, k, v, q_vis=q_vis, k_frame=k_frame, backend=backend)
    _close("out", out, ro, 1e-5)
    _check_lse(lse, rl, 1e-5)
    # tile 0 (rows 0..4, which see the same keys: not cut at Q_TILE) hidden; tile 1 rows 5..8: keys
    # 0..3 seen by all with no mask, the band 4..7 masked; tile 2 rows 9..12: keys 0..7 unmasked,
    # the band 8..23; tile 3 (rows 13..15) sees up to frame 5 (all keys) with a mask. 8 query heads
    # on 2 K/V heads: each token is 4 packed rows.
    want = [(16, 4, False), (16, 4, True), (16, 8, False), (16, 16, True), (12, 24, True)]
    assert calls == want, calls
    for got, want in zip(
        attn_bwd(
            w.float(),
            q,
            k,
            v,
            out,
            lse,
            q_vis=q_vis,
            k_frame=k_frame,
            dlse=u.float(),
            backend=backend,
        ),
        grads,
    ):
        _close("grad", got, want, 1e-5)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_partly_visible_tile_masks_only_the_band(backend, monkeypatch):
    """A tile whose rows see 2..5 frames: frames 0-1 go unmasked, the mask covers frames 2-4 only;
    exact after the merge."""
    calls = []
    real = backends._FWD[backend]

    def spy(q, k, v, scale, mask, causal):
        calls.append((q.shape[1], k.shape[1], None if mask is None else tuple(mask.shape)))
        return real(q, k, v, scale, mask, causal)

    monkeypatch.setitem(backends._FWD, backend, spy)
    q, k, v, _, _ = _inputs(2, 6, 28, 14, 2, 8)  # GQA 7:1: 6 tokens are 42 packed rows
    k_frame = (torch.arange(28) // 4).expand(2, 28)  # 7 frames of 4 keys
    q_vis = torch.tensor([[2, 2, 3, 4, 5, 5], [3, 5, 5, 5, 5, 5]])
    ro, rl, w, u, grads = _reference(q, k, v, q_vis=q_vis, k_frame=k_frame)
    out, lse = attn_fwd(q, k, v, q_vis=q_vis, k_frame=k_frame, backend=backend)
    _close("out", out, ro, 1e-5)
    _check_lse(lse, rl, 1e-5)
    assert calls == [(42, 8, None), (42, 12, (2, 42, 12))], calls
    for got, want in zip(
        attn_bwd(
            w.float(),
            q,
            k,
            v,
            out,
            lse,
            q_vis=q_vis,
            k_frame=k_frame,
            dlse=u.float(),
            backend=backend,
        ),
        grads,
    ):
        _close("grad", got, want, 1e-5)


def test_query_groups_pack_into_rows_by_qwen2_heads():
    """K/V head i serves query heads i*G .. i*G+G-1; packed row s*G+g holds token s's head i*G+g;
    lse likewise."""
    x = torch.arange(2 * 3 * 6 * 1).view(2, 3, 6, 1)  # B=2, S=3, Hq=6 (Hkv=2, G=3), D=1
    p = pack_rows(x, 3)
    assert p.shape == (2, 9, 2, 1)
    assert p[1, 2 * 3 + 1, 1, 0] == x[1, 2, 1 * 3 + 1, 0]
    assert torch.equal(unpack_rows(p, 3), x)
    lse = torch.arange(2 * 6 * 3).view(2, 6, 3)
    assert torch.equal(
        pack_lse(lse, 3)[..., None].transpose(1, 2), pack_rows(lse.transpose(1, 2)[..., None], 3)
    )
    assert torch.equal(unpack_lse(pack_lse(lse, 3), 3), lse)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_empty_and_fully_hidden_blocks(backend, monkeypatch):
    """Sk == 0 (which would SIGFPE the CPU op) and blocks nobody sees never call a kernel."""

    def boom(*a, **k):
        raise AssertionError("kernel called on an empty or fully hidden block")

    monkeypatch.setitem(backends._FWD, backend, boom)
    q, k, v, _, _ = _inputs(2, 5, 0, 8, 2, 8)
    out, lse = attn_fwd(q, k, v, backend=backend)
    assert torch.equal(out, torch.zeros_like(q)) and (lse == NEG_INF).all()
    dq, dk, dv = attn_bwd(
        torch.ones_like(q), q, k, v, out, lse, dlse=torch.ones_like(lse), backend=backend
    )
    assert torch.equal(dq, torch.zeros_like(q)) and dk.shape == k.shape

    q, k, v, _, _ = _inputs(2, 0, 7, 8, 2, 8)
    out, lse = attn_fwd(q, k, v, backend=backend)
    assert out.shape == q.shape and lse.shape == (2, 8, 0)

    q, k, v, _, _ = _inputs(2, 5, 7, 8, 2, 8)
    q_vis = torch.full((2, 5), 3)
    k_frame = torch.full((2, 7), 3)  # every key is frame 3, queries see frames < 3
    out, lse = attn_fwd(q, k, v, q_vis=q_vis, k_frame=k_frame, backend=backend)
    assert torch.equal(out, torch.zeros_like(q)) and (lse == NEG_INF).all()
    grads = attn_bwd(
        torch.ones_like(q), q, k, v, out, lse, q_vis=q_vis, k_frame=k_frame, backend=backend
    )
    assert all(torch.equal(g, torch.zeros_like(g)) for g in grads)


def test_causal_is_bottom_right_aligned():
    q, k, v, _, _ = _inputs(1, 3, 5, 2, 2, 8)
    out, lse = attn_fwd(q, k, v, causal=True)
    # the last query sees every key; the first sees keys 0..2
    full_last, _ = attn_fwd(q[:, 2:], k, v)
    first, _ = attn_fwd(q[:, :1], k[:, :3], v[:, :3])
    torch.testing.assert_close(out[:, 2:], full_last)
    torch.testing.assert_close(out[:, :1], first)
    # more queries than keys: the first Sq - Sk queries see nothing
    out, lse = attn_fwd(q[:, :3], k[:, :1], v[:, :1], causal=True)
    assert (lse[..., :2] == NEG_INF).all() and torch.isfinite(lse[..., 2]).all()


def test_backends_agree():
    q, k, v, q_vis, k_frame = _inputs(2, 9, 12, 8, 2, 16, media=True)
    res = {
        be: attn_fwd(q, k, v, q_vis=q_vis, k_frame=k_frame, causal=True, backend=be)
        for be in CPU_BACKENDS
    }
    (o1, l1), (o2, l2) = res.values()
    torch.testing.assert_close(o1, o2, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(l1, l2, atol=1e-6, rtol=1e-5)
    g = [
        attn_bwd(
            torch.ones_like(q),
            q,
            k,
            v,
            o1,
            l1,
            q_vis=q_vis,
            k_frame=k_frame,
            causal=True,
            dlse=torch.ones_like(l1),
            backend=be,
        )
        for be in CPU_BACKENDS
    ]
    for a, b in zip(*g):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_available_backends_and_errors():
    assert available_backends("cpu") == ["cpu", "math"]
    q, k, v, _, _ = _inputs(1, 2, 3, 4, 2, 8)
    with pytest.raises(ValueError, match="unknown attention backend"):
        attn_fwd(q, k, v, backend="nope")
    with pytest.raises(ValueError, match="multiple"):
        attn_fwd(q, k[:, :, :1].expand(1, 3, 3, 8), v[:, :, :1].expand(1, 3, 3, 8))
    with pytest.raises(ValueError, match="go together"):
        attn_fwd(q, k, v, q_vis=torch.ones(1, 2, dtype=torch.long))
    before = backends.prefer_backend("math")  # the run's --attn-backend
    try:
        assert backends.choose_backend(None, q, False, 8) == "math"
    finally:
        backends.prefer_backend(before)


@pytest.mark.parametrize("use_lse", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_autograd_through_out_and_lse(use_lse, dtype):
    q, k, v, q_vis, k_frame = _inputs(2, 7, 10, 8, 2, 16, dtype=dtype, media=True)
    ro, rl, w, u, (gq, gk, gv) = _reference(q, k, v, q_vis=q_vis, k_frame=k_frame)
    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse = attention(qq, kk, vv, q_vis=q_vis, k_frame=k_frame)
    loss = (out.float() * w.float()).sum()
    if use_lse:
        loss = loss + (torch.where(torch.isfinite(lse), lse, 0) * u.float()).sum()
    loss.backward()
    tol = TOL[dtype]
    _close("out", out, ro, tol)
    if use_lse:
        _close("dq", qq.grad, gq, tol)
        _close("dk", kk.grad, gk, tol)
        _close("dv", vv.grad, gv, tol)
    else:  # out-only reference gradient
        ro2, _, _, _, _ = _reference(q, k, v, q_vis=q_vis, k_frame=k_frame)
        q2, k2, v2 = (t.detach().double().requires_grad_() for t in (q, k, v))
        o2, _ = reference_attention(q2, k2, v2, q_vis=q_vis, k_frame=k_frame)
        (o2 * w).sum().backward()
        _close("dq", qq.grad, q2.grad, tol)
        _close("dv", vv.grad, v2.grad, tol)


# --------------------------------------------------------------------------- merge


def _partials(b=2, s=5, h=3, d=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, s, h, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, 12, h, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, 12, h, d, generator=g, dtype=torch.float64)
    return q, k, v


def test_merge_equals_full_attention_in_any_order():
    q, k, v = _partials()
    full_o, full_l = reference_attention(q, k, v)
    parts = [reference_attention(q, k[:, a:b_], v[:, a:b_]) for a, b_ in ((0, 3), (3, 4), (4, 12))]
    o, l_ = merge(*parts[0], *parts[1])
    o, l_ = merge(o, l_, *parts[2])
    torch.testing.assert_close(o, full_o)
    torch.testing.assert_close(l_, full_l)
    o2, l2 = merge(*parts[2], *merge(*parts[1], *parts[0]))
    torch.testing.assert_close(o2, full_o)
    torch.testing.assert_close(l2, full_l)
    om, lm = merge_many(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))
    torch.testing.assert_close(om, full_o)
    torch.testing.assert_close(lm, full_l)
    acc_o, acc_l = parts[0][0].clone(), parts[0][1].clone()
    merge_(acc_o, acc_l, *parts[1])
    merge_(acc_o, acc_l, *parts[2])
    torch.testing.assert_close(acc_o, full_o)
    torch.testing.assert_close(acc_l, full_l)


def test_merge_float32_outputs_and_large_lse():
    o = torch.randn(1, 2, 1, 3, dtype=torch.bfloat16)
    l_ = torch.tensor([[[1e4, -1e4]]])
    out, lse = merge(o, l_, o, l_)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    torch.testing.assert_close(lse, l_ + math.log(2))
    torch.testing.assert_close(out, o.float())


def test_merge_with_empty_sides_is_nan_free_in_forward_and_backward():
    b, s, h, d = 1, 3, 2, 4
    oa = torch.randn(b, s, h, d, requires_grad=True)
    ob = torch.randn(b, s, h, d, requires_grad=True)
    # row 0: a empty; row 1: both empty; row 2: b empty
    la = torch.tensor([[[NEG_INF, NEG_INF, 0.5]] * h]).requires_grad_()
    lb = torch.tensor([[[0.3, NEG_INF, NEG_INF]] * h]).requires_grad_()
    out, lse = merge(oa, la, ob, lb)
    assert torch.equal(out[:, 0], ob[:, 0].detach()) and torch.equal(out[:, 2], oa[:, 2].detach())
    assert (out[:, 1] == 0).all() and (lse[..., 1] == NEG_INF).all()
    torch.testing.assert_close(lse[..., 0], lb[..., 0].detach())
    (out.sum() + torch.where(torch.isfinite(lse), lse, 0).sum()).backward()
    for t in (oa, ob, la, lb):
        assert not torch.isnan(t.grad).any()
    assert (oa.grad[:, :2] == 0).all() and (la.grad[..., :2] == 0).all()
    # merge_many: all empty
    om, lm = merge_many(torch.zeros(3, b, s, h, d), torch.full((3, b, h, s), NEG_INF))
    assert (om == 0).all() and (lm == NEG_INF).all()


def test_merge_gradients_match_reference():
    q, k, v = _partials(seed=3)
    kk, vv = k.clone().requires_grad_(), v.clone().requires_grad_()
    o, l_ = merge(
        *reference_attention(q, kk[:, :5], vv[:, :5]), *reference_attention(q, kk[:, 5:], vv[:, 5:])
    )
    (o.sum() + l_.sum()).backward()
    k2, v2 = k.clone().requires_grad_(), v.clone().requires_grad_()
    fo, fl = reference_attention(q, k2, v2)
    (fo.sum() + fl.sum()).backward()
    torch.testing.assert_close(kk.grad, k2.grad)
    torch.testing.assert_close(vv.grad, v2.grad)


# --------------------------------------------------------------------------- CUDA (skipped without
# a GPU)


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("backend", ["flash", "efficient", "cudnn", "flash_attn", "math"])
@pytest.mark.parametrize("media", [False, True])
def test_cuda_backends_match_reference(backend, media):
    if backend not in available_backends("cuda"):
        pytest.skip(f"{backend} not available")
    dtype = torch.bfloat16
    if media and backend in ("flash", "flash_attn"):
        media = False  # these take no mask; masked calls fall back to efficient
    for causal in (False, True):
        _run_case((2, 37, 100, 8, 2, 64), dtype, backend, causal, media, device="cuda")
    _run_case((2, 33, 0, 8, 2, 64), dtype, backend, False, False, device="cuda")  # empty shard


@pytest.mark.cuda
@cuda
def test_cuda_fp32_efficient():
    _run_case((1, 5, 70, 4, 2, 32), torch.float32, "efficient", False, True, device="cuda")


@pytest.mark.cuda
@cuda
def test_cuda_kernels_at_7b_shapes_match_float64(tmp_path):
    """Every CUDA backend at mPLUG-Owl3-7B's head shapes (28/4 heads, d 128) against tens of
    thousands of keys (48 frames of 729): output and lse against float64, within tolerances a 1%
    lse error fails (scripts/check_kernels.py, the acceptance run's second item)."""
    import argparse

    from scripts.check_kernels import check
    from scripts.harness import Rows

    args = argparse.Namespace(device="cuda", frames=48, rows=256, dtype=None, backends=None)
    rows = Rows(tmp_path / "kernels.json")
    assert check(args, rows), [r["why"] for r in rows.rows if not r.get("ok", True)]


def test_unverified_cuda_paths_fall_back_when_they_reject_arguments(monkeypatch):
    """flash / flash_attn / cudnn calls are written from signatures; a rejecting call falls back
    exactly."""
    monkeypatch.setattr(backends, "_broken", {})

    def reject(*a, **k):
        raise RuntimeError("unexpected argument")

    monkeypatch.setitem(backends._FWD, "flash", reject)
    monkeypatch.setitem(backends._BWD, "flash", reject)
    q, k, v, _, _ = _inputs(1, 4, 6, 4, 2, 8)
    want_o, want_l = backends._math_fwd(q, k, v, 0.5, None, False)
    with pytest.warns(UserWarning, match="failed"):
        o, l_ = backends.kernel_fwd("flash", q, k, v, 0.5, None, False)
    torch.testing.assert_close(o, want_o)
    torch.testing.assert_close(l_, want_l)
    with pytest.warns(UserWarning, match="failed"):
        grads = backends.kernel_bwd(
            "flash", torch.ones_like(q), q, k, v, o, l_, None, 0.5, None, False
        )
    want = backends._math_bwd(torch.ones_like(q), q, k, v, o, l_, None, 0.5, None, False)
    for a, b in zip(grads, want):
        torch.testing.assert_close(a, b)
    assert ("fwd", "flash") in backends._broken and ("bwd", "flash") in backends._broken


def test_under_no_fallback_a_rejected_call_fails_and_earlier_breakage_is_forgotten(monkeypatch):
    """What every CUDA test runs under: a backend that rejects a call raises instead of handing the
    call to "efficient", and a backend an earlier test broke is tried again."""
    calls = []

    def flash(q, k, v, scale, mask, causal):
        calls.append(q.shape)
        return backends._math_fwd(q, k, v, scale, mask, causal)

    def reject(*a, **k):
        raise RuntimeError("unexpected argument")

    monkeypatch.setattr(backends, "_broken", {("fwd", "flash"): "an earlier test"})
    monkeypatch.setitem(backends._FWD, "flash", flash)
    q, k, v, _, _ = _inputs(1, 4, 6, 4, 4, 8)
    with no_fallback():
        backends.kernel_fwd("flash", q, k, v, 0.5, None, False)
    assert len(calls) == 1 and list(backends._broken) == [("fwd", "flash")]
    monkeypatch.setitem(backends._FWD, "flash", reject)
    with pytest.raises(backends.BackendFallbackWarning, match="unexpected argument"):
        with no_fallback():
            backends.kernel_fwd("flash", q, k, v, 0.5, None, False)


def test_band_masks_live_only_with_their_tile(monkeypatch):
    """attn_fwd / attn_bwd plan tiles as they run: when a tile is planned, at most the two before it
    still hold their band masks (the first two are looked at together), not every tile of the block
    (GPU memory at an hour)."""
    import weakref

    monkeypatch.setattr(masks, "Q_TILE", 4)
    monkeypatch.setattr(masks, "MIN_TILE", 4)
    real, alive, most, masked = kernels.tile_plans, [], [0], [0]

    def watched(*args, **kw):
        for plan in real(*args, **kw):
            alive[:] = [r for r in alive if r() is not None]
            most[0] = max(most[0], len(alive))
            if plan.mask is not None:
                alive.append(weakref.ref(plan.mask))
                masked[0] += 1
            yield plan

    monkeypatch.setattr(kernels, "tile_plans", watched)
    b, sq, sk = 1, 24, 48
    q, k, v, _, _ = _inputs(b, sq, sk, 4, 2, 8, dtype=torch.float64)
    k_frame = (torch.arange(sk) // 4).unsqueeze(0)  # 12 frames of 4 keys
    # every 2 tokens see one more frame: a band per tile
    q_vis = (torch.arange(sq) // 2 + 1).unsqueeze(0)
    ro, rl, w, u, grads = _reference(q, k, v, q_vis=q_vis, k_frame=k_frame)
    out, lse = attn_fwd(q, k, v, q_vis=q_vis, k_frame=k_frame)
    _close("out", out, ro, 1e-12)
    assert masked[0] >= 6 and most[0] <= 2, (masked[0], most[0])
    most[0] = 0
    for got, want in zip(
        attn_bwd(w, q, k, v, out, lse, q_vis=q_vis, k_frame=k_frame, dlse=u), grads
    ):
        _close("grad", got, want, 1e-12)
    assert most[0] <= 2, most[0]


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_a_media_mask_that_hides_nothing_is_one_unmasked_call(backend, monkeypatch):
    """A question or a decoded token sees every frame: one kernel call without a mask, not planned
    tile by tile."""
    calls = _kernel_calls(backend, monkeypatch)
    q, k, v, _, _ = _inputs(1, 10, 24, 8, 2, 8)
    k_frame = (torch.arange(24) // 4).unsqueeze(0)  # frames 0..5
    q_vis = torch.tensor([[6, 6, 7, 6, 9, 6, 6, 6, 8, 6]])  # every row sees all 6 frames
    ro, rl, _, _, _ = _reference(q, k, v, q_vis=q_vis, k_frame=k_frame)
    out, lse = attn_fwd(q, k, v, q_vis=q_vis, k_frame=k_frame, backend=backend)
    _close("out", out, ro, 1e-5)
    _check_lse(lse, rl, 1e-5)
    assert calls == [(10 * 4, 24, False)], calls
    calls.clear()
    attn_fwd(
        q,
        k,
        v,
        q_vis=torch.where(torch.arange(10) == 3, 5, q_vis),
        k_frame=k_frame,
        backend=backend,
    )
    assert any(masked for _, _, masked in calls), "one row that misses a frame keeps the mask"


def _window_case(b, sq, sk, frames, seed, unsorted=False):
    g = torch.Generator().manual_seed(seed)
    q, k, v, _, _ = _inputs(b, sq, sk, 8, 2, 8, dtype=torch.float64, seed=seed)
    k_frame = torch.randint(0, frames, (b, sk), generator=g)
    k_frame = k_frame if unsorted else torch.sort(k_frame, 1).values
    q_vis = torch.sort(torch.randint(0, frames + 2, (b, sq), generator=g), 1).values
    q_vis[:, 1:2] = 0  # a row that sees nothing (none for one token)
    return q, k, v, q_vis, k_frame


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("window", [1, 2, 5])
@pytest.mark.parametrize("unsorted", [False, True])
@pytest.mark.parametrize("tile", [2, 256])
def test_a_window_of_frames_is_exact_forward_and_backward(
    backend, window, unsorted, tile, monkeypatch
):
    """Each query sees only the latest `window` frames of those before it (window 1: the latest,
    OpenFlamingo's published masking): float64 against the dense reference, GQA 4:1, short
    tiles, keys in frame order or not, rows that see nothing."""
    monkeypatch.setattr(masks, "Q_TILE", tile)
    for seed, (b, sq, sk, frames) in enumerate([(2, 13, 29, 6), (1, 40, 24, 8), (1, 1, 9, 3)]):
        q, k, v, q_vis, k_frame = _window_case(b, sq, sk, frames, seed, unsorted)
        kw = dict(q_vis=q_vis, k_frame=k_frame, window=window)
        ro, rl, w, u, grads = _reference(q, k, v, **kw)
        out, lse = attn_fwd(q, k, v, backend=backend, **kw)
        _close("out", out, ro, 1e-12)
        _check_lse(lse, rl, 1e-12)
        got = attn_bwd(w, q, k, v, out, lse, dlse=u, backend=backend, **kw)
        for name, a, want in zip(("dq", "dk", "dv"), got, grads):
            _close(name, a, want, 1e-12)


def test_a_window_with_host_known_indices_and_a_decoded_token(monkeypatch):
    """A decoded token sees every frame (host-known q_vis): under a window it sees only the latest,
    so a shard without that frame gives an empty result (out 0, lse -inf), and one holding it the
    latest frame's attention alone."""
    q, k, v, _, _ = _inputs(1, 1, 12, 8, 2, 8, dtype=torch.float64)
    k_frame = (torch.arange(12) // 4).view(1, 12)  # frames 0, 1, 2
    q_vis = masks.Indices(torch.tensor([[3]]), 3, 3, torch.tensor([[3]]))
    k_idx = masks.Indices.of_host(k_frame, "cpu")
    out, lse = attn_fwd(q, k, v, q_vis=q_vis, k_frame=k_idx, window=1)
    ro, rl = reference_attention(q, k[:, 8:], v[:, 8:])
    _close("out", out, ro, 1e-12)
    _check_lse(lse, rl, 1e-12)
    early = masks.Indices.of_host(k_frame[:, :8], "cpu")
    out, lse = attn_fwd(q, k[:, :8], v[:, :8], q_vis=q_vis, k_frame=early, window=1)
    assert (out == 0).all() and (lse == NEG_INF).all()
    out, lse = attn_fwd(q, k, v, q_vis=q_vis, k_frame=k_idx, window=3)  # every frame: no mask
    _close("out", out, reference_attention(q, k, v)[0], 1e-12)


def test_latest_frame_tiles_are_unmasked_frame_blocks(monkeypatch):
    """Window 1 over frames in order, tiles cut at every change: each run of tokens after one
    placeholder sees one frame's keys, so the tiles are unmasked blocks of one frame's keys, no
    band; with the CPU's shortest tile one masked band spans them."""
    calls = _kernel_calls("math", monkeypatch)
    monkeypatch.setattr(masks, "Q_TILE", 256)
    monkeypatch.setattr(masks, "MIN_TILE", 1)
    q, k, v, _, _ = _inputs(1, 12, 12, 8, 2, 8)
    k_frame = (torch.arange(12) // 4).view(1, 12)
    q_vis = torch.tensor([[0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3]])
    out, _ = attn_fwd(q, k, v, q_vis=q_vis, k_frame=k_frame, window=1, backend="math")
    ro, _ = reference_attention(q, k, v, q_vis=q_vis, k_frame=k_frame, window=1)
    _close("out", out, ro, 1e-5)
    assert calls == [(16, 4, False), (16, 4, False), (12, 4, False)], calls
    monkeypatch.setattr(masks, "MIN_TILE", 32)
    calls.clear()
    attn_fwd(q, k, v, q_vis=q_vis, k_frame=k_frame, window=1, backend="math")
    assert calls == [(44, 12, True)], calls


def test_a_window_is_a_media_masks_and_at_least_one_frame():
    q, k, v, q_vis, k_frame = _inputs(1, 3, 4, 8, 2, 8, media=True)
    for bad in (0, -1, True):
        with pytest.raises(ValueError, match="1 frame or more"):
            attn_fwd(q, k, v, q_vis=q_vis, k_frame=k_frame, window=bad)
    with pytest.raises(ValueError, match="with q_vis"):
        attn_fwd(q, k, v, window=1)
