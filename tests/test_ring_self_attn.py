"""Causal ring self-attention over a sharded text sequence (zigzag and contiguous layouts)."""

from __future__ import annotations

import pytest
import torch
from attn_reference import reference_attention

from lvx_app.parallel.layout import zigzag_chunk_sizes, zigzag_indices, zigzag_shard, zigzag_unshard
from scripts.baselines import ring_self_attn
from scripts.gloo_ranks import run_ranks

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}

# name, batch, seq, q heads, kv heads, head dim, dtype
CASES = [
    ("divisible", 1, 48, 8, 2, 16, torch.float32),
    ("indivisible", 2, 37, 8, 2, 16, torch.float32),
    ("shorter-than-2n", 1, 5, 4, 4, 8, torch.float32),  # some zigzag chunks are empty
    ("bf16", 2, 37, 8, 2, 16, torch.bfloat16),
]


def _contiguous_indices(seq: int, rank: int, world: int) -> torch.Tensor:
    return torch.arange(seq).tensor_split(world)[rank]


def _violation(got, want, tol) -> float:
    if got.numel() == 0:
        return 0.0
    return float(((got.detach().double() - want).abs() - tol * (1 + want.abs())).max())


def _run_cases(rank: int, world: int):
    results = []
    for name, b, s, hq, hkv, d, dtype in CASES:
        g = torch.Generator().manual_seed(1)
        q, k, v, dout = (torch.randn(b, s, h, d, generator=g).to(dtype) for h in (hq, hkv, hkv, hq))
        q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
        ref, _ = reference_attention(q64, k64, v64, causal=True)
        ref.backward(dout.double())
        want_full = {"out": ref.detach(), "dq": q64.grad, "dk": k64.grad, "dv": v64.grad}
        for layout in ("zigzag", "contiguous"):
            if layout == "zigzag":
                idx = zigzag_indices(s, rank, world)
            else:
                idx = _contiguous_indices(s, rank, world)
            ql, kl, vl = (t.index_select(1, idx).requires_grad_() for t in (q, k, v))
            stats: dict = {}
            out = ring_self_attn(ql, kl, vl, layout=layout, stats=stats)
            out.backward(dout.index_select(1, idx))
            got = {"out": out, "dq": ql.grad, "dk": kl.grad, "dv": vl.grad}
            worst = {
                t: _violation(got[t], want_full[t].index_select(1, idx), TOL[dtype]) for t in got
            }
            results.append((name, layout, worst, all(got[t].dtype == dtype for t in got), stats))
    return results


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_ring_self_attn_matches_causal_reference(world):
    for rank, results in enumerate(run_ranks(_run_cases, world)):
        for name, layout, worst, dtypes_ok, stats in results:
            bad = {t: w for t, w in worst.items() if w > 0}
            assert not bad, f"world {world} rank {rank} {layout} {name}: beyond tolerance by {bad}"
            assert dtypes_ok
            if world == 1:
                assert not stats.get("fwd_bytes") and not stats.get("bwd_bytes")


@pytest.mark.parametrize("seq", [0, 3, 16, 37])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_zigzag_shard_roundtrip(seq, world):
    x = torch.arange(2 * seq).view(1, seq, 2)
    shards = [zigzag_shard(x, r, world) for r in range(world)]
    assert sum(sh.shape[1] for sh in shards) == seq
    assert torch.equal(zigzag_unshard(shards), x)
    chunks = zigzag_chunk_sizes(seq, world)
    assert max(chunks) - min(chunks) <= 1 and sum(chunks) == seq
    # rank r holds chunk r then chunk 2n-1-r, in order
    for r, sh in enumerate(shards):
        start = sum(chunks[:r])
        end = sum(chunks[: 2 * world - 1 - r])
        expect = list(range(start, start + chunks[r])) + list(
            range(end, end + chunks[2 * world - 1 - r])
        )
        assert sh[0, :, 0].div(2).long().tolist() == expect


def _wrong_layout(rank: int, world: int):
    x = torch.randn(1, 6 + 2 * rank, 2, 8)  # contiguous-style uneven shards, not zigzag
    try:
        ring_self_attn(x, x, x)
    except ValueError as exc:
        return str(exc)
    return None


def test_zigzag_rejects_a_wrong_layout():
    msgs = run_ranks(_wrong_layout, 2)
    assert all(m and "zigzag_shard" in m for m in msgs)


def _balance(rank: int, world: int):
    """Count query-key pairs each rank computes: zigzag keeps them equal."""
    from scripts.baselines import ring

    done = []
    real = ring.attn_fwd

    def counting(q, k, v, **kw):
        done.append(q.shape[1] * k.shape[1] // (2 if kw.get("causal") else 1))
        return real(q, k, v, **kw)

    ring.attn_fwd = counting
    x = torch.randn(1, 64, 2, 8)
    ring_self_attn(*(zigzag_shard(x, rank, world),) * 3)
    ring.attn_fwd = real
    return sum(done)


def test_zigzag_balances_work():
    work = run_ranks(_balance, 4)
    assert max(work) - min(work) <= 0.1 * max(work), work
