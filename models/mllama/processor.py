"""Mllama's processor: the chat prompt, its ids, the images' tiles and the cross-attention mask.

The chat template is the published one for a user turn (no system turn is added when the turn has
images): `<|begin_of_text|><|start_header_id|>user<|end_header_id|>\\n\\n` + one `<|image|>` per
image + the text + `<|eot_id|><|start_header_id|>assistant<|end_header_id|>\\n\\n`.

A video is its frames as consecutive images: one `<|image|>` per frame (one prompt position per
frame), each frame resized into `video_tiles` tiles (1 by default: 1,601 visual tokens a frame at
560 pixels) and padded with empty tiles to `max_image_tiles`, as the published processor pads an
image of that many tiles; the cross-attention mask never opens an empty tile. Consecutive
`<|image|>`s share one span, so every text token after the frames sees all of them: the media mask
LV-XAttn shards is then one prefix for every row.

Cross-attention mask (as published): the token at an `<|image|>` and every token after it see that
image's real tiles, until the next `<|image|>` that does not directly follow it (the last span runs
to the end)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from ..config_checks import read_json_object
from ..detokenize import StreamDecoder
from ..generation_config import answer_length
from ..safetensors_folder import CheckpointError
from ..surface import VIDEO, FramePrep, Prompt
from .image_tiles import (
    CLIP_MEAN,
    CLIP_STD,
    arrangements,
    fit_and_pad_uint8,
    normalize_uint8,
    tile_image,
)
from .tokenizer import BOS, EOT, IMAGE, MllamaTokenizer

USER = "<|start_header_id|>user<|end_header_id|>\n\n"
ASSISTANT = "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
ROLES = ("system", "user", "assistant")


def chat_prompt(text: str, images: int) -> str:
    """One user turn with `images` images before its text, ready for the answer."""
    return f"{BOS}{USER}{IMAGE * images}{text}{ASSISTANT}"


def image_spans(ids: Sequence[int], image_id: int) -> list[tuple[int, int]]:
    """[start, end) of the tokens that see each image, in the published rule."""
    where = [i for i, t in enumerate(ids) if t == image_id]
    spans = [[a, b] for a, b in zip(where, where[1:])] + [[where[-1], len(ids)]] if where else []
    end = len(ids)
    for span in reversed(spans):  # a run of consecutive images shares the span after the run
        if span[1] == span[0] + 1:
            span[1] = end
        end = span[1]
    return [(a, b) for a, b in spans]


@dataclass
class MllamaInputs:
    input_ids: torch.Tensor  # (1, L) int64
    pixel_values: torch.Tensor | None  # (1, N, T, 3, S, S) float32
    aspect_ratio_ids: torch.Tensor | None  # (1, N) int64
    aspect_ratio_mask: torch.Tensor | None  # (1, N, T) int64
    cross_attention_mask: torch.Tensor | None  # (1, L, N, T) int64

    def model_inputs(self) -> dict[str, torch.Tensor]:
        """The keywords of `MllamaModel.forward` / `greedy`."""
        return dict(
            pixels=self.pixel_values,
            ar_ids=self.aspect_ratio_ids,
            ar_mask=self.aspect_ratio_mask,
            cross_mask=self.cross_attention_mask,
        )


class MllamaProcessor:
    def __init__(
        self,
        tokenizer: MllamaTokenizer,
        tile_size: int = 560,
        max_image_tiles: int = 4,
        mean=CLIP_MEAN,
        std=CLIP_STD,
        video_tiles: int = 1,
        max_new_tokens: int | None = None,
    ):
        self.tokenizer, self.tile_size, self.max_image_tiles = tokenizer, tile_size, max_image_tiles
        self.mean, self.std, self.video_tiles = tuple(mean), tuple(std), video_tiles
        self.max_new_tokens = max_new_tokens  # the checkpoint's own answer length, if it has one

    @classmethod
    def from_pretrained(cls, directory: str | Path) -> "MllamaProcessor":
        """From the folder's tokenizer.json, generation_config.json and image processor settings:
        preprocessor_config.json as published, or the `image_processor` of processor_config.json,
        which transformers 5's `save_pretrained` writes instead."""
        d, what = Path(directory), "the image processor's settings"
        if (d / "processor_config.json").exists() and not (d / "preprocessor_config.json").exists():
            pre = read_json_object(d / "processor_config.json", what).get("image_processor")
        else:
            pre = read_json_object(d / "preprocessor_config.json", what)
        if not isinstance(pre, dict) or "size" not in pre:
            raise CheckpointError(
                f"{d} has no image processor settings (preprocessor_config.json, or "
                "processor_config.json's image_processor): copy them from the checkpoint it was "
                "made from"
            )
        return cls(
            MllamaTokenizer.from_pretrained(d),
            tile_size=int(pre["size"]["height"]),
            max_image_tiles=int(pre.get("max_image_tiles", 4)),
            mean=pre.get("image_mean", CLIP_MEAN),
            std=pre.get("image_std", CLIP_STD),
            max_new_tokens=answer_length(d),
        )

    def __call__(
        self, text: str, images: Sequence = (), max_tiles: int | None = None
    ) -> MllamaInputs:
        """Ids of `text` (special tokens written in it are single ids), the tiles of `images`
        (one per `<|image|>`, in order, each in at most `max_tiles` tiles), padded with empty
        tiles to `max_image_tiles` as the published processor pads them."""
        ids = self.tokenizer.encode(text)
        if ids.count(self.tokenizer.image_id) != len(images):
            raise ValueError(
                f"the text has {ids.count(self.tokenizer.image_id)} {IMAGE} tokens for "
                f"{len(images)} images: give one image per {IMAGE}"
            )
        input_ids = torch.tensor([ids], dtype=torch.int64)
        if not images:
            return MllamaInputs(input_ids, None, None, None, None)
        tiles = min(max_tiles or self.max_image_tiles, self.max_image_tiles)
        done = [tile_image(im, self.tile_size, tiles, self.mean, self.std) for im in images]
        n, s, most = len(done), self.tile_size, self.max_image_tiles
        pixels = np.zeros((1, n, most, 3, s, s), np.float32)
        ar_mask = torch.zeros(1, n, most, dtype=torch.int64)
        ar_mask[:, :, 0] = 1
        for i, t in enumerate(done):
            pixels[0, i, : len(t.tiles)] = t.tiles
            ar_mask[0, i, : len(t.tiles)] = 1
        cross = torch.zeros(1, len(ids), n, most, dtype=torch.int64)
        for i, (a, b) in enumerate(image_spans(ids, self.tokenizer.image_id)):
            cross[0, a:b, i, : len(done[i].tiles)] = 1
        ratios = arrangements(most)  # ids count the arrangements of up to max_image_tiles
        ar_ids = torch.tensor([[ratios.index(t.arrangement) + 1 for t in done]])
        return MllamaInputs(input_ids, torch.from_numpy(pixels), ar_ids, ar_mask, cross)

    # ---- the engine's side: chat prompts with a video as a frame count ---------------------------
    @property
    def image_size(self) -> int:
        return self.tile_size

    @property
    def frame_prep(self) -> FramePrep:
        """One tile a frame: resized keeping its aspect ratio into the tile, padded black (the
        model adds the empty tiles)."""
        return FramePrep(
            self.tile_size,
            fit_and_pad_uint8,
            partial(normalize_uint8, mean=self.mean, std=self.std),
        )

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """`<|eot_id|>` first (it closes a turn), then the other ends of an answer."""
        eot = self.tokenizer.eot_id
        return (eot, *sorted(self.tokenizer.stop_ids - {eot}))

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

    def _turns(
        self,
        messages: Sequence[dict],
        videos: list,
        ids: list[int],
        starts: list[int],
        offset: int,
        ends: list[int] | None = None,
    ) -> str:
        """Append each message's turn to `ids` (a `<|video|>` in a user message becomes one
        `<|image|>` per frame of the next of `videos`), and where each turn ends to `ends`; return
        the text they stand for."""
        text = ""
        for m in messages:
            role, content = m["role"], m["content"]
            if role not in ROLES:
                raise ValueError(f"unknown role {role!r}: use one of {', '.join(ROLES)}")
            ids += self.encode(f"<|start_header_id|>{role}<|end_header_id|>\n\n")
            pieces = content.split(VIDEO)
            if len(pieces) > 1 and role != "user":
                raise ValueError(f"a {VIDEO} goes in a user message")
            for k, piece in enumerate(pieces):
                if k:
                    if not videos:
                        raise ValueError(f"more {VIDEO} markers than videos")
                    frames = videos.pop(0)
                    if not isinstance(frames, int):
                        raise ValueError("Llama-3.2-Vision takes a video as its frame count here")
                    starts += range(offset + len(ids), offset + len(ids) + frames)
                    ids += [self.tokenizer.image_id] * frames
                ids += self.encode_text(piece)
            ids.append(self.tokenizer.eot_id)
            text += f"<|start_header_id|>{role}<|end_header_id|>\n\n{content}{EOT}"
            if ends is not None:
                ends.append(len(ids))
        return text

    def _prompt(
        self, messages, videos, add_generation_prompt: bool, offset: int, bos: bool, ends=None
    ):
        ids: list[int] = [self.tokenizer.bos_id] if bos else []
        starts: list[int] = []
        videos = list(videos)
        text = (BOS if bos else "") + self._turns(messages, videos, ids, starts, offset, ends)
        if videos:
            raise ValueError(f"{len(videos)} videos without a {VIDEO} marker")
        if add_generation_prompt:
            header = "<|start_header_id|>assistant<|end_header_id|>\n\n"
            ids += self.encode(header)
            text += header
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
        """A conversation from its start, in the published template (no system turn is added):
        `<|begin_of_text|>`, each message as `<|start_header_id|>{role}<|end_header_id|>\\n\\n`
        + content + `<|eot_id|>`, then the assistant's header. videos[k]: the frame count of the
        k-th `<|video|>`."""
        if images:
            raise ValueError("lvx runs Llama-3.2-Vision on videos; still images are not supported")
        return self._prompt(messages, videos, add_generation_prompt, 0, bos=True)

    def training_prompt(
        self, messages: Sequence[dict], *, videos: Sequence = ()
    ) -> tuple[Prompt, list[tuple[int, int]]]:
        """(the ids of a conversation through its last assistant message, in the published
        template, and [start, end) of each assistant message's tokens that carry a loss: its answer
        and the `<|eot_id|>` closing it, as Llama 3 is trained)."""
        assistant = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        if not assistant:
            raise ValueError("a training conversation needs an assistant message")
        kept = list(messages[: assistant[-1] + 1])
        ends: list[int] = []
        prompt = self._prompt(kept, videos, False, 0, bos=True, ends=ends)
        header = len(self.encode("<|start_header_id|>assistant<|end_header_id|>\n\n"))
        begins = [1, *ends[:-1]]  # after `<|begin_of_text|>`, then after each turn
        spans = [(begins[i] + header, ends[i]) for i in assistant]
        return prompt, spans

    def build_followup(
        self,
        content: str,
        *,
        offset: int,
        images: Sequence = (),
        videos: Sequence = (),
        cut: bool = True,
    ) -> Prompt:
        """The ids after an answer closed with `<|eot_id|>`, for the next user turn."""
        if images:
            raise ValueError("lvx runs Llama-3.2-Vision on videos; still images are not supported")
        return self._prompt([{"role": "user", "content": content}], videos, True, offset, False)

    def build_continuation(self, messages: Sequence[dict], *, offset: int) -> Prompt:
        """The ids after an answer closed with `<|eot_id|>`, for the next messages (text only)."""
        return self._prompt(messages, [], True, offset, False)

    def video(self, frames: Sequence, question: str) -> MllamaInputs:
        """A chat turn about a video's frames: one `<|image|>` per frame, `video_tiles` each."""
        return self(chat_prompt(question, len(frames)), frames, max_tiles=self.video_tiles)
