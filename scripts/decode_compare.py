"""Eager and static (CUDA-graph, compiled) decoding compared on one build: the same tokens fed to
both (teacher-forced), the logits compared after every one.

Equal greedy answers prove little with random weights (the top logits nearly tie, so a wrong step
may still pick the same token, and a right one a different token); the logits themselves are what
the two paths must agree on. Each step's difference is measured as its RMS over the eager logits'
RMS, and the comparison fails past `bound`:

    bound = sqrt(2 L + 1) * eps

with L the decoder layers and eps one unit in the last place of the dtype (bf16: 2^-8; float32,
whose outputs round less than its sums do, the error of a sum of up to 2^14 terms, 2^-16). Both
paths run the same weights on the same inputs; what may differ is how each sublayer's output is
rounded (another attention kernel: the static step's text attention reads the used keys of a
fixed buffer, the eager one a slice; a graph's kernels may pick other tilings). Each of the 2 L
sublayers (attention, MLP) and the LM head can then round its output to a different neighbour,
at most one unit each in relative size, and independent roundings add as a random walk: sqrt(2 L
+ 1) units. At 7B (28 layers) in bf16 that is 3.0e-2 of the logits' RMS. A step that reads a
stale buffer, the wrong position or keys past the used ones changes the logits by their own size
(a relative difference near 1), far past it.
"""

from __future__ import annotations

import math
import time

import torch

from lvx_app.engine.conversation import Conversation
from lvx_app.engine.static_decode import DecodeStep, StaticDecode

ULP = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-16}


def bound(layers: int, dtype: torch.dtype) -> float:
    """The largest relative logits difference the comparison lets pass (module docstring)."""
    return math.sqrt(2 * layers + 1) * ULP[dtype]


class LogitsTap:
    """The model as the static step calls it, with each decode step's last logits copied into one
    fixed buffer (inside a captured step too, so a replay refreshes it)."""

    def __init__(self, model) -> None:
        self.model, self.last = model, None

    def decode_step(self, *args, **kwargs):
        logits = self.model.decode_step(*args, **kwargs)
        if self.last is None:
            self.last = torch.empty_like(logits[0, -1])
        self.last.copy_(logits[0, -1])
        return logits


@torch.inference_mode()
def forced_logits(
    conversation: Conversation,
    prefix: int,
    tokens: list[int],
    step: DecodeStep | None,
    rides: bool = False,
    seconds: list[float] | None = None,
) -> list[torch.Tensor]:
    """The logits (V,) float32 after each of `tokens` is fed on top of the first `prefix` cached
    ones: by the eager loop (`step` None, `Conversation.feed`) or by a `StaticDecode` of `step`
    (`rides`: a group's, the fed token riding on its first visual combine, as the group decodes).
    With `seconds`, the tokens are fed twice on the same step (the first pass warms up and
    captures) and the second pass's time is appended there."""
    static = None if step is None else StaticDecode(conversation, step, rides)
    tap = None
    if static is not None:
        tap = LogitsTap(static.model)
        static.model = tap
    try:
        for _ in range(1 if seconds is None else 2):
            conversation.truncate(prefix)
            t0 = time.perf_counter()
            out = _one_pass(conversation, static, tap, tokens)
            if seconds is not None:
                _sync(conversation.info.device)
                seconds.append(time.perf_counter() - t0)
        return out
    finally:
        if static is not None:
            static.finish()
            conversation.truncate(prefix)


def _one_pass(conversation, static, tap, tokens: list[int]) -> list[torch.Tensor]:
    if static is None:
        return [conversation.feed(t).float().clone() for t in tokens]
    static.start(len(tokens) + 1)
    out = []
    for t in tokens:
        if static.carry is not None:
            static.next_token_riding(t, False)
        else:
            static.next_token(t)
        out.append(tap.last.float().clone())
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def compare(eager: list[torch.Tensor], other: list[torch.Tensor], limit: float) -> dict:
    """Every step's RMS difference over the eager logits' RMS, the worst, and whether it passes;
    also how many steps' top tokens differ (reported: near-ties make it noise)."""
    steps = [
        float((b - a).pow(2).mean().sqrt() / a.pow(2).mean().sqrt().clamp_min(1e-30))
        for a, b in zip(eager, other)
    ]
    worst = max(steps) if steps else 0.0
    return {
        "steps": len(steps),
        "max_relative_logits_difference": worst,
        "bound": limit,
        "ok": bool(steps) and worst <= limit,
        "per_step": steps,
        "top_token_differs": sum(int(a.argmax() != b.argmax()) for a, b in zip(eager, other)),
    }
