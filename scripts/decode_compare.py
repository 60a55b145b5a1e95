"""Eager and static (CUDA-graph, compiled) decoding compared on one build: the same tokens fed to
both (teacher-forced), with what each step wrote and computed recorded after every one
(`forced_trace`), and compared (`compare`):

- bookkeeping: the position each token is written at and the keys it sees (the static step's
  device counters, eager's host-side cache length) must be equal at every step;
- the first decoder layer's K/V of each fed token must be bit-equal (both paths compute them with
  the same ops from the same inputs; a static step that writes at a wrong position, or whose RoPE
  reads a wrong one, differs);
- the first decoder layer's output for the fed token, and the logits, may differ by at most
  `NOISE_FACTOR` times a noise floor measured in the same run: the same eager loop with its text
  attention on a second backend (`second_backend`) against eager's own, step by step. What may
  differ between eager and the static step is how their kernels round (the static step's text
  attention reads the used keys of a fixed buffer, eager's a slice; a graph's kernels may pick
  other tilings): the floor is that difference for another kernel, measured, not a formula (the
  roundings of a deep network do not add like a random walk: at a 7B-like weight scale a correct
  step differs by more than such a formula allows, and one reading one key too many by less).

Equal greedy answers prove little with random weights (the top logits nearly tie), so they are
reported only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from lvx_app.engine.conversation import Conversation
from lvx_app.engine.static_decode import DecodeStep, StaticDecode
from lvx_kernels.kernels import attention
from lvx_models.api import AttentionHooks

# one unit of each dtype: the least noise floor the bound takes (two runs that differ by nothing
# measurable still round at this scale on another build)
ULP = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-16}


NOISE_FACTOR = 4.0  # how many times the measured noise floor a difference may be


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


def first_layer(model) -> torch.nn.Module:
    """The model's first decoder layer (`language_model.model.layers[0]`)."""
    return model.language_model.model.layers[0]


class FirstLayerTap:
    """The first decoder layer's output for the last fed token, copied by a forward hook into one
    buffer made beforehand (inside a captured or compiled step too, so a replay refreshes it)."""

    def __init__(self, model) -> None:
        layer = first_layer(model)
        weight = next(layer.parameters())
        self.last = torch.zeros(model.config.hidden_size, dtype=weight.dtype, device=weight.device)
        self.handle = layer.register_forward_hook(self._copy)

    def _copy(self, module, args, output) -> None:
        self.last.copy_(output[0, -1])

    def close(self) -> None:
        self.handle.remove()


@dataclass
class Trace:
    """What each fed token's step computed and wrote: the logits (V,) and first layer's output
    (hidden,) in float32, that layer's K/V written for the token, and (position it was written at,
    keys it saw)."""

    logits: list[torch.Tensor] = field(default_factory=list)
    hidden: list[torch.Tensor] = field(default_factory=list)
    kv: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    counters: list[tuple[int, int]] = field(default_factory=list)


@torch.inference_mode()
def forced_trace(
    conversation: Conversation,
    prefix: int,
    tokens: list[int],
    step: DecodeStep | None,
    rides: bool = False,
    seconds: list[float] | None = None,
    hooks: AttentionHooks | None = None,
    traced: bool = True,
) -> Trace:
    """What each of `tokens`, fed on top of the first `prefix` cached ones, computed: by the eager
    loop (`step` None, `Conversation.feed` with `hooks`, None: the conversation's) or by a
    `StaticDecode` of `step` (`rides`: a group's, the fed token riding on its first visual combine,
    as the group decodes). `traced` False: the logits only (no host read but the token's). With
    `seconds`, the tokens are fed twice on the same step (the first pass warms up and captures)
    and the second pass's time is appended there."""
    static = None if step is None else StaticDecode(conversation, step, rides)
    tap = None
    if static is not None:
        tap = LogitsTap(static.model)
        static.model = tap
    first = FirstLayerTap(conversation.model) if traced else None
    try:
        for _ in range(1 if seconds is None else 2):
            conversation.truncate(prefix)
            t0 = time.perf_counter()
            out = _one_pass(conversation, static, tap, first, tokens, hooks)
            if seconds is not None:
                _sync(conversation.info.device)
                seconds.append(time.perf_counter() - t0)
        return out
    finally:
        if first is not None:
            first.close()
        if static is not None:
            static.finish()
            conversation.truncate(prefix)


def forced_logits(conversation, prefix, tokens, step, rides=False, seconds=None):
    """The logits (V,) float32 after each of `tokens` is fed (`forced_trace`, untraced)."""
    return forced_trace(conversation, prefix, tokens, step, rides, seconds, traced=False).logits


def _one_pass(conversation, static, tap, first, tokens: list[int], hooks) -> Trace:
    trace = Trace()
    if static is not None:
        static.start(len(tokens) + 1)
    for t in tokens:
        if first is not None:  # where the token goes and what it sees, before its step
            length = conversation.cache.length
            counters = (length, length + 1)
            if static is not None:
                counters = (int(static.position), int(static.used))
            trace.counters.append(counters)
        if static is None:
            trace.logits.append(conversation.feed(t, hooks=hooks).float().clone())
        else:
            if static.carry is not None:
                static.next_token_riding(t, False)
            else:
                static.next_token(t)
            trace.logits.append(tap.last.float().clone())
        if first is not None:
            layer, at = conversation.cache.layers[0], conversation.cache.length - 1
            trace.kv.append((layer.k[0, at].clone(), layer.v[0, at].clone()))
            trace.hidden.append(first.last.float().clone())
    return trace


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def second_backend(device: torch.device) -> str:
    """The text attention backend of the noise floor's run: another kernel than the one the engine
    picks for a decoded token (the memory-efficient kernel on a GPU, the float32 reference on a
    CPU)."""
    return "efficient" if device.type == "cuda" else "math"


def floor_hooks(conversation: Conversation) -> AttentionHooks:
    """The conversation's attention hooks with the text attention on `second_backend`."""
    backend = second_backend(conversation.info.device)

    def text(q, k, v, step, layer):
        return attention(q, k, v, causal=True, backend=backend, alibi=getattr(step, "alibi", None))

    return AttentionHooks(text=text, visual=conversation.hooks.visual)


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((b - a).pow(2).mean().sqrt() / a.pow(2).mean().sqrt().clamp_min(1e-30))


def _within_floor(eager, other, floor, unit: float) -> dict:
    """Every step's RMS difference over eager's RMS, the floor's, and the bound they set."""
    steps = [_relative(a, b) for a, b in zip(eager, other)]
    noise = [_relative(a, b) for a, b in zip(eager, floor)]
    limit = NOISE_FACTOR * max([unit, *noise])
    worst = max(steps, default=0.0)
    return {"max": worst, "noise_floor": max(noise, default=0.0), "bound": limit,
            "ok": bool(steps) and worst <= limit, "per_step": steps}  # fmt: skip


def compare(eager: Trace, other: Trace, floor: Trace, unit: float, exact_kv: bool = True) -> dict:
    """`other` against `eager`, fed the same tokens (module docstring): the logits and the first
    layer's output within NOISE_FACTOR times the noise floor `floor` measured (at least `unit`,
    the dtype's), the bookkeeping equal, and (`exact_kv`: an uncompiled step) the first layer's
    K/V bit-equal. `why` names what failed."""
    logits = _within_floor(eager.logits, other.logits, floor.logits, unit)
    hidden = _within_floor(eager.hidden, other.hidden, floor.hidden, unit)
    kv = sum(not (torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]))
             for a, b in zip(eager.kv, other.kv))  # fmt: skip
    counters = [i for i, (a, b) in enumerate(zip(eager.counters, other.counters)) if a != b]
    why = [
        *([f"logits off by {logits['max']:.2e} of their RMS (bound {logits['bound']:.2e})"]
          if not logits["ok"] else []),
        *([f"first layer's output off by {hidden['max']:.2e} (bound {hidden['bound']:.2e})"]
          if not hidden["ok"] else []),
        *([f"first layer's K/V differ at {kv} steps"] if kv and exact_kv else []),
        *([f"step {counters[0]} writes at / sees {other.counters[counters[0]]}, eager "
           f"{eager.counters[counters[0]]}"] if counters else []),
    ]  # fmt: skip
    return {
        "steps": len(logits["per_step"]),
        "max_relative_logits_difference": logits["max"],
        "noise_floor": logits["noise_floor"],
        "bound": logits["bound"],
        "first_layer": {k: v for k, v in hidden.items() if k != "per_step"},
        "kv_steps_differing": kv,
        "bookkeeping_steps_differing": len(counters),
        "ok": not why,
        "why": "; ".join(why),
        "per_step": logits["per_step"],
        "top_token_differs": sum(
            int(a.argmax() != b.argmax()) for a, b in zip(eager.logits, other.logits)
        ),
    }
