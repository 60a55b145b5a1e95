"""The static decode step's text attention (`attn_fwd_upto`): one decoded token against the first
`used` keys of a reserved buffer, `used` on the device.

On a GPU in half precision the key count is the flash kernel's own bound (aten's variable-length
flash forward with `seqused_k`): no mask, no memory-efficient kernel, no key past the count read.
Elsewhere one masked call. Both equal attention over the used keys alone; the CUDA path runs on CPU
against the op stand-ins (tests/cuda_standins.py), and its argument list against the real op's
shape rules on fake CUDA tensors at 7B decode shapes.
"""

from __future__ import annotations

import pytest
import torch
from cuda_standins import on_stand_ins
from test_hyper_attention import P, tiny_config, tiny_model
from test_static_decode import TOKENS, _conversation, _started
from torch._subclasses.fake_tensor import FakeTensorMode

from lvx_app.config import GenerationConfig
from lvx_app.engine.generator import Generator, LoopOutcome
from lvx_kernels import backends
from lvx_kernels.backends import BackendFallbackWarning, kernel_tally
from lvx_kernels.kernels import attn_fwd, attn_fwd_upto

HQ, HKV, D, RESERVED, USED = 14, 2, 16, 12, 7


@pytest.fixture
def standins(monkeypatch):
    """CPU tensors count as CUDA and every CUDA op is a recording stand-in."""
    yield from on_stand_ins(monkeypatch, flash_attn=False)


def _inputs(dtype: torch.dtype, tail: float = float("nan")):
    """A decoded token's q and a reserved K/V buffer whose keys past USED hold `tail`."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 1, HQ, D, generator=g).to(dtype)
    k, v = (torch.randn(1, RESERVED, HKV, D, generator=g).to(dtype) for _ in range(2))
    for t in (k, v):
        t[:, USED:] = tail
    return q, k, v, torch.tensor([USED], dtype=torch.int32)


def _reference(q, k, v):
    """Attention over the used keys alone, float64."""
    out, lse = attn_fwd(*(t.double() for t in (q, k[:, :USED], v[:, :USED])))
    return out, lse


def _check(got, want, atol):
    torch.testing.assert_close(got[0].double(), want[0], rtol=0, atol=atol)
    torch.testing.assert_close(got[1].double(), want[1], rtol=0, atol=1e-5)


def test_the_static_steps_attention_is_mask_free_on_a_flash_kernel(standins):
    """bf16 on CUDA: one variable-length flash call bounded by `used`, with the query heads
    unpacked (flash's decode path); a NaN tail past the count is never read."""
    q, k, v, used = _inputs(torch.bfloat16)
    with kernel_tally() as tally:
        got = attn_fwd_upto(q, k, v, used)
    assert tally.ran("fwd") == ["flash_varlen"] and not tally.fallbacks
    assert [c.op for c in standins.calls] == ["flash_varlen_fwd"]
    assert standins.calls[0].q == (1, HQ, D) and standins.calls[0].k == (RESERVED, HKV, D)
    _check(got, _reference(q, k, v), atol=1e-2)


@pytest.mark.parametrize(
    ("dtype", "backend", "kernel"),
    [(torch.float32, None, "efficient"), (torch.bfloat16, "cudnn", "cudnn")],
    ids=["float32_has_no_flash", "forced_cudnn"],
)
def test_where_no_flash_kernel_applies_one_masked_call_runs(standins, dtype, backend, kernel):
    q, k, v, used = _inputs(dtype, tail=0.0)
    with kernel_tally() as tally:
        got = attn_fwd_upto(q, k, v, used, backend=backend)
    assert tally.ran("fwd") == [kernel]
    _check(got, _reference(q, k, v), atol=1e-2 if dtype == torch.bfloat16 else 1e-5)


def test_on_cpu_one_masked_call_equals_attention_over_the_used_keys():
    q, k, v, used = _inputs(torch.float32, tail=0.0)
    with kernel_tally() as tally:
        got = attn_fwd_upto(q, k, v, used)
    assert tally.ran("fwd") == ["cpu"]
    _check(got, _reference(q, k, v), atol=1e-5)


def test_a_rejected_bounded_call_falls_back_to_the_masked_kernel_once(standins, monkeypatch):
    def reject(*args, **kw):
        raise RuntimeError("seqused_k is not supported here")

    monkeypatch.setitem(backends.KERNEL_OPS, "flash_varlen_fwd", reject)
    q, k, v, used = _inputs(torch.bfloat16, tail=0.0)
    with pytest.warns(BackendFallbackWarning, match="flash_varlen"):
        first = attn_fwd_upto(q, k, v, used)
    with kernel_tally() as tally:
        second = attn_fwd_upto(q, k, v, used)  # marked broken: no second try, no warning
    assert tally.ran("fwd") == ["efficient"]
    # every later call is a fallback too: a tally opened after the rejection still says so
    assert list(tally.fallbacks) == [
        "fwd flash_varlen -> efficient: seqused_k is not supported here"
    ]
    for got in (first, second):
        _check(got, _reference(q, k, v), atol=1e-2)


def test_the_bounded_call_fits_the_real_flash_op_at_7b_decode_shapes():
    """The real aten op's shape rules (fake CUDA tensors, no GPU): 28 query heads, 4 K/V heads,
    head_dim 128, bf16, a reserved buffer of an hour's text; out and lse come back as the model
    reads them."""
    with FakeTensorMode():
        q = torch.empty(1, 1, 28, 128, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.empty(1, 20_000, 4, 128, device="cuda", dtype=torch.bfloat16) for _ in "kv")
        used = torch.empty(1, device="cuda", dtype=torch.int32)
        out, lse = backends._flash_varlen_fwd(q, k, v, used, 128**-0.5)
        assert (tuple(out.shape), out.dtype) == ((1, 1, 28, 128), torch.bfloat16)
        assert (tuple(lse.shape), lse.dtype) == ((1, 28, 1), torch.float32)


def test_the_static_step_answers_as_the_eager_loop_on_the_mask_free_kernel(standins):
    """The tiny g2 model in bf16 "on CUDA" (stand-ins): the static step's every text attention runs
    on the bounded flash call, none on the memory-efficient kernel, and the answer is the eager
    loop's, token for token."""
    model = tiny_model(tiny_config("g2")).to(torch.bfloat16)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, model.config.vocab_size, (16,), generator=g)
    frames = torch.randn(3, P, model.config.hidden_size, generator=g).to(torch.bfloat16)
    visual = model.prepare_visual(frames, torch.tensor([2, 6, 11]))
    eager, logits = _conversation(model, ids, visual)
    want = list(Generator(eager, ()).answer(logits, None, GenerationConfig(TOKENS), LoopOutcome()))
    static, logits = _conversation(model, ids, visual)
    step = _started(static, TOKENS)
    got = [int(logits.argmax())]
    with kernel_tally() as tally:
        for _ in range(TOKENS - 1):
            got.append(step.next_token(got[-1]))
    assert got == want
    text_layers = model.config.num_hidden_layers
    assert tally.calls["fwd flash_varlen"] == text_layers * (TOKENS - 1)
    assert "fwd efficient" not in tally.calls, tally.calls
