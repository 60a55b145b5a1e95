"""Aten ops dispatched inside a block, counted by name: on a CPU the stand-in for the kernels a GPU
would launch (each aten op that computes is one launch, and each costs host time to dispatch).

`decode_ops` counts them per decoded token around the engine's own answer loop; the decode test
holds the tiny checkpoint to a bound with it, `bench_decode_ops.py` reports it at 7B depth and
`bench_decode.py` beside its other per-token figures.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

SHORT, LONG = 8, 40  # the two answers whose difference gives the count per token


class AtenOps(TorchDispatchMode):
    """Counts the aten ops dispatched inside it: `count` in all, `by_name` per op."""

    def __init__(self) -> None:
        super().__init__()
        self.by_name: Counter = Counter()

    @property
    def count(self) -> int:
        return sum(self.by_name.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.by_name[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def decode_ops(model, frames: int = 3, seed: int = 0) -> tuple[float, Counter, list[int]]:
    """(aten ops per decoded token, per token by op name, the longer answer) of `model` in one
    process on the CPU: a prompt with `frames` random frames prefilled once, then a greedy answer
    of SHORT and one of LONG tokens through the engine's token loop (`Generator`), counted; the
    difference over LONG - SHORT tokens leaves what a question costs once out."""
    from lvx_app.config import GenerationConfig
    from lvx_app.engine.conversation import Conversation
    from lvx_app.engine.generator import Generator, LoopOutcome
    from lvx_app.parallel.group import DistInfo

    cfg = model.config
    one = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend=None)
    g = torch.Generator().manual_seed(seed)
    conversation = Conversation(model, one, None)
    dtype = model.language_model.model.embed_tokens.weight.dtype
    features = torch.randn(frames, cfg.vision.num_patches, cfg.hidden_size, generator=g)
    starts = 2 + 4 * torch.arange(frames)
    conversation.show_video(model.prepare_visual(features.to(dtype), starts))
    ids = torch.randint(0, cfg.vocab_size, (int(starts[-1]) + 9,), generator=g)
    logits, _ = conversation.prefill(ids, whole=True)
    prompt, counts, answer = conversation.position, [], []
    for tokens in (SHORT, LONG):
        conversation.truncate(prompt)
        with AtenOps() as ops:
            loop = Generator(conversation, ()).answer(
                logits, None, GenerationConfig(tokens), LoopOutcome()
            )
            answer = list(loop)
        counts.append(ops.by_name)
    per_name = counts[1].copy()
    per_name.subtract(counts[0])
    per_token = Counter({k: v / (LONG - SHORT) for k, v in per_name.items() if v})
    return sum(per_name.values()) / (LONG - SHORT), per_token, answer
