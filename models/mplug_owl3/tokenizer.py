"""Qwen2 byte-level BPE tokenizer of mPLUG-Owl3, read from the checkpoint's `tokenizer.json` with
`tokenizers`.

No transformers needed. Specials (reference mplug_owl3.md §5.1): `<|endoftext|>`, `<|im_start|>`,
`<|im_end|>` are added tokens (single ids). `<|image|>`, `<|video|>` and the cut / video-frame
markers are plain text: BPE splits them into a few ordinary tokens, and nothing here assumes how
many.

Control tokens come only from the chat template (`Control` pieces); text a user wrote is encoded by
`encode_text`, where `<|im_end|>` typed into a question is the text it looks like, so no question,
subtitle line or system prompt can open or close a turn.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

from tokenizers import Tokenizer

from ..detokenize import StreamDecoder
from ..valid_text import valid_text


class Control(str):
    """A control token placed by the chat template: encoded as its one id, whereas the same
    characters in a text piece are encoded as text."""


IM_START = Control("<|im_start|>")
IM_END = Control("<|im_end|>")
ENDOFTEXT = Control("<|endoftext|>")


class Owl3Tokenizer:
    """Thin wrapper: `encode(text) -> ids` exactly as the official `tokenizer(text).input_ids`
    (Qwen2 adds no BOS)."""

    def __init__(self, tokenizer: Tokenizer):
        self.tk = tokenizer
        self._text_tk = Tokenizer.from_str(tokenizer.to_str())  # special tokens split as text
        self._text_tk.encode_special_tokens = True
        missing = [t for t in (ENDOFTEXT, IM_START, IM_END) if tokenizer.token_to_id(t) is None]
        if missing:
            raise ValueError(
                f"tokenizer has no {missing[0]} token: not a Qwen2 / mPLUG-Owl3 tokenizer.json"
            )
        self.endoftext_id = tokenizer.token_to_id(ENDOFTEXT)
        self.im_start_id = tokenizer.token_to_id(IM_START)
        self.im_end_id = tokenizer.token_to_id(IM_END)

    @classmethod
    def from_file(cls, path: str | Path) -> "Owl3Tokenizer":
        return cls(Tokenizer.from_file(str(path)))

    @classmethod
    def from_pretrained(cls, directory: str | Path) -> "Owl3Tokenizer":
        return cls.from_file(Path(directory) / "tokenizer.json")

    def __len__(self) -> int:
        """Number of token ids the tokenizer can produce (BPE vocab + added tokens)."""
        return self.tk.get_vocab_size(with_added_tokens=True)

    @property
    def stop_ids(self) -> tuple[int, int]:
        """Generation stops at either (the official generate passes both as eos_token_id)."""
        return (self.im_end_id, self.endoftext_id)

    @property
    def special_ids(self) -> frozenset[int]:
        return frozenset(i for i, t in self.tk.get_added_tokens_decoder().items() if t.special)

    def longest_token_bytes(self) -> int:
        """The most UTF-8 bytes one token stands for: byte-level BPE spells each byte as one
        character of its vocabulary; an added token stands for its own text."""
        added = {t.content for t in self.tk.get_added_tokens_decoder().values()}
        vocab = self.tk.get_vocab(with_added_tokens=True)
        return max(len(t.encode()) if t in added else len(t) for t in vocab)

    def encode(self, text: str) -> list[int]:
        """As the official `tokenizer(text).input_ids`: control tokens written in `text` become
        their ids. For template text only; what a user wrote goes through `encode_text`."""
        return self.tk.encode(valid_text(text), add_special_tokens=False).ids if text else []

    def encode_text(self, text: str) -> list[int]:
        """`text` as plain text: a control token written in it is split like any other text.
        Equal to `encode` for text without control tokens."""
        return self._text_tk.encode(valid_text(text), add_special_tokens=False).ids if text else []

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.tk.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.tk.token_to_id(token)

    def decode_answer(self, ids: Iterable[int]) -> str:
        """The official answer decoding: drop id 0 (pad), drop one trailing terminator, decode,
        strip."""
        ids = [int(i) for i in ids if int(i) != 0]
        if ids and ids[-1] in self.stop_ids:
            ids = ids[:-1]
        return self.decode(ids).strip()

    def stream(self, skip_special_tokens: bool = True) -> StreamDecoder:
        return StreamDecoder(self, skip_special_tokens=skip_special_tokens)
