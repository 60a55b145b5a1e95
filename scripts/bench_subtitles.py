"""What subtitles cost at load: finding and reading them, and choosing the lines the model sees.

A synthetic video (64x64, 1 fps) with one subtitle cue every 2.4 s, written once with a mov_text
stream inside it and once more as an .srt sidecar; then, per length: the embedded stream demuxed
with PyAV, the sidecar parsed, the lines at 1 fps sampled frames selected, and the token budget
applied with the tiny checkpoint's tokenizer.

    python scripts/bench_subtitles.py --minutes 10 60
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

from lvx_app.defaults import DEFAULT_SUBTITLE_TOKENS
from lvx_app.subtitles import fit_lines, read_embedded, resolve_subtitles, select_lines
from lvx_app.video.synthetic import add_subtitle_stream, make_video, write_srt
from lvx_models.mplug_owl3.processor import Owl3Processor
from lvx_models.mplug_owl3.tiny import write_tiny_checkpoint
from scripts.harness import show


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--minutes", type=float, nargs="+", default=[10, 60])
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="lvx-bench-subs-"))
    processor = Owl3Processor.from_pretrained(write_tiny_checkpoint(work / "tiny", "g2"))
    rows = []
    for minutes in args.minutes:
        seconds = int(minutes * 60)
        cues = [
            (i * 2.4, i * 2.4 + 2.2, f"spoken line {i} about what is on screen")
            for i in range(int(seconds / 2.4))
        ]
        plain = make_video(work / f"plain{minutes:g}.mp4", seconds, fps=1, width=64, height=64)
        video = add_subtitle_stream(plain, work / f"talk{minutes:g}.mp4", cues)
        embedded, demux_s = _timed(lambda: read_embedded(video))
        write_srt(work / f"talk{minutes:g}.srt", cues)
        sidecar, parse_s = _timed(lambda: resolve_subtitles(video, "auto"))
        assert sidecar.source.endswith(".srt") and len(sidecar.cues) == len(embedded.cues) == len(
            cues
        )
        lines, select_s = _timed(
            lambda: select_lines(sidecar.cues, [float(t) for t in range(seconds)])
        )
        kept, fit_s = _timed(
            lambda: fit_lines(lines, DEFAULT_SUBTITLE_TOKENS, lambda s: len(processor.encode(s)))
        )
        rows.append(
            {
                "minutes": minutes,
                "cues": len(cues),
                "embedded demux s": demux_s,
                "sidecar parse s": parse_s,
                "lines at frames": len(lines),
                "select s": select_s,
                f"kept in {DEFAULT_SUBTITLE_TOKENS} tokens": len(kept),
                "budget s": fit_s,
            }
        )
    show("subtitles at load (CPU)", rows)


if __name__ == "__main__":
    main()
