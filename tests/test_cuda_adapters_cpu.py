"""The CUDA adapters (efficient, cudnn, flash, flash-attn) run on CPU against stand-in ops with the
real conventions.

Their argument plumbing, GQA row packing, mask band and lse handling are checked
against the float64 reference, forward and backward, with and without masks, at GQA
7:1, on uneven and empty shards; and no op ever gets a K/V with more than Hkv heads.
The real kernels run in the CUDA-marked tests of test_attention_kernels.py.
"""

import warnings

import pytest
import torch
from cuda_standins import Recorder, install
from test_attention_kernels import _inputs, _run_case

from lvx_app.attention import backends, masks
from lvx_app.attention.kernels import attn_fwd

HQ, HKV = 14, 2  # GQA 7:1, as mPLUG-Owl3-7B's 28 / 4
OPS = {
    "efficient": ("efficient_fwd", "efficient_bwd"),
    "cudnn": ("cudnn_fwd", "efficient_bwd"),
    "flash": ("flash_fwd", "flash_bwd"),
    "flash_attn": ("fa_fwd", "fa_bwd"),
}
DTYPE = {
    "efficient": torch.float32,
    "cudnn": torch.float32,
    "flash": torch.bfloat16,
    "flash_attn": torch.bfloat16,
}


@pytest.fixture
def standins(monkeypatch):
    """CPU tensors count as CUDA, flash-attn counts as installed, and every CUDA op is a recording
    stand-in."""
    rec = Recorder()
    monkeypatch.setattr(backends, "_on_cuda", lambda q: True)
    monkeypatch.setattr(backends, "_flash_attn", lambda: object())
    monkeypatch.setattr(backends, "_broken", set())
    for name, fn in install(rec).items():
        monkeypatch.setitem(backends.KERNEL_OPS, name, fn)
    with warnings.catch_warnings():
        # a rejected call would fall back silently: make it fail instead
        warnings.simplefilter("error")
        yield rec


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
