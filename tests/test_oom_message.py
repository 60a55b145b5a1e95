"""Running out of GPU memory stays that: the session says so in its own line with what to try, and
the attention backend that ran out stays in use (only a call an op rejects marks it broken). The
CUDA kernels are the CPU stand-ins of `cuda_standins`, one of which runs out of memory once."""

from __future__ import annotations

import pytest
import torch
from engine_configs import engine_config

from lvx_app.config import GenerationConfig
from lvx_app.engine.records import VideoRequest
from scripts.gloo_ranks import run_ranks

OOM = "CUDA out of memory. Tried to allocate 20.00 GiB"


def _out_of_memory_once(rank: int, world: int, checkpoint: str, video: str, when: str):
    """A bf16 session on the flash stand-in, which runs out of memory once, in the question's
    prefill or in the first decoding step (`when`): (the error line, the backends marked broken,
    the kernels of the next answer, whether it answered)."""
    from cuda_standins import Recorder, install

    from lvx_app.engine.session import RankSession
    from lvx_app.parallel.group import init_distributed
    from lvx_kernels import backends

    backends._on_cuda = lambda q: True
    backends._flash_attn = lambda: None  # the aten flash kernel is the first choice
    backends.KERNEL_OPS.update(install(Recorder()))
    real, armed = backends.KERNEL_OPS["flash_fwd"], [False]

    def flaky(*args, **kwargs):
        if armed[0]:
            armed[0] = False
            raise torch.OutOfMemoryError(OOM)
        return real(*args, **kwargs)

    session = RankSession(engine_config(checkpoint, dtype="bfloat16"), init_distributed(cuda=False))
    session.load_video(VideoRequest(video, session.config.video))
    generation = GenerationConfig(max_new_tokens=4)
    backends.KERNEL_OPS["flash_fwd"] = flaky
    if when == "question":
        armed[0] = True
    else:  # the first decoding step
        feed, first = session.conversation.feed, [True]

        def arming_feed(token, **kwargs):
            armed[0], first[0] = first[0], False
            return feed(token, **kwargs)

        session.conversation.feed = arming_feed
    try:
        "".join(session.ask("what happens in the video?", generation))
        line = None
    except RuntimeError as exc:
        line = str(exc)
    with backends.kernel_tally() as tally:
        answer = "".join(session.ask("and then?", generation))
    return line, dict(backends._broken), tally.ran("fwd"), bool(answer)


@pytest.mark.slow
def test_out_of_memory_is_the_sessions_line_and_the_backend_stays(tiny_checkpoints, short_video):
    for when, stage in (("question", "reading the question"), ("answer", "answering")):
        line, broken, ran, answered = run_ranks(
            _out_of_memory_once, 1, tiny_checkpoints["g2"], short_video, when
        )[0]
        assert line is not None and "\n" not in line
        assert f"rank 0 ran out of GPU memory while {stage}" in line, line
        assert "--gpus" in line and "--kv-mode recompute" in line
        assert broken == {} and "flash" in ran and answered, (broken, ran)
