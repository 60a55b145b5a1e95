"""Ring, Ulysses and all-gather cross-attention vs the float64 reference, forward and backward.

One spawned gloo run per world size checks every case on every rank: uneven shards (a rank with no
queries, a rank with no keys), GQA 8/2, the media mask with rows that see nothing and ranks whose
keys nobody sees, fp32 and bf16.
"""

from __future__ import annotations

import pytest
import torch
from attn_reference import reference_attention

from scripts.baselines import allgather_xattn, ring_xattn, ulysses_supported, ulysses_xattn
from scripts.gloo_ranks import run_ranks

PATHS = {"ring": ring_xattn, "ulysses": ulysses_xattn, "allgather": allgather_xattn}
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
KEYS_PER_FRAME = 5

# name, batch, S_q, S_kv, q heads, kv heads, head dim, dtype, media mask, split
CASES = [
    ("even", 1, 16, 40, 8, 2, 16, torch.float32, False, "even"),
    ("uneven-empty-masked", 2, 13, 47, 8, 2, 16, torch.float32, True, "skewed"),
    ("mha-masked", 1, 9, 31, 4, 4, 8, torch.float32, True, "skewed"),
    ("bf16-uneven-masked", 2, 13, 47, 8, 2, 16, torch.bfloat16, True, "skewed"),
]


def split_sizes(total: int, world: int, empty_rank: int | None) -> list[int]:
    """Uneven shard lengths summing to `total`: rank i weighted i+1, `empty_rank` gets none."""
    weights = [0 if r == empty_rank else r + 1 for r in range(world)]
    if sum(weights) == 0:
        weights = [1] * world
    sizes = [total * w // sum(weights) for w in weights]
    sizes[max(range(world), key=lambda r: weights[r])] += total - sum(sizes)
    return sizes


def make_case(case, seed: int = 0):
    """Full (unsharded) inputs of one case, identical on every rank."""
    _, b, sq, skv, hq, hkv, d, dtype, masked, _ = case
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, sq, hq, d, generator=g).to(dtype)
    k = torch.randn(b, skv, hkv, d, generator=g).to(dtype)
    v = torch.randn(b, skv, hkv, d, generator=g).to(dtype)
    dout = torch.randn(b, sq, hq, d, generator=g).to(dtype)
    q_vis = k_frame = None
    if masked:
        frames = -(-skv // KEYS_PER_FRAME)
        k_frame = (torch.arange(skv) // KEYS_PER_FRAME).expand(b, skv).contiguous()
        # Non-decreasing visible-frame counts starting at 0 (first rows see nothing); the last
        # frames are never visible, so the last rank's keys are fully hidden.
        q_vis = torch.randint(0, frames - 1, (b, sq), generator=g).sort(dim=1).values
        q_vis[:, :2] = 0
    return q, k, v, dout, q_vis, k_frame


def reference(q, k, v, dout, q_vis, k_frame):
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    out, _ = reference_attention(q, k, v, q_vis=q_vis, k_frame=k_frame)
    out.backward(dout.double())
    return out.detach(), q.grad, k.grad, v.grad


def _shard(x, sizes, rank):
    if x is None:
        return None
    start = sum(sizes[:rank])
    return x[:, start : start + sizes[rank]].contiguous()


def _max_violation(got, want, tol) -> float:
    """max(|got - want| - tol·(1 + |want|)); <= 0 means within tolerance."""
    if got.numel() == 0:
        return 0.0
    return float(((got.detach().double() - want).abs() - tol * (1 + want.abs())).max())


def _run_cases(rank: int, world: int):
    results = []
    for case in CASES:
        name, split, dtype = case[0], case[-1], case[7]
        q, k, v, dout, q_vis, k_frame = make_case(case)
        ref = reference(q, k, v, dout, q_vis, k_frame)
        skewed = split == "skewed" and world > 1
        q_sizes = split_sizes(q.shape[1], world, 0 if skewed else None)
        kv_sizes = split_sizes(k.shape[1], world, world - 1 if skewed else None)
        for path, fn in PATHS.items():
            why = ulysses_supported(q.shape[2], k.shape[2], world) if path == "ulysses" else None
            ql, kl, vl = (
                _shard(x, s, rank).requires_grad_()
                for x, s in ((q, q_sizes), (k, kv_sizes), (v, kv_sizes))
            )
            kwargs = dict(
                q_vis=_shard(q_vis, q_sizes, rank), k_frame=_shard(k_frame, kv_sizes, rank)
            )
            if why is not None:
                with pytest.raises(ValueError, match="cannot shard heads"):
                    fn(ql, kl, vl, **kwargs)
                results.append((name, path, "skipped", why))
                continue
            stats: dict = {}
            out = fn(ql, kl, vl, stats=stats, **kwargs)
            out.backward(_shard(dout, q_sizes, rank))
            got = {"out": out, "dq": ql.grad, "dk": kl.grad, "dv": vl.grad}
            want = dict(
                zip(
                    ("out", "dq", "dk", "dv"),
                    (_shard(ref[0], q_sizes, rank), _shard(ref[1], q_sizes, rank))
                    + (_shard(ref[2], kv_sizes, rank), _shard(ref[3], kv_sizes, rank)),
                )
            )
            worst = {t: _max_violation(got[t], want[t], TOL[dtype]) for t in got}
            dtypes_ok = all(got[t].dtype == dtype for t in got)
            results.append((name, path, worst, dtypes_ok, stats, q_sizes, kv_sizes))
    return results


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_baselines_match_reference(world):
    for rank, results in enumerate(run_ranks(_run_cases, world)):
        for name, path, *rest in results:
            if rest[0] == "skipped":
                assert world not in (1, 2, 4), f"ulysses should support world {world}: {rest[1]}"
                continue
            worst, dtypes_ok, stats, _, _ = rest
            bad = {t: w for t, w in worst.items() if w > 0}
            assert not bad, f"world {world} rank {rank} {path} {name}: beyond tolerance by {bad}"
            assert dtypes_ok, f"{path} {name}: gradients not in the input dtype"
            if world == 1:
                assert stats.get("fwd_bytes", 0) == 0 and stats.get("bwd_bytes", 0) == 0


def _ring_bytes(rank: int, world: int):
    """ring_xattn sends exactly the un-repeated K/V (+k_frame) shards, and dK/dV (float32) back."""
    case = ("bytes", 1, 11, 37, 8, 2, 16, torch.bfloat16, True, "skewed")
    q, k, v, dout, q_vis, k_frame = make_case(case)
    q_sizes = split_sizes(q.shape[1], world, 0)
    kv_sizes = split_sizes(k.shape[1], world, world - 1)
    ql, kl, vl = (
        _shard(x, s, rank).requires_grad_() for x, s in ((q, q_sizes), (k, kv_sizes), (v, kv_sizes))
    )
    stats: dict = {}
    out = ring_xattn(
        ql,
        kl,
        vl,
        q_vis=_shard(q_vis, q_sizes, rank),
        k_frame=_shard(k_frame, kv_sizes, rank),
        stats=stats,
    )
    fwd_only = dict(stats)
    out.backward(_shard(dout, q_sizes, rank))
    return (
        fwd_only,
        stats,
        kv_sizes,
        k.element_size(),
        k_frame.element_size(),
        k.shape[2] * k.shape[3],
    )


@pytest.mark.parametrize("world", [3, 4])
def test_ring_xattn_moves_only_kv(world):
    for rank, (fwd, both, kv_sizes, el, frame_el, heads_dim) in enumerate(
        run_ranks(_ring_bytes, world)
    ):
        # shard lengths held at each round
        held = [kv_sizes[(rank - t) % world] for t in range(world)]
        # n-1 hops of K, V, k_frame
        kv = sum(n * (2 * heads_dim * el + frame_el) for n in held[:-1])
        grads = sum(n * 2 * heads_dim * 4 for n in held)  # n hops of float32 dK, dV
        assert fwd == {"fwd_bytes": kv}
        assert both == {"fwd_bytes": kv, "bwd_bytes": kv + grads}


def _ulysses_error(rank: int, world: int):
    q = torch.randn(1, 4, 6, 8)
    kv = torch.randn(1, 4, 2, 8)
    try:
        ulysses_xattn(q, kv, kv)
    except ValueError as exc:
        return str(exc)
    return None


def test_ulysses_says_which_heads_work():
    msgs = run_ranks(_ulysses_error, 4)
    assert all(m and "6 query heads do not divide over 4 ranks" in m for m in msgs)


def _with_lse_cases(rank: int, world: int):
    """The engine's forward-only baselines: this rank's (out, lse) against the float64 reference's
    shards."""
    from scripts.baselines import allgather_xattn_with_lse, ring_xattn_with_lse

    results = []
    for case in [c for c in CASES if c[7] == torch.float32]:
        q, k, v, _, q_vis, k_frame = make_case(case)
        want_out, want_lse = reference_attention(
            q.double(), k.double(), v.double(), q_vis=q_vis, k_frame=k_frame
        )
        skewed = case[-1] == "skewed" and world > 1
        q_sizes = split_sizes(q.shape[1], world, 0 if skewed else None)
        kv_sizes = split_sizes(k.shape[1], world, world - 1 if skewed else None)
        for path, fn in (("ring", ring_xattn_with_lse), ("allgather", allgather_xattn_with_lse)):
            stats: dict = {}
            out, lse = fn(
                _shard(q, q_sizes, rank),
                _shard(k, kv_sizes, rank),
                _shard(v, kv_sizes, rank),
                stats=stats,
                q_vis=_shard(q_vis, q_sizes, rank),
                k_frame=_shard(k_frame, kv_sizes, rank),
            )
            lse_want = want_lse.detach()[:, :, sum(q_sizes[:rank]) : sum(q_sizes[: rank + 1])]
            seen = torch.isfinite(lse_want)
            lse_ok = (
                torch.equal(seen, torch.isfinite(lse))
                and _max_violation(lse[seen], lse_want[seen], 1e-5) <= 0
            )
            out_worst = _max_violation(
                out, _shard(want_out.detach(), q_sizes, rank), TOL[torch.float32]
            )
            results.append(
                (
                    case[0],
                    path,
                    out_worst,
                    lse_ok,
                    lse.dtype == torch.float32,
                    stats.get("fwd_bytes", 0),
                )
            )
    return results


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_forward_only_baselines_return_exact_out_and_lse(world):
    sent_by_path: dict = {}
    for rank, results in enumerate(run_ranks(_with_lse_cases, world)):
        for name, path, out_worst, lse_ok, lse_fp32, sent in results:
            assert out_worst <= 0 and lse_ok and lse_fp32, (
                f"world {world} rank {rank} {path} {name}"
            )
            sent_by_path[path] = sent_by_path.get(path, 0) + sent
    for path, sent in sent_by_path.items():  # K/V travel exactly when there is more than one rank
        assert (sent > 0) == (world > 1), (path, sent)
