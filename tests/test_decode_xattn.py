"""decode_xattn: the same new query on every rank, K/V sharded unevenly; one collective, exact,
identical."""

import pytest
import torch
from attn_reference import reference_attention

from lvx_app.attention import decode_xattn
from scripts.gloo_ranks import run_ranks

B, SK, HQ, HKV, D = 2, 19, 8, 2, 8


def _cuts(total, world, zero):
    w = [i + 1 for i in range(world)]
    if world > 1:
        w[zero % world] = 0
    return [round(total * sum(w[:i]) / sum(w)) for i in range(world + 1)]


def _decode_cases(rank, world):
    out = []
    for i, (sq, dtype, media) in enumerate(
        [(1, torch.float32, False), (3, torch.float32, True), (2, torch.bfloat16, True)]
    ):
        g = torch.Generator().manual_seed(i)
        q = torch.randn(B, sq, HQ, D, generator=g).to(dtype)
        k = torch.randn(B, SK, HKV, D, generator=g).to(dtype)
        v = torch.randn(B, SK, HKV, D, generator=g).to(dtype)
        q_vis = k_frame = None
        if media:
            k_frame = torch.sort(torch.randint(0, 4, (B, SK), generator=g), 1).values
            q_vis = torch.randint(1, 5, (B, sq), generator=g)
            q_vis[1, 0] = 0  # this query sees nothing
        c = _cuts(SK, world, zero=i)
        ks = slice(c[rank], c[rank + 1])
        kw = {} if not media else dict(q_vis=q_vis, k_frame=k_frame[:, ks])
        o, l_ = decode_xattn(q, k[:, ks], v[:, ks], **kw)
        ro, rl = reference_attention(q, k, v, q_vis=q_vis, k_frame=k_frame)
        fin = torch.isfinite(rl)
        out.append(
            dict(
                o=o.float().numpy(),
                l=l_.numpy(),
                dtype=dtype,
                o_dtype=o.dtype,
                l_dtype=l_.dtype,
                err_o=(o.double() - ro).abs().max().item(),
                err_l=(torch.where(fin, l_.double(), 0) - torch.where(fin, rl, 0))
                .abs()
                .max()
                .item(),
                mask_ok=torch.equal(torch.isfinite(l_), fin),
            )
        )
    return out


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_decode_matches_reference_and_is_identical_on_every_rank(world):
    per_rank = run_ranks(_decode_cases, world)
    for rank, cases in enumerate(per_rank):
        for i, c in enumerate(cases):
            tol = 1e-5 if c["dtype"] == torch.float32 else 2e-2
            assert c["mask_ok"], f"rank {rank} case {i}: -inf rows differ"
            assert c["err_o"] <= tol and c["err_l"] <= tol, (
                f"rank {rank} case {i}: {c['err_o']}, {c['err_l']}"
            )
            assert c["o_dtype"] == c["dtype"] and c["l_dtype"] == torch.float32
            # bit-identical on every rank (tensors cross processes as numpy arrays)
            assert (c["o"] == per_rank[0][i]["o"]).all() and (c["l"] == per_rank[0][i]["l"]).all()


def _combine_twice(rank, world):
    """Two decode steps through one `CombineBuffers`, as a session runs them, against fresh
    buffers: the same results, the same buffers, one all_gather_into_tensor per call."""
    import torch.distributed as dist

    from lvx_app.attention.decode_xattn import CombineBuffers

    calls, gather = [], getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    name = gather.__name__

    def counted(*args, **kwargs):
        calls.append(name)
        return gather(*args, **kwargs)

    setattr(dist, name, counted)
    kept, same, storage = CombineBuffers(), [], set()
    for step in range(2):
        g = torch.Generator().manual_seed(10 * step + rank)
        q = torch.randn(1, 1, HQ, D, generator=torch.Generator().manual_seed(step))
        k, v = (torch.randn(1, 5 + rank, HKV, D, generator=g) for _ in range(2))
        o, l_ = decode_xattn(q, k, v, buffers=kept)
        storage.add((kept.send.data_ptr(), kept.every.data_ptr()))
        fresh_o, fresh_l = decode_xattn(q, k, v)
        same.append(torch.equal(o, fresh_o) and torch.equal(l_, fresh_l))
    return all(same), len(storage), calls


def test_the_combine_reuses_its_buffers_and_gathers_once_per_call():
    for same, storages, calls in run_ranks(_combine_twice, 2):
        assert same and storages == 1 and len(calls) == 4, (same, storages, calls)
