"""The text K/V cache this rank holds, and the forwards that extend it.

Every rank holds the whole cache (replicated after each sharded prefill) and the same `position`
(the global number of tokens fed). A prefill is either sharded over the ranks (the video prompt,
whose tokens travel with their frames in the layout; a long question, cut into contiguous runs) or
fed whole on every rank (a short question, each decoded token: every rank then holds the logits).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lvx_app.engine.parallelize import ShardedAttention
from lvx_app.parallel.group import DistInfo
from lvx_app.parallel.layout import token_owners
from lvx_app.parallel.shards import shard_bounds


class Conversation:
    """The text cache, the position of the next token, and what waits to be fed before the next
    user turn (the closing `<|im_end|>`, a truncated answer's last token)."""

    def __init__(
        self, model, info: DistInfo, attn: ShardedAttention | None, layout: str = "zigzag"
    ) -> None:
        self.model, self.info, self.attn, self.layout = model, info, attn, layout
        self.visual = None  # the video's visual inputs (`VisualInputs`), set when a video loads
        self.clear()

    def clear(self) -> None:
        """Forget every token."""
        self.cache = self.model.new_cache()
        self.position = 0
        self.pending: list[int] = []
        self.fed: list[int] = []  # the id of every token in the cache, in order
        if self.attn is not None:
            self.attn.truncate(0)

    def truncate(self, length: int) -> None:
        """Keep the first `length` tokens (every rank holds the whole cache: local = global)."""
        self.cache.truncate(length)
        if self.attn is not None:
            self.attn.truncate(length)
        self.position = length
        self.pending = []
        del self.fed[length:]

    def restore(
        self, layers: list[tuple[torch.Tensor, torch.Tensor]], positions, ids: Sequence[int] = ()
    ) -> None:
        """Take a saved prompt's whole text cache (every layer's k, v and their positions);
        `ids`: its tokens."""
        for i, (k, v) in enumerate(layers):
            self.cache.update(i, k, v)
        if self.attn is not None:
            self.attn.restore(positions)
        self.position = self.cache.length
        self.fed = [int(t) for t in ids]

    def held_prefix(self, ids: Sequence[int]) -> int:
        """How many of `ids`, from the first, the cache already holds (0 when the tokens it holds
        are not known)."""
        if len(self.fed) != self.position:
            return 0
        held = 0
        for mine, theirs in zip(self.fed, ids):
            if mine != theirs:
                break
            held += 1
        return held

    def key_positions(self) -> torch.Tensor:
        """(1, length) global position of every cached key."""
        if self.attn is not None:
            return self.attn.key_positions
        return torch.arange(self.cache.length).view(1, -1)

    def forward(
        self, ids: torch.Tensor, positions: torch.Tensor | None, *, replicated: bool, sizes=None
    ) -> torch.Tensor:
        """The model on this rank's tokens `ids` at `positions` (a host tensor; None: the next
        positions after the cache, made on the device without a copy); the last token's logits (1,
        1, V)."""
        if self.attn is not None:
            held = torch.arange(self.position, self.position + ids.numel())
            self.attn.begin(
                held if positions is None else positions, replicated=replicated, sizes=sizes
            )
        device = self.info.device
        with torch.no_grad():
            return self.model(
                ids.view(1, -1).to(device),
                None if positions is None else positions.view(1, -1),
                cache=self.cache,
                visual=self.visual,
                last_only=True,
            )

    def prefill(
        self,
        ids: torch.Tensor,
        *,
        whole: bool = False,
        media_starts: torch.Tensor | None = None,
        tail_from: int | None = None,
    ) -> tuple[torch.Tensor | None, int]:
        """Feed `ids` (global); return (this rank's last logits or None, the rank owning the last
        token). `whole`: fed alike on every rank; else sharded over the ranks, then the new text
        K/V are replicated."""
        n = int(ids.numel())
        if whole or self.attn is None:
            mine, owner, sizes = torch.arange(n), 0, None
        else:
            mine, owner, sizes = self._share(n, media_starts, tail_from)
        cached = self.cache.length
        # fed whole, the tokens follow the cache (every rank holds all of it)
        positions = None if whole or self.attn is None else self.position + mine
        logits = self.forward(ids[mine], positions, replicated=whole, sizes=sizes)
        if self.attn is not None and not whole:
            self.attn.replicate(self.cache, cached)
        self.position += n
        self.fed.extend(ids.tolist())
        return (logits[0, -1] if mine.numel() else None), owner

    def _share(
        self, n: int, media_starts: torch.Tensor | None, tail_from: int | None
    ) -> tuple[torch.Tensor, int, list[int]]:
        """(this rank's indices into the n new tokens, sorted; the rank holding the last one; every
        rank's number of tokens).

        The video prompt (`media_starts` given) travels with its frames in the session's layout, and
        its text after the last placeholder (from `tail_from`: it sees every frame) is dealt by the
        same layout; a question is cut into contiguous runs."""
        world, rank = self.info.world_size, self.info.rank
        if media_starts is not None:
            who = token_owners(n, media_starts, world, self.layout, tail_from)
            sizes = torch.bincount(who, minlength=world).tolist()
            return torch.nonzero(who == rank).flatten(), int(who[-1]) if n else 0, sizes
        bounds = [shard_bounds(n, world, r) for r in range(world)]
        sizes = [end - start for start, end in bounds]
        owner = max((r for r in range(world) if sizes[r]), default=0)
        return torch.arange(*bounds[rank]), owner, sizes

    def feed(self, token: int) -> torch.Tensor:
        """One decoding step, alike on every rank: feed `token` (written on the device, not copied
        there), return the next logits (V,)."""
        ids = torch.full((1, 1), token, dtype=torch.int64, device=self.info.device)
        logits = self.forward(ids, None, replicated=True)[0, -1]
        self._count(token)
        return logits

    def fed_in_place(self, token: int) -> None:
        """Count `token` as fed when a step outside `forward` has written its K/V in place at the
        next position (`StaticDecode`)."""
        for layer in self.cache.layers:
            layer.length += 1
        self._count(token)

    def _count(self, token: int) -> None:
        self.position += 1
        self.fed.append(int(token))

    def unfeed(self) -> None:
        """Take back the last token fed."""
        self.position -= 1
        del self.fed[self.position :]
        self.cache.truncate(self.cache.length - 1)
        if self.attn is not None:
            self.attn.truncate(self.cache.length)
