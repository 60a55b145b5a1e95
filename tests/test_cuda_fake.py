"""The CUDA attention ops the backend adapters call, run on a CPU build with fake CUDA tensors at 7B
shapes.

PyTorch's FakeTensorMode lets a CPU-only build create CUDA-placed tensors with factory functions and
pass them to the aten SDPA ops, whose meta functions return correctly shaped fake outputs. This
checks, without a GPU, that the real ops `lvx_kernels/backends.py` calls (through
`KERNEL_OPS`) still exist with the argument lists it passes, and that their outputs (out, lse,
dq/dk/dv) have the shapes and dtypes the adapters slice and reshape.
`tests/test_cuda_adapters_cpu.py` runs the adapters themselves against stand-ins written to these
conventions; this file checks the conventions against the ops' own shape rules.

Shapes: mPLUG-Owl3-7B (28 query heads, 4 KV heads, d 128, bf16), one rank's block of an hour at 1
fps over 8 GPUs (2,263 query tokens against a 328,050-key shard), GQA-packed as the adapters pass
them (4 heads, each carrying its 7 query heads as 7x rows) and with K/V repeated to 28 heads, with
and without an additive mask.

What this cannot check (run `python scripts/gpu_acceptance.py` on a GPU for those):
- numerics: fake tensors have no values, so nothing here says the kernels compute attention
correctly;
- the adapters themselves on fake CUDA tensors: they transpose/slice/expand their inputs
(`_heads_first`,
  `lse[..., :sq]`, `_cuda_bias`'s `expand`), and views of fake CUDA tensors raise "PyTorch is not
  linked with support for cuda devices" on a CPU build, so each op is called here on freshly made
  heads-first tensors instead (the adapters run on CPU against stand-ins in
  `tests/test_cuda_adapters_cpu.py`);
- flash-attn (`flash_attn_func`, `_flash_attn_backward`): a separate CUDA package, not installable
on CPU;
- the stream overlap in `lvx_app/parallel/ring_comm.py` and NCCL: `torch.cuda.Stream` needs a real
device.
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

aten = torch.ops.aten
B, HQ, HKV, D = 1, 28, 4, 128
# one rank's share of 1 h at 1 fps over 8 GPUs: 18,104 / 8 text rows, 2,624,400 / 8 keys
SQ, SK = (2263, 328050)
DT = torch.bfloat16
SCALE = D**-0.5

# (heads, query rows): GQA-packed (7 query heads as 7x rows per KV head, what attn_fwd passes), or
# K/V repeated
LAYOUTS = {"repeated": (HQ, SQ), "gqa_packed": (HKV, SQ * (HQ // HKV))}


def _cuda(*shape: int, dtype: torch.dtype = DT) -> torch.Tensor:
    return torch.empty(*shape, device="cuda", dtype=dtype)


def _qkv(layout: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    h, rows = LAYOUTS[layout]
    return _cuda(B, h, rows, D), _cuda(B, h, SK, D), _cuda(B, h, SK, D)


def _check_grads(grads, q, k, v) -> None:
    for g, x, name in zip(grads[:3], (q, k, v), ("dq", "dk", "dv")):
        assert (tuple(g.shape), g.dtype, g.device.type) == (tuple(x.shape), DT, "cuda"), name


@pytest.fixture
def fake():
    with FakeTensorMode():
        yield


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("masked", [False, True], ids=["no_mask", "additive_mask"])
def test_cudnn_forward_and_backward(fake, layout: str, masked: bool) -> None:
    """cuDNN: `_cudnn_fwd` reshapes lse (B, H, Sq, 1) to (B, H, Sq). The adapters' cuDNN backward is
    `efficient`'s
    today; cuDNN's own backward op is checked too, with the forward's seed/offset, for a backend
    table that uses it."""
    q, k, v = _qkv(layout)
    h, rows = LAYOUTS[layout]
    bias = _cuda(B, h, rows, SK) if masked else None
    res = aten._scaled_dot_product_cudnn_attention(
        q, k, v, bias, True, 0.0, False, False, scale=SCALE
    )
    out, lse = res[0], res[1]
    assert (tuple(out.shape), out.dtype) == ((B, h, rows, D), DT)
    assert (
        lse.dtype == torch.float32
        and lse.numel() == B * h * rows
        and tuple(lse.shape[:3]) == (B, h, rows)
    )
    grads = aten._scaled_dot_product_cudnn_attention_backward(
        _cuda(B, h, rows, D),
        q,
        k,
        v,
        out,
        lse,
        res[6],
        res[7],
        bias,
        None,
        None,
        rows,
        SK,
        0.0,
        False,
        scale=SCALE,
    )
    _check_grads(grads, q, k, v)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_flash_forward_and_backward(fake, layout: str) -> None:
    """PyTorch flash (no mask: the adapter refuses masked calls): lse is (B, H, Sq) float32, used as
    is."""
    q, k, v = _qkv(layout)
    h, rows = LAYOUTS[layout]
    res = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, False, False, scale=SCALE)
    out, lse = res[0], res[1]
    assert (tuple(out.shape), out.dtype) == ((B, h, rows, D), DT)
    assert (tuple(lse.shape), lse.dtype) == ((B, h, rows), torch.float32)
    # what `_flash_bwd` passes
    rng, unused = (_cuda(2, dtype=torch.uint64), _cuda(0, dtype=torch.uint64))
    grads = aten._scaled_dot_product_flash_attention_backward(
        _cuda(B, h, rows, D),
        q,
        k,
        v,
        out,
        lse,
        None,
        None,
        rows,
        SK,
        0.0,
        False,
        rng,
        unused,
        scale=SCALE,
    )
    _check_grads(grads, q, k, v)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("masked", [False, True], ids=["no_mask", "additive_mask"])
def test_efficient_forward_and_backward(fake, layout: str, masked: bool) -> None:
    """Memory-efficient: lse comes padded to a multiple of 32 rows (`_efficient_fwd` slices it,
    `_efficient_bwd` pads
    it back); the mask is an additive bias in q's dtype."""
    q, k, v = _qkv(layout)
    h, rows = LAYOUTS[layout]
    # the adapter's is a view of 16-aligned rows; fakes cannot slice
    bias = _cuda(B, h, rows, SK) if masked else None
    out, lse, _seed, _offset = aten._scaled_dot_product_efficient_attention(
        q, k, v, bias, True, 0.0, False, scale=SCALE
    )
    padded = -(-rows // 32) * 32
    assert (tuple(out.shape), out.dtype) == ((B, h, rows, D), DT)
    assert (tuple(lse.shape), lse.dtype) == ((B, h, padded), torch.float32)
    dummy = torch.zeros((), dtype=torch.int64, device="cuda")
    grads = aten._scaled_dot_product_efficient_attention_backward(
        _cuda(B, h, rows, D),
        q,
        k,
        v,
        bias,
        out,
        lse,
        dummy,
        dummy,
        0.0,
        [True, True, True, False],
        False,
        scale=SCALE,
    )
    _check_grads(grads, q, k, v)


def test_views_of_fake_cuda_tensors_fail_on_a_cpu_build(fake) -> None:
    """Why the adapters themselves are not called above: if this starts passing (a CUDA build, or a
    PyTorch that
    fakes views too), call `backends._cudnn_fwd` & co. directly instead of the raw ops."""
    if torch.cuda.is_available():
        pytest.skip("CUDA build: views of fake CUDA tensors work here")
    with pytest.raises(RuntimeError, match="not linked with support for cuda"):
        _cuda(B, HQ, SQ, D)[..., :64]
