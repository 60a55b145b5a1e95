"""Which visual keys each text row sees, and the local cross-attention under that mask.

The processor gives a mask per text token x image x tile (`cross_attention_mask`): a token sees the
real tiles of the images whose `<|image|>` span covers it (consecutive `<|image|>`s share one span,
which is what a video's frames are). A row that sees no tile at all (the text before the first
image) is a "masked-out" row: as transformers computes it, its attention is left unmasked (it
attends to every visual key, empty tiles included) and the layer drops its MLP output (Meta's
reference zeroes its attention output too; lvx follows transformers, what users compare with).

Visual keys are laid out image-major, then tile, then patch: unit u = image * tiles + tile holds
`tokens_per_unit` keys. The attention runs through lvx's kernels with GQA folded: when every row's
tiles are a prefix of the units in the order (real tiles by image, then the empty tiles), it is one
masked call with the media mask (`q_vis`, `k_frame`) that LV-XAttn shards; otherwise one call per
distinct set of units, on the keys of that set.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from lvx_kernels.kernels import attention


@dataclass(frozen=True)
class CrossVisibility:
    """sees: (L, U) bool, row l sees unit u; tokens_per_unit: keys per tile. Rows that see
    nothing have already been opened to every unit (`masked_out` says which). units: the unit of
    each `tokens_per_unit` keys of the K/V at hand, in their order (all units 0..U-1 when None; a
    rank holding some frames' K/V lists theirs)."""

    sees: torch.Tensor
    masked_out: torch.Tensor
    tokens_per_unit: int
    units: torch.Tensor | None = None

    @classmethod
    def from_token_mask(
        cls, mask: torch.Tensor, tokens_per_unit: int, units: torch.Tensor | None = None
    ) -> "CrossVisibility":
        """mask (L, images, tiles) of 0/1 for one sequence, as the processor makes it."""
        sees = mask.flatten(1).bool()
        masked_out = ~sees.any(dim=1)
        sees = sees | masked_out[:, None]
        return cls(sees, masked_out, tokens_per_unit, units)

    def held_units(self) -> torch.Tensor:
        return torch.arange(self.sees.shape[1]) if self.units is None else self.units.cpu()

    def last_row(self, rows: int) -> "CrossVisibility":
        """What `rows` tokens after this forward's last one see (a decoded token: the last span)."""
        return CrossVisibility(
            self.sees[-1:].expand(rows, -1),
            self.masked_out[-1:].expand(rows),
            self.tokens_per_unit,
            self.units,
        )

    @cached_property  # once per forward, not once per cross layer
    def media_mask(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(q_vis (1, L), k_frame (1, S_kv)) int64 when every row sees a prefix of the units
        ordered real tiles first (image by image), then the empty ones; else None."""
        real = self.sees[~self.masked_out].any(dim=0)  # the units some real row sees
        order = torch.cat([torch.nonzero(real).flatten(), torch.nonzero(~real).flatten()])
        rank = torch.empty_like(order)
        rank[order] = torch.arange(order.numel())
        count = self.sees.sum(dim=1)
        prefix = torch.arange(order.numel())[None, :] < count[:, None]
        if not torch.equal(self.sees[:, order], prefix):
            return None
        k_frame = rank[self.held_units()].repeat_interleave(self.tokens_per_unit)
        return count[None].to(torch.int64), k_frame[None].to(torch.int64)


def local_cross_attn(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, vis: CrossVisibility, layer: int
) -> torch.Tensor:
    """Cross-attention of q (1, L, Hq, D) to k, v (1, S_kv, Hkv, D) in one process -> (1, L, Hq,
    D)."""
    media = vis.media_mask
    if media is not None:
        q_vis, k_frame = (t.to(q.device) for t in media)
        return attention(q, k, v, q_vis=q_vis, k_frame=k_frame)[0]
    out = q.new_zeros(q.shape)
    patterns, group = torch.unique(vis.sees, dim=0, return_inverse=True)
    for i, pattern in enumerate(patterns):
        rows = torch.nonzero(group == i).flatten().to(q.device)
        held = pattern[vis.held_units()]
        keys = torch.nonzero(held.repeat_interleave(vis.tokens_per_unit)).flatten()
        keys = keys.to(k.device)
        part = attention(q[:, rows], k[:, keys], v[:, keys])[0]
        out = out.index_copy(1, rows, part)
    return out
