"""The baselines LV-XAttn is measured against (benchmarks and tests only; the product never runs them):
Ring Attention (pass-KV) cross- and causal self-attention, DeepSpeed-Ulysses and all-gather cross-attention."""

from lvx_app.attention.baselines.allgather import allgather_xattn
from lvx_app.attention.baselines.ring import ring_self_attn, ring_xattn
from lvx_app.attention.baselines.ulysses import ulysses_supported, ulysses_xattn

__all__ = ["allgather_xattn", "ring_self_attn", "ring_xattn", "ulysses_supported", "ulysses_xattn"]
