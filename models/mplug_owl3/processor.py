"""mPLUG-Owl3 processor: ChatML prompt, media placeholders, `media_starts` / `media_offset`, image
cutting. The template is `chat_template`, a still image's cut `image_cut`, the result a `Prompt`
(the record every family makes) with mPLUG-Owl3's media (`prompt_inputs`); this module tokenizes
the template's chunks and loads the checkpoint's own rules.

Follows the official processors (reference mplug_owl3.md §5) for every release:

- Template (§5.2): chunks `<|im_start|>system\\n<|im_end|>` (empty system turn unless the first
  message is a system message), `\\n<|im_start|>user\\n{content}<|im_end|>` split so every
  `<|image|>` is its own chunk, `\\n<|im_start|>assistant\\n` + `{content}<|im_end|>` +
  `<|endoftext|>` for past answers. Every chunk is tokenized on its own (no BPE merges across chunk
  borders); `media_starts[j]` is where placeholder j's ids begin. The control tokens are the
  template's own ids; every text between them, the messages' content included, is encoded as plain
  text, so a control token typed into a message is text (the official processor would read it as
  the control token).
- Videos (§5.4): one `<|image|>` per frame, no cut; wrapped in `<|start_video_frame|>` ...
  `<|end_video_frame|>` or bare, as the checkpoint's `PromptRules` say. Frames go through
  `lvx_models.pixels`.
- Still images (§5.3): with `cut=True` the image is resized to the best `grid_squ_6` anchor (docowl
  ranking), split row-major into rows*cols crops, plus a global view last; the placeholder becomes
  the rules' cut prompt (`v2_global` or `v3_global`). Beside a video they are cut or not as the
  rules say.
- `media_offset(prompt)` (§5.5): G1 `[1, L, 2]` int64 (`[0, #{j: t > start_j}]`, -1000000 without
  images); G2 `[tensor(starts)]`.

The rules (video span, cut beside videos, cut prompt) are read from the checkpoint's own processor
files, else the published default of its release (`prompt_rules.py`).

Deliberate differences from the official code, all where the official one is broken or refuses:
- Images and videos are matched to their own markers in order (`images[k]` to the k-th `<|image|>`,
  `videos[k]` to the k-th `<|video|>`). The 241014 and 241101 processors take one list "videos
  first, then images" in marker order, so they only work when every video marker comes before every
  image marker; for those prompts the result is identical. The 240728 processor refuses images
  together with videos; we accept them and, like it, do not cut them.
- A still image sent with cut off keeps its pixels. The 241014 processor (as read, reference §10.1)
  appends an image's pixels only when it was cut, so there such an image has a placeholder and no
  pixels; the 241101 one appends them, as lvx does.
- Multi-image 240728 cut prompts use each image's own grid (its processor reads the wrong grid after
  the first image; ms-swift fixes it the same way, §5.3).
- A final assistant message with content is kept as the start of the answer (official code drops
  it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch

from ..config_checks import checked_config
from ..detokenize import StreamDecoder
from ..pixels import square_prep
from ..safetensors_folder import safetensors_files
from ..surface import Prompt
from .chat_template import ASSISTANT_HEADER, IMAGE, IMAGE_CHUNK, VIDEO, ChatTemplate, Chunk
from .checkpoint import CheckpointError, detect_architecture, detect_gate_form, resolve_folder
from .config import SiglipVisionConfig, form_of, split_form
from .image_cut import cut_image
from .prompt_inputs import MediaItem, media_offset
from .prompt_rules import PromptRules, published_rules, read_prompt_rules
from .tokenizer import ENDOFTEXT, Control, Owl3Tokenizer

# the markers a user message holds go with the processor that reads them
__all__ = ["IMAGE", "VIDEO", "Owl3Processor"]


class Owl3Processor:
    """Tokenizer + template + media handling for one checkpoint form ("g1-gateproj", "g1", "g2")."""

    def __init__(
        self,
        tokenizer: Owl3Tokenizer,
        form: str,
        image_size: int,
        *,
        patch_size: int = 14,
        rules: PromptRules | None = None,
        path: Path | None = None,
        max_new_tokens: int | None = None,
    ):
        self.generation = split_form(form)[0]  # "g1" | "g2": the media_offset format
        self.form = form
        self.tokenizer = tokenizer
        self.image_size = int(image_size)
        self.tokens_per_image = (self.image_size // patch_size) ** 2  # tokens per placeholder
        self.rules = rules or published_rules(form)  # makes the template
        self.path = path
        self.max_new_tokens = max_new_tokens  # the checkpoint's own answer length, if it has one
        self._image_ids = tokenizer.encode(IMAGE)

    @property
    def rules(self) -> PromptRules:
        """The checkpoint's prompt rules (video span, cut beside videos, cut prompt)."""
        return self.template.rules

    @rules.setter
    def rules(self, rules: PromptRules) -> None:
        self.template = ChatTemplate(rules, self.image_size)

    @property
    def cut_template(self) -> str:
        return self.rules.cut_template

    # ---- construction
    # ----------------------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path_or_id: str | Path, form: str | None = None) -> "Owl3Processor":
        """From a checkpoint directory (or hub id). Without `form`, it is detected from the
        weight keys; the prompt rules come from the checkpoint's processor files, else the form's
        release."""
        d = resolve_folder(path_or_id)
        if not (d / "config.json").exists():
            raise CheckpointError(f"{d} is not an mPLUG-Owl3 checkpoint: no config.json")
        vision = SiglipVisionConfig.from_dict(
            checked_config(d / "config.json").get("vision_config") or {}
        )
        if form is None:
            keys = list(safetensors_files(d))
            form = form_of(detect_architecture(keys)[0], detect_gate_form(keys))
        return cls(
            Owl3Tokenizer.from_pretrained(d),
            form,
            vision.image_size,
            patch_size=vision.patch_size,
            rules=read_prompt_rules(d, form),
            path=d,
        )

    @classmethod
    def from_checkpoint(cls, info: Any) -> "Owl3Processor":
        """From a `loader.CheckpointInfo` (what `load_model` uses)."""
        v = info.config.vision
        return cls(
            Owl3Tokenizer.from_pretrained(info.path),
            info.config.form,
            v.image_size,
            patch_size=v.patch_size,
            rules=info.prompt_rules,
            path=info.path,
            max_new_tokens=info.max_new_tokens,
        )

    # ---- tokens
    # ----------------------------------------------------------------------------------------------
    @property
    def stop_ids(self) -> tuple[int, int]:
        """(<|im_end|>, <|endoftext|>): generation stops at either."""
        return self.tokenizer.stop_ids

    def encode(self, text: str) -> list[int]:
        """Template text: control tokens written in it become their ids (see `encode_text`)."""
        return self.tokenizer.encode(text)

    def encode_text(self, text: str) -> list[int]:
        """Text a user wrote (a question, a subtitle line, an answer sent back): plain text."""
        return self.tokenizer.encode_text(text)

    def decode(self, ids: Sequence[int] | torch.Tensor, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(torch.as_tensor(ids).reshape(-1).tolist(), skip_special_tokens)

    def stream(self) -> StreamDecoder:
        return StreamDecoder(self.tokenizer)

    @property
    def frame_prep(self):
        """How a video's frames become pixel values: bicubic to the square `image_size`."""
        return square_prep(self.image_size)

    # ---- images
    # ----------------------------------------------------------------------------------------------
    def process_image(
        self, image: Any, cut: bool = True
    ) -> tuple[torch.Tensor, tuple[int, int] | None]:
        """(pixel_values (n, 3, S, S), (rows, cols) or None). Cut: rows*cols crops row-major, then
        the global view."""
        return cut_image(image, self.image_size, cut)

    # ---- prompts
    # ----------------------------------------------------------------------------------------------
    def _encode_chunk(self, chunk: Chunk) -> list[int]:
        """A chunk's control tokens as their ids, each run of text between them as plain text."""
        ids: list[int] = []
        text = ""
        for piece in chunk:
            if isinstance(piece, Control):
                ids += self.tokenizer.encode_text(text) + [self.tokenizer.token_to_id(piece)]
                text = ""
            else:
                text += piece
        return ids + self.tokenizer.encode_text(text)

    def _encode_chunks(self, chunks: list[Chunk], media: list[MediaItem], offset: int) -> Prompt:
        ids: list[int] = []
        starts: list[int] = []
        for chunk in chunks:
            if chunk == IMAGE_CHUNK:
                starts.append(offset + len(ids))
                ids.extend(self._image_ids)
            else:
                ids.extend(self._encode_chunk(chunk))
        assert len(starts) == sum(m.num_placeholders for m in media)
        return Prompt(
            torch.tensor(ids, dtype=torch.int64),
            starts,
            "".join("".join(chunk) for chunk in chunks),
            offset,
            placeholder_len=len(self._image_ids),
            media=media,
        )

    def media_offset(self, prompt: Prompt) -> torch.Tensor | list[torch.Tensor]:
        """The official `media_offset` of a whole prompt, in this checkpoint's generation."""
        return media_offset(prompt, self.generation)

    def build_chat_prompt(
        self,
        messages: Sequence[dict],
        *,
        images: Sequence[Any] = (),
        videos: Sequence[Any] = (),
        cut: bool = True,
        add_generation_prompt: bool = True,
    ) -> Prompt:
        """Tokenize a conversation from its start.

        messages: [{"role": "system"|"user"|"assistant", "content": str}], user content may hold
        `<|image|>` and `<|video|>` markers. images[k] fills the k-th `<|image|>` (PIL image or
        uint8 (H,W,3) array/tensor); videos[k] fills the k-th `<|video|>`: uint8 frames (N,H,W,3)
        (pixel values are made here) or an int frame count (placeholders only; the caller makes the
        pixel values, e.g. sharded over ranks). cut: cut still images (official default). The prompt
        ends with `\\n<|im_start|>assistant\\n` unless add_generation_prompt is False.
        """
        media: list[MediaItem] = []
        chunks = self.template.chunks(
            messages, list(images), list(videos), cut, media, add_generation_prompt, True
        )
        return self._encode_chunks(chunks, media, 0)

    def build_followup(
        self,
        content: str,
        *,
        offset: int,
        images: Sequence[Any] = (),
        videos: Sequence[Any] = (),
        cut: bool = True,
    ) -> Prompt:
        """The ids to append after a generated answer that ended with <|im_end|>, for the next user
        turn.

        They are exactly what the official template puts between that answer and the new prompt's
        end:
        `<|endoftext|>`, `\\n<|im_start|>user\\n{content}<|im_end|>`, `\\n<|im_start|>assistant\\n`.
        `offset` = tokens already in the conversation (so media_starts are absolute).
        """
        media: list[MediaItem] = []
        chunks = [(ENDOFTEXT,)] + self.template.chunks(
            [{"role": "user", "content": content}],
            list(images),
            list(videos),
            cut,
            media,
            True,
            False,
        )
        return self._encode_chunks(chunks, media, offset)

    def build_continuation(self, messages: Sequence[dict], *, offset: int) -> Prompt:
        """The ids to append after a generated answer that ended with <|im_end|>, for the next
        messages (text only): `build_followup` for any run of user and system messages, as the
        template lays them out after that answer."""
        chunks = [(ENDOFTEXT,)] + self.template.chunks(messages, [], [], True, [], True, False)
        return self._encode_chunks(chunks, [], offset)

    def training_prompt(
        self, messages: Sequence[dict], *, videos: Sequence[Any] = ()
    ) -> tuple[Prompt, list[tuple[int, int]]]:
        """(the ids of a conversation through its last assistant message, [start, end) of each
        assistant message's tokens that carry a loss: its answer, `<|im_end|>` and
        `<|endoftext|>`), in the official training template (reference mplug_owl3.md §5.2).

        Every chunk is tokenised on its own, so the ids of a conversation prefix are a prefix of
        the whole; a span runs from the prefix's length through the ids the next (empty) answer's
        header would follow. The prompt's ids run on past the last span (that header): the caller
        cuts them."""
        header = self._encode_chunk(ASSISTANT_HEADER)
        gen = {"role": "assistant", "content": ""}

        def ids(msgs: Sequence[dict]) -> Prompt:
            return self.build_chat_prompt(
                list(msgs) + [gen], videos=videos, add_generation_prompt=False
            )

        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            start = ids(messages[:i]).input_ids.numel()
            through = ids(messages[: i + 1]).input_ids
            end = through.numel() - len(header)
            if through[end:].tolist() != header:  # the template changed: refuse, never mislabel
                raise RuntimeError("could not locate the assistant answer in the chat template")
            spans.append((start, end))
        if not spans:
            raise ValueError("a training conversation needs an assistant message")
        last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
        return ids(messages[: last + 1]), spans
