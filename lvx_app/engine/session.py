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
from dataclasses import replace
from typing import Any

import torch

from lvx_app.config import Config, GenerationConfig, VideoConfig
from lvx_app.defaults import DEFAULT_MAX_NEW_TOKENS
from lvx_app.devices import memory_report, resolve_dtype
from lvx_app.engine.api import (
    AnswerStats,
    EngineError,
    ProgressFn,
    QuestionTooLong,
    VideoOpening,
    VideoSummary,
)
from lvx_app.engine.chat_prompt import Answers, conversation_ids
from lvx_app.engine.conversation import Conversation
from lvx_app.engine.generator import Generator, LoopOutcome, never_stop
from lvx_app.engine.limits import (
    MAX_QUESTION_CHARS,
    PrefillShape,
    question_char_limit,
    question_limit,
    too_long,
)
from lvx_app.engine.parallelize import ShardedAttention, parallelize
from lvx_app.engine.static_decode import decode_step
from lvx_app.engine.video_context import Identity, VideoContext, oom_message, video_messages
from lvx_app.engine.visual_kv import kv_nbytes
from lvx_app.parallel.collectives import all_min, nbytes
from lvx_app.parallel.group import DistInfo
from lvx_app.subtitles import Cue
from lvx_app.video.feature_cache import encoder_identity
from lvx_app.video.ingest import auto_memory_budget
from lvx_models.mplug_owl3.checkpoint import CheckpointError
from lvx_models.mplug_owl3.fingerprint import checkpoint_identity
from lvx_models.mplug_owl3.loader import load_model

# (model, this rank's group info, the config) -> the attention installed on the model
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
        self.attn = parallelize(self.model, info, config) if sharded else None
        layout = config.parallel.layout
        self.conversation = Conversation(self.model, info, self.attn, layout)
        self.video = VideoContext(
            self.model, self.processor, config, self.conversation, identity, self.dtype
        )
        step = decode_step(model_config, info.device, info.world_size)
        self.generator = Generator(self.conversation, self.processor.stop_ids, step)
        self.last_answer: AnswerStats | None = None
        # the longest answer when the options name none: the checkpoint's own, else lvx's
        self.answer_length = self.processor.max_new_tokens or DEFAULT_MAX_NEW_TOKENS
        self.answers = Answers()
        longest = self.processor.tokenizer.longest_token_bytes()
        context = int(self.model.config.max_position_embeddings)
        self.question_chars = question_char_limit(context, longest)

    # ---- commands (every rank, same order)
    # --------------------------------------------------------
    def load_video(
        self,
        path: str,
        video: VideoConfig,
        subtitles: Sequence[Cue] | None = None,
        progress: ProgressFn | None = None,
        opening: VideoOpening = VideoOpening(),
    ) -> VideoSummary:
        """Make the video resident and prefill its prompt; the conversation starts afresh."""
        return self.video.load(path, video, subtitles, progress, opening)

    def reset(self) -> None:
        """Forget the conversation; keep the video and its prefilled prompt."""
        loaded = self.video.loaded
        if loaded is None:
            self.conversation.clear()
        else:  # a text-only chat may have replaced the video prompt: it is prefilled again
            self._show_video(True)
            self._hold(loaded.prefix_ids)

    def ask(
        self,
        question: str,
        generation: GenerationConfig,
        should_stop: Callable[[], bool] = never_stop,
    ) -> Iterator[str]:
        """Answer one turn; yields text pieces on rank 0 (other ranks yield nothing)."""
        self._show_video(True)
        yield from self._answer(self._turn_ids(question), generation, should_stop)

    def chat(
        self,
        turns: Sequence[dict],
        generation: GenerationConfig,
        should_stop: Callable[[], bool] = never_stop,
    ) -> Iterator[str]:
        """Answer the last user message of a whole conversation (the OpenAI-compatible API's
        messages: role and content of each; the first user message may hold the loaded video as
        `<|video|>`). The cache keeps the longest prefix of its tokens it holds; only the rest is
        prefilled."""
        ids, with_video = conversation_ids(self.processor, turns, self.video.loaded, self.answers)
        self._show_video(with_video)
        keep = min(self.conversation.held_prefix(ids.tolist()), int(ids.numel()) - 1)
        self.conversation.truncate(keep)
        yield from self._answer(ids[keep:], generation, should_stop)

    def _answer(
        self, ids: torch.Tensor, generation: GenerationConfig, should_stop: Callable[[], bool]
    ) -> Iterator[str]:
        """Prefill `ids` after what the cache holds, then generate the answer; yields text pieces
        on rank 0. The answer's text and tokens are remembered for a later `chat`."""
        conversation, leader, n = self.conversation, self.info.rank == 0, int(ids.numel())
        if generation.max_new_tokens is None:
            generation = replace(generation, max_new_tokens=self.answer_length)
        self._check_length(n)
        t0 = time.perf_counter()
        stats = AnswerStats(prompt_tokens=conversation.position + n, prefill_tokens=n)
        whole = self._whole(n)
        try:
            logits, owner = conversation.prefill(ids, whole=whole)
        except torch.cuda.OutOfMemoryError as exc:
            message = oom_message(self.info.rank, self.info.device, "reading the question")
            raise RuntimeError(message) from exc
        conversation.pending = []
        outcome, decoder = LoopOutcome(), self.processor.stream()
        text = []
        tokens = self.generator.answer(
            logits, None if whole else owner, generation, outcome, should_stop
        )
        try:
            for token in tokens:
                stats.new_tokens += 1
                if token in self.generator.stop_ids:  # the answer's last token: not shown
                    continue
                stats.tokens.append(token)
                piece = decoder.push(token)
                text.append(piece)
                if piece and leader:
                    yield piece
        except torch.cuda.OutOfMemoryError as exc:
            raise RuntimeError(oom_message(self.info.rank, self.info.device, "answering")) from exc
        tail = decoder.flush()
        text.append(tail)
        if tail and leader:
            yield tail
        self.answers.remember("".join(text), stats.tokens)
        if outcome.unfed is not None:
            conversation.pending = [outcome.unfed]
        conversation.pending.append(self.processor.stop_ids[0])  # close the turn with <|im_end|>
        if outcome.first_token_at is not None:
            stats.ttft_s = outcome.first_token_at - t0
        stats.interrupted, stats.truncated = outcome.interrupted, outcome.truncated
        stats.total_s = time.perf_counter() - t0
        self.last_answer = stats

    def replay(self, turns: Sequence[tuple[str, Sequence[int]]]) -> None:
        """Feed earlier turns (a question, the token ids of its answer: `AnswerStats.tokens`) after
        the video prompt, generating nothing: a conversation rebuilt exactly as it was answered."""
        conversation = self.conversation
        self._show_video(True)
        for question, answer in turns:
            ids = self._turn_ids(question)
            n = int(ids.numel())
            self._check_length(n)
            conversation.prefill(ids, whole=self._whole(n))
            conversation.pending = [*map(int, answer), self.processor.stop_ids[0]]

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
            row.update({name: round(seconds, 4) for name, seconds in loaded.timings.items()})
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
            "max new tokens": self.config.generation.max_new_tokens or self.answer_length,
            MAX_QUESTION_CHARS: self.question_chars,
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
    def _whole(self, n: int) -> bool:
        """Whether `n` new tokens are fed alike on every rank (else sharded over the ranks)."""
        return self.attn is None or self.attn.replicate_queries(n)

    def _show_video(self, shown: bool) -> None:
        """Let the hyper layers attend to the loaded video or not (a conversation without it must
        not see it: a token sees every frame whose place in the loaded prompt comes before its
        position)."""
        loaded = self.video.loaded
        self.conversation.visual = loaded.visual if shown and loaded is not None else None

    def _hold(self, ids: torch.Tensor) -> None:
        """Make the cache hold exactly `ids`: keep the longest prefix it holds, prefill the rest."""
        keep = self.conversation.held_prefix(ids.tolist())
        self.conversation.truncate(keep)
        if keep < ids.numel():
            self.conversation.prefill(ids[keep:], whole=self._whole(int(ids.numel()) - keep))

    def _turn_ids(self, question: str) -> torch.Tensor:
        loaded, conversation = self.video.loaded, self.conversation
        if loaded is None:
            raise EngineError("no video is loaded; load one first")
        if not question.strip():
            raise EngineError("the question is empty")
        prefix = loaded.prefix_ids
        if (
            conversation.position == prefix.numel()
            or conversation.held_prefix(prefix.tolist()) < prefix.numel()
        ):  # the first turn after load or reset (or after a chat without the video)
            self._hold(prefix)
            full = self.processor.build_chat_prompt(
                video_messages(loaded.opening, loaded.subtitle_block, question),
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
