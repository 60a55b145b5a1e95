"""A group's static decode step against its eager loop, on every rank of a torchrun group: both
fed the same tokens (teacher-forced), each rank's logits compared after every one on one build.

Every rank builds the same random-weight model (7B-241101 shapes on GPUs, small ones on CPUs),
holds its share of a video's frames (random features, the engine's zigzag layout) behind the
sharded attention, and prefills the same video prompt. The eager loop then answers greedily (its
answer is the tokens both are fed) and the tokens are fed to each decoding in turn, twice (the
first pass warms up and captures): the eager loop, and the group's static step
(`lvx_app/engine/static_decode.py`: fixed buffers, bounded text attention, the fed token riding
on the first visual combine), captured as a CUDA graph where the group allows it (NCCL 2.9.6 on)
and run uncaptured otherwise (gloo: what `--cuda-graphs` itself does there). Each rank's logits
are compared as `scripts/decode_compare.py` compares one process's (the bookkeeping, the first
layer's K/V and output, the logits against a noise floor measured on the group), on untimed passes
of their own. Rank 0
writes tokens/s of both (the slowest rank's), every rank's largest difference and every
attention-kernel fallback (warm-up and capture included) to `--out`; the exit code is 1 when a
rank's comparison fails.

    torchrun --nproc-per-node 2 scripts/group_decode_compare.py --device cuda --out g.json
    torchrun --nproc-per-node 2 scripts/group_decode_compare.py --device cpu --minutes 0.1
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

if not __package__:  # `python3 scripts/NAME.py`: this checkout's packages, installed or not
    sys.path[0] = str(Path(__file__).resolve().parents[1])
    import scripts  # noqa: F401

from lvx_app.config import ModelConfig
from lvx_app.defaults import CHECK_TIMEOUT_S
from lvx_app.engine.conversation import Conversation
from lvx_app.engine.parallelize import ShardedAttention
from lvx_app.engine.static_decode import DecodeStep, decode_step
from lvx_app.parallel.group import DistInfo, destroy_distributed, init_distributed
from lvx_app.parallel.layout import owned
from lvx_kernels.backends import kernel_tally
from scripts.decode_compare import ULP, compare, floor_hooks, forced_logits, forced_trace
from scripts.harness import Rows, command_line, machine
from scripts.random_model import random_model


def group_prompt(model, minutes: float, info: DistInfo) -> tuple[Conversation, torch.Tensor]:
    """This rank's conversation, its share of the video shown and the video prompt prefilled
    alike on every rank, and the prompt's last logits."""
    cfg = model.config
    frames = max(info.world_size, int(minutes * 60))
    starts = 18 + 5 * torch.arange(frames)
    g = torch.Generator().manual_seed(1)  # the same prompt on every rank
    ids = torch.randint(0, cfg.vocab_size, (int(starts[-1]) + 5 + 24,), generator=g)
    attn = ShardedAttention(None, info.rank, info.world_size)
    conversation = Conversation(model, info, attn)
    mine = owned(frames, info.world_size, info.rank, conversation.layout)
    torch.manual_seed(2 + info.rank)  # each rank's own frames
    with torch.no_grad():
        dtype = next(model.parameters()).dtype
        shape = (len(mine), cfg.vision.num_patches, cfg.hidden_size)
        features = torch.randn(shape, device=info.device, dtype=dtype)
        visual = model.prepare_visual(features, starts, torch.tensor(mine, dtype=torch.int64))
        conversation.show_video(visual)
    logits, _ = conversation.prefill(ids, whole=True)
    return conversation, logits


def static_step(info: DistInfo) -> tuple[DecodeStep, str | None]:
    """The group's step as `--cuda-graphs` makes it here, and why it is not captured (or None)."""
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        step = decode_step(ModelConfig(cuda_graphs=True), info.device, info.world_size)
    return step, (str(said[0].message) if said else None)


def compare_on_rank(conversation, logits, new_tokens: int, step: DecodeStep) -> dict:
    """This rank's figures: the eager loop's greedy answer fed to both decodings, each twice (the
    second pass timed), the static step's logits against eager's at every step."""
    prefix = conversation.position
    answer = [agreed(logits)]
    with torch.inference_mode():
        for _ in range(new_tokens - 1):
            answer.append(agreed(conversation.feed(answer[-1])))
    conversation.truncate(prefix)
    eager_s: list[float] = []
    static_s: list[float] = []
    with kernel_tally() as tally:
        forced_logits(conversation, prefix, answer, None, seconds=eager_s)
        forced_logits(conversation, prefix, answer, step, rides=True, seconds=static_s)
        eager = forced_trace(conversation, prefix, answer, None)  # untimed: traced
        floor = forced_trace(conversation, prefix, answer, None, hooks=floor_hooks(conversation))
        static = forced_trace(conversation, prefix, answer, step, rides=True)
    dtype = next(conversation.model.parameters()).dtype
    return {
        "comparison": compare(eager, static, floor, ULP[dtype], exact_kv=not step.compiled),
        "seconds": {"eager": eager_s[-1], "static": static_s[-1]},
        "fallbacks": sorted(tally.fallbacks),
        "tokens": len(answer),
    }


def agreed(logits: torch.Tensor) -> int:
    """Rank 0's greedy token, on every rank (as the group agrees on each token it decodes)."""
    token = logits.argmax().view(1)
    dist.broadcast(token, 0)
    return int(token)


def gathered(mine: dict, info: DistInfo) -> list[dict]:
    """Every rank's figures, in rank order (on every rank)."""
    every: list = [None] * info.world_size
    dist.all_gather_object(every, mine)
    return every


def summary(every: list[dict], step: DecodeStep, why: str | None) -> tuple[list[dict], dict]:
    """(the two modes' rows, the comparison entry) from every rank's figures: tokens/s at the
    slowest rank's time, the worst rank's difference."""
    tokens = every[0]["tokens"]
    name = "static step (CUDA graph)" if step.graphs else "static step (uncaptured)"
    rows = [
        {"mode": mode, "tokens_per_s": tokens / max(r["seconds"][key] for r in every)}
        for mode, key in (("eager", "eager"), (name, "static"))
    ]
    per_rank = [r["comparison"] for r in every]
    worst = max(per_rank, key=lambda c: c["max_relative_logits_difference"])
    entry = {
        **worst,
        "ok": all(c["ok"] for c in per_rank),
        "ranks": len(every),
        "per_rank": [c["max_relative_logits_difference"] for c in per_rank],
        "captured": step.graphs,
        "not_captured_because": why,
    }
    return rows, {f"{name} on {len(every)} ranks": entry}


def run(info: DistInfo, shape: str, minutes: float, new_tokens: int) -> dict:
    """The whole check on this rank; every rank returns the group's result."""
    dtype = torch.bfloat16 if info.device.type == "cuda" else torch.float32
    model = random_model(shape, info.device, dtype)
    conversation, logits = group_prompt(model, minutes, info)
    step, why = static_step(info)
    every = gathered(compare_on_rank(conversation, logits, new_tokens, step), info)
    rows, comparison = summary(every, step, why)
    fallbacks = sorted({f for r in every for f in r["fallbacks"]})
    return {"rows": rows, "comparison": comparison, "fallbacks": fallbacks, "shape": shape}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shape", choices=["7b", "small"], default=None, help="7b on GPUs")
    parser.add_argument("--minutes", type=float, default=10.0, help="video length at 1 fps")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--out", type=Path, default=None, help="the JSON (rank 0 writes it)")
    parser.add_argument("--out-key", help="write it under this key of the JSON file")
    args = parser.parse_args(argv)
    cuda = torch.device(args.device).type == "cuda"
    shape = args.shape or ("7b" if cuda else "small")
    info = init_distributed(cuda=cuda, timeout_s=CHECK_TIMEOUT_S)
    try:
        result = run(info, shape, args.minutes, args.new_tokens)
    finally:
        destroy_distributed()
    if info.rank == 0:
        rows = Rows(args.out, args.out_key, command=command_line(), machine=machine(args.device))
        for row in result.pop("rows"):
            rows.add(row)
        rows.save(**result)
        for name, c in result["comparison"].items():
            state = "ok" if c["ok"] else "FAILED"
            print(f"{name} vs eager, teacher-forced: logits differ by at most "
                  f"{c['max_relative_logits_difference']:.2e} of their RMS over {c['steps']} "
                  f"steps on the worst rank (bound {c['bound']:.2e}): {state}")  # fmt: skip
        print({r["mode"]: round(r["tokens_per_s"], 2) for r in rows.rows}, flush=True)
    return 0 if all(c["ok"] for c in result["comparison"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
