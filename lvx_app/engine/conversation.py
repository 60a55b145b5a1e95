"""The text K/V cache this rank holds, and the forwards that extend it.

Every rank holds the whole cache (replicated after each sharded prefill) and the same `position`
(the global number of tokens fed). A prefill is either sharded over the ranks (the video prompt,
whose tokens travel with their frames in the layout; a long question, cut into contiguous runs) or
fed whole on every rank (a short question, each decoded token: every rank then holds the logits).
Every forward is handed the attention hooks it calls: the conversation's own (the sharded attention
`parallelize` made, else one process's local attention), or those of the answer it is part of (the
evidence recorder's, wrapping them).
Every forward and every write into the cache runs under `torch.inference_mode()`: no autograd
bookkeeping per op, and the cache's buffers are inference tensors, written only in that mode.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lvx_app.engine.parallelize import ShardedAttention
from lvx_app.parallel.group import DistInfo
from lvx_app.parallel.layout import token_owners
from lvx_app.parallel.shards import shard_bounds
from lvx_kernels.carry import Carry
from lvx_kernels.feed import REPLICATED, Feed
from lvx_models.api import AttentionHooks


class Conversation:
    """The text cache (its length is the one count of the tokens fed), the video the hyper layers
    attend to, and what waits to be fed before the next user turn (the closing `<|im_end|>`, a
    truncated answer's last token). `hooks`: the attention every forward calls unless handed
    others (the sharded attention's when `attn` is given)."""

    def __init__(
        self, model, info: DistInfo, attn: ShardedAttention | None, layout: str = "zigzag"
    ) -> None:
        self.model, self.info, self.attn, self.layout = model, info, attn, layout
        self.hooks = AttentionHooks() if attn is None else AttentionHooks(attn.text, attn.visual)
        self._visual = None
        self.clear()

    @property
    def position(self) -> int:
        """The global number of tokens fed, the position of the next: the text cache's length
        (every rank holds the whole cache)."""
        return self.cache.length

    @property
    def visual(self):
        """The visual inputs (`VisualInputs`) the hyper layers attend to, or None."""
        return self._visual

    def show_video(self, visual) -> None:
        """Let the hyper layers attend to `visual` from the next forward on (None: to nothing)."""
        self._visual = visual

    @property
    def pending(self) -> list[int]:
        """The tokens that end the last answer's turn, fed in front of the next question."""
        return list(self._pending)

    def end_turn(self, ids: Sequence[int]) -> None:
        """Keep `ids` (a truncated answer's last token, `<|im_end|>`) to feed before the next
        question; the next prefill feeds them with it."""
        self._pending = [int(t) for t in ids]

    def clear(self) -> None:
        """Forget every token."""
        self.cache = self.model.new_cache()
        self._pending: list[int] = []
        self.fed: list[int] = []  # the id of every token in the cache, in order
        self._fed_visual = None  # the visual inputs shown when the cache's first token was fed

    def truncate(self, length: int) -> None:
        """Keep the first `length` tokens (every rank holds the whole cache: local = global)."""
        self.cache.truncate(length)
        self._pending = []
        del self.fed[length:]

    @torch.inference_mode()
    def restore(
        self, layers: list[tuple[torch.Tensor, torch.Tensor]], positions, ids: Sequence[int] = ()
    ) -> None:
        """Take a saved prompt's whole text cache (every layer's k, v and their positions, which a
        whole cache holds at 0, 1, 2, ...); `ids`: its tokens."""
        length = layers[0][0].shape[1] if layers else 0
        if not torch.equal(torch.as_tensor(positions).view(-1).cpu(), torch.arange(length)):
            raise ValueError("a saved prompt's keys must sit at positions 0, 1, 2, ...")
        for i, (k, v) in enumerate(layers):
            self.cache.update(i, k, v)
        self.fed = [int(t) for t in ids]
        self._fed_visual = self._visual

    def held_prefix(self, ids: Sequence[int]) -> int:
        """How many of `ids`, from the first, the cache already holds (0 when the tokens it holds
        are not known, or were fed with another video shown: a family's rows before the first
        frame attend to it)."""
        if len(self.fed) != self.position or self._fed_visual is not self._visual:
            return 0
        held = 0
        for mine, theirs in zip(self.fed, ids):
            if mine != theirs:
                break
            held += 1
        return held

    def key_positions(self) -> torch.Tensor:
        """(1, length) global position of every cached key."""
        return torch.arange(self.cache.length).view(1, -1)

    def _forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor | None,
        feed: Feed,
        hooks: AttentionHooks | None = None,
    ):
        """The model on this rank's tokens `ids` at `positions` (a host tensor; None: the next
        positions after the cache, made on the device without a copy), fed as `feed` says, calling
        `hooks` (None: the conversation's); the last token's logits (1, 1, V). A forward that fails
        leaves the cache as it was."""
        start = self.cache.length
        if not start:
            self._fed_visual = self._visual
        try:
            with torch.inference_mode():
                return self.model(
                    ids.view(1, -1).to(self.info.device),
                    positions,
                    cache=self.cache,
                    visual=self._visual,
                    last_only=True,
                    feed=feed,
                    hooks=hooks or self.hooks,
                )
        except BaseException:
            self.cache.truncate(start)
            raise

    @torch.inference_mode()
    def prefill(
        self,
        ids: torch.Tensor,
        *,
        whole: bool = False,
        media_starts: torch.Tensor | None = None,
        tail_from: int | None = None,
        hooks: AttentionHooks | None = None,
    ) -> tuple[torch.Tensor | None, int]:
        """Feed `ids` (global), the pending tokens' turn over; return (this rank's last logits or
        None, the rank owning the last token). `whole`: fed alike on every rank; else sharded over
        the ranks, then the new text K/V are replicated. `hooks`: the answer's (None: the
        conversation's)."""
        n, cached = int(ids.numel()), self.cache.length
        if whole or self.attn is None:
            # fed whole, the tokens follow the cache (every rank holds all of it)
            mine, owner, positions, feed = torch.arange(n), 0, None, REPLICATED
        else:
            every, owner = self._share(n, media_starts, tail_from)
            mine, sizes = every[self.info.rank], [int(e.numel()) for e in every]
            positions = (cached + mine).view(1, -1)
            every = [cached + e for e in every]  # every rank's positions, known to every rank
            feed = self.attn.sharded_feed(positions, sizes, self.info.device, cached, every)
        logits = self._forward(ids[mine], positions, feed, hooks)
        if not feed.replicated:
            try:
                self.attn.replicate(self.cache, cached, positions, feed.sizes)
            except BaseException:
                self.cache.truncate(cached)
                raise
        self._pending = []
        self.fed.extend(ids.tolist())
        return (logits[0, -1] if mine.numel() else None), owner

    def _share(
        self, n: int, media_starts: torch.Tensor | None, tail_from: int | None
    ) -> tuple[list[torch.Tensor], int]:
        """(every rank's indices into the n new tokens, each sorted, in rank order; the rank
        holding the last one).

        The video prompt (`media_starts` given) travels with its frames in the session's layout, and
        its text after the last placeholder (from `tail_from`: it sees every frame) is dealt by the
        same layout; a question is cut into contiguous runs."""
        world = self.info.world_size
        if media_starts is not None:
            who = token_owners(n, media_starts, world, self.layout, tail_from)
            every = [torch.nonzero(who == r).flatten() for r in range(world)]
            return every, int(who[-1]) if n else 0
        every = [torch.arange(*shard_bounds(n, world, r)) for r in range(world)]
        owner = max((r for r in range(world) if every[r].numel()), default=0)
        return every, owner

    @torch.inference_mode()
    def feed(
        self, token: int, carry: Carry | None = None, hooks: AttentionHooks | None = None
    ) -> torch.Tensor:
        """One decoding step, alike on every rank: feed `token` (written on the device, not copied
        there), return the next logits (V,). `carry`: numbers that ride on the step's first visual
        combine; `hooks`: the answer's (None: the conversation's)."""
        ids = torch.full((1, 1), token, dtype=torch.int64, device=self.info.device)
        feed = REPLICATED if carry is None else Feed(carry=carry)
        logits = self._forward(ids, None, feed, hooks)[0, -1]
        self.fed.append(int(token))
        return logits

    def fed_in_place(self, token: int) -> None:
        """Count `token` as fed when a step outside `forward` has written its K/V in place at the
        next position (`StaticDecode`)."""
        self.cache.count_written(1)
        self.fed.append(int(token))

    def unfeed(self) -> None:
        """Take back the last token fed."""
        self.cache.truncate(self.cache.length - 1)
        del self.fed[self.position :]
