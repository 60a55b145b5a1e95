"""mPLUG-Owl3's side of a prompt: the media it holds (`Prompt.media`) and the official
`media_offset` of a whole prompt (reference §5.5)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..surface import Prompt

NO_MEDIA = -1_000_000  # G1 media_offset value for a sample without images


@dataclass
class MediaItem:
    """One image or video of a prompt and the placeholders it became."""

    kind: str  # "image" | "video"
    num_placeholders: int  # 1, rows*cols+1 for a cut image, or the number of frames
    # (num_placeholders, 3, S, S); None for a video given as a frame count
    pixel_values: torch.Tensor | None
    cut: tuple[int, int] | None = None  # (rows, cols) of a cut image


def media_offset(prompt: Prompt, generation: str) -> torch.Tensor | list[torch.Tensor]:
    """The official `media_offset` of `prompt` (a whole prompt) as a batch of one: G2 the starts,
    G1 (1, L, 2) with [0, #{j : t > start_j}] (NO_MEDIA without images)."""
    if prompt.offset:
        raise ValueError(
            "media_offset describes a whole prompt from position 0; use media_starts for a "
            "follow-up"
        )
    starts = torch.tensor(prompt.media_starts, dtype=torch.int64)
    if generation == "g2":
        return [starts]
    L = prompt.input_ids.numel()
    out = torch.zeros(1, L, 2, dtype=torch.int64)
    if starts.numel() == 0:
        out[0, :, 1] = NO_MEDIA
    else:  # count[t] = #{j : t > start_j}
        out[0, :, 1] = torch.searchsorted(starts, torch.arange(L, dtype=torch.int64), right=False)
    return out
