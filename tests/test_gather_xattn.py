"""The gather schedule on 1..4 gloo ranks vs the float64 reference, and the ring-or-gather choice.

The same cases as LV-XAttn's test (uneven blocks, a rank with no queries, a rank with no keys, GQA
8/2, media masks with rows that see nothing, a loss through out and lse), plus float64 inputs held
to 1e-12, forward and backward.
"""

import pytest
import torch
from attn_reference import reference_attention
from test_lv_xattn import CASES, HQ, SK, SQ, TOL, B, D, _case_data, _cuts

from lvx_app.attention import choose_schedule, gather_xattn_with_lse
from lvx_app.attention.schedule import crossovers
from lvx_kernels import masks
from scripts.gloo_ranks import run_ranks

GATHER_CASES = CASES + [("media_fp64", torch.float64, True, True, 1, 2, False, None, None)]
TOLS = {**TOL, torch.float64: 1e-12}


def _err(a, b):
    assert not torch.isnan(a).any()
    return (a.detach().double() - b).abs().max().item() if a.numel() else 0.0


def _one_case(rank, world, i, case, fn):
    name, dtype, media, with_lse, qz, kz, unsorted, tile, scale = case
    masks.Q_TILE = tile or 256
    q, k, v, w, u, q_vis, k_frame = _case_data(i, dtype, media, unsorted)
    qc = _cuts(SQ, world, None if qz < 0 else qz % world)
    kc = _cuts(SK, world, None if kz < 0 else kz % world)
    qs, ks = slice(qc[rank], qc[rank + 1]), slice(kc[rank], kc[rank + 1])
    rq, rk, rv = (t.to(torch.float64, copy=True).requires_grad_() for t in (q, k, v))
    ro, rl = reference_attention(rq, rk, rv, scale=scale, q_vis=q_vis, k_frame=k_frame)
    fin = torch.isfinite(rl)
    loss = (ro * w).sum() + (torch.where(fin, rl, 0) * u).sum() * with_lse
    loss.backward()
    lq, lk, lv = (t[:, sl].clone().requires_grad_() for t, sl in ((q, qs), (k, ks), (v, ks)))
    stats: dict = {}
    kw = dict(scale=scale, stats=stats)
    if media:
        kw.update(q_vis=q_vis[:, qs], k_frame=k_frame[:, ks])
    out, lse = fn(lq, lk, lv, **kw)
    lfin = torch.isfinite(lse)
    mine = (out.double() * w[:, qs]).sum() + (
        torch.where(lfin, lse, 0).double() * u[:, :, qs]
    ).sum() * with_lse
    mine.backward()
    errs = {
        "out": _err(out, ro[:, qs].detach()),
        "dq": _err(lq.grad, rq.grad[:, qs]),
        "dk": _err(lk.grad, rk.grad[:, ks]),
        "dv": _err(lv.grad, rv.grad[:, ks]),
        "lse": _err(torch.where(lfin, lse, 0), torch.where(fin, rl, 0)[:, :, qs].detach()),
        "lse_mask": float(not torch.equal(lfin, fin[:, :, qs])),
    }
    esz = torch.empty((), dtype=dtype).element_size()
    return dict(
        name=name,
        errs=errs,
        tol=TOLS[dtype],
        sizes=[qc[j + 1] - qc[j] for j in range(world)],
        esz=esz,
        media=media,
        fwd=stats.get("fwd_bytes", 0),
        bwd=stats.get("bwd_bytes", 0),
        dtype=out.dtype,
        want=dtype,
    )


def _gather_cases(rank, world):
    return [
        _one_case(rank, world, i, case, gather_xattn_with_lse)
        for i, case in enumerate(GATHER_CASES)
    ]


def _expected_bytes(world, sizes, esz, media):
    """Gather sends every rank's Q (+q_vis) and the packed (O, lse) partials of all rows, padded to
    the longest block for the Q all_gather, n-1 times; backward (dO, dlse) the same way and the dQ
    reduce_scatter."""
    if world == 1:
        return 0, 0
    rows, longest, acc = sum(sizes), max(sizes), 8 if esz == 8 else 4
    fwd = (world - 1) * (longest * B * (HQ * D * esz + 4 * media) + rows * B * HQ * (D + 1) * acc)
    bwd = (world - 1) * longest * B * (HQ * D * esz + HQ * acc + HQ * D * acc)
    return fwd, bwd


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_gather_matches_reference_forward_and_backward(world):
    for rank, results in enumerate(run_ranks(_gather_cases, world)):
        for res in results:
            where = f"world {world} rank {rank} case {res['name']}"
            for name, e in res["errs"].items():
                assert e <= res["tol"] * (name != "lse_mask"), f"{where}: {name} error {e:.3g}"
            assert res["dtype"] == res["want"], where
            want = _expected_bytes(world, res["sizes"], res["esz"], res["media"])
            assert (res["fwd"], res["bwd"]) == want, (
                f"{where}: bytes {(res['fwd'], res['bwd'])} != {want}"
            )


def test_choose_schedule(tmp_path, monkeypatch):
    monkeypatch.setenv("LVX_CACHE_DIR", str(tmp_path))  # no calibration: the built-in table
    crossovers.cache_clear()
    assert choose_schedule(24, 4) == "gather"
    assert choose_schedule(10_000, 4) == "ring"
    assert choose_schedule(24, 1) == "ring"
    assert choose_schedule(10_000, 4, "gather") == "gather"
    # more ranks than measured: the largest measured crossover
    assert choose_schedule(1, 8) == "gather"
    with pytest.raises(ValueError, match="use one of auto, ring, gather"):
        choose_schedule(1, 2, "tree")
