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
from lvx_kernels.kernels import attn_fwd_upto
from scripts import bench_xattn_7b, check_kernels
from scripts.harness import Rows
from scripts.reference64 import OUT_RMS_TOLERANCE, forward64, grads64

CALLS = (
    "every key visible",
    "media mask",
    "decoded token",
    "bounded decode",
    "causal prefill over a cached prefix",
)


def _check(tmp_path, dtype=None, frames=1, rows=16, backends=None) -> tuple[bool, dict]:
    args = argparse.Namespace(
        device="cpu", frames=frames, rows=rows, prefix=64, dtype=dtype, backends=backends
    )
    table = Rows(tmp_path / "kernels.json", key="checks")
    ok = check_kernels.check(args, table)
    table.save(ok=ok)
    return ok, json.loads((tmp_path / "kernels.json").read_text())["checks"]


def _plant(monkeypatch, wrong_out=None, wrong_lse=None) -> None:
    """Every call of the check (`attn_fwd` and the bounded decode's `attn_fwd_upto`) with its
    output or lse made wrong as given."""

    def planted(kernel):
        def run(*args, **kwargs):
            out, lse = (wrong_out or kernel)(*args, **kwargs)
            return out, lse if wrong_lse is None else wrong_lse(lse)

        return run

    monkeypatch.setattr(check_kernels, "attn_fwd", planted(attn_fwd))
    monkeypatch.setattr(check_kernels, "attn_fwd_upto", planted(attn_fwd_upto))


def _shifted_weights(kernel):
    """`kernel` with every key's softmax weight 1% up or down (a fixed sign per key), renormalised:
    a score bias of log(1.01) per key, carried by one more head-dim column (q's holds 1/scale)."""

    def run(q, k, v, *args, **kwargs):
        scale = q.shape[-1] ** -0.5
        g = torch.Generator().manual_seed(5)
        sign = torch.randint(0, 2, (k.shape[0], k.shape[1], k.shape[2], 1), generator=g) * 2 - 1
        bias = (sign * math.log(1.01)).to(k.dtype)
        out, lse = kernel(
            torch.cat([q, torch.full_like(q[..., :1], 1 / scale)], -1),
            torch.cat([k, bias], -1),
            torch.cat([v, torch.zeros_like(v[..., :1])], -1),
            *args,
            scale=scale,
            **kwargs,
        )
        return out[..., :-1], lse

    return run


def test_the_cpu_kernels_pass_the_check_at_7b_head_shapes(tmp_path) -> None:
    ok, written = _check(tmp_path)
    assert ok and written["ok"] is True
    assert {(r["backend"], r["call"]) for r in written["rows"]} == {
        (b, c) for b in ("auto", "cpu", "math") for c in CALLS
    }
    for r in written["rows"]:
        assert r["lse_max_abs_error"] < 1e-4 and r["out_rms_relative_error"] < 1e-5, r
        assert r["ran"] == ["cpu" if r["backend"] == "auto" else r["backend"]], r


@pytest.mark.parametrize(
    "wrong", [lambda lse: lse * 1.01, lambda lse: lse + math.log(1.01)], ids=["lse", "softmax sum"]
)
def test_a_kernel_whose_lse_is_off_by_one_percent_fails(tmp_path, monkeypatch, wrong) -> None:
    _plant(monkeypatch, wrong_lse=wrong)
    ok, written = _check(tmp_path, dtype="bfloat16")
    assert not ok and written["ok"] is False
    assert all(r["why"].startswith("lse off by") for r in written["rows"]), written["rows"]


def _scaled_weights(kernel):
    """`kernel` with every softmax weight times 1.01 (the output 1% too large)."""

    def run(*args, **kwargs):
        out, lse = kernel(*args, **kwargs)
        return out * 1.01, lse

    return run


@pytest.mark.parametrize("wrong", [_scaled_weights, _shifted_weights], ids=["scaled", "shifted"])
def test_weights_one_percent_off_fail_in_bf16(tmp_path, monkeypatch, wrong) -> None:
    """Weights scaled by 1.01, or each 1% up or down and renormalised, fail every call in bf16,
    whose own kernels pass."""
    monkeypatch.setattr(check_kernels, "attn_fwd", wrong(attn_fwd))
    monkeypatch.setattr(check_kernels, "attn_fwd_upto", wrong(attn_fwd_upto))
    ok, written = _check(tmp_path, dtype="bfloat16")
    assert not ok
    for r in written["rows"]:
        assert "of its RMS" in r["why"], r
        assert r["out_rms_relative_error"] > 1.25 * OUT_RMS_TOLERANCE[torch.bfloat16], r


def test_the_bf16_kernels_pass_with_room(tmp_path) -> None:
    """The same check without a planted error passes in bf16, each output at most 3/4 of the RMS
    bound off: the bound sits between a bf16 kernel and a 1% weight error."""
    ok, written = _check(tmp_path, dtype="bfloat16")
    assert ok, [r["why"] for r in written["rows"] if not r["ok"]]
    assert all(r["out_rms_relative_error"] < 0.75 * OUT_RMS_TOLERANCE[torch.bfloat16]
               for r in written["rows"])  # fmt: skip


def test_a_wrong_output_and_a_call_run_by_another_kernel_fail(tmp_path, monkeypatch) -> None:
    def scaled_out(*args, **kwargs):
        out, lse = attn_fwd(*args, **kwargs)
        return out * 1.05, lse

    monkeypatch.setattr(check_kernels, "attn_fwd", scaled_out)
    ok, written = _check(tmp_path)
    plain = [r for r in written["rows"] if r["call"] != "bounded decode"]
    assert not ok and all("output off by" in r["why"] for r in plain)

    def on_math(*args, backend=None, **kwargs):  # the call handed to another kernel
        return attn_fwd(*args, backend="math", **kwargs)

    monkeypatch.setattr(check_kernels, "attn_fwd", on_math)
    ok, written = _check(tmp_path)
    cpu = [r for r in written["rows"] if r["backend"] == "cpu" and r["call"] != "bounded decode"]
    assert not ok and cpu and all(r["why"] == "ran math instead of cpu" for r in cpu)


def test_a_backend_the_engine_never_picks_is_reported_not_failed(tmp_path, monkeypatch) -> None:
    """A failing row of a backend outside `ENGINE_PICKS` (cuDNN on a GPU; math stands in here) is
    written with its reason and leaves the check passed; the same row on a backend the engine picks
    fails it."""

    def math_off(*args, backend=None, **kwargs):
        out, lse = attn_fwd(*args, backend=backend, **kwargs)
        return (out * 1.05, lse) if backend == "math" else (out, lse)

    monkeypatch.setattr(check_kernels, "attn_fwd", math_off)
    monkeypatch.setattr(check_kernels, "ENGINE_PICKS", ("cpu", "efficient", "flash"))
    ok, written = _check(tmp_path)
    reported = [r for r in written["rows"] if r["backend"] == "math" and not r["ok"]]
    assert ok and reported and all(not r["counts"] for r in reported)
    monkeypatch.setattr(check_kernels, "ENGINE_PICKS", ("cpu", "math"))
    assert not _check(tmp_path)[0]


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
    acceptance report shows as skipped. The kernel check's automatic rows run whatever the forced
    backends take: they are the engine's own calls."""
    for script in (check_kernels, bench_xattn_7b):
        monkeypatch.setattr(script, "can_run", lambda *args: False)
    out = tmp_path / "block.json"
    argv = ["--device", "cpu", "--frames", "2", "--iters", "1", "--warmup", "0", "--out", str(out)]
    assert bench_xattn_7b.main(argv) == 0
    assert json.loads(out.read_text())["skipped"].startswith("no backend took")
    out = tmp_path / "kernels.json"
    argv = ["--device", "cpu", "--frames", "1", "--rows", "4", "--prefix", "8", "--out", str(out)]
    assert check_kernels.main(argv) == 0
    written = json.loads(out.read_text())
    assert "skipped" not in written and written["ok"] is True
    assert {r["call"] for r in written["rows"] if "ok" in r} == set(CALLS)
    assert all(r["backend"] == "auto" for r in written["rows"] if "ok" in r)


def test_the_cuda_rows_pass_on_the_op_stand_ins(tmp_path, monkeypatch) -> None:
    """The check's CUDA rows on CPU, every CUDA op a stand-in with the real op's signature and
    layouts (tests/cuda_standins.py): each path runs on the kernel the engine picks (the bounded
    decode, two batch rows, on flash's variable-length form: its (Hq, B*Sq) lse laid out per row),
    and each forced backend passes."""
    from cuda_standins import on_stand_ins

    fixture = on_stand_ins(monkeypatch, flash_attn=False)
    next(fixture)
    monkeypatch.setattr(check_kernels, "available_backends", lambda device: ["flash", "efficient"])
    ok, written = _check(tmp_path, dtype="bfloat16", frames=3)
    assert ok, [r["why"] for r in written["rows"] if not r.get("ok", True)]
    auto = {r["call"]: r["ran"] for r in written["rows"]
            if r["backend"] == "auto" and r["dtype"] == "bfloat16"}  # fmt: skip
    assert auto == {
        "every key visible": ["flash"],
        "media mask": ["efficient", "flash"],  # the masked band, and the rows that see all
        "decoded token": ["flash"],
        "bounded decode": ["flash_varlen"],
        "causal prefill over a cached prefix": ["flash"],
    }


def _one_part_off(monkeypatch, how: str) -> list[int]:
    """Every second part an `attn_fwd` merges (a masked band, a causal square) with its weight 1%
    off (its lse raised by log(1.01): the softmax weight it carries, and the lse, off) or its
    output 1% off; the rest exact. Returns the count of planted parts."""
    from lvx_kernels import kernels

    real, merged = kernels.merge_, [0]

    def merge_(out, lse, part_out, part_lse):
        merged[0] += 1
        if merged[0] % 2 == 0:
            if how == "weight":
                part_lse = part_lse + math.log(1.01)
            else:
                part_out = part_out * 1.01
        return real(out, lse, part_out, part_lse)

    monkeypatch.setattr(kernels, "merge_", merge_)
    return merged


@pytest.mark.parametrize("how", ["weight", "output"])
def test_one_part_of_a_merged_call_one_percent_off_fails_the_float32_rows(
    tmp_path, monkeypatch, how
) -> None:
    """A call that merges several kernel calls' parts (the media mask's band and its rows that see
    every frame, the causal square and its cached prefix) with one part's weight or output 1% off:
    its float32 rows fail the check, bf16's own rounding being too coarse to see it at every
    shape; the calls that merge nothing pass."""
    merged = _one_part_off(monkeypatch, how)
    ok, written = _check(tmp_path, dtype="bfloat16", frames=3, rows=32)
    assert merged[0] >= 4 and not ok
    tight = [r for r in written["rows"] if r["dtype"] == "float32"]
    assert {r["call"] for r in tight} == set(check_kernels.MERGED_CALLS)
    assert all(not r["ok"] and "off by" in r["why"] for r in tight), tight
    assert all(r["ok"] for r in written["rows"] if r["call"] not in check_kernels.MERGED_CALLS)


def test_a_cudnn_device_fault_fails_only_its_rows(tmp_path, monkeypatch) -> None:
    """cuDNN (a backend the engine never picks) faulting the device on every call, on the op
    stand-ins: the faults are its rows' failures, written and reported; its rows run after every
    other backend's, which all pass, and neither the kernel check nor the 7B block fails."""
    from cuda_standins import on_stand_ins

    from lvx_kernels import backends

    fixture = on_stand_ins(monkeypatch, flash_attn=False)
    next(fixture)
    fault = getattr(torch, "AcceleratorError", RuntimeError)

    def cudnn_faults(*args, **kwargs):
        raise fault("CUDA error: an illegal memory access was encountered")

    monkeypatch.setitem(backends.KERNEL_OPS, "cudnn_fwd", cudnn_faults)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert backends.available_backends("cuda") == ["flash", "efficient", "cudnn", "math"]
    ok, written = _check(tmp_path, "bfloat16", frames=2, backends=["cudnn", "flash", "efficient"])
    checked = [r for r in written["rows"] if "ok" in r]
    faulted = [r for r in checked if not r["ok"]]
    assert ok and faulted and {r["backend"] for r in faulted} == {"cudnn"}
    assert all(r["why"].startswith(f"raised {fault.__name__}: CUDA error") for r in faulted)
    first_cudnn = next(i for i, r in enumerate(written["rows"]) if r["backend"] == "cudnn")
    assert all(r["backend"] == "cudnn" for r in written["rows"][first_cudnn:])
    args = argparse.Namespace(device="cpu", frames=8, gpus=8, ratio=145.0, dtype="bfloat16",
                              warmup=0, iters=1)  # fmt: skip
    monkeypatch.setattr(bench_xattn_7b, "available_backends", lambda device: ["flash", "cudnn"])
    rows = Rows(None, machine={"device": "cpu"})
    assert bench_xattn_7b.run(args, rows)
    cudnn = next(r for r in rows.rows if r["backend"] == "cudnn")
    assert not cudnn["values_ok"] and cudnn["error"].startswith(f"raised {fault.__name__}")


def test_a_bounded_decode_without_its_kernel_is_a_fallback(tmp_path, monkeypatch) -> None:
    """A torch whose flash op takes no key count (`bounds_keys` false, on the op stand-ins): the
    static step's text attention runs masked, and the tally says so as a fallback, so the kernel
    check's automatic bounded-decode row fails (the decode item fails on it the same way)."""
    from cuda_standins import on_stand_ins

    from lvx_kernels import backends, kernels

    fixture = on_stand_ins(monkeypatch, flash_attn=False)
    next(fixture)
    for module in (kernels, check_kernels):
        monkeypatch.setattr(module, "bounds_keys", lambda q, d: False)
    monkeypatch.setattr(check_kernels, "available_backends", lambda device: ["efficient"])
    ok, written = _check(tmp_path, dtype="bfloat16", frames=2)
    want_row = ("auto", "bounded decode")
    row = next(r for r in written["rows"] if (r["backend"], r["call"]) == want_row)
    want = "fwd flash_varlen -> masked: this torch's flash op takes no seqused_k"
    assert not ok and row["fallbacks"] == [want] and row["ran"] == ["efficient"], row
    assert all(r["ok"] for r in written["rows"] if r is not row and "ok" in r)
    with backends.kernel_tally() as tally:
        q = torch.randn(1, 1, 4, 16, dtype=torch.bfloat16)
        kv = torch.randn(1, 8, 2, 16, dtype=torch.bfloat16)
        kernels.attn_fwd_upto(q, kv, kv, torch.tensor([5], dtype=torch.int32))
    assert dict(tally.fallbacks) == {want: 1}


def test_the_vision_towers_attention_is_counted_by_the_tally() -> None:
    """The Llama-3.2-Vision tower's attention calls PyTorch's own `scaled_dot_product_attention`
    directly: while a tally is open each call is counted ("fwd sdpa"), nested tallies too, and the
    function is PyTorch's own again once the last tally closes."""
    import torch.nn.functional as F

    from lvx_kernels.backends import kernel_tally
    from lvx_models.mllama.config import MllamaVisionConfig
    from lvx_models.mllama.vision import VisionAttention

    own = F.scaled_dot_product_attention
    attn = VisionAttention(MllamaVisionConfig(hidden_size=32, attention_heads=4))
    x, bias = torch.randn(1, 6, 32), torch.zeros(1, 1, 6, 6)
    with kernel_tally() as outer:
        attn(x, bias)
        with kernel_tally() as inner:
            attn(x, bias)
        attn(x, bias)
    assert outer.calls == {"fwd sdpa": 3} and inner.calls == {"fwd sdpa": 1}
    assert F.scaled_dot_product_attention is own
