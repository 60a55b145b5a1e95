"""The SigLIP tower's layout, batching and fused linears: what makes it fast without changing what
it computes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_hyper_attention import tiny_config, tiny_model
from torch import nn

from lvx_models.mplug_owl3 import vision
from lvx_models.mplug_owl3.config import SiglipVisionConfig
from lvx_models.mplug_owl3.vision import frames_per_batch, fused_linear


def test_residual_stream_is_contiguous():
    """Every layer gets, and the tower returns, a contiguous (N, P, C) tensor: the conv's output
    read as patches-by-channels is a transposed view, and carrying it on made every layer norm copy
    it and every residual add stride through memory."""
    model = tiny_model(tiny_config("g2"))
    seen = []
    for layer in model.vision_model.encoder.layers:
        layer.register_forward_pre_hook(lambda _m, args: seen.append(args[0].is_contiguous()))
    px = torch.rand(3, 3, 28, 28, dtype=torch.float64) * 2 - 1
    with torch.no_grad():
        out = model.vision_model(px)
    assert seen == [True] * len(model.vision_model.encoder.layers)
    assert out.is_contiguous() and out.shape == (3, 4, 32)


def test_patch_embedding_is_the_stride_14_convolution():
    """The patch matmul equals the conv it stands for (float64), also where the image is not a
    multiple of the patch (30 px: the conv drops the last 2 pixel rows and columns)."""
    model = tiny_model(tiny_config("g1"))  # 30 px
    emb = model.vision_model.embeddings
    px = torch.rand(3, 3, 30, 30, dtype=torch.float64) * 2 - 1
    with torch.no_grad():
        conv = F.conv2d(px, emb.patch_embedding.weight, emb.patch_embedding.bias, stride=14)
        want = conv.flatten(2).transpose(1, 2) + emb.position_embedding.weight
        torch.testing.assert_close(emb(px), want, rtol=1e-12, atol=1e-12)


def test_default_batch_bounds_the_widest_activation():
    """By default encode_images runs as many frames per tower call as keep tokens x MLP width
    within 16 so400m frames' worth: 16 at the released shapes, all 40 frames of a tiny tower in one
    call (not three calls of 16), with the same features as any fixed batch size."""
    assert frames_per_batch(SiglipVisionConfig()) == 16
    assert frames_per_batch(SiglipVisionConfig(), budget=1) == 1
    model = tiny_model(tiny_config("g2"))
    calls = []
    model.vision_model.register_forward_hook(lambda _m, args, _out: calls.append(len(args[0])))
    px = torch.rand(40, 3, 28, 28, dtype=torch.float64) * 2 - 1
    got = model.encode_images(px)
    assert calls == [40]
    calls.clear()
    want = model.encode_images(px, batch_size=16)
    assert calls == [16, 16, 8]
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


class CountingOneDNN:
    """Wraps the oneDNN linear op and records which form each call took."""

    def __init__(self, op):
        self.op, self.calls = op, []

    def __call__(self, *args):
        self.calls.append(args[3])  # "none" or "gelu"
        return self.op(*args)

    def binary(self, *args):
        self.calls.append(args[4])  # "add"
        return self.op.binary(*args)


@pytest.fixture
def onednn(monkeypatch):
    if vision._ONEDNN_LINEAR is None:
        pytest.skip("this torch build has no oneDNN")
    counting = CountingOneDNN(vision._ONEDNN_LINEAR)
    monkeypatch.setattr(vision, "_ONEDNN_LINEAR", counting)
    return counting


def test_fused_linear_is_one_onednn_call_with_the_plain_ops_result(onednn):
    """From ONEDNN_MIN_MACS on, in float32 without autograd: the linear, the linear + GELU and the
    linear + residual add are each one oneDNN call and equal the plain ops (float rounding), on a
    strided input too."""
    g = torch.Generator().manual_seed(0)
    linear = nn.Linear(256, 128)
    x = torch.randn(256, 1024, generator=g).t()  # (1024, 256), not contiguous
    residual = torch.randn(1024, 128, generator=g)
    wb = linear.weight, linear.bias
    assert x.numel() * linear.out_features >= vision.ONEDNN_MIN_MACS
    with torch.no_grad():
        plain = linear(x)
        cases = [
            (fused_linear(x, *wb), plain),
            (fused_linear(x, *wb, gelu="tanh"), F.gelu(plain, approximate="tanh")),
            (fused_linear(x, *wb, residual=residual), residual + plain),
        ]
    assert onednn.calls == ["none", "gelu", "add"]
    for got, want in cases:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_fused_linear_takes_the_plain_ops_elsewhere(onednn):
    """Small matmuls, autograd and float64 take the plain ops (gradients flow, float64 is exact)."""
    linear = nn.Linear(256, 128)
    x = torch.randn(1024, 256)
    with torch.no_grad():
        fused_linear(x[:8], linear.weight, linear.bias)  # below ONEDNN_MIN_MACS
    fused_linear(x, linear.weight, linear.bias, gelu="tanh").sum().backward()
    assert linear.weight.grad is not None
    l64 = nn.Linear(256, 128).double()
    with torch.no_grad():
        got = fused_linear(x.double(), l64.weight, l64.bias, residual=x[:, :128].double())
        assert torch.equal(got, x[:, :128].double() + l64(x.double()))
    assert onednn.calls == []
