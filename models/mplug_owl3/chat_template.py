"""The official ChatML template in chunks (reference mplug_owl3.md §5.2), each media marker of a
user message expanded into the placeholders the checkpoint's prompt rules say (§5.3, §5.4).

Chunks: `<|im_start|>system\\n<|im_end|>` (empty system turn unless the first message is a system
message), `\\n<|im_start|>user\\n{content}<|im_end|>` split so every `<|image|>` is its own chunk,
`\\n<|im_start|>assistant\\n` + `{content}<|im_end|>` + `<|endoftext|>` for past answers. The
processor tokenizes every chunk on its own (no BPE merges across chunk borders).

A chunk is a tuple of pieces: the control tokens this template places (`Control`) and text. A
message's content is only ever text, so `<|im_end|>` written in it cannot end its turn.
"""

from __future__ import annotations

import re
from typing import Sequence

from ..pixels import to_pixel_values
from ..surface import VIDEO  # the app's marker: the video goes where it stands
from .image_cut import cut_image
from .prompt_inputs import MediaItem
from .prompt_rules import PromptRules
from .tokenizer import ENDOFTEXT, IM_END, IM_START, Control

IMAGE = "<|image|>"
VIDEO_START = "<|start_video_frame|>"
VIDEO_END = "<|end_video_frame|>"

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

Chunk = tuple[str, ...]  # text and `Control` pieces, tokenized together
IMAGE_CHUNK: Chunk = (IMAGE,)  # one placeholder
ASSISTANT_HEADER: Chunk = ("\n", IM_START, "assistant\n")


def _split_at_images(pieces: Chunk) -> list[Chunk]:
    """`pieces` as chunks, each `<|image|>` of their text a chunk of its own."""
    chunks: list[Chunk] = []
    current: list[str] = []
    for piece in pieces:
        parts = [piece] if isinstance(piece, Control) else _IMAGE_SPLIT.split(piece)
        for part in parts:
            if part == IMAGE:
                chunks += [tuple(current), IMAGE_CHUNK]
                current = []
            elif part:
                current.append(part)
    return chunks + [tuple(current)]


class ChatTemplate:
    """Messages -> template chunks, with images and videos placed by `rules` at `image_size`."""

    def __init__(self, rules: PromptRules, image_size: int) -> None:
        if rules.cut_template not in CUT_PROMPTS:
            raise ValueError(
                f"cut template must be one of {tuple(CUT_PROMPTS)}, not {rules.cut_template!r}"
            )
        self.rules, self.image_size = rules, image_size

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
                pv, grid = cut_image(images.pop(0), self.image_size, cut)
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

    def chunks(
        self,
        messages: Sequence[dict],
        images: list,
        videos: list,
        cut: bool,
        media: list[MediaItem],
        add_generation_prompt: bool,
        system_turn: bool,
    ) -> list[Chunk]:
        """The chunks of `messages`, consuming `images` and `videos` into `media` in marker order;
        `system_turn`: open with the empty system turn unless the first message is a system one (a
        conversation from its start); `add_generation_prompt`: end with the assistant's turn."""
        if videos and not self.rules.cut_beside_video:
            # The 240728 processor (mPLUG/mPLUG-Owl3-7B-240728, processing_mplugowl3.py,
            # mPLUGOwl3Processor.__call__) turns cut off for the whole call when videos are present;
            # the 241014 and 241101 ones cut each still image with the call's cut_enable.
            cut = False
        chunks: list[Chunk] = []
        for n, msg in enumerate(messages):
            role, content = msg["role"], msg.get("content") or ""
            if role != "user" and (IMAGE in content or VIDEO in content):
                raise ValueError(
                    f"media markers are only allowed in user messages, found one in a {role} "
                    "message"
                )
            if n == 0 and role != "system" and system_turn:
                chunks.append((IM_START, "system\n", IM_END))
            if role == "system":
                chunks.append((IM_START, "system\n" + content, IM_END))
            elif role == "user":
                text = self._expand_media(content, images, videos, cut, media)
                chunks.extend(_split_at_images(("\n", IM_START, "user\n" + text, IM_END)))
            elif role == "assistant":
                chunks.append(ASSISTANT_HEADER)
                if n == len(messages) - 1:  # the answer being generated: its content starts it
                    chunks.append((content,))
                else:
                    chunks.extend([(content, IM_END), (ENDOFTEXT,)])
            else:
                raise ValueError(f"unknown role {role!r} (use system, user or assistant)")
        if images or videos:
            raise ValueError(
                f"{len(images)} image(s) and {len(videos)} video(s) given without a matching "
                f"<|image|> / <|video|> marker in the user messages"
            )
        if add_generation_prompt and messages and messages[-1]["role"] != "assistant":
            chunks.append(ASSISTANT_HEADER)
        return chunks
