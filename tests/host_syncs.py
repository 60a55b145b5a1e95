"""Host reads of tensors per decoded token, counted from outside (`host_reads`, every thread and
module of the process): the count over an answer of `short` tokens is taken from the count over one
of `long` tokens, so what a question costs once cancels out and the slope per token is left.
"""

from __future__ import annotations

from collections import Counter

from scripts.host_reads import counting_host_reads

__all__ = ["counting_host_reads", "counted_answers", "decode_reads", "per_token", "prefill_copies"]


def counted_answers(session, counts: Counter) -> list[int]:
    """Make the session's token loop record the host reads each answer made (into the returned
    list) and run to max_new_tokens (no stop token), so answers of known lengths can be compared."""
    per_answer: list[int] = []
    generator = session.generator
    real_answer = generator.answer
    generator.stop_ids = set()

    def answer(*args, **kwargs):
        before = sum(counts.values())
        yield from real_answer(*args, **kwargs)
        per_answer.append(sum(counts.values()) - before)

    generator.answer = answer
    return per_answer


def per_token(short: int, long: int, counts: list[int]) -> float:
    """The slope: host reads per decoded token between an answer of `short` and one of `long`
    tokens."""
    return (counts[1] - counts[0]) / (long - short)


def decode_reads(
    rank: int, world: int, checkpoint: str, video: str, short: int, long: int, sampling=None
):
    """Host reads per decoded token on this rank, over the engine of `world` ranks (one process when
    1): a video loaded, then an answer of `short` and one of `long` tokens (`sampling`: temperature,
    top_p). Rank 0 also returns the answers and their lengths."""
    from engine_configs import engine_config

    from lvx_app.engine.session import RankSession
    from lvx_app.parallel.group import init_distributed
    from lvx_app.runtime.control import ControlChannel
    from lvx_app.runtime.driver import GroupDriver, worker_loop

    config = engine_config(checkpoint)
    session = RankSession(config, init_distributed(cuda=False))
    channel = ControlChannel()
    with counting_host_reads() as counts:
        answers = counted_answers(session, counts)
        if rank != 0:
            worker_loop(session, channel)
            return per_token(short, long, answers)
        engine = GroupDriver(session, channel, config)
        engine.load_video(video)
        texts, tokens = [], []
        for n in (short, long):
            answer = engine.ask("what happens in the video?", max_new_tokens=n, **(sampling or {}))
            texts.append("".join(answer))
            tokens.append(engine.last_answer.new_tokens)
        engine.close()
    return per_token(short, long, answers), texts, tokens


def prefill_copies(rank: int, world: int, checkpoint: str, video: str) -> list[int]:
    """The `.cpu()` copies each `Conversation.prefill` of this rank made while the engine of
    `world` ranks loaded `video` (its sharded video-prompt prefill: the LV-XAttn rings)."""
    from engine_configs import engine_config

    from lvx_app.engine.conversation import Conversation
    from lvx_app.engine.session import RankSession
    from lvx_app.parallel.group import init_distributed
    from lvx_app.runtime.control import ControlChannel
    from lvx_app.runtime.driver import GroupDriver, worker_loop

    copies: list[int] = []
    real_prefill = Conversation.prefill

    def prefill(self, *args, **kwargs):
        with counting_host_reads() as reads:
            out = real_prefill(self, *args, **kwargs)
        copies.append(reads["cpu"])
        return out

    Conversation.prefill = prefill
    config = engine_config(checkpoint)
    session = RankSession(config, init_distributed(cuda=False))
    channel = ControlChannel()
    if rank != 0:
        worker_loop(session, channel)
        return copies
    engine = GroupDriver(session, channel, config)
    engine.load_video(video)
    engine.close()
    return copies
