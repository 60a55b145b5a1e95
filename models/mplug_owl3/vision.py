"""SigLIP vision tower (so400m-patch14) and the projector into the language model's width.

Only the part mPLUG-Owl3 uses is built: embeddings and the first `num_hidden_layers - 1` encoder
layers, because the model reads `hidden_states[-2]` (the residual stream after 26 of 27 layers). The
last layer, `post_layernorm` and the pooling head are never run, so they are not parameters here
(the loader skips their keys). Parameter names match HF's `SiglipVisionTransformer` under
`vision_model.`.

Speed without changing the result beyond float rounding:
- the residual stream is contiguous (N, P, C) from the patch embedding on (the conv's output read
  as patches-by-channels is a transposed view, and carried on, every layer norm would copy it again
  and every residual add would stride through memory);
- on CPU in float32 without autograd each linear is one oneDNN call with its bias and the GELU or
  the residual add done as the output is written (`fused_linear`); elsewhere the plain ops.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import Owl3Config, SiglipVisionConfig

# The widest activation (tokens x MLP width) one tower call may hold when the caller does not say:
# what 16 so400m frames make (16 x 729 x 4304, ~200 MB in float32). A small tower then runs
# thousands of frames per call instead of paying a call's fixed cost every 16 frames.
BATCH_ACTIVATION_ELEMENTS = 16 * 729 * 4304


def _onednn_linear():
    """oneDNN's linear with a fused epilogue (`mkldnn::_linear_pointwise`, the op torch's own CPU
    compiler emits), or None where this torch build has no oneDNN."""
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._linear_pointwise
    except (AttributeError, RuntimeError):
        return None


_ONEDNN_LINEAR = _onednn_linear()
# Below this many multiply-adds a oneDNN call costs more than its faster matmul saves (a tiny
# tower's linears): those take the plain ops.
ONEDNN_MIN_MACS = 1 << 25


def fused_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    gelu: str | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, then `F.gelu(approximate=gelu)` if `gelu` is given, or
    `residual +` it.

    On CPU in float32 without autograd, from `ONEDNN_MIN_MACS` multiply-adds, it is one oneDNN call
    that adds the bias and applies the GELU or the residual add while writing the output: one pass
    over the widest activations instead of three, and oneDNN's matmul where MKL's is slower (AMD
    CPUs). Elsewhere (GPU, autograd, other dtypes, small matmuls) the plain ops."""
    if (
        _ONEDNN_LINEAR is not None
        and x.device.type == "cpu"
        and x.dtype == weight.dtype == torch.float32
        and not torch.is_grad_enabled()
        and x.numel() * weight.shape[0] >= ONEDNN_MIN_MACS
    ):
        if residual is not None:
            return _ONEDNN_LINEAR.binary(x, residual, weight, bias, "add")
        if gelu is not None:
            return _ONEDNN_LINEAR(x, weight, bias, "gelu", [], gelu)
        return _ONEDNN_LINEAR(x, weight, bias, "none", [], "")
    y = F.linear(x, weight, bias)
    if gelu is not None:
        y = F.gelu(y, approximate=gelu)
    return y if residual is None else residual + y


def frames_per_batch(cfg: SiglipVisionConfig, budget: int = BATCH_ACTIVATION_ELEMENTS) -> int:
    """Frames per tower call whose widest activation stays within `budget` elements (at least 1)."""
    widest = cfg.num_patches * max(cfg.hidden_size, cfg.intermediate_size)
    return max(1, budget // widest)


class SiglipEmbeddings(nn.Module):
    def __init__(self, cfg: SiglipVisionConfig):
        super().__init__()
        self.patch_embedding = nn.Conv2d(
            cfg.num_channels, cfg.hidden_size, cfg.patch_size, stride=cfg.patch_size
        )
        self.position_embedding = nn.Embedding(cfg.num_patches, cfg.hidden_size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """(N, 3, S, S) -> (N, P, C), contiguous. The stride-14 conv without padding (384 and 378
        both give a 27x27 grid; 384 drops 6 pixels right/bottom) is computed as what it is, one
        matmul of each patch's pixels with the kernel: the output comes patches-by-channels
        directly, and a small batch pays no convolution set-up."""
        w = self.patch_embedding.weight  # (C, 3, p, p)
        n, ch, height, width = pixel_values.shape
        p = w.shape[-1]
        gh, gw = height // p, width // p
        x = pixel_values[:, :, : gh * p, : gw * p].to(w.dtype)
        patches = x.reshape(n, ch, gh, p, gw, p).permute(0, 2, 4, 1, 3, 5).reshape(n, gh * gw, -1)
        x = fused_linear(patches, w.flatten(1), self.patch_embedding.bias)  # patches row-major
        return x + self.position_embedding.weight


class SiglipAttention(nn.Module):
    def __init__(self, cfg: SiglipVisionConfig):
        super().__init__()
        c = cfg.hidden_size
        self.heads = cfg.num_attention_heads
        self.q_proj, self.k_proj = nn.Linear(c, c), nn.Linear(c, c)
        self.v_proj, self.out_proj = nn.Linear(c, c), nn.Linear(c, c)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + attention(x): the add is fused into the output projection."""
        n, p, c = x.shape
        q, k, v = (
            fused_linear(x, proj.weight, proj.bias).view(n, p, self.heads, -1).transpose(1, 2)
            for proj in (self.q_proj, self.k_proj, self.v_proj)
        )
        o = F.scaled_dot_product_attention(q, k, v)  # scale head_dim^-0.5, no mask
        o = o.transpose(1, 2).reshape(n, p, c)
        return fused_linear(o, self.out_proj.weight, self.out_proj.bias, residual=residual)


class SiglipMLP(nn.Module):
    def __init__(self, cfg: SiglipVisionConfig):
        super().__init__()
        if cfg.hidden_act != "gelu_pytorch_tanh":
            raise ValueError(
                f"vision hidden_act {cfg.hidden_act!r} is not supported (SigLIP uses "
                "gelu_pytorch_tanh)"
            )
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + MLP(x): the GELU is fused into fc1, the add into fc2."""
        h = fused_linear(x, self.fc1.weight, self.fc1.bias, gelu="tanh")
        return fused_linear(h, self.fc2.weight, self.fc2.bias, residual=residual)


class SiglipEncoderLayer(nn.Module):
    def __init__(self, cfg: SiglipVisionConfig):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.self_attn = SiglipAttention(cfg)
        self.layer_norm2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.mlp = SiglipMLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.self_attn(self.layer_norm1(x), residual=x)
        return self.mlp(self.layer_norm2(x), residual=x)


class SiglipEncoder(nn.Module):
    def __init__(self, cfg: SiglipVisionConfig):
        super().__init__()
        self.layers = nn.ModuleList(SiglipEncoderLayer(cfg) for _ in range(cfg.num_used_layers))


class SiglipVisionTower(nn.Module):
    """pixel_values (N, 3, S, S) -> features (N, P, 1152): the residual stream after all but the
    last layer."""

    def __init__(self, cfg: SiglipVisionConfig):
        super().__init__()
        self.config = cfg
        self.embeddings = SiglipEmbeddings(cfg)
        self.encoder = SiglipEncoder(cfg)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(pixel_values)
        for layer in self.encoder.layers:
            x = layer(x)
        return x


def build_projector(config: Owl3Config) -> nn.Module:
    """`vision2text_model`: Linear(1152, H) (G1 checkpoints) or Linear-GELU(erf)-Linear
    (7B-241101)."""
    c, h = config.vision.hidden_size, config.hidden_size
    if config.projector == "linear":
        return nn.Linear(c, h)
    return nn.Sequential(nn.Linear(c, h), nn.GELU(), nn.Linear(h, h))
