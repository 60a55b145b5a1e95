"""Tiny random-weight Llama-3.2-Vision checkpoints in the published layout, built in about a
second: `config.json` (the published keys and nesting), `model.safetensors` (every published key,
bfloat16 like the real files), `tokenizer.json` (a Llama-3-style byte-level BPE trained on
generated text, its 256 special tokens after the BPE vocabulary and `<|image|>` after them, as
published), `tokenizer_config.json` and `chat_template.json` (the published template's user turn),
`preprocessor_config.json` and `generation_config.json`.

Tiny sizes: vision hidden 32, 4 local + 2 global layers, 4 heads, tiles of 28 pixels with patch 14
(5 tokens a tile), up to 4 tiles; local outputs 1 and 3 concatenated (96 features); text hidden
64, 5 layers (cross-attention at 1 and 3), 4 heads / 2 K/V heads, llama3 RoPE.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    pre_tokenizers,
    processors,
    trainers,
)

from .checkpoint import published_shapes
from .config import LLAMA3_ROPE, MllamaConfig, MllamaTextConfig, MllamaVisionConfig
from .tokenizer import BOS, IMAGE, special_tokens

LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
    r"\s*[\r\n]+|\s+(?!\S)|\s+"
)
_WORDS = (
    "the a video frame person man woman dog cat car red blue green walks runs sits holds opens "
    "what who where when why how many is are was does did in on at of to with and or not answer "
    "question describe happens scene first last time image picture yes no A B C D letter only"
).split()
CHAT_TEMPLATE = (
    "{{- bos_token }}{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}{%- else %}"
    "{%- for content in message['content'] %}{%- if content['type'] == 'image' %}"
    "{{- '<|image|>' }}{%- elif content['type'] == 'text' %}{{- content['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}{{- '<|eot_id|>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}"
)


def train_tiny_tokenizer(seed: int = 0, vocab_size: int = 500) -> Tokenizer:
    rnd = random.Random(seed)
    lines = [" ".join(rnd.choice(_WORDS) for _ in range(rnd.randint(3, 12))) for _ in range(1500)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel(add_prefix_space=True, trim_offsets=True, use_regex=True)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(lines, trainer=trainer)
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in special_tokens()]
    )
    bos = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B:1", special_tokens=[(BOS, bos)]
    )
    return tok


def tiny_config(first_special: int, max_tiles: int = 4) -> MllamaConfig:
    """The tiny sizes around a tokenizer whose special tokens start at `first_special`."""
    ratios = [list(r) for r in _ratios(max_tiles)]
    vision = MllamaVisionConfig(
        hidden_size=32,
        num_hidden_layers=4,
        num_global_layers=2,
        attention_heads=4,
        intermediate_size=64,
        vision_output_dim=96,
        image_size=28,
        patch_size=14,
        max_num_tiles=max_tiles,
        intermediate_layers_indices=[1, 3],
        supported_aspect_ratios=ratios,
    )
    text = MllamaTextConfig(
        vocab_size=first_special + 256,
        hidden_size=64,
        num_hidden_layers=5,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        rope_scaling=dict(LLAMA3_ROPE),
        cross_attention_layers=[1, 3],
        bos_token_id=first_special,
        eos_token_id=[first_special + 1, first_special + 8, first_special + 9],
        pad_token_id=first_special + 4,
    )
    return MllamaConfig(vision, text, image_token_index=first_special + 256)


def _ratios(max_tiles: int) -> list[tuple[int, int]]:
    n = range(1, max_tiles + 1)
    return [(a, b) for a in n for b in n if a * b <= max_tiles]


def random_weights(cfg: MllamaConfig, seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every published key: matrices N(0, 0.05), norms 1 + N(0, 0.1), every gate N(0, 1) (so the
    visual path, the tile embeddings and the gated layers all matter), position tables N(0, 0.5)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for key, shape in published_shapes(cfg).items():
        if ("norm" in key or "layernorm" in key) and key.endswith("weight"):
            t = 1.0 + 0.1 * torch.randn(shape, generator=g)
        elif "gate" in key.rsplit(".", 1)[-1] and "proj" not in key:
            t = torch.randn(shape, generator=g)
        elif "embedding" in key or key.endswith("class_embedding"):
            t = 0.5 * torch.randn(shape, generator=g)
        else:
            t = 0.05 * torch.randn(shape, generator=g)
        out[key] = t.to(dtype).contiguous()
    return out


def _tokenizer_config(tok: Tokenizer) -> dict:
    added = {
        str(tok.token_to_id(t)): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t in special_tokens()
    }
    return {
        "added_tokens_decoder": added,
        "bos_token": BOS,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": True,
        "eos_token": "<|eot_id|>",
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": 131072,
        "pad_token": "<|finetune_right_pad_id|>",
        "tokenizer_class": "PreTrainedTokenizerFast",
    }


def write_tiny_checkpoint(
    directory: str | Path, seed: int = 0, *, dtype: torch.dtype = torch.bfloat16, max_tiles: int = 4
) -> Path:
    """Write the checkpoint into `directory` (deterministic for a seed) and return it."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    tok = train_tiny_tokenizer(seed)
    cfg = tiny_config(tok.token_to_id(BOS), max_tiles)
    assert tok.token_to_id(IMAGE) == cfg.image_token_index
    (d / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps(_tokenizer_config(tok), indent=2) + "\n")
    (d / "chat_template.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}) + "\n")
    pre = {
        "do_convert_rgb": True,
        "do_normalize": True,
        "do_pad": True,
        "do_rescale": True,
        "do_resize": True,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_processor_type": "MllamaImageProcessor",
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "max_image_tiles": max_tiles,
        "processor_class": "MllamaProcessor",
        "resample": 2,
        "rescale_factor": 1 / 255,
        "size": {"height": cfg.vision.image_size, "width": cfg.vision.image_size},
    }
    (d / "preprocessor_config.json").write_text(json.dumps(pre, indent=2) + "\n")
    gen = {
        "bos_token_id": cfg.text.bos_token_id,
        "eos_token_id": cfg.text.eos_token_id,
        "pad_token_id": cfg.text.pad_token_id,
        "do_sample": True,
        "temperature": 0.6,
        "top_p": 0.9,
        "max_new_tokens": 32,  # random weights: a short answer shows the pipeline runs
    }
    (d / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    save_file(random_weights(cfg, seed, dtype), str(d / "model.safetensors"), {"format": "pt"})
    return d
