"""The SigLIP tower's layout and batching: what makes it fast without changing what it computes."""

from __future__ import annotations

import torch
from test_hyper_attention import tiny_config, tiny_model

from lvx_models.mplug_owl3.config import SiglipVisionConfig
from lvx_models.mplug_owl3.vision import frames_per_batch


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
