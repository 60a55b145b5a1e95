"""How one forward's tokens lie over the ranks: what a sharded attention needs besides its tensors,
handed to it with the forward (as gpt-fast hands `input_pos`), never set on it before.

- Replicated (`sizes` None): every rank feeds the same tokens (a short question, each decoded
  token). Text attention is local over the whole text cache; the visual partials are combined in
  one collective (`decode_xattn`), on which `carry` rides.
- Sharded: each rank feeds its own tokens, `sizes` lists every rank's count (in rank order), and
  the causal text attention runs as an LV-XAttn ring whose media mask is `text_q_vis` (query
  position + 1) and `text_k_frame` (key positions): the same in every layer, so made once.
  `positions` holds every rank's query positions on the host, so the masks of the blocks a ring
  round receives are known there too (every rank computes the same layout).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from lvx_kernels.carry import Carry
from lvx_kernels.masks import MaskIndex


@dataclass(frozen=True)
class Feed:
    """One forward's tokens as the ranks feed them (module docstring)."""

    sizes: tuple[int, ...] | None = None  # every rank's token count; None: replicated
    text_q_vis: MaskIndex | None = None  # (1, L) this rank's query positions + 1
    text_k_frame: MaskIndex | None = None  # (1, S) positions of the keys this rank's ring attends
    carry: Carry | None = None  # numbers riding on the first replicated visual combine
    # every rank's query positions, (1, L_r) host tensors in rank order: a ring round plans the
    # query block it receives from its sender's host copy, not from the device
    positions: tuple[Tensor, ...] | None = None

    @property
    def replicated(self) -> bool:
        return self.sizes is None


REPLICATED = Feed()
