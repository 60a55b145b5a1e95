"""The published Llama-3.2-Vision sizes (reference mllama.md), so a plan can name a release by
what it is: the 11B is `MllamaConfig()`'s defaults, the 90B a wider, deeper text model with a
cross-attention layer every fifth from 3 and the same vision tower."""

from __future__ import annotations

from .config import MllamaConfig, MllamaTextConfig


def _90b() -> MllamaConfig:
    text = MllamaTextConfig(
        hidden_size=8192,
        num_hidden_layers=100,
        num_attention_heads=64,
        num_key_value_heads=8,
        intermediate_size=28672,
        cross_attention_layers=list(range(3, 100, 5)),
    )
    return MllamaConfig(text=text)


RELEASES: dict[str, MllamaConfig] = {
    "Llama-3.2-11B-Vision": MllamaConfig(),
    "Llama-3.2-90B-Vision": _90b(),
}
