"""Aten ops per decoded token, counted around the engine's own answer loop (one process, the tiny
G2 checkpoint with a video, greedy): the slope between an 8- and a 40-token answer, so what a
question costs once cancels out. Each aten op is a kernel launch on a GPU and host time on every
device; the bound keeps the decode layer lean (fused projections, RoPE and norms without per-head
reshapes, no mask per token)."""

from __future__ import annotations

import json

import pytest
import torch

from lvx_models.mplug_owl3.loader import load_model
from scripts.op_count import LONG, decode_ops

MAX_OPS_PER_TOKEN = 250


def test_a_decoded_token_dispatches_few_aten_ops(tiny_checkpoints):
    model = load_model(tiny_checkpoints["g2"]).model
    per_token, _, answer = decode_ops(model)
    assert len(answer) == LONG
    assert per_token <= MAX_OPS_PER_TOKEN, per_token


def test_fused_projections_answer_as_the_separate_ones(tiny_checkpoints):
    """The loader fuses q/k/v and gate/up: the same float32 logits bit for bit as the Linears one
    by one, which stay the parameters under the checkpoint's keys (a load into them reaches the
    fused weights; moving the model fuses again)."""
    fused = load_model(tiny_checkpoints["g2"]).model
    plain = load_model(tiny_checkpoints["g2"], fuse=False).model
    layer = fused.language_model.model.layers[0]
    assert (
        layer.self_attn.fused
        and layer.mlp.fused
        and not plain.language_model.model.layers[0].self_attn.fused
    )
    assert fused.state_dict().keys() == plain.state_dict().keys()
    ids = torch.arange(12).view(1, -1)
    with torch.inference_mode():
        assert torch.equal(fused(ids), plain(ids))
    with torch.no_grad():
        for p in plain.parameters():
            p.add_(0.01 * torch.randn_like(p))
    fused.load_state_dict(plain.state_dict())
    with torch.inference_mode():
        assert torch.equal(fused(ids), plain(ids))
    fused.double(), plain.double()
    assert layer.self_attn.fused["q_proj", "k_proj", "v_proj"].weight.dtype == torch.float64
    with torch.inference_mode():  # float64 matmuls of another width may round apart
        torch.testing.assert_close(fused(ids), plain(ids), rtol=1e-12, atol=1e-12)


def test_fused_projections_step_aside_for_autograd(tiny_checkpoints):
    """With autograd on (finetuning) every Linear runs itself, so gradients reach its parameters."""
    model = load_model(tiny_checkpoints["g2"]).model
    model(torch.arange(6).view(1, -1)).sum().backward()
    attn = model.language_model.model.layers[0].self_attn
    assert attn.q_proj.weight.grad is not None and attn.v_proj.bias.grad is not None


@pytest.mark.slow
def test_the_benchmark_counts_a_token_at_7b_depth(tmp_path):
    from scripts.bench_decode_ops import main

    assert main(["--hidden", "56", "--json", str(tmp_path / "ops.json")]) == 0
    (row,) = json.loads((tmp_path / "ops.json").read_text())["rows"]
    assert (row["layers"], row["hyper_layers"], row["heads"]) == (28, 4, "28/4")
    assert 0 < row["ops_per_token"] <= 50 * 28 and row["top_ops"]
