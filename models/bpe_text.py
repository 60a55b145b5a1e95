"""Text <-> ids through a `tokenizers` byte-level BPE, as the families whose checkpoints ship a
tokenizer.json read it: special tokens written in template text are single ids; text a user wrote
(`encode_text`) is plain text, a special token typed in it included."""

from __future__ import annotations

from typing import Iterable

from tokenizers import Tokenizer

from .valid_text import valid_text


class BpeText:
    """The text half a family's tokenizer shares: `tok` encodes templates, a copy that splits
    special tokens as text encodes what a user wrote."""

    def __init__(self, tokenizer: Tokenizer):
        self.tok = tokenizer
        self._text_tok = Tokenizer.from_str(tokenizer.to_str())  # special tokens split as text
        self._text_tok.encode_special_tokens = True

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(valid_text(text), add_special_tokens=False).ids if text else []

    def encode_text(self, text: str) -> list[int]:
        """`text` as plain text: a special token written in it is split like any other text."""
        if not text:
            return []
        return self._text_tok.encode(valid_text(text), add_special_tokens=False).ids

    def longest_token_bytes(self) -> int:
        """The most UTF-8 bytes one token stands for (byte-level BPE: a character a byte; an added
        token stands for its own text)."""
        added = {t.content for t in self.tok.get_added_tokens_decoder().values()}
        vocab = self.tok.get_vocab(with_added_tokens=True)
        return max(len(t.encode()) if t in added else len(t) for t in vocab)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)
