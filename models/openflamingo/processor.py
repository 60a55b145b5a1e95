"""OpenFlamingo's processor: its published prompt format, the ids and the frames' preparation.

OpenFlamingo is a base model without a chat template; its text is interleaved chunks, each ended
by `<|endofchunk|>`, an image standing where its `<image>` is. lvx writes a conversation in the
format of the published evaluation's VQA prompt, `<image>Question:{question} Short answer:{answer}
<|endofchunk|>` (no space around the answer, no BOS):
- a user message is `Question:{content} Short answer:` when an answer follows (or is to be
  generated), else `Question:{content}<|endofchunk|>` (a chunk without an answer); a video at the
  start of its content goes before `Question:` (as the published `<image>` does), elsewhere where
  its `<|video|>` is; a video is one `<image>` per frame (one prompt position a frame; no frame
  times are written, as neither other family's processor writes them);
- an assistant message is `{content}<|endofchunk|>`, the end the answer generates
  (`stop_ids[0]`), so the next user message follows it directly;
- a system message is its text and a newline, before what follows.
Each piece is tokenized on its own (user text as plain text), so the ids of a conversation's
prefix are a prefix of the whole conversation's ids."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch

from ..detokenize import StreamDecoder
from ..generation_config import answer_length
from ..surface import VIDEO, FramePrep, Prompt
from .frames import normalize_openai, resize_crop_uint8
from .tokenizer import END_OF_CHUNK, IMAGE, FlamingoTokenizer

QUESTION = "Question:"
ANSWER_CUE = " Short answer:"
ROLES = ("system", "user", "assistant")


class FlamingoProcessor:
    def __init__(
        self, tokenizer: FlamingoTokenizer, image_size: int = 224, max_new_tokens: int | None = None
    ):
        self.tokenizer, self.image_size = tokenizer, image_size
        self.max_new_tokens = max_new_tokens  # the checkpoint's own answer length, if it has one

    @classmethod
    def from_pretrained(cls, text_folder: str | Path, image_size: int) -> "FlamingoProcessor":
        """From the text model folder's tokenizer (the factory's tokens added) and
        generation_config.json; `image_size`: the vision tower's."""
        d = Path(text_folder)
        return cls(FlamingoTokenizer.from_pretrained(d), image_size, answer_length(d))

    @property
    def frame_prep(self) -> FramePrep:
        """open_clip's `openai` preprocessing: shorter side resized, center crop, its mean/std."""
        return FramePrep(self.image_size, resize_crop_uint8, normalize_openai)

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """`<|endofchunk|>` first (it closes an answer's chunk), then the end of text."""
        return self.tokenizer.stop_ids

    def encode(self, text: str) -> list[int]:
        """Template text: special tokens written in it become their ids."""
        return self.tokenizer.encode(text)

    def encode_text(self, text: str) -> list[int]:
        """Text a user wrote: plain text, a special token typed in it included."""
        return self.tokenizer.encode_text(text)

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(torch.as_tensor(ids).reshape(-1).tolist(), skip_special_tokens)

    def stream(self) -> StreamDecoder:
        return StreamDecoder(self.tokenizer)

    # ---- the conversation ------------------------------------------------------------------------
    def _frames(self, videos: list, ids: list[int], starts: list[int], offset: int) -> str:
        """One `<image>` per frame of the next of `videos` (a frame count)."""
        if not videos:
            raise ValueError(f"more {VIDEO} markers than videos")
        frames = videos.pop(0)
        if not isinstance(frames, int) or isinstance(frames, bool):
            raise ValueError("OpenFlamingo takes a video as its frame count here")
        starts += range(offset + len(ids), offset + len(ids) + frames)
        ids += [self.tokenizer.image_id] * frames
        return IMAGE * frames

    def _user(self, content: str, videos: list, ids: list, starts: list, offset: int) -> str:
        """`{video}Question:{content}` with each `<|video|>` as its frames (a leading one before
        `Question:`, the text after it without its leading whitespace)."""
        pieces, text = content.split(VIDEO), ""
        if len(pieces) > 1 and not pieces[0].strip():
            text += self._frames(videos, ids, starts, offset)
            pieces = [pieces[1].lstrip(), *pieces[2:]]
        ids += self.encode(QUESTION)
        text += QUESTION
        for k, piece in enumerate(pieces):
            if k:
                text += self._frames(videos, ids, starts, offset)
            ids += self.encode_text(piece)
            text += piece
        return text

    def _render(
        self,
        messages: Sequence[dict],
        videos: Sequence,
        add_generation_prompt: bool,
        offset: int,
        spans: list[tuple[int, int]] | None = None,
    ) -> Prompt:
        """The ids of `messages` from `offset`, with the answer cue at the end when asked; each
        assistant message's [start, end) (its answer and `<|endofchunk|>`) goes to `spans`."""
        ids: list[int] = []
        starts: list[int] = []
        text, videos = "", list(videos)
        for i, m in enumerate(messages):
            role, content = m["role"], m["content"]
            if role not in ROLES:
                raise ValueError(f"unknown role {role!r}: use one of {', '.join(ROLES)}")
            if VIDEO in content and role != "user":
                raise ValueError(f"a {VIDEO} goes in a user message")
            if role == "system":
                ids += self.encode_text(content + "\n")
                text += content + "\n"
            elif role == "assistant":
                begin = len(ids)
                ids += self.encode_text(content) + [self.tokenizer.eoc_id]
                text += content + END_OF_CHUNK
                if spans is not None:
                    spans.append((begin, len(ids)))
            else:
                text += self._user(content, videos, ids, starts, offset)
                last = i == len(messages) - 1
                answered = add_generation_prompt if last else messages[i + 1]["role"] == "assistant"
                cue = ANSWER_CUE if answered else END_OF_CHUNK
                ids += self.encode(cue)
                text += cue
        if videos:
            raise ValueError(f"{len(videos)} videos without a {VIDEO} marker")
        return Prompt(torch.tensor(ids, dtype=torch.int64), starts, text, offset)

    def build_chat_prompt(
        self,
        messages: Sequence[dict],
        *,
        images: Sequence = (),
        videos: Sequence = (),
        cut: bool = True,
        add_generation_prompt: bool = True,
    ) -> Prompt:
        """A conversation from its start (videos[k]: the frame count of the k-th `<|video|>`),
        ending with the answer cue `Short answer:` unless `add_generation_prompt` is False (then
        a last user message is a chunk of its own, closed by `<|endofchunk|>`)."""
        if images:
            raise ValueError("lvx runs OpenFlamingo on videos; still images are not supported")
        return self._render(messages, videos, add_generation_prompt, 0)

    def build_followup(
        self,
        content: str,
        *,
        offset: int,
        images: Sequence = (),
        videos: Sequence = (),
        cut: bool = True,
    ) -> Prompt:
        """The ids after an answer closed with `<|endofchunk|>`, for the next user turn."""
        if images:
            raise ValueError("lvx runs OpenFlamingo on videos; still images are not supported")
        return self._render([{"role": "user", "content": content}], videos, True, offset)

    def build_continuation(self, messages: Sequence[dict], *, offset: int) -> Prompt:
        """The ids after an answer closed with `<|endofchunk|>`, for the next messages (text)."""
        return self._render(messages, [], True, offset)

    def training_prompt(
        self, messages: Sequence[dict], *, videos: Sequence = ()
    ) -> tuple[Prompt, list[tuple[int, int]]]:
        """(the ids of a conversation through its last assistant message, and [start, end) of each
        assistant message's tokens that carry a loss: its answer and the `<|endofchunk|>` closing
        it, as open_flamingo's training labels them)."""
        assistant = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        if not assistant:
            raise ValueError("a training conversation needs an assistant message")
        spans: list[tuple[int, int]] = []
        prompt = self._render(messages[: assistant[-1] + 1], videos, False, 0, spans)
        return prompt, spans
