"""Llama 3's tokenizer as the published `tokenizer.json` holds it (byte-level BPE, 256 special
tokens after the BPE vocabulary, `<|image|>` right after them), read with `tokenizers`."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer

from ..bpe_text import BpeText

IMAGE = "<|image|>"
BOS = "<|begin_of_text|>"
EOT = "<|eot_id|>"
# Llama 3's special tokens by offset from the first special id (the rest are reserved).
NAMED_SPECIALS = {
    0: BOS,
    1: "<|end_of_text|>",
    4: "<|finetune_right_pad_id|>",
    6: "<|start_header_id|>",
    7: "<|end_header_id|>",
    8: "<|eom_id|>",
    9: "<|eot_id|>",
    10: "<|python_tag|>",
}
RESERVED_BEFORE = {2: 0, 3: 1, 5: 2}  # offset -> reserved number, below offset 11


def special_tokens() -> list[str]:
    """The 256 special tokens in id order, then `<|image|>` (id 128256 in the published files)."""
    out = []
    for i in range(256):
        if i in NAMED_SPECIALS:
            out.append(NAMED_SPECIALS[i])
        else:
            n = RESERVED_BEFORE.get(i, i - 8)
            out.append(f"<|reserved_special_token_{n}|>")
    return out + [IMAGE]


class MllamaTokenizer(BpeText):
    """Text <-> ids. Special tokens written in the text are single ids (as the published
    tokenizer's added tokens are); nothing is added around the text (the chat template writes the
    `<|begin_of_text|>`)."""

    def __init__(self, tokenizer: Tokenizer):
        super().__init__(tokenizer)
        self.image_id = self._id(IMAGE)
        self.bos_id = self._id(BOS)
        self.eot_id = self._id(EOT)
        self.stop_ids = frozenset(
            self._id(t) for t in ("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>")
        )

    @classmethod
    def from_pretrained(cls, directory: str | Path) -> "MllamaTokenizer":
        return cls(Tokenizer.from_file(str(Path(directory) / "tokenizer.json")))

    def _id(self, token: str) -> int:
        i = self.tok.token_to_id(token)
        if i is None:
            raise ValueError(
                f"the tokenizer has no {token} token: not a Llama-3.2-Vision tokenizer"
            )
        return i
