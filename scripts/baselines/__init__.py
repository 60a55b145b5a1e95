"""The baselines LV-XAttn is measured against, for benchmarks and tests (the product never runs
them; scripts/baselines/engine.py installs them in the engine): Ring Attention (pass-KV) cross- and
causal self-attention, DeepSpeed-Ulysses and all-gather cross-attention."""

from scripts.baselines.allgather import allgather_xattn, allgather_xattn_with_lse
from scripts.baselines.ring import ring_self_attn, ring_xattn, ring_xattn_with_lse
from scripts.baselines.ulysses import ulysses_supported, ulysses_xattn

__all__ = [
    "allgather_xattn",
    "allgather_xattn_with_lse",
    "ring_self_attn",
    "ring_xattn",
    "ring_xattn_with_lse",
    "ulysses_supported",
    "ulysses_xattn",
]
