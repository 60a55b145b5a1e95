"""Tiny random-weight mPLUG-Owl3 checkpoints in exactly the official Hugging Face layout, built in
well under a second.

`write_tiny_checkpoint(dir, generation)` writes what an official repo holds and the loader reads:
- `config.json`: the official keys and nesting (reference §4), tiny sizes;
- `model.safetensors` (or shards + `model.safetensors.index.json`): EVERY official key of the
  generation (§3), the unused vision keys included (last encoder layer, post_layernorm, pooling
  head), in bfloat16 like the real files;
- `tokenizer.json` + `vocab.json` + `merges.txt`: a Qwen2-style byte-level BPE (Qwen2 pre-tokenizer
  regex, NFC, byte-level decoder) trained with `tokenizers` on generated chat text; `<|endoftext|>`,
  `<|im_start|>`, `<|im_end|>` are added special tokens AFTER the BPE vocabulary, as in Qwen2 (so id
  0 is an ordinary token, which the official "drop id 0" decode relies on). `<|image|>` and the cut
  / video markers are plain text as in the real tokenizer (reference §5.1): they occur in the
  training text, so BPE gives them a few tokens, never one id;
- `tokenizer_config.json` (Qwen2-Instruct style) and `generation_config.json`;
- `processing_mplugowl3.py` and `image_processing_mplugowl3.py` stating the prompt rules of the
  release the form was published as (video span, cut beside videos, cut prompt; `prompt_rules.py`),
  in the form lvx reads them from a published checkpoint. They are settings, not a processor: lvx
  reads them as text and never runs them.

Tiny sizes: text hidden 64, 4 layers (2 hyper), 4 heads / 2 kv heads (head_dim 16); SigLIP hidden
32, 3 layers (2 used), patch 14 and image_size 28 (G2) / 30 (G1, like 384 it is not a multiple of
14: the conv drops the remainder) -> a 2x2 grid = 4 visual tokens per image. G1: linear projector,
`self_attn.gate`, tied embeddings (like 1B-241014). G1-gateproj: the same with the input-dependent
`self_attn.gate_proj.0.*` (like 7B-240728). G2: MLP projector, untied (like 7B-241101). Everything
derives from the config.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Literal

import torch
from safetensors.torch import save_file
from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    trainers,
)

from .checkpoint import LM, official_shapes
from .config import FORMS, Owl3Config, SiglipVisionConfig, split_form
from .prompt_rules import IMAGE_PROCESSING_FILE, PROCESSING_FILE, PromptRules, published_rules

# Qwen2's pre-tokenizer split (from its tokenizer.json).
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
    r"\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
MARKERS = (
    "<|image|>",
    "<|video|>",
    "<|start_cut|>",
    "<|end_cut|>",
    "<|start_video_frame|>",
    "<|end_video_frame|>",
)

_WORDS = (
    "the a video frame person man woman dog cat car red blue green walks runs sits holds opens "
    "what who where when why how many is are was does did in on at of to with and or not answer "
    "question option best describe happens scene first last time second minute hour image picture "
    "global view cut rows columns subimg system user assistant yes no A B C D please letter only"
).split()
_UNICODE = ("é", "ü", "ß", "中文", "日本", "☃", "→", "😀", "Ω", "ñ")


def _corpus(seed: int, n: int = 1500) -> list[str]:
    rnd = random.Random(seed)
    lines = []
    for _ in range(n):
        words = [rnd.choice(_WORDS) for _ in range(rnd.randint(3, 12))]
        if rnd.random() < 0.3:
            words.insert(rnd.randrange(len(words)), rnd.choice(_UNICODE))
        if rnd.random() < 0.3:
            words.insert(rnd.randrange(len(words)), str(rnd.randint(0, 9999)))
        text = " ".join(words) + rnd.choice([".", "?", "!", ",", ":", ""])
        r = rnd.random()
        if r < 0.25:
            text = rnd.choice(MARKERS) + text
        elif r < 0.4:
            rows, cols = rnd.randint(1, 4), rnd.randint(1, 4)
            text = f"<|start_cut|>{rows}*{cols}\n<|image|> <|image|>\n<|image|><|end_cut|>{text}"
        elif r < 0.5:
            text = (
                f"Cut to {rnd.randint(1, 4)} rows {rnd.randint(1, 4)} columns with a global "
                "view\nsubimg(0,1)" + text
            )
        elif r < 0.6:
            text = "<|start_video_frame|><|image|><|image|><|end_video_frame|>" + text
        if rnd.random() < 0.3:
            text = f"<|im_start|>{rnd.choice(['system', 'user', 'assistant'])}\n{text}<|im_end|>\n"
        lines.append(text)
    return lines


def train_tiny_tokenizer(seed: int = 0, vocab_size: int = 600) -> Tokenizer:
    """A Qwen2-style byte-level BPE (all 256 bytes in the alphabet, so any text round-trips), ~0.05
    s."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.post_processor = None
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    return tok


def tiny_config(
    form: str = "g2",
    vocab_size: int = 640,
    *,
    bos_token_id: int = 0,
    eos_token_id: int = 0,
    tie_word_embeddings: bool | None = None,
    projector: Literal["linear", "mlp"] | None = None,
) -> Owl3Config:
    """Tiny sizes for a checkpoint generation label (`config.FORMS`: "g1-gateproj", "g1" or
    "g2")."""
    generation, gate_form = split_form(form)
    g1 = generation == "g1"
    return Owl3Config(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=g1 if tie_word_embeddings is None else tie_word_embeddings,
        hyper_layers=[1, 3] if g1 else [2, 4],
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        vision=SiglipVisionConfig(
            hidden_size=32,
            image_size=30 if g1 else 28,
            intermediate_size=64,
            num_attention_heads=2,
            num_hidden_layers=3,
            patch_size=14,
        ),
        generation=generation,
        projector=projector or ("linear" if g1 else "mlp"),
        gate_form=gate_form,
        extra={"sliding_window": 32768 if g1 else 131072},
    )


def random_weights(
    cfg: Owl3Config, seed: int = 0, dtype: torch.dtype = torch.bfloat16
) -> dict[str, torch.Tensor]:
    """Every official key with a random tensor: N(0, 0.02) matrices, N(0, 0.02) biases, norms ~ 1 +
    N(0, 0.1), the G1 gate and gate_proj ~ N(0, 1) (so both the text and the visual path matter, and
    for gate_proj the gate depends on the token)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for key, shape in official_shapes(cfg).items():
        if "norm" in key and key.endswith("weight"):
            t = 1.0 + 0.1 * torch.randn(shape, generator=g)
        elif key.endswith(".gate") or ".gate_proj.0." in key:
            t = torch.randn(shape, generator=g)
        elif key.endswith("position_embedding.weight") or key.endswith("probe"):
            t = 0.5 * torch.randn(shape, generator=g)
        else:
            t = 0.02 * torch.randn(shape, generator=g)
        out[key] = t.to(dtype).contiguous()
    return out


WORD = re.compile(r" [A-Za-z]{2,}")  # a token that shows as a word after a space
WORD_GAIN = 4.0  # how much louder a word's output row is than the others


def favour_words(weights: dict[str, torch.Tensor], tok: Tokenizer, cfg: Owl3Config) -> None:
    """Make the output rows of word tokens louder, so that greedy decoding of the random weights
    writes visible words instead of newlines, control bytes or halves of a UTF-8 character (the
    answers stay gibberish, but a user sees that text came out)."""
    key = f"{LM}lm_head.weight"
    if cfg.tie_word_embeddings:
        key = f"{LM}model.embed_tokens.weight"
    rows = weights[key]
    for token, i in tok.get_vocab(with_added_tokens=False).items():
        if WORD.fullmatch(tok.decode([i])):
            rows[i] = (rows[i].float() * WORD_GAIN).to(rows.dtype)


def _tokenizer_config(tok: Tokenizer) -> dict:
    return {
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(tok.token_to_id(t)): {
                "content": t,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for t in SPECIALS
        },
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None,
        "chat_template": (
            "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
            "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
        ),
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 32768,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


_SETTINGS_HEADER = (
    "# Processor settings of a tiny random-weight mPLUG-Owl3 checkpoint, stated as a published\n"
    "# checkpoint's processor files state them. lvx reads this file as text; it is never run.\n"
)


def processor_files(rules: PromptRules) -> dict[str, str]:
    """{file name: text} of the two processor files that state `rules` (what lvx reads back)."""
    cut_off = "    if videos:\n        cut_enable = False\n" if not rules.cut_beside_video else ""
    processing = (
        f"{_SETTINGS_HEADER}\n\n"
        "def media_entries(videos, images, cut_enable=True):\n"
        f"{cut_off}"
        f'    video = {{"type": "video", "use_video_span": {rules.video_span}}}\n'
        '    image = dict(type="image", cut_enable=cut_enable)\n'
        "    return [video] * len(videos) + [image] * len(images)\n"
    )
    prompt, _, scope = rules.cut_template.partition("_")
    image_processing = (
        f"{_SETTINGS_HEADER}\n"
        f'CUT_CFG = {{"anchors": "grid_squ_6", "cut_prompt": "{prompt}", '
        f'"add_global": {scope == "global"}}}\n'
    )
    return {PROCESSING_FILE: processing, IMAGE_PROCESSING_FILE: image_processing}


def write_tiny_checkpoint(
    directory: str | Path,
    generation: str = "g2",
    seed: int = 0,
    *,
    shards: int = 1,
    dtype: torch.dtype = torch.bfloat16,
    tie_word_embeddings: bool | None = None,
    projector: Literal["linear", "mlp"] | None = None,
) -> Path:
    # long: the official layout's files, written in one place
    """Write a random-weight checkpoint of `generation` ("g1-gateproj", "g1" or "g2") into
    `directory`.

    `shards > 1` splits the weights over `model-0000k-of-0000n.safetensors` with a
    `model.safetensors.index.json`, as HF does for large checkpoints. Deterministic for a given
    seed. Returns the directory.
    """
    if generation not in FORMS:
        raise ValueError(f"generation must be one of {', '.join(FORMS)}, not {generation!r}")
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)

    tok = train_tiny_tokenizer(seed)
    n_tok = tok.get_vocab_size(with_added_tokens=True)
    cfg = tiny_config(
        generation,
        vocab_size=(n_tok + 64) // 64 * 64,  # padded like the real 151851 > 151646
        bos_token_id=tok.token_to_id("<|endoftext|>"),
        eos_token_id=tok.token_to_id("<|im_end|>"),
        tie_word_embeddings=tie_word_embeddings,
        projector=projector,
    )
    cfg.to_json(d / "config.json")
    tok.save(str(d / "tokenizer.json"))
    tok.model.save(str(d))  # vocab.json, merges.txt
    (d / "tokenizer_config.json").write_text(json.dumps(_tokenizer_config(tok), indent=2) + "\n")
    gen = {
        "bos_token_id": cfg.bos_token_id,
        "do_sample": True,
        "eos_token_id": [cfg.eos_token_id, cfg.bos_token_id],
        "pad_token_id": cfg.bos_token_id,
        "repetition_penalty": 1.05,
        "temperature": 0.7,
        "top_k": 20,
        "top_p": 0.8,
        "max_new_tokens": 32,  # random weights: a short answer shows the pipeline runs
        "transformers_version": "4.41.2",
    }
    (d / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    for name, text in processor_files(published_rules(generation)).items():
        (d / name).write_text(text)

    weights = random_weights(cfg, seed, dtype)
    favour_words(weights, tok, cfg)
    meta = {"format": "pt"}
    for old in list(d.glob("model*.safetensors")) + list(d.glob("model.safetensors.index.json")):
        old.unlink()
    if shards <= 1:
        save_file(weights, str(d / "model.safetensors"), metadata=meta)
    else:
        keys = list(weights)
        per = -(-len(keys) // shards)
        weight_map, total = {}, 0
        for s in range(shards):
            name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            part = {k: weights[k] for k in keys[s * per : (s + 1) * per]}
            save_file(part, str(d / name), metadata=meta)
            weight_map.update({k: name for k in part})
            total += sum(t.numel() * t.element_size() for t in part.values())
        (d / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
            + "\n"
        )
    return d
