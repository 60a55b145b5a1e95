"""The released OpenFlamingo sizes (open_flamingo's model zoo), so a plan can name a release by what
it is: the CLIP ViT-L/14 tower (`openai` weights), the perceiver and cross layers at open_flamingo's
defaults, and the MPT language model's published config.json:

- `OpenFlamingo-3B-vitl-mpt1b`: `anas-awadalla/mpt-1b-redpajama-200b` (`mosaic_gpt`: d_model 2048,
  16 heads, 24 layers, mlp_ratio 4, ALiBi with bias max 8, QK LayerNorm, no biases, max_seq_len
  2048), a cross layer before every block (`cross_attn_every_n_layers=1`).
- `OpenFlamingo-9B-vitl-mpt7b`: `mosaicml/mpt-7b` (`mpt`: d_model 4096, 32 heads, 32 layers,
  expansion_ratio 4, ALiBi with bias max 8, no QK LayerNorm, no biases, max_seq_len 2048), a cross
  layer before every fourth block (`cross_attn_every_n_layers=4`).

Both tie the head to `wte`, whose rows open_flamingo resizes to its tokenizer (GPT-NeoX's 50,277
tokens and the `<|endofchunk|>`, `<image>` and `<PAD>` it adds).
"""

from __future__ import annotations

from .config import MptConfig, OpenFlamingoConfig


def _3b() -> OpenFlamingoConfig:
    return OpenFlamingoConfig(cross_attn_every_n_layers=1)


def _9b() -> OpenFlamingoConfig:
    text = MptConfig(d_model=4096, n_heads=32, n_layers=32, qk_ln=False)
    return OpenFlamingoConfig(text=text, cross_attn_every_n_layers=4)


RELEASES: dict[str, OpenFlamingoConfig] = {
    "OpenFlamingo-3B-vitl-mpt1b": _3b(),
    "OpenFlamingo-9B-vitl-mpt7b": _9b(),
}
