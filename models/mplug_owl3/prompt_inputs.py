"""A tokenized prompt and the media it holds: what the processor hands the model and the engine."""

from __future__ import annotations

from dataclasses import dataclass

import torch

NO_MEDIA = -1_000_000  # G1 media_offset value for a sample without images


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
