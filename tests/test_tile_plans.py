"""Few kernel calls per layer, planned on the host: a causal square is one native causal call
(query groups folded into the batch), the diagonal of a sharded text attention too, tiles whose rows
all see the same keys are never cut, GPU tiles are longer, and a decoded token is planned without
reading the device. Every plan stays exact against the float64 reference, forward and backward."""

from __future__ import annotations

import pytest
import torch
from attn_reference import reference_attention
from host_syncs import counting_host_reads

from lvx_kernels import backends, masks
from lvx_kernels.kernels import attn_bwd, attn_fwd
from lvx_kernels.masks import Indices

CPU_BACKENDS = ["cpu", "math"]
TOL = {torch.float32: 2e-5, torch.float64: 1e-12}


def _calls(backend: str, monkeypatch) -> list:
    """A list that records (rows, keys, masked, causal, batch) of every forward kernel call."""
    calls = []
    real = backends._FWD[backend]

    def spy(q, k, v, scale, mask, causal):
        calls.append((q.shape[1], k.shape[1], mask is not None, causal, q.shape[0]))
        return real(q, k, v, scale, mask, causal)

    monkeypatch.setitem(backends._FWD, backend, spy)
    return calls


def _check(q, k, v, dtype, backend, **mask):
    """attn_fwd and attn_bwd of (q, k, v) against the float64 reference, lse gradient included."""
    qq, kk, vv = (t.detach().double().requires_grad_() for t in (q, k, v))
    ro, rl = reference_attention(qq, kk, vv, **mask)
    g = torch.Generator().manual_seed(1)
    w = torch.randn(ro.shape, generator=g, dtype=torch.float64)
    u = torch.randn(rl.shape, generator=g, dtype=torch.float64)
    fin = torch.isfinite(rl)
    ((ro * w).sum() + (torch.where(fin, rl, 0) * u).sum()).backward()
    q, k, v = (t.to(dtype) for t in (q, k, v))
    out, lse = attn_fwd(q, k, v, backend=backend, **mask)
    tol = TOL[dtype]
    torch.testing.assert_close(out.double(), ro.detach(), atol=tol, rtol=tol)
    torch.testing.assert_close(
        torch.where(fin, lse.double(), 0), torch.where(fin, rl.detach(), 0), atol=tol, rtol=tol
    )
    grads = attn_bwd(
        w.to(dtype), q, k, v, out, lse, dlse=(u * fin).to(dtype), backend=backend, **mask
    )
    for got, want in zip(grads, (qq.grad, kk.grad, vv.grad)):
        torch.testing.assert_close(got.double(), want, atol=10 * tol, rtol=10 * tol)


def _qkv(sq: int, sk: int, hq: int = 6, hkv: int = 2, d: int = 8):
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(1, s, h, d, generator=g) for s, h in ((sq, hq), (sk, hkv), (sk, hkv)))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("cached", [0, 5])
def test_causal_attention_with_query_groups_is_one_causal_call(backend, cached, monkeypatch):
    """Causal text attention with 3 query heads per K/V head: the keys before the new tokens in one
    unmasked call, the new tokens' square in one causal call whose batch holds the 3 groups (the
    K/V not copied), however long the prompt (no tiles, no masks)."""
    calls = _calls(backend, monkeypatch)
    monkeypatch.setattr(masks, "Q_TILE", 4)  # would have cut the rows into tiles
    q, k, v = _qkv(13, 13 + cached)
    _check(q, k, v, torch.float32, backend, causal=True)
    square = (13, 13, False, True, 3)
    assert calls == ([(13 * 3, cached, False, False, 1)] if cached else []) + [square], calls


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_a_decoded_token_is_one_unmasked_call(backend, monkeypatch):
    calls = _calls(backend, monkeypatch)
    q, k, v = _qkv(1, 9)
    _check(q, k, v, torch.float32, backend, causal=True)
    assert calls == [(3, 9, False, False, 1)]


def _text_ring_block(runs: list[tuple[int, int]], before: int):
    """q_vis / k_frame of a sharded text attention's diagonal block: the rank's own tokens (runs of
    positions) against its own keys, `before` cached keys at positions 0.. first."""
    own = torch.cat([torch.arange(a, b) for a, b in runs])
    keys = torch.cat([torch.arange(before), own])
    return (own + 1).view(1, -1), keys.view(1, -1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_the_diagonal_of_a_sharded_text_attention_is_one_causal_call(backend, dtype, monkeypatch):
    """A zigzag rank's own two runs of tokens against its own keys (text causality as the media
    mask): every token sees one key more than the one before, so the whole block is the cached
    keys in one unmasked call and one causal square, not a masked tile every MIN_TILE tokens."""
    calls = _calls("math" if dtype == torch.float64 else backend, monkeypatch)
    monkeypatch.setattr(masks, "MIN_TILE", 4)
    q_vis, k_frame = _text_ring_block([(10, 19), (40, 49)], before=6)
    q, k, v = _qkv(18, 24)
    _check(q, k, v, dtype, backend, q_vis=q_vis, k_frame=k_frame)
    assert calls == [(18 * 3, 6, False, False, 1), (18, 18, False, True, 3)], calls


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_rows_that_all_see_the_same_keys_are_never_cut(backend, monkeypatch):
    """Another rank's query block in a ring: its first run sees none of this rank's keys, its second
    all of them; the second is one call whatever Q_TILE."""
    calls = _calls(backend, monkeypatch)
    monkeypatch.setattr(masks, "Q_TILE", 4)
    monkeypatch.setattr(masks, "MIN_TILE", 4)
    q_vis, _ = _text_ring_block([(0, 9), (60, 75)], before=0)
    _, k_frame = _text_ring_block([(20, 29), (40, 49)], before=0)
    q, k, v = _qkv(24, 18)
    _check(q, k, v, torch.float32, backend, q_vis=q_vis, k_frame=k_frame)
    assert calls == [(15 * 3, 18, False, False, 1)], calls


def test_gpu_tiles_are_longer_than_cpu_tiles():
    """A video prompt's rows see one more frame every 5 tokens: on the CPU a band tile is cut after
    MIN_TILE tokens, for a GPU after MIN_TILE_CUDA (fewer calls, fewer merges)."""
    frames, per = 64, 4
    starts = torch.arange(frames) * 5
    q_vis = torch.searchsorted(starts, torch.arange(frames * 5), right=True).view(1, -1)
    k_frame = torch.arange(frames).repeat_interleave(per).view(1, -1)
    q, k = torch.empty(1, q_vis.shape[1], 1, 8), torch.empty(1, k_frame.shape[1], 1, 8)

    def tiles(**kw) -> int:
        plans = masks.tile_plans(q, k, False, q_vis, k_frame, **kw)
        return len({p.q0 for p in plans})

    assert masks.min_tile("cpu") == masks.MIN_TILE < masks.min_tile("cuda") == masks.MIN_TILE_CUDA
    assert tiles() == -(-frames * 5 // (masks.MIN_TILE + 3))  # cut at the next frame after 32
    assert tiles(min_tokens=masks.MIN_TILE_CUDA) < tiles() / 3


def test_a_decoded_token_is_planned_without_reading_a_tensor():
    """q_vis and k_frame given with what the host knows (`Indices`: the engine's positions, the
    video's frames): a decoded token, which sees every frame, costs no host read; given as bare
    tensors, the plan reads both."""
    k_frame = torch.arange(6).repeat_interleave(4).view(1, -1)
    q_vis = torch.full((1, 1), 6)
    q, k = torch.empty(1, 3, 2, 8), torch.empty(1, 24, 2, 8)
    with counting_host_reads() as reads:
        bare = list(masks.tile_plans(q, k, False, masks.pack_vis(q_vis, 3), k_frame, 3))
    assert sum(reads.values()) >= 2 and len(bare) == 1
    k_frame, q_vis = Indices(k_frame, 0, 5, k_frame), Indices(q_vis, 6, 6)
    with counting_host_reads() as reads:
        plans = list(masks.tile_plans(q, k, False, masks.pack_vis(q_vis, 3), k_frame, 3))
    assert not reads and [(p.q0, p.q1, p.k0, p.k1, p.mask) for p in plans] == [(0, 3, 0, 24, None)]
