"""An answer's token loop, the one every rank runs in step.

Every rank computes the same logits, so every rank samples the same token and feeds it at once; the
ranks agree on rank 0's token (and rank 0's stop flag, set by Ctrl-C or Stop) inside that step's
first visual combine, where the token rides along (a `Carry` fed with the step): no collective of
its own per token, which measured 1.17x faster decoding on 2 CPU ranks than a broadcast per token. A
step whose token was not rank 0's is redone alike on every rank; a token fed but not wanted (a stop
flag, the final stop token) is taken back. Rank 0 shows its token before that step (it is the agreed
one by definition). The first token when a long question's prefill ended on another rank, and the
last token of a truncated answer (never fed), are agreed by a broadcast of their own. Asked for
`--cuda-graphs` or `--compile-decode`, a greedy answer's steps run on the session's `StaticDecode`
(on a group the token and the stop flag ride inside its step alike).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from lvx_app.config import GenerationConfig
from lvx_app.engine.conversation import Conversation
from lvx_app.engine.records import EngineWarning
from lvx_app.engine.sampling import sample_token
from lvx_app.engine.static_decode import DecodeStep, StaticDecode
from lvx_app.parallel.collectives import on_wire
from lvx_kernels.carry import Carry
from lvx_models.api import AttentionHooks


def never_stop() -> bool:
    return False


@dataclass
class LoopOutcome:
    """How the token loop ended, besides the tokens it yielded."""

    first_token_at: float | None = None  # time.perf_counter() when the first token was known
    interrupted: bool = False  # the stop flag was set before a token was taken
    truncated: bool = False  # max_new_tokens reached without a stop token
    unfed: int | None = None  # a truncated answer's last token: sampled, not yet fed


class Generator:
    """The answer loop of this rank over its `Conversation`."""

    def __init__(
        self, conversation: Conversation, stop_ids: Collection[int], step: DecodeStep = DecodeStep()
    ) -> None:
        self.conversation, self.step = conversation, step
        self.stop_ids = set(stop_ids)
        info = conversation.info
        self.leader = info.rank == 0
        # a group whose model has hyper layers: tokens ride on the first visual combine
        self.rides = conversation.attn is not None and bool(
            conversation.model.config.cross_layer_indices
        )
        self.diverged = False  # the ranks once decoded different tokens (warned once)
        self.static: StaticDecode | None = None  # the session's static step, made at first use

    @torch.inference_mode()  # each resume of the loop, not only its first
    def answer(
        self,
        logits: torch.Tensor | None,
        first_src: int | None,
        generation: GenerationConfig,
        outcome: LoopOutcome,
        should_stop: Callable[[], bool] = never_stop,
        hooks: AttentionHooks | None = None,
    ) -> Iterator[int]:
        """Yield the answer's token ids, a final stop token included. `logits` (V,): the prompt's
        last, None on a rank without them; `first_src`: the rank holding them when not every rank
        does (None: all do). `should_stop` (rank 0's: Ctrl-C, Stop) is read before each token.
        `hooks`: the attention the answer's forwards call (None: the conversation's)."""
        static = None
        if self.step.used_for(generation):
            if self.static is None:  # one per session: its capture serves every later answer
                self.static = StaticDecode(self.conversation, self.step, self.rides)
            static = self.static
            static.start(generation.max_new_tokens)
        try:
            yield from self._tokens(
                logits, first_src, generation, outcome, should_stop, static, hooks
            )
        finally:
            if static is not None:
                static.finish()

    def _tokens(
        self,
        logits: torch.Tensor | None,
        first_src: int | None,
        generation: GenerationConfig,
        outcome: LoopOutcome,
        should_stop: Callable[[], bool],
        static: StaticDecode | None,
        hooks: AttentionHooks | None,
    ) -> Iterator[int]:
        """`answer`'s token loop; `static`: the step that decodes it, when one does."""
        last = generation.max_new_tokens - 1
        # without a video the hyper layers make no visual combine to ride on
        rides = self.rides and self.conversation.visual is not None
        chosen = None  # the next token, once the static step chose it on the device
        for i in range(generation.max_new_tokens):
            mine = chosen if chosen is not None else self._sampled(logits, generation, i)
            flag = should_stop()
            ride = rides and i < last and (i > 0 or first_src is None)
            early = ride and self.leader and not flag  # rank 0's token is the agreed one
            if early:
                outcome.first_token_at = outcome.first_token_at or time.perf_counter()
                yield mine
            if ride and static is not None:
                token, stop, chosen = self._static_agreeing(static, mine, flag)
            elif ride:
                logits, token, stop = self._feed_agreeing(mine, flag, hooks)
            else:
                token, stop = self._agree(mine, flag, 0 if i or first_src is None else first_src)
            outcome.first_token_at = outcome.first_token_at or time.perf_counter()
            if stop:
                outcome.interrupted = True
                return
            if not early:
                yield token
            if token in self.stop_ids:
                return
            if i == last:
                outcome.truncated, outcome.unfed = True, token
                return
            if ride:  # fed already, as the ranks agreed on it
                continue
            if static is not None:
                chosen = static.next_token(token)
            else:
                logits = self.conversation.feed(token, hooks=hooks)

    @staticmethod
    def _sampled(logits: torch.Tensor | None, generation: GenerationConfig, i: int) -> int | None:
        return None if logits is None else sample_token(logits, generation, i)

    def _feed_agreeing(
        self, token: int, stop: bool, hooks: AttentionHooks | None
    ) -> tuple[torch.Tensor, int, bool]:
        """Feed this rank's own token while the ranks agree on rank 0's token and stop flag; leave
        the agreed token fed, unless it stops the answer."""
        conversation = self.conversation
        carry = Carry([token, int(stop)])
        logits = conversation.feed(token, carry, hooks)
        # (ranks, 2), every decoding step runs the hyper layers: the step's one read of the group
        got = carry.received.tolist()
        (agreed, agreed_stop), tokens = got[0], [row[0] for row in got]
        agreed_stop = bool(agreed_stop)
        if not agreed_stop and any(t != agreed for t in tokens):
            self._warn_diverged(tokens)
            conversation.unfeed()
            logits = conversation.feed(agreed, hooks=hooks)
        if agreed_stop or agreed in self.stop_ids:
            conversation.unfeed()
        return logits, agreed, agreed_stop

    def _static_agreeing(
        self, static: StaticDecode, token: int, stop: bool
    ) -> tuple[int, bool, int | None]:
        """`_feed_agreeing` on the static step: (the agreed token, rank 0's stop flag, this rank's
        greedy next token once the agreed one is fed, or None when it is taken back)."""
        got, chosen = static.next_token_riding(token, stop)
        (agreed, agreed_stop), tokens = got[0], [row[0] for row in got]
        agreed_stop = bool(agreed_stop)
        if not agreed_stop and any(t != agreed for t in tokens):
            self._warn_diverged(tokens)
            static.take_back()
            _, chosen = static.next_token_riding(agreed, stop)
        if agreed_stop or agreed in self.stop_ids:
            static.take_back()
            chosen = None
        return agreed, agreed_stop, chosen

    def _warn_diverged(self, tokens: list[int]) -> None:
        if self.leader and not self.diverged:  # once: such ranks may differ at every token
            warnings.warn(
                f"the ranks decoded different tokens ({tokens}); rank 0's is used:"
                " their logits differ, so answers may differ from one process's",
                EngineWarning,
            )
        self.diverged = True

    def _agree(self, token: int | None, stop: bool, src: int) -> tuple[int, bool]:
        """Every rank takes rank `src`'s token and rank 0's stop flag (a collective of its own)."""
        if self.conversation.attn is None:  # one rank
            return int(token), stop
        device = self.conversation.info.device
        box = on_wire(torch.tensor([-1 if token is None else token, int(stop)]), device)
        if src == 0:
            dist.broadcast(box, src=0)
            return int(box[0]), bool(box[1])
        tok, flag = box.clone(), box.clone()
        dist.broadcast(tok, src=src)
        dist.broadcast(flag, src=0)
        return int(tok[0]), bool(flag[1])
