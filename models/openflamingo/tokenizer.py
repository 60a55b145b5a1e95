"""OpenFlamingo's tokenizer: the text model's published `tokenizer.json` (MPT's, the GPT-NeoX
byte-level BPE) with the tokens open_flamingo's factory adds to it, read with `tokenizers`.

The factory calls `add_special_tokens({"additional_special_tokens": ["<|endofchunk|>",
"<image>"]})` and, when the tokenizer names no pad token (MPT's names none), adds `<PAD>` as its
pad token; each added token takes the next id after the vocabulary (50277, 50278, 50279 for
GPT-NeoX's 50,277 tokens), and the language model's input embeddings are resized to that many
rows, which the published `checkpoint.pt` holds. Nothing is added around the text (no BOS), as
the factory's tokenizer adds none."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer

from ..bpe_text import BpeText
from ..safetensors_folder import CheckpointError

IMAGE = "<image>"
END_OF_CHUNK = "<|endofchunk|>"
PAD = "<PAD>"
ADDED = (END_OF_CHUNK, IMAGE)  # in the factory's order
EOS = "<|endoftext|>"  # GPT-NeoX's end of text (MPT's eos token)
SETTINGS = ("tokenizer_config.json", "special_tokens_map.json")


def named_pad(directory: Path) -> str | None:
    """The pad token the folder's tokenizer settings name, if any (as transformers reads them)."""
    for name in SETTINGS:
        try:
            pad = json.loads((directory / name).read_text()).get("pad_token")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(pad, dict):
            pad = pad.get("content")
        if isinstance(pad, str) and pad:
            return pad
    return None


def with_flamingo_tokens(tok: Tokenizer, pad: str | None) -> Tokenizer:
    """`tok` with `<|endofchunk|>`, `<image>` and (without a pad token) `<PAD>` added as the
    factory adds them (a token it already holds keeps its id)."""
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ADDED])
    if pad is None:
        tok.add_special_tokens([AddedToken(PAD, special=True, normalized=False)])
    return tok


class FlamingoTokenizer(BpeText):
    """Text <-> ids. Special tokens written in template text are single ids; text a user wrote
    (`encode_text`) is plain text, a special token typed in it included."""

    def __init__(self, tokenizer: Tokenizer, pad: str | None = None):
        super().__init__(tokenizer)
        self.image_id = self._id(IMAGE)
        self.eoc_id = self._id(END_OF_CHUNK)
        self.eos_id = self.tok.token_to_id(EOS)
        self.pad_id = self._id(pad or PAD)

    @classmethod
    def from_pretrained(cls, directory: str | Path) -> "FlamingoTokenizer":
        """The text model folder's tokenizer with the factory's tokens added."""
        d = Path(directory)
        try:
            tok = Tokenizer.from_file(str(d / "tokenizer.json"))
        except Exception as exc:  # noqa: BLE001 - a missing or broken file is one line
            why = (str(exc).splitlines() or [""])[0][:160]
            raise CheckpointError(
                f"{d / 'tokenizer.json'} cannot be read ({why}): copy it from the text model's "
                "repository"
            ) from None
        pad = named_pad(d)
        return cls(with_flamingo_tokens(tok, pad), pad)

    def __len__(self) -> int:
        """Ids the tokenizer can produce: the rows of the model's input embeddings."""
        return self.tok.get_vocab_size(with_added_tokens=True)

    def _id(self, token: str) -> int:
        i = self.tok.token_to_id(token)
        if i is None:
            raise CheckpointError(f"the tokenizer has no {token} token")
        return i

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """`<|endofchunk|>` (open_flamingo's `generate` stops there), then the end of text."""
        return (self.eoc_id,) if self.eos_id is None else (self.eoc_id, self.eos_id)
