"""The official Video-MME multiple-choice prompt (benchmark README), with and without subtitles.

Parts, joined by newlines: [subtitle header + the selected subtitle lines], the instruction, the
question, the four options as stored ("A. Black."), and the answer cue. The video itself is not part
of this text: the engine places the frames where the model's chat template puts them.
"""

from __future__ import annotations

from typing import Sequence

from lvx_app.subtitles import SUBTITLE_HEADER, subtitle_block

__all__ = ["ANSWER_CUE", "INSTRUCTION", "PROMPT_VERSION", "SUBTITLE_HEADER", "build_prompt"]

PROMPT_VERSION = "videomme-official-1"

INSTRUCTION = (
    "Select the best answer to the following multiple-choice question based on the video. "
    "Respond with only the letter (A, B, C, or D) of the correct option."
)
ANSWER_CUE = "The best answer is:"


def build_prompt(
    question: str, options: Sequence[str], subtitles: Sequence[str] | None = None
) -> str:
    """The official prompt. ``subtitles`` are the already selected lines (see
    ``lvx_app.subtitles.select_lines``); None or an empty list gives the subtitle-free prompt, as
    the protocol does for a video without them. The subtitle block is `subtitle_block`'s, the same
    text `lvx chat` puts after the video."""
    parts = [subtitle_block(subtitles)] if subtitles else []
    parts += [INSTRUCTION, question, *options, ANSWER_CUE]
    return "\n".join(parts)
