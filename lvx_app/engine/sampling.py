"""One token id from the logits: greedy, or temperature and nucleus (top-p) sampling.

It runs where the logits are (on the GPU too): only the chosen id comes back to the host. When
sampling, token i of an answer draws from a generator seeded with (seed, i), so every rank draws the
same token from the same logits, also a rank that skipped an earlier one.
"""

from __future__ import annotations

import torch

from lvx_app.config import GenerationConfig


def sample_next(
    logits: torch.Tensor,
    *,
    temperature: float = 0.0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """One token id (0-d int64 tensor, on the logits' device) from logits (V,): greedy at
    temperature 0, else temperature and top-p sampling."""
    if temperature <= 0:  # a cast changes no order: the argmax of the logits as they are
        return logits.argmax()
    logits = logits.float()
    # shifted so the best is 0: a tiny temperature (1e-300) sends the others to -inf, never the best
    # (an overflow to inf, or 0/0 where the temperature rounds to 0 in float32, made NaNs)
    shifted = logits - logits.max()
    logits = torch.where(shifted == 0, shifted, shifted / temperature)
    if top_p < 1.0:
        sorted_logits, order = logits.sort(descending=True)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs > top_p  # keep the smallest prefix whose mass reaches top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return torch.multinomial(logits.softmax(-1), 1, generator=generator)[0]


def sample_token(logits: torch.Tensor, generation: GenerationConfig, i: int) -> int:
    """Token `i` of an answer, as every rank draws it from the same logits."""
    generator = None
    if generation.temperature > 0:
        generator = torch.Generator(device=logits.device)
        generator.manual_seed((generation.seed * 1_000_003 + i) % 2**63)
    chosen = sample_next(
        logits, temperature=generation.temperature, top_p=generation.top_p, generator=generator
    )
    return int(chosen)  # the one host read of a decoding step
