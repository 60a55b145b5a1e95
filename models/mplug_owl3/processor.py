"""mPLUG-Owl3 processor: ChatML prompt, media placeholders, `media_starts` / `media_offset`, image
cutting.

Follows the official processors (reference mplug_owl3.md §5) for every release:

- Template (§5.2): chunks `<|im_start|>system\\n<|im_end|>` (empty system turn unless the first
  message is a system message), `\\n<|im_start|>user\\n{content}<|im_end|>` split so every
  `<|image|>` is its own chunk, `\\n<|im_start|>assistant\\n` + `{content}<|im_end|>` +
  `<|endoftext|>` for past answers. Every chunk is tokenized on its own (no BPE merges across chunk
  borders); `media_starts[j]` is where placeholder j's ids begin.
- Videos (§5.4): one `<|image|>` per frame, no cut; wrapped in `<|start_video_frame|>` ...
  `<|end_video_frame|>` or bare, as the checkpoint's `PromptRules` say. Frames go through
  `image_transform`.
- Still images (§5.3): with `cut=True` the image is resized to the best `grid_squ_6` anchor (docowl
  ranking), split row-major into rows*cols crops, plus a global view last; the placeholder becomes
  the rules' cut prompt (`v2_global` or `v3_global`). Beside a video they are cut or not as the
  rules say.
- `media_offset()` (§5.5): G1 `[1, L, 2]` int64 (`[0, #{j: t > start_j}]`, -1000000 without images);
  G2 `[tensor(starts)]`.

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

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from .checkpoint import (
    CheckpointError,
    detect_architecture,
    detect_gate_form,
    resolve_checkpoint,
    safetensors_files,
)
from .config import SiglipVisionConfig, form_of, split_form
from .image_transform import _as_uint8_nhwc, normalize, resize_uint8, to_pixel_values
from .prompt_rules import PromptRules, published_rules, read_prompt_rules
from .tokenizer import ENDOFTEXT, IM_END, IM_START, Owl3Tokenizer, StreamDecoder

IMAGE = "<|image|>"
VIDEO = "<|video|>"
VIDEO_START = "<|start_video_frame|>"
VIDEO_END = "<|end_video_frame|>"
NO_MEDIA = -1_000_000  # G1 media_offset value for a sample without images

# (rows, cols) anchors of the official "grid_squ_6" set; there is no 1x1
GRID_SQU_6 = ((2, 2), (1, 3), (1, 4), (3, 1), (4, 1), (2, 3), (3, 2))

CUT_PROMPTS = {
    "v2_global": lambda r, c: (
        f"Cut to {r} rows {c} columns with a global view\n"
        + "\n".join(" ".join(f"subimg({i},{j}){IMAGE}" for j in range(c)) for i in range(r))
        + f"\nglobal_view{IMAGE}"
    ),
    "v3_global": lambda r, c: (
        f"<|start_cut|>{r}*{c}\n"
        + "\n".join(" ".join(IMAGE for _ in range(c)) for _ in range(r))
        + f"\n{IMAGE}<|end_cut|>"
    ),
}
_MEDIA_SPLIT = re.compile(f"({re.escape(IMAGE)}|{re.escape(VIDEO)})")
_IMAGE_SPLIT = re.compile(f"({re.escape(IMAGE)})")


def select_cut_grid(
    height: int, width: int, image_size: int, anchors: Sequence[tuple[int, int]] = GRID_SQU_6
) -> tuple[int, int]:
    """(rows, cols) chosen by the official 'docowl' rule: argmax of 100 * shape_IoU + IoU.

    Computed with the official tensor dtypes (int64 boxes, the rescaled anchor height truncated to
    an integer, float32 IoU), so ties and near-ties resolve exactly as there.
    """
    s = image_size
    boxes = torch.tensor([[0, 0, c * s, r * s] for r, c in anchors])  # xyxy, int64
    areas = (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])
    shaped = boxes.clone()
    # aspect-matched anchor, truncated
    shaped[:, 3] = (height / width * boxes[:, 2].float()).to(torch.int64)

    def iou(b1: torch.Tensor, b2: torch.Tensor) -> torch.Tensor:
        area2 = (b2[:, 2] - b2[:, 0]) * (b2[:, 3] - b2[:, 1])
        lt = torch.max(b1[:, None, :2], b2[:, :2])
        rb = torch.min(b1[:, None, 2:], b2[:, 2:])
        wh = (rb - lt).clamp(min=0)
        inter = wh[:, :, 0] * wh[:, :, 1]
        return inter / (areas[:, None] + area2 - inter + 1e-5)

    image_iou = iou(boxes, torch.tensor([[0, 0, width, height]])).squeeze(1)
    shape_iou = iou(boxes, shaped).diag()
    return anchors[int(torch.argmax(shape_iou * 100 + image_iou))]


@dataclass
class MediaItem:
    """One image or video of a prompt and the placeholders it became."""

    kind: str  # "image" | "video"
    num_placeholders: int  # 1, rows*cols+1 for a cut image, or the number of frames
    # (num_placeholders, 3, S, S); None for a video given as a frame count
    pixel_values: torch.Tensor | None
    cut: tuple[int, int] | None = None  # (rows, cols) of a cut image


@dataclass
class PromptInputs:
    """A tokenized prompt. Positions are absolute: `offset` is where `input_ids[0]` sits in the
    conversation."""

    input_ids: torch.Tensor  # (L,) int64
    # absolute index of the first id of each <|image|> placeholder, in order
    media_starts: list[int]
    placeholder_len: (
        int  # ids per <|image|> placeholder (never hard-coded: read from the tokenizer)
    )
    media: list[MediaItem]
    generation: str
    text: str  # the prompt text the chunks were made from
    offset: int = 0

    @property
    def num_placeholders(self) -> int:
        return len(self.media_starts)

    @property
    def pixel_values(self) -> torch.Tensor | None:
        """All images' and frames' pixel values in placeholder order, or None if any video came as a
        count."""
        if not self.media or any(m.pixel_values is None for m in self.media):
            return None
        return torch.cat([m.pixel_values for m in self.media])

    def media_offset(self) -> torch.Tensor | list[torch.Tensor]:
        """The official `media_offset` of this prompt as a batch of one (reference §5.5)."""
        if self.offset:
            raise ValueError(
                "media_offset describes a whole prompt from position 0; use media_starts for a "
                "follow-up"
            )
        starts = torch.tensor(self.media_starts, dtype=torch.int64)
        if self.generation == "g2":
            return [starts]
        L = self.input_ids.numel()
        out = torch.zeros(1, L, 2, dtype=torch.int64)
        if starts.numel() == 0:
            out[0, :, 1] = NO_MEDIA
        else:  # count[t] = #{j : t > start_j}
            out[0, :, 1] = torch.searchsorted(
                starts, torch.arange(L, dtype=torch.int64), right=False
            )
        return out


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
        self.rules = rules or published_rules(form)
        if self.rules.cut_template not in CUT_PROMPTS:
            raise ValueError(
                f"cut template must be one of {tuple(CUT_PROMPTS)}, not {self.rules.cut_template!r}"
            )
        self.path = path
        self.max_new_tokens = max_new_tokens  # the checkpoint's own answer length, if it has one
        self._image_ids = tokenizer.encode(IMAGE)

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
        d = resolve_checkpoint(path_or_id)
        if not (d / "config.json").exists():
            raise CheckpointError(f"{d} is not an mPLUG-Owl3 checkpoint: no config.json")
        vision = SiglipVisionConfig.from_dict(
            json.loads((d / "config.json").read_text()).get("vision_config") or {}
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
        return self.tokenizer.encode(text)

    def decode(self, ids: Sequence[int] | torch.Tensor, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(torch.as_tensor(ids).reshape(-1).tolist(), skip_special_tokens)

    def stream(self) -> StreamDecoder:
        return StreamDecoder(self.tokenizer)

    # ---- images
    # ----------------------------------------------------------------------------------------------
    def process_image(
        self, image: Any, cut: bool = True
    ) -> tuple[torch.Tensor, tuple[int, int] | None]:
        """(pixel_values (n, 3, S, S), (rows, cols) or None). Cut: rows*cols crops row-major, then
        the global view."""
        x = _as_uint8_nhwc(image)
        if x.shape[0] != 1:
            raise ValueError(
                f"one image expected, got a batch of {x.shape[0]} (pass video frames as videos=)"
            )
        s = self.image_size
        global_view = normalize(resize_uint8(x, s, s))
        if not cut:
            return global_view, None
        rows, cols = select_cut_grid(x.shape[1], x.shape[2], s)
        big = normalize(resize_uint8(x, rows * s, cols * s))[0]  # (3, rows*S, cols*S)
        crops = big.view(3, rows, s, cols, s).permute(1, 3, 0, 2, 4).reshape(rows * cols, 3, s, s)
        return torch.cat([crops, global_view]), (rows, cols)

    # ---- prompts
    # ----------------------------------------------------------------------------------------------
    def _expand_media(
        self, content: str, images: list, videos: list, cut: bool, media: list[MediaItem]
    ) -> str:
        """Replace the <|image|> / <|video|> markers of one message by placeholders, consuming
        images/videos."""
        out = []
        for part in _MEDIA_SPLIT.split(content):
            if part == IMAGE:
                if not images:
                    raise ValueError("more <|image|> markers in the messages than images given")
                pv, grid = self.process_image(images.pop(0), cut)
                media.append(MediaItem("image", pv.shape[0], pv, grid))
                out.append(CUT_PROMPTS[self.rules.cut_template](*grid) if grid else IMAGE)
            elif part == VIDEO:
                if not videos:
                    raise ValueError("more <|video|> markers in the messages than videos given")
                v = videos.pop(0)
                if isinstance(v, int):
                    n, pv = v, None
                else:
                    pv = to_pixel_values(v, self.image_size)
                    n = pv.shape[0]
                if n < 1:
                    raise ValueError("a video needs at least one frame")
                media.append(MediaItem("video", n, pv))
                # The 241014 and 241101 processors (mPLUG/mPLUG-Owl3-2B-241014 and -7B-241101,
                # processing_mplugowl3.py, mPLUGOwl3Processor.__call__) mark every video
                # use_video_span and wrap its frames; the 240728 one writes them bare.
                frames = IMAGE * n
                out.append(f"{VIDEO_START}{frames}{VIDEO_END}" if self.rules.video_span else frames)
            else:
                out.append(part)
        return "".join(out)

    def _chunks(
        self,
        messages: Sequence[dict],
        images: list,
        videos: list,
        cut: bool,
        media: list[MediaItem],
        add_generation_prompt: bool,
        system_turn: bool,
    ) -> list[str]:
        if videos and not self.rules.cut_beside_video:
            # The 240728 processor (mPLUG/mPLUG-Owl3-7B-240728, processing_mplugowl3.py,
            # mPLUGOwl3Processor.__call__) turns cut off for the whole call when videos are present;
            # the 241014 and 241101 ones cut each still image with the call's cut_enable.
            cut = False
        chunks: list[str] = []
        for n, msg in enumerate(messages):
            role, content = msg["role"], msg.get("content") or ""
            if role != "user" and (IMAGE in content or VIDEO in content):
                raise ValueError(
                    f"media markers are only allowed in user messages, found one in a {role} "
                    "message"
                )
            if n == 0 and role != "system" and system_turn:
                chunks.append(f"{IM_START}system\n{IM_END}")
            if role == "system":
                chunks.append(f"{IM_START}system\n{content}{IM_END}")
            elif role == "user":
                text = self._expand_media(content, images, videos, cut, media)
                chunks.extend(_IMAGE_SPLIT.split(f"\n{IM_START}user\n{text}{IM_END}"))
            elif role == "assistant":
                chunks.append(f"\n{IM_START}assistant\n")
                if (
                    n == len(messages) - 1
                ):  # the answer being generated (its content, if any, starts it)
                    chunks.append(content)
                else:
                    chunks.extend([f"{content}{IM_END}", ENDOFTEXT])
            else:
                raise ValueError(f"unknown role {role!r} (use system, user or assistant)")
        if images or videos:
            raise ValueError(
                f"{len(images)} image(s) and {len(videos)} video(s) given without a matching "
                f"<|image|> / <|video|> marker in the user messages"
            )
        if add_generation_prompt and messages and messages[-1]["role"] != "assistant":
            chunks.append(f"\n{IM_START}assistant\n")
        return chunks

    def _encode_chunks(
        self, chunks: list[str], media: list[MediaItem], offset: int
    ) -> PromptInputs:
        ids: list[int] = []
        starts: list[int] = []
        for c in chunks:
            if c == IMAGE:
                starts.append(offset + len(ids))
                ids.extend(self._image_ids)
            elif c:
                ids.extend(self.tokenizer.encode(c))
        assert len(starts) == sum(m.num_placeholders for m in media)
        return PromptInputs(
            torch.tensor(ids, dtype=torch.int64),
            starts,
            len(self._image_ids),
            media,
            self.generation,
            "".join(chunks),
            offset,
        )

    def build_chat_prompt(
        self,
        messages: Sequence[dict],
        *,
        images: Sequence[Any] = (),
        videos: Sequence[Any] = (),
        cut: bool = True,
        add_generation_prompt: bool = True,
    ) -> PromptInputs:
        """Tokenize a conversation from its start.

        messages: [{"role": "system"|"user"|"assistant", "content": str}], user content may hold
        `<|image|>` and `<|video|>` markers. images[k] fills the k-th `<|image|>` (PIL image or
        uint8 (H,W,3) array/tensor); videos[k] fills the k-th `<|video|>`: uint8 frames (N,H,W,3)
        (pixel values are made here) or an int frame count (placeholders only; the caller makes the
        pixel values, e.g. sharded over ranks). cut: cut still images (official default). The prompt
        ends with `\\n<|im_start|>assistant\\n` unless add_generation_prompt is False.
        """
        media: list[MediaItem] = []
        chunks = self._chunks(
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
    ) -> PromptInputs:
        """The ids to append after a generated answer that ended with <|im_end|>, for the next user
        turn.

        They are exactly what the official template puts between that answer and the new prompt's
        end:
        `<|endoftext|>`, `\\n<|im_start|>user\\n{content}<|im_end|>`, `\\n<|im_start|>assistant\\n`.
        `offset` = tokens already in the conversation (so media_starts are absolute).
        """
        media: list[MediaItem] = []
        chunks = [ENDOFTEXT] + self._chunks(
            [{"role": "user", "content": content}],
            list(images),
            list(videos),
            cut,
            media,
            True,
            False,
        )
        return self._encode_chunks(chunks, media, offset)

    def build_continuation(self, messages: Sequence[dict], *, offset: int) -> PromptInputs:
        """The ids to append after a generated answer that ended with <|im_end|>, for the next
        messages (text only): `build_followup` for any run of user and system messages, as the
        template lays them out after that answer."""
        chunks = [ENDOFTEXT] + self._chunks(messages, [], [], True, [], True, False)
        return self._encode_chunks(chunks, [], offset)
