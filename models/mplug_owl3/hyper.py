"""Hyper attention: the Qwen2 layers that also attend to the visual tokens (reference mplug_owl3.md
§2).

Visual tokens never enter the text sequence. A hyper layer l uses the same RoPE'd query as its
self-attention and attends to visual keys/values made from the projector output E (N frames x P=729
tokens x H):

    kv_l = v_kv_proj_l(RMSNorm(E; input_layernorm_l.weight)),  split head-major (kv_head, {K, V}, d)
    K_l gets MI-RoPE: every token of frame j is rotated at the same position p_j; V is not rotated.

Per generation:
  - G2 (7B-241101): p_j = start_j; token t sees frame j iff t >= start_j. The output is ONE softmax
    over [visual keys; text keys], computed here exactly as text attention (out, lse) merged with
    visual attention (out, lse) by log-sum-exp.
  - G1 (240728, 241014): p_j = start_j + 1; token t sees frame j iff start_j < t. Text
    self-attention C_sa and visual cross-attention C_ca (per head, before o_proj) are mixed as (1 -
    g) * C_sa + g * C_ca, only on rows that see at least one frame. The gate g has two forms, picked
    by the checkpoint keys (`config.gate_form`): "proj" (official 7B-240728 code): g =
    sigmoid(C_sa[.., h, :] @ W.T + b), `gate_proj = Sequential(Linear(hd, hd), Sigmoid())`, the same
    Linear for every head, so g depends on the token; "channel" (241014): a constant g =
    sigmoid(gate), one value per channel of the hidden size. Either needs only the row's own C_sa,
    so a rank mixes its query rows without any communication, in prefill, decoding and training
    alike.

start_j is the token index where frame j's `<|image|>` placeholder begins (`media_starts`). Visible
frames always form a prefix 0..q_vis-1, so a query carries one integer q_vis and a visual key its
frame index k_frame; the attention kernels mask with `k_frame < q_vis`. A decode token comes after
every placeholder, so it sees all frames.
"""

from __future__ import annotations

import torch
from torch import nn

from lvx_kernels.masks import Indices, device_tensor
from lvx_kernels.merge import merge_seen

from ..steps import VisualStep
from .config import VISUAL_KV_CHUNK_BYTES, Owl3Config  # the chunk: tests set it smaller here
from .layers import apply_rope, rms_norm, rope_cos_sin
from .qwen2 import Qwen2Attention, StepContext


def frame_rope_positions(media_starts: torch.Tensor, generation: str) -> torch.Tensor:
    """MI-RoPE position of each frame's keys: G2 start_j, G1 start_j + 1."""
    return media_starts if generation == "g2" else media_starts + 1


def visible_frames(
    token_positions: torch.Tensor, media_starts: torch.Tensor, generation: str
) -> torch.Tensor:
    """q_vis per token (same shape as token_positions, int64): how many frames (a prefix) the token
    sees.

    G2: #{j : t >= start_j};  G1: #{j : start_j < t}.  `media_starts` must be sorted ascending
    (placeholder order).
    """
    starts = media_starts.to(token_positions.device, torch.int64).contiguous()
    flat = token_positions.reshape(-1).to(torch.int64).contiguous()
    q_vis = torch.searchsorted(starts, flat, right=(generation == "g2"))
    return q_vis.view(token_positions.shape)


def split_kv(
    kv: torch.Tensor, num_kv_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """v_kv_proj output (..., 2*n_kv*hd) -> k, v (..., n_kv, hd), head-major layout (kv_head, {K,
    V}, d).

    Columns h*2hd .. h*2hd+hd-1 are K of kv head h, the next hd columns its V (never "first half
    K").
    """
    kv = kv.unflatten(-1, (num_kv_heads, 2, head_dim))
    return kv[..., 0, :], kv[..., 1, :]


def visual_kv(
    e: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    v_kv_proj: nn.Linear,
    frame_positions: torch.Tensor,
    num_kv_heads: int,
    head_dim: int,
    theta: float,
):
    """Visual K/V of one hyper layer from E (N, P, H): each (1, N*P, n_kv, hd), K MI-RoPE'd (fp32)
    at its frame's position. Frames are flattened frame-major, patch-minor.

    Without autograd the frames go through in chunks of about `VISUAL_KV_CHUNK_BYTES` of float32
    work, written into K and V buffers of their own: the float32 copies of E and the projection's (K
    | V) output exist for one
    chunk at a time, and V is not a view that keeps the whole projection alive (an hour of video on
    one GPU)."""
    n, p, h = e.shape

    def project(chunk: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # (n', P, n_kv, hd)
        k, v = split_kv(v_kv_proj(rms_norm(chunk, norm_weight, eps)), num_kv_heads, head_dim)
        cos, sin = rope_cos_sin(
            positions.to(e.device).view(-1, 1).expand(-1, p), head_dim, theta, e.dtype
        )
        return apply_rope(k, cos, sin, fp32=True), v

    if (
        torch.is_grad_enabled()
    ):  # finetuning recomputes K/V under autograd: one pass, as the backward needs it all
        k, v = project(e, frame_positions)
        return k.reshape(1, n * p, num_kv_heads, head_dim), v.reshape(
            1, n * p, num_kv_heads, head_dim
        )
    # rms_norm holds two float32 copies of a chunk
    step = max(1, VISUAL_KV_CHUNK_BYTES // (p * h * 8))
    # rms_norm's output, the projection's input and output
    dtype = torch.promote_types(norm_weight.dtype, e.dtype)
    k_out = torch.empty(n, p, num_kv_heads, head_dim, dtype=dtype, device=e.device)
    v_out = torch.empty_like(k_out)
    for i in range(0, n, step):
        k_out[i : i + step], v_out[i : i + step] = project(
            e[i : i + step], frame_positions[i : i + step]
        )
    return k_out.view(1, n * p, num_kv_heads, head_dim), v_out.view(
        1, n * p, num_kv_heads, head_dim
    )


class HyperAttention(Qwen2Attention):
    """Qwen2 self-attention plus visual cross-attention (`v_kv_proj`, and `gate` or `gate_proj` for
    G1)."""

    def __init__(self, config: Owl3Config, layer_idx: int):
        super().__init__(config, layer_idx)
        self.generation = config.generation
        self.v_kv_proj = nn.Linear(config.hidden_size, 2 * self.num_kv_heads * self.head_dim)
        if config.generation == "g1" and config.gate_form == "proj":
            self.gate_proj = nn.Sequential(nn.Linear(self.head_dim, self.head_dim), nn.Sigmoid())
        elif config.generation == "g1":
            self.gate = nn.Parameter(torch.zeros(config.hidden_size))

    def g1_gate(self, c_sa: torch.Tensor, ct: torch.dtype) -> torch.Tensor:
        """The G1 gate in dtype `ct`: per token and head from C_sa (B, L, nh, hd) for "proj", else
        (nh, hd)."""
        if hasattr(self, "gate_proj"):
            return self.gate_proj(c_sa.to(self.gate_proj[0].weight.dtype)).to(ct)
        return torch.sigmoid(self.gate.to(ct)).view(self.num_heads, self.head_dim)

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        q, k, v = self.project(x, ctx)
        out, lse = ctx.hooks.text(q, k, v, ctx, self.layer_idx)
        vis: VisualStep | None = ctx.visual
        if vis is not None:
            out_v, lse_v = ctx.hooks.visual(q, ctx, self.layer_idx)
            if self.generation == "g2":  # one softmax over [visual; text] == their LSE merge
                out = merge_seen(out, lse, out_v, lse_v)
            else:  # gate mix before o_proj, only where at least one frame is visible
                out = self._g1_mix(out, out_v, vis.q_vis)
        return self.output(out, x)  # (B, L, hidden), L may be 0

    def _g1_mix(self, out: torch.Tensor, out_v: torch.Tensor, q_vis) -> torch.Tensor:
        """(1 - g) * C_sa + g * C_ca on the rows that see a frame, C_sa elsewhere (float32)."""
        ct = torch.promote_types(out.dtype, torch.float32)
        g = self.g1_gate(out, ct)
        out = out.to(ct)
        mixed = (1 - g) * out + g * out_v.to(ct)
        if isinstance(q_vis, Indices) and q_vis.low is not None and q_vis.low > 0:
            return mixed  # every row sees a frame (a decoded token sees them all)
        seen = device_tensor(q_vis) > 0
        return torch.where(seen[..., None, None], mixed, out)
