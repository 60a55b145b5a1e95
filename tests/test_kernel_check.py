"""The kernel check at 7B shapes (scripts/check_kernels.py) and LV-XAttn's 7B block
(scripts/bench_xattn_7b.py), on CPU at reduced length as the rehearsal runs them: they pass on the
real kernels and fail on a kernel whose lse is 1% off, whose output or gradients are wrong, or
that handed the call to another kernel."""

from __future__ import annotations

import argparse
import json
import math

import pytest
import torch

from lvx_app.attention import attn_bwd, attn_fwd
from scripts import bench_xattn_7b, check_kernels
from scripts.harness import Rows
from scripts.reference64 import forward64, grads64


def _check(tmp_path, **kw) -> tuple[bool, dict]:
    args = argparse.Namespace(device="cpu", frames=1, rows=16, dtype=None, backends=None, **kw)
    rows = Rows(tmp_path / "kernels.json", key="checks")
    ok = check_kernels.check(args, rows)
    rows.save(ok=ok)
    return ok, json.loads((tmp_path / "kernels.json").read_text())["checks"]


def test_the_cpu_kernels_pass_the_check_at_7b_head_shapes(tmp_path) -> None:
    ok, written = _check(tmp_path)
    assert ok and written["ok"] is True
    assert {(r["backend"], r["call"]) for r in written["rows"]} == {
        (b, c)
        for b in ("cpu", "math")
        for c in ("every key visible", "media mask", "decoded token")
    }
    assert all(
        r["lse_max_abs_error"] < 1e-4 and r["ran"] == [r["backend"]] for r in written["rows"]
    )


@pytest.mark.parametrize(
    "wrong", [lambda lse: lse * 1.01, lambda lse: lse + math.log(1.01)], ids=["lse", "softmax sum"]
)
def test_a_kernel_whose_lse_is_off_by_one_percent_fails(tmp_path, monkeypatch, wrong) -> None:
    def off(*args, **kwargs):
        out, lse = attn_fwd(*args, **kwargs)
        return out, wrong(lse)

    monkeypatch.setattr(check_kernels, "attn_fwd", off)
    ok, written = _check(tmp_path)
    assert not ok and written["ok"] is False
    assert all(r["why"].startswith("lse off by") for r in written["rows"])


def test_a_wrong_output_and_a_call_run_by_another_kernel_fail(tmp_path, monkeypatch) -> None:
    def scaled_out(*args, **kwargs):
        out, lse = attn_fwd(*args, **kwargs)
        return out * 1.05, lse

    monkeypatch.setattr(check_kernels, "attn_fwd", scaled_out)
    ok, written = _check(tmp_path)
    assert not ok and all("output off by" in r["why"] for r in written["rows"])

    def on_math(*args, backend=None, **kwargs):  # the call handed to another kernel
        return attn_fwd(*args, backend="math", **kwargs)

    monkeypatch.setattr(check_kernels, "attn_fwd", on_math)
    ok, written = _check(tmp_path)
    cpu = [r for r in written["rows"] if r["backend"] == "cpu"]
    assert not ok and cpu and all(r["why"] == "ran math instead of cpu" for r in cpu)


def test_the_float64_reference_gradients_are_autograds(tmp_path) -> None:
    """reference64's chunked forward and hand-written gradients against float64 autograd."""
    g = torch.Generator().manual_seed(3)
    q, k, v, dout = (torch.randn(1, n, h, 16, generator=g, dtype=torch.float64)
                     for n, h in ((9, 8), (11, 2), (11, 2), (9, 8)))  # fmt: skip
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    ref_out, _ = attn_fwd(*leaves, scale=0.25)
    want = torch.autograd.grad((ref_out * dout).sum(), leaves)
    out64, lse64 = forward64(q, k, v, 0.25)
    rows, keys = torch.tensor([0, 4, 8]), torch.tensor([1, 10])
    dq, dk, dv = grads64(dout, q, k, v, out64, lse64, 0.25, rows, keys)
    assert torch.allclose(out64, ref_out.detach(), atol=1e-12)
    assert torch.allclose(dq, want[0][:, rows], atol=1e-12)
    assert torch.allclose(dk, want[1][:, keys], atol=1e-12)
    assert torch.allclose(dv, want[2][:, keys], atol=1e-12)


def test_the_7b_block_checks_its_values_and_says_when_they_are_wrong(tmp_path, monkeypatch) -> None:
    args = argparse.Namespace(device="cpu", frames=8, gpus=8, ratio=145.0, dtype=None,
                              warmup=0, iters=1)  # fmt: skip
    rows = Rows(tmp_path / "block.json", machine={"device": "cpu"})
    assert bench_xattn_7b.run(args, rows)
    cpu = next(r for r in rows.rows if r["backend"] == "cpu")
    assert cpu["values_ok"] and cpu["ran"] == {"attn_fwd": ["cpu"], "attn_bwd": ["cpu"]}

    def wrong_dk(*a, **kw):
        dq, dk, dv = attn_bwd(*a, **kw)
        return dq, dk * 1.1, dv

    monkeypatch.setattr(bench_xattn_7b, "attn_bwd", wrong_dk)
    rows = Rows(None, machine={"device": "cpu"})
    assert not bench_xattn_7b.run(args, rows)
    assert rows.rows[0]["values_off"].startswith("dk off by")


def test_a_check_where_no_backend_took_any_call_says_it_checked_nothing(tmp_path, monkeypatch):
    """Every backend declining every call is no pass: the file says nothing was checked, which the
    acceptance report shows as skipped."""
    for script in (check_kernels, bench_xattn_7b):
        monkeypatch.setattr(script, "can_run", lambda *args: False)
    for script, argv in (
        (check_kernels, ["--frames", "1", "--rows", "4"]),
        (bench_xattn_7b, ["--frames", "2", "--iters", "1", "--warmup", "0"]),
    ):
        out = tmp_path / f"{script.__name__}.json"
        assert script.main(["--device", "cpu", *argv, "--out", str(out)]) == 0
        assert json.loads(out.read_text())["skipped"].startswith("no backend took")
