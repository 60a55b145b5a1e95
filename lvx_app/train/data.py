"""Finetuning data: JSONL conversations about videos, tokenised with the model's chat template.

One line per sample, either {"video": "clip.mp4", "conversations": [{"from": "human", "value":
    "..."}, {"from": "gpt", "value": "..."}, ...]} (`role`/`content` with user/assistant work too),
    or {"video": "clip.mp4", "question": "...", "answer": "..."} (`question`/`answer` may also be
    equal-length lists: a multi-turn conversation). `video` is relative to `--video-dir` (or
    absolute). The video goes first in the first user turn as `<|video|>\\n`, exactly as the chat
    engine asks its questions, unless that turn already holds a `<|video|>` marker.

The sequence is the model's own training template (its processor's `training_prompt`: for
mPLUG-Owl3 every answer is followed by `<|im_end|>` and `<|endoftext|>`, for Llama-3.2-Vision by
`<|eot_id|>`); only the tokens the processor marks (each answer and its end tokens) carry a loss.
Tokens after the last answer are dropped.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

IGNORE = -100
VIDEO_MARKER = "<|video|>"
_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
}


class DataError(ValueError):
    """A problem in the training data the user must fix; the message names the file and line."""


@dataclass
class Sample:
    """One conversation about one video."""

    video: Path
    messages: list[dict[str, str]]
    source: str  # "file:line", for error messages


def _messages(obj: dict[str, Any], where: str) -> list[dict[str, str]]:
    if "conversations" in obj:
        conv = obj["conversations"]
        if not isinstance(conv, list) or not conv:
            raise DataError(f"{where}: 'conversations' must be a non-empty list of turns")
        out = []
        for turn in conv:
            role = turn.get("role", turn.get("from"))
            text = turn.get("content", turn.get("value"))
            if role not in _ROLES or not isinstance(text, str):
                raise DataError(
                    f"{where}: each turn needs 'from'/'role' (human, gpt, user, assistant, system) "
                    f"and 'value'/'content' text, got {turn!r:.120}"
                )
            out.append({"role": _ROLES[role], "content": text})
    elif "question" in obj and "answer" in obj:
        qs, ans = obj["question"], obj["answer"]
        qs, ans = ([qs], [ans]) if isinstance(qs, str) else (qs, ans)
        if not isinstance(qs, list) or not isinstance(ans, list) or len(qs) != len(ans) or not qs:
            raise DataError(
                f"{where}: 'question' and 'answer' must be two strings or two lists of equal length"
            )
        out = [
            m
            for q, a in zip(qs, ans)
            for m in ({"role": "user", "content": str(q)}, {"role": "assistant", "content": str(a)})
        ]
    else:
        raise DataError(f"{where}: a sample needs 'conversations', or 'question' and 'answer'")
    if not any(m["role"] == "assistant" for m in out):
        raise DataError(f"{where}: no assistant answer to learn from")
    users = [m for m in out if m["role"] == "user"]
    if not users:
        raise DataError(f"{where}: no user turn")
    if any(VIDEO_MARKER in m["content"] for m in out if m is not users[0]):
        raise DataError(
            f"{where}: only the first user turn may hold the {VIDEO_MARKER} marker (one video per "
            "sample)"
        )
    if VIDEO_MARKER not in users[0]["content"]:
        users[0]["content"] = f"{VIDEO_MARKER}\n{users[0]['content']}"
    return out


def load_jsonl(path: str | Path, video_dir: str | Path | None = None) -> list[Sample]:
    """Read and check every sample (missing videos are reported here, before any training
    starts)."""
    path = Path(path)
    if not path.exists():
        raise DataError(
            f"{path} not found; pass --data with a JSONL file of {{video, conversations}} samples"
        )
    base = Path(video_dir) if video_dir is not None else path.parent
    samples: list[Sample] = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            obj = json.loads(line)
        except ValueError as e:
            raise DataError(f"{where}: not valid JSON ({e})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("video"), str):
            raise DataError(f"{where}: each line must be an object with a 'video' file name")
        video = Path(obj["video"])
        video = video if video.is_absolute() else base / video
        if not video.exists():
            raise DataError(f"{where}: video {video} not found; check --video-dir")
        samples.append(Sample(video, _messages(obj, where), where))
    if not samples:
        raise DataError(f"{path} holds no samples")
    return samples


@dataclass
class Tokenized:
    """A training sequence: ids, next-token labels (IGNORE outside assistant answers) and frame
    placeholders."""

    input_ids: torch.Tensor  # (L,) int64
    labels: torch.Tensor  # (L,) int64: labels[t] is the target of the logits at t (already shifted)
    media_starts: torch.Tensor  # (N_frames,) int64

    @property
    def num_targets(self) -> int:
        return int((self.labels != IGNORE).sum())


def tokenize(processor: Any, messages: Sequence[dict[str, str]], num_frames: int) -> Tokenized:
    """Tokenise with the model's chat template (`processor.training_prompt`, which also says which
    tokens of each assistant message carry a loss) and label those spans; tokens after the last
    one are dropped."""
    full, spans = processor.training_prompt(messages, videos=[num_frames])
    input_ids = full.input_ids[: spans[-1][1]]
    target = torch.full_like(input_ids, IGNORE)
    for s, e in spans:
        target[s:e] = input_ids[s:e]
    labels = torch.full_like(input_ids, IGNORE)
    labels[:-1] = target[1:]
    return Tokenized(input_ids, labels, torch.tensor(full.media_starts, dtype=torch.int64))
