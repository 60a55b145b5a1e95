"""The answer's token loop, the one every rank runs in step, and the sampling of one token from
logits.

The loop knows nothing about ranks or caches: the session hands it a function that feeds one token
and returns the next logits, and one that makes every rank agree on the token and on rank 0's stop
flag. Tests drive the same loop with a single model in one process.

Agreeing costs a collective per token. Every rank computes the same logits, so a session can instead
feed its own token at once and learn in the same step's collectives whether it was rank 0's
(`carried`): rank 0 yields its token before that step (it is the agreed one), the others once the
step has agreed on it, and a token fed but not wanted (a stop flag, the final stop token) is taken
back (`unfeed`). The first token when a question's prefill ended on another rank, and the last one
of a truncated answer (never fed), are still agreed on their own.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Collection, Iterator, Optional

import torch

from lvx_app.engine.api import GenerationParams

# (this rank's token or None, this rank's stop flag, rank whose token counts) -> (agreed token,
# agreed stop flag)
Agree = Callable[[Optional[int], bool, int], tuple[int, bool]]
# (this rank's token, this rank's stop flag) -> (next logits, agreed token, agreed stop flag): feeds
# the token while the ranks agree on it (rank 0's), and leaves the agreed token fed
Carried = Callable[[int, bool], tuple[torch.Tensor, int, bool]]


def never_stop() -> bool:
    return False


def agree_alone(token: int | None, stop: bool, src: int) -> tuple[int, bool]:
    """The agreement of a single process: its own token and stop flag."""
    return int(token), stop


@dataclass
class LoopOutcome:
    """How the token loop ended, besides the tokens it yielded."""

    first_token_at: float | None = (
        None  # time.perf_counter() when the first token was agreed (for TTFT)
    )
    interrupted: bool = False  # should_stop() said so before a token was taken
    truncated: bool = False  # max_new_tokens reached without a stop token
    unfed: int | None = None  # a truncated answer's last token: sampled, not yet fed to the model


def _sample(logits: torch.Tensor, params: GenerationParams, i: int) -> int:
    """Token `i` of the answer from its logits; when sampling, a generator per token, so every rank
    draws the same, including one that skipped the first token (greedy needs none)."""
    generator = None
    if params.temperature > 0:
        generator = torch.Generator(device="cpu").manual_seed((params.seed * 1_000_003 + i) % 2**63)
    return int(
        sample_next(
            logits.float().cpu(),
            temperature=params.temperature,
            top_p=params.top_p,
            generator=generator,
        )
    )


def token_loop(
    logits: torch.Tensor | None,
    step: Callable[[int], torch.Tensor],
    params: GenerationParams,
    stop_ids: Collection[int],
    outcome: LoopOutcome,
    *,
    should_stop: Callable[[], bool] = never_stop,
    agree: Agree = agree_alone,
    first_src: int = 0,
    carried: Carried | None = None,
    unfeed: Callable[[], None] | None = None,
    carry_first: bool = False,
    leader: bool = True,
) -> Iterator[int]:
    """Yield the answer's token ids one at a time, a final stop token included.

    `logits` (V,) are the prompt's last logits, None on a rank that does not hold the prompt's last
    token (it takes rank `first_src`'s first token through `agree`; later tokens come from rank 0).
    `step(token)` feeds one token and returns the next logits; the last token of a truncated answer
    is not fed (`outcome.unfed`). With `carried` (and `unfeed`, which takes back the last token
    fed), tokens before the last are agreed inside the step that feeds them, the first one too when
    every rank holds the prompt's logits (`carry_first`); the cache ends as without it. The `leader`
    (rank 0, whose token is the agreed one) yields such a token before that step.
    """
    token, fed = None, False  # fed: `token` is already in the cache (agreed by `carried`)
    for i in range(params.max_new_tokens):
        if i and not fed:
            logits = step(token)
        mine = None if logits is None else _sample(logits, params, i)
        flag = should_stop()
        carry = carried is not None and i + 1 < params.max_new_tokens and (i > 0 or carry_first)
        # the leader's own token is the one agreed: show it at once
        early = carry and leader and not flag
        if early:
            if i == 0:
                outcome.first_token_at = time.perf_counter()
            yield mine
        if carry:
            logits, token, stop = carried(mine, flag)
        else:
            token, stop = agree(mine, flag, first_src if i == 0 else 0)
        fed = carry
        if i == 0 and not early:
            outcome.first_token_at = time.perf_counter()
        if fed and (stop or token in stop_ids):
            unfeed()
        if stop:
            outcome.interrupted = True
            return
        if not early:
            yield token
        if token in stop_ids:
            return
        if i == params.max_new_tokens - 1:
            outcome.truncated = True
            outcome.unfed = token
            return


def sample_next(
    logits: torch.Tensor,
    *,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    repetition_penalty: float = 1.0,
    seen: Optional[torch.Tensor] = None,
    generator: Optional[torch.Generator] = None,
) -> torch.Tensor:
    """One token id (0-d int64 tensor) from logits (V,): greedy at temperature 0, else temperature /
    top-k / top-p sampling. repetition_penalty (HF rule) divides positive and multiplies negative
    logits of `seen` ids."""
    logits = logits.float()
    if repetition_penalty != 1.0 and seen is not None and seen.numel():
        ids = seen.to(logits.device).unique()
        picked = logits[ids]
        logits = logits.clone()
        logits[ids] = torch.where(
            picked > 0, picked / repetition_penalty, picked * repetition_penalty
        )
    if temperature <= 0:
        return logits.argmax()
    logits = logits / temperature
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(descending=True)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs > top_p  # keep the smallest prefix whose mass reaches top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return torch.multinomial(logits.softmax(-1), 1, generator=generator)[0]
