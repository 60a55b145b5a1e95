"""A tiny GPT-NeoX-style tokenizer, made offline with `tokenizers`, in the text model repository's
published form: byte-level BPE (GPT-2's split, NFC), `<|endoftext|>` (id 0) and `<|padding|>`
(id 1) before the BPE vocabulary, no post-processor adding tokens, and the settings files
(`tokenizer_config.json`, `special_tokens_map.json`) naming no pad token, as MPT's do. The tokens
open_flamingo adds are not in it: lvx adds them when it reads the folder, as the factory does."""

from __future__ import annotations

import json
import random
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

SPECIALS = ("<|endoftext|>", "<|padding|>")
_WORDS = (
    "the a video frame person man woman dog cat car red blue green walks runs sits holds opens "
    "what who where when why how many is are was does did in on at of to with and or not answer "
    "question short describe happens scene first last time image picture yes no A B C D letter"
).split()
_PUNCT = (".", "?", "!", ",", ":", "")


def _corpus(seed: int, n: int = 1500) -> list[str]:
    rnd = random.Random(seed)
    lines = []
    for _ in range(n):
        words = " ".join(rnd.choice(_WORDS) for _ in range(rnd.randint(3, 12)))
        lines.append(f"Question:{words}{rnd.choice(_PUNCT)} Short answer:{rnd.choice(_WORDS)}")
    return lines


def train_tiny_tokenizer(seed: int = 0, vocab_size: int = 500) -> Tokenizer:
    """Byte-level BPE over every byte (any text round-trips), in about 0.05 s."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=list(SPECIALS),
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    return tok


def write_tiny_tokenizer(directory: Path, seed: int = 0) -> Tokenizer:
    """`tokenizer.json` and its settings files into `directory`; returns the tokenizer."""
    tok = train_tiny_tokenizer(seed)
    tok.save(str(directory / "tokenizer.json"))
    special = {"bos_token": SPECIALS[0], "eos_token": SPECIALS[0], "unk_token": SPECIALS[0]}
    settings = {
        **special,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": True,
        "model_max_length": 2048,
        "tokenizer_class": "GPTNeoXTokenizer",
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(settings, indent=2) + "\n")
    (directory / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
    return tok
