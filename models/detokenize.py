"""Streaming detokenization every family's processor uses: the text of an answer as it grows,
token by token, without a broken character."""

from __future__ import annotations

from typing import Iterable, Protocol


class Detokenizer(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class StreamDecoder:
    """Incremental detokenisation for streaming: `push(id)` returns the text that became final.

    Works for any tokenizer that decodes a list of ids (every family's). Byte-level BPE tokens can
    end in the middle of a UTF-8 character; decoding such a prefix gives U+FFFD. We hold text back
    while the decoded tail ends in U+FFFD, and only re-decode a short window of recent tokens (the
    prefix/read offsets scheme), so a long answer costs O(1) per token.
    """

    def __init__(self, tokenizer: Detokenizer, skip_special_tokens: bool = True):
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.prefix = 0  # window start: text of ids[prefix:read] has already been emitted
        self.read = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=self.skip)

    def push(self, token_ids: int | Iterable[int]) -> str:
        self.ids.extend(
            [int(token_ids)] if isinstance(token_ids, int) else [int(t) for t in token_ids]
        )
        done = self._decode(self.ids[self.prefix : self.read])
        full = self._decode(self.ids[self.prefix :])
        if len(full) > len(done) and not full.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return full[len(done) :]
        return ""

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the very end decodes as
        U+FFFD)."""
        done = self._decode(self.ids[self.prefix : self.read])
        full = self._decode(self.ids[self.prefix :])
        self.prefix = self.read = len(self.ids)
        return full[len(done) :]
