"""The CUDA adapters (efficient, cudnn, flash, flash-attn) run on CPU against stand-in ops with the
real conventions.

Their argument plumbing, GQA row packing, mask band and lse handling are checked against the float64
reference, forward and backward, with and without masks, at GQA 7:1, on uneven and empty shards; and
no op ever gets a K/V with more than Hkv heads. The real kernels run in the CUDA-marked tests of
test_attention_kernels.py.
"""

import pytest
import torch
from cuda_standins import Recorder, on_stand_ins
from test_attention_kernels import _inputs, _run_case

from lvx_kernels import backends, masks
from lvx_kernels.kernels import attn_fwd

HQ, HKV = 14, 2  # GQA 7:1, as mPLUG-Owl3-7B's 28 / 4
OPS = {
    "efficient": ("efficient_fwd", "efficient_bwd"),
    "cudnn": ("cudnn_fwd", "efficient_bwd"),
    "flash": ("flash_fwd", "flash_bwd"),
    "flash_attn": ("fa_fwd", "fa_bwd"),
}
DTYPE = {
    "efficient": torch.float32,
    "cudnn": torch.bfloat16,
    "flash": torch.bfloat16,
    "flash_attn": torch.bfloat16,
}


@pytest.fixture
def standins(monkeypatch):
    """CPU tensors count as CUDA, flash-attn counts as installed, and every CUDA op is a recording
    stand-in."""
    yield from on_stand_ins(monkeypatch, flash_attn=True)


def _no_kv_copies(rec: Recorder):
    assert rec.calls, "no CUDA op was called"
    for c in rec.calls:
        h = 2 if c.op.startswith("fa_") else 1  # flash-attn is (B, S, H, D), aten (B, H, S, D)
        assert c.k[h] == c.v[h] == HKV, (
            f"{c.op} got K/V with {c.k[h]} heads (> {HKV}: a repeated copy)"
        )
        assert c.q[h] == HKV, (
            f"{c.op} got {c.q[h]} query heads: query groups must arrive packed into rows"
        )


@pytest.mark.parametrize("backend", list(OPS))
@pytest.mark.parametrize(
    "causal,media", [(False, False), (True, False), (False, True), (True, True)]
)
def test_cuda_adapter_matches_reference_on_cpu(standins, backend, causal, media, monkeypatch):
    # several tiles, each with an unmasked part and a masked band
    monkeypatch.setattr(masks, "Q_TILE", 3)
    monkeypatch.setattr(masks, "MIN_TILE", 3)
    _run_case((2, 10, 23, HQ, HKV, 16), DTYPE[backend], backend, causal, media)
    _no_kv_copies(standins)
    fwd, bwd = OPS[backend]
    # flash and flash-attn take no mask: only the unmasked parts reach them, bands go to "efficient"
    assert fwd in standins.ops() and bwd in standins.ops(), standins.ops()
    masked = [c for c in standins.calls if c.bias is not None]
    if backend in ("flash", "flash_attn"):
        assert {c.op for c in masked} <= {"efficient_fwd", "efficient_bwd"}
    if media:
        assert masked and all(c.bias[-1] < 23 for c in masked), (
            "every mask covers a band, never all keys"
        )
    for c in masked:  # heads broadcast: expanded (stride 0) for efficient, a size-1 dim for cuDNN
        assert c.bias[1] == (1 if c.op == "cudnn_fwd" else c.q[1]), c


@pytest.mark.parametrize("backend", list(OPS))
def test_cuda_adapter_empty_and_single_row_shards(standins, backend):
    # empty K/V shard: no op at all
    _run_case((2, 5, 0, HQ, HKV, 16), DTYPE[backend], backend, False, False)
    assert standins.calls == []
    _run_case((1, 1, 13, HQ, HKV, 16), DTYPE[backend], backend, False, False)  # one decoded token
    _no_kv_copies(standins)
    assert {c.q[2] if not c.op.startswith("fa_") else c.q[1] for c in standins.calls} == {HQ // HKV}


def test_forward_reads_the_resident_kv_in_place(standins):
    """No K/V copy of any size in forward: every op gets a view of the caller's K/V storage."""
    q, k, v, q_vis, k_frame = _inputs(1, 9, 40, HQ, HKV, 16, dtype=torch.bfloat16, media=True)
    attn_fwd(q, k, v, q_vis=q_vis, k_frame=k_frame)
    assert standins.ops() == {"fa_fwd", "efficient_fwd"}
    assert all(c.k_storage == k.untyped_storage().data_ptr() for c in standins.calls)


def _cuda_q(dtype: torch.dtype, d: int = 16) -> torch.Tensor:
    return torch.zeros(1, 4, HKV, d, dtype=dtype)


def test_can_run_cudnn_only_in_half_precision_up_to_head_dim_128(standins):
    """cuDNN attention is fp16/bf16 only and takes head_dim <= 128: other calls go to another
    backend before any op sees them, so no fallback is needed."""
    assert backends.can_run("cudnn", _cuda_q(torch.bfloat16), True, 128)
    assert backends.can_run("cudnn", _cuda_q(torch.float16), False, 64)
    assert not backends.can_run("cudnn", _cuda_q(torch.float32), False, 64)
    assert not backends.can_run("cudnn", _cuda_q(torch.bfloat16), False, 256)
    assert backends.can_run("efficient", _cuda_q(torch.float32), True, 64)
    q, k, v, q_vis, k_frame = _inputs(1, 4, 9, HQ, HKV, 256, dtype=torch.bfloat16, media=True)
    attn_fwd(q, k, v, q_vis=q_vis, k_frame=k_frame, backend="cudnn")
    assert "cudnn_fwd" not in standins.ops() and standins.calls


def test_efficient_backward_packs_out_and_dout(standins):
    """An `out` whose rows are not packed (a slice of a wider tensor) is packed before the kernel,
    which reads it with packed rows whatever its strides."""
    q, k, v, _, _ = _inputs(2, 5, 7, HKV, HKV, 16)
    wide = torch.randn(2, 5, HKV, 24)
    out, dout = wide[..., :16], wide[..., 8:]
    assert not out.is_contiguous()
    got = backends._efficient_bwd(dout, q, k, v, out, torch.zeros(2, HKV, 5), 0.25, None, False)
    want = backends._math_bwd(dout, q, k, v, out, torch.zeros(2, HKV, 5), None, 0.25, None, False)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize(
    "error",
    [
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB"),
        RuntimeError("CUDA error: an illegal memory access was encountered"),
    ],
    ids=["oom", "device_fault"],
)
def test_running_out_of_memory_never_marks_a_backend_broken(standins, monkeypatch, error):
    """Only an op refusing the call's arguments may send later calls to "efficient": an OOM or a
    device fault is the caller's to see, and the backend stays in use."""

    def fail(*args, **kwargs):
        raise error

    monkeypatch.setitem(backends.KERNEL_OPS, "cudnn_fwd", fail)
    q, k, v, _, _ = _inputs(1, 4, 9, HKV, HKV, 16, dtype=torch.bfloat16)
    with pytest.raises(type(error)):
        backends.kernel_fwd("cudnn", q, k, v, 0.25, None, False)
    assert not backends._broken and "efficient_fwd" not in standins.ops()


def test_a_rejected_call_falls_back_and_the_tally_says_so(standins, monkeypatch):
    """A shape/dtype rejection marks the backend broken, warns once with its own category, and every
    tally open at the time records the kernel that ran and the fallback with its reason."""

    def reject(*args, **kwargs):
        raise RuntimeError("No available kernel. Aborting execution.")

    monkeypatch.setitem(backends.KERNEL_OPS, "cudnn_fwd", reject)
    q, k, v, _, _ = _inputs(1, 4, 9, HKV, HKV, 16, dtype=torch.bfloat16)
    with backends.kernel_tally() as outer:
        with pytest.warns(backends.BackendFallbackWarning, match="No available kernel"):
            with backends.kernel_tally() as inner:
                backends.kernel_fwd("cudnn", q, k, v, 0.25, None, False)
        backends.kernel_fwd("cudnn", q, k, v, 0.25, None, False)  # broken now: no second warning
        backends.kernel_bwd("cudnn", q, q, k, v, q, torch.zeros(1, HKV, 4), None, 0.25, None, False)
    assert list(backends._broken) == [("fwd", "cudnn")]
    assert inner.calls == {"fwd efficient": 1}
    assert inner.fallbacks == {
        "fwd cudnn -> efficient: No available kernel. Aborting execution.": 1
    }
    assert outer.calls == {"fwd efficient": 2, "bwd efficient": 1}
    assert outer.ran("fwd") == ["efficient"] and outer.ran("bwd") == ["efficient"]
    assert outer.fallbacks == {
        "fwd cudnn -> efficient: No available kernel. Aborting execution.": 2
    }


def test_bench_xattn_7b_names_the_kernels_that_ran_and_every_fallback(standins, monkeypatch):
    """cuDNN's row says its backward ran on "efficient"; a backend whose op rejects the call is
    timed on "efficient" and its row and the JSON's fallback lines say so; both rows' values are
    checked against float64."""
    from scripts import bench_xattn_7b as bench

    block = bench.block("cpu", 6, 40, torch.bfloat16)
    row = bench.bench_backend("cudnn", block, 1, 0)
    assert row["ran"] == {"attn_fwd": ["cudnn"], "attn_bwd": ["efficient"]}
    assert row["fallbacks"] == [] and row["values_ok"], row["values_off"]

    def reject(*args, **kwargs):
        raise RuntimeError("flash: unsupported head_dim")

    monkeypatch.setitem(backends.KERNEL_OPS, "flash_fwd", reject)
    with pytest.warns(backends.BackendFallbackWarning):
        row = bench.bench_backend("flash", block, 2, 1)
    assert row["ran"] == {"attn_fwd": ["efficient"], "attn_bwd": ["flash"]}
    assert row["fallbacks"] == [
        "flash attn_fwd: fwd flash -> efficient: flash: unsupported head_dim (4 calls)"
    ]


@pytest.fixture
def run_backend():
    """The run's --attn-backend, put back as it was after the test."""
    before = backends.prefer_backend("auto")
    yield backends.prefer_backend
    backends.prefer_backend(before)


def test_the_runs_attn_backend_is_taken_wherever_it_can_run(standins, run_backend, monkeypatch):
    """`--attn-backend cudnn`, handed over once as a rank sets up, moves an unmasked bf16 call from
    flash-attn to cuDNN; a call cuDNN cannot run (float32) keeps the automatic choice; nothing reads
    the environment per call any more."""
    q, k, v, _, _ = _inputs(1, 4, 9, HQ, HKV, 16, dtype=torch.bfloat16)
    with backends.kernel_tally() as automatic:
        attn_fwd(q, k, v)
    assert automatic.ran("fwd") == ["flash_attn"]
    assert run_backend("cudnn") == "auto"
    monkeypatch.setenv("LVX_ATTN_BACKEND", "flash")
    with backends.kernel_tally() as chosen:
        attn_fwd(q, k, v)
        attn_fwd(q.float(), k.float(), v.float())
    assert chosen.calls == {"fwd cudnn": 1, "fwd efficient": 1}
    with pytest.raises(ValueError, match="unknown attention backend 'nope'"):
        run_backend("nope")


def test_a_rank_set_up_from_the_config_prefers_its_attn_backend(run_backend):
    """`set_up_rank` hands the config's backend to the kernels; `--attn-backend` is an option of
    the commands that load a model, with LVX_ATTN_BACKEND as its environment variable."""
    from lvx_app.cli.main import app
    from lvx_app.config import Config, ConfigError
    from lvx_app.parallel.world import World
    from lvx_app.runtime.rank_main import set_up_rank

    q = torch.zeros(1, 4, HKV, 16)  # a CPU float32 call: automatically the "cpu" kernel
    assert backends.choose_backend(None, q, False, 16) == "cpu"
    set_up_rank(Config.from_options(attn_backend="math"), World(1))
    assert backends.choose_backend(None, q, False, 16) == "math"
    with pytest.raises(ConfigError, match="--attn-backend"):
        Config.from_options(attn_backend="nope")
    import typer

    click_app = typer.main.get_command(app)
    for name in ("chat", "serve", "eval", "finetune"):
        command = click_app.commands[name]
        if name == "eval":
            command = command.commands["videomme"]
        (option,) = [p for p in command.params if "--attn-backend" in p.opts]
        assert option.envvar == "LVX_ATTN_BACKEND", name
