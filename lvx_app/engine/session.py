"""One video and one conversation, held by every rank of the group (SPMD).

A rank's session is three parts composed: the `Conversation` (the text K/V cache every rank holds
and the forwards that extend it), the `VideoContext` (this rank's frames and the prefilled video
prompt) and the `Generator` (an answer's token loop). `parallelize` installs the sharded attention
on the model from outside before any of them runs. Every method is called on every rank in the same
order; only rank 0's results reach the user.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from lvx_app.config import Config, GenerationConfig, VideoConfig
from lvx_app.devices import memory_report, resolve_dtype
from lvx_app.engine.api import AnswerStats, EngineError, ProgressFn, QuestionTooLong, VideoSummary
from lvx_app.engine.conversation import Conversation
from lvx_app.engine.generator import Generator, LoopOutcome, never_stop
from lvx_app.engine.limits import PrefillShape, question_limit, too_long
from lvx_app.engine.parallelize import ShardedAttention, parallelize
from lvx_app.engine.static_decode import decode_step
from lvx_app.engine.video_context import Identity, VideoContext, oom_message, video_text
from lvx_app.engine.visual_kv import kv_nbytes
from lvx_app.parallel.collectives import all_min, nbytes
from lvx_app.parallel.group import DistInfo
from lvx_app.subtitles import Cue
from lvx_app.video.feature_cache import encoder_identity
from lvx_app.video.ingest import auto_memory_budget
from lvx_models.mplug_owl3.checkpoint import CheckpointError
from lvx_models.mplug_owl3.fingerprint import checkpoint_identity
from lvx_models.mplug_owl3.loader import load_model

# (model, this rank's group info, the parallel options) -> the attention installed on the model
Parallelize = Callable[..., ShardedAttention]


class RankSession:
    """This rank's share of the engine."""

    def __init__(
        self, config: Config, info: DistInfo, parallelize: Parallelize = parallelize
    ) -> None:
        self.config, self.info = config, info
        model_config = config.model
        try:
            self.dtype = resolve_dtype(
                model_config.dtype, info.device, ("float32", "bfloat16", "float16")
            )
            identity = _identity(config)
            loaded = load_model(
                model_config.path,
                dtype=self.dtype,
                device=info.device,
                revision=model_config.revision,
            )
        except (ValueError, CheckpointError) as exc:
            raise EngineError(str(exc)) from None
        self.model, self.processor = loaded.model, loaded.processor
        self.model.eval()
        sharded = info.world_size > 1
        self.attn = parallelize(self.model, info, config.parallel) if sharded else None
        layout = config.parallel.layout
        self.conversation = Conversation(self.model, info, self.attn, layout)
        self.video = VideoContext(
            self.model, self.processor, config, self.conversation, identity, self.dtype
        )
        step = decode_step(model_config, info.device, info.world_size)
        self.generator = Generator(self.conversation, self.processor.stop_ids, step)
        self.last_answer: AnswerStats | None = None

    # ---- commands (every rank, same order)
    # --------------------------------------------------------
    def load_video(
        self,
        path: str,
        video: VideoConfig,
        subtitles: Sequence[Cue] | None = None,
        progress: ProgressFn | None = None,
    ) -> VideoSummary:
        """Make the video resident and prefill its prompt; the conversation starts afresh."""
        return self.video.load(path, video, subtitles, progress)

    def reset(self) -> None:
        """Forget the conversation; keep the video and its prefilled prompt."""
        loaded = self.video.loaded
        if loaded is None:
            self.conversation.clear()
        else:
            self.conversation.truncate(int(loaded.prefix_ids.numel()))

    def ask(
        self,
        question: str,
        generation: GenerationConfig,
        should_stop: Callable[[], bool] = never_stop,
    ) -> Iterator[str]:
        """Answer one turn; yields text pieces on rank 0 (other ranks yield nothing)."""
        conversation, leader = self.conversation, self.info.rank == 0
        ids = self._turn_ids(question)
        self._check_length(int(ids.numel()))
        t0 = time.perf_counter()
        stats = AnswerStats(prompt_tokens=conversation.position + int(ids.numel()))
        whole = self.attn is None or self.attn.replicate_queries(int(ids.numel()))
        try:
            logits, owner = conversation.prefill(ids, whole=whole)
        except torch.cuda.OutOfMemoryError as exc:
            message = oom_message(self.info.rank, self.info.device, "reading the question")
            raise RuntimeError(message) from exc
        conversation.pending = []
        outcome, decoder = LoopOutcome(), self.processor.stream()
        stops = set(self.processor.stop_ids)
        tokens = self.generator.answer(
            logits, None if whole else owner, generation, outcome, should_stop
        )
        try:
            for token in tokens:
                stats.new_tokens += 1
                piece = decoder.push(token) if token not in stops else ""
                if piece and leader:
                    yield piece
        except torch.cuda.OutOfMemoryError as exc:
            raise RuntimeError(oom_message(self.info.rank, self.info.device, "answering")) from exc
        tail = decoder.flush()
        if tail and leader:
            yield tail
        if outcome.unfed is not None:
            conversation.pending = [outcome.unfed]
        conversation.pending.append(self.processor.stop_ids[0])  # close the turn with <|im_end|>
        if outcome.first_token_at is not None:
            stats.ttft_s = outcome.first_token_at - t0
        stats.interrupted, stats.truncated = outcome.interrupted, outcome.truncated
        stats.total_s = time.perf_counter() - t0
        self.last_answer = stats

    def local_stats(self) -> dict[str, Any]:
        """This rank's row of `/stats`: its frames, memory and traffic."""
        row: dict[str, Any] = {"rank": self.info.rank, "device": str(self.info.device)}
        loaded = self.video.loaded
        if loaded is not None:
            row["frames"] = loaded.local_frames
            if loaded.features is not None:
                row["visual E"] = f"{nbytes(loaded.features) / 2**20:.1f} MiB"
            visual = self.conversation.visual
            if loaded.kv_mode == "cache" and visual is not None:
                row["visual K/V"] = f"{kv_nbytes(visual.kv) / 2**20:.1f} MiB"
            if loaded.visual_kv.compute_s is not None:
                row["visual K/V compute s"] = round(loaded.visual_kv.compute_s, 4)
            row["video prompt prefill s"] = round(loaded.prefill_s, 4)
        row["text tokens"] = self.conversation.cache.length
        if self.attn is not None:
            row["attention bytes sent"] = self.attn.stats.get("fwd_bytes", 0)
        row.update(memory_report(self.info.device))
        return row

    # ---- rank 0 ----------------------------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        return {
            "model": self.config.model.path,
            "generation": self.model.config.form,
            "world size": self.info.world_size,
            "device": str(self.info.device),
            "dtype": str(self.dtype).removeprefix("torch."),
            "layout": self.config.parallel.layout,
        }

    def summarize_stats(self, per_rank: list[dict[str, Any]]) -> dict[str, Any]:
        """`/stats` from every rank's row."""
        out: dict[str, Any] = {**self.describe(), "ranks": per_rank}
        loaded = self.video.loaded
        if loaded is not None:
            summary = loaded.summary
            out["video"] = (
                f"{summary.path}: {summary.frames} frames, {summary.visual_tokens:,} visual tokens"
            )
            out["prompt tokens"] = self.conversation.position
            out["kv mode"] = loaded.kv_mode
            cached = loaded.kv_mode == "cache"
            out["visual K/V"] = loaded.visual_kv.line() if cached else "recomputed per forward"
        if self.last_answer is not None:
            last = self.last_answer
            out["last answer"] = f"TTFT {last.ttft_s:.2f} s, {last.tokens_per_s:.1f} tok/s"
        return out

    # ---- the question ----------------------------------------------------------------------------
    def _turn_ids(self, question: str) -> torch.Tensor:
        loaded, conversation = self.video.loaded, self.conversation
        if loaded is None:
            raise EngineError("no video is loaded; load one first")
        if not question.strip():
            raise EngineError("the question is empty")
        prefix = loaded.prefix_ids
        if conversation.position == prefix.numel():  # the first turn after load or reset
            full = self.processor.build_chat_prompt(
                [{"role": "user", "content": video_text(loaded.subtitle_block, question)}],
                videos=[loaded.summary.frames],
            ).input_ids
            if not torch.equal(full[: prefix.numel()], prefix):
                raise RuntimeError("the prompt prefix changed between load and ask (tokenizer)")
            return full[prefix.numel() :]
        offset = conversation.position + len(conversation.pending)
        follow = self.processor.build_followup(question, offset=offset).input_ids
        return torch.cat([torch.tensor(conversation.pending, dtype=torch.int64), follow])

    def _check_length(self, n: int) -> None:
        """Refuse a question too long to prefill, on every rank alike: the ranks agree on the
        smallest budget first."""
        budget = auto_memory_budget(self.info.device)
        if self.info.world_size > 1:
            budget = all_min(budget if budget is not None else 2**62, self.info.device)
        shape = PrefillShape(self.info.world_size, self.conversation.position, self.dtype.itemsize)
        limit, why = question_limit(self.model.config, shape, budget)
        if n > limit:
            raise QuestionTooLong(too_long(n, limit, why))


def _identity(config: Config) -> Identity:
    """The weights' names in the caches (computed before loading the weights, so features are never
    filed under weights newer than the model's)."""
    model, video = config.model, config.video
    if not video.cache:
        return Identity(model.path, "", "")
    model_key, encoder = encoder_identity(model.path, model.revision, video.cache_dir)
    return Identity(model_key, encoder, checkpoint_identity(model.path, model.revision))
