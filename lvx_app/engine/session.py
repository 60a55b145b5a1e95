"""One video and one conversation, held by every rank of the group (SPMD).

A rank's session is its parts composed: the `Conversation` (the text K/V cache every rank holds
and the forwards that extend it), the `VideoContext` (this rank's frames and the prefilled video
prompt), the `Generator` (an answer's token loop) and the `Turns` (a question's tokens, its checks
and its streamed answer). `parallelize` makes the sharded attention the conversation hands every
forward before any of them runs. Every command method is called on every rank in the same order;
only rank 0's results reach the user.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from lvx_app.cache.folder import keep_within_limit
from lvx_app.config import Config, GenerationConfig
from lvx_app.defaults import DEFAULT_MAX_NEW_TOKENS
from lvx_app.devices import memory_report, resolve_dtype
from lvx_app.engine.chat_prompt import conversation_ids
from lvx_app.engine.conversation import Conversation
from lvx_app.engine.generator import Generator, never_stop
from lvx_app.engine.limits import MAX_QUESTION_CHARS, question_char_limit
from lvx_app.engine.parallelize import ShardedAttention, parallelize
from lvx_app.engine.question_lines import lined_turns, lines_for
from lvx_app.engine.records import AnswerStats, EngineError, ProgressFn, VideoRequest, VideoSummary
from lvx_app.engine.resident_visual_kv import kv_nbytes
from lvx_app.engine.static_decode import decode_step
from lvx_app.engine.turns import Turns
from lvx_app.engine.video_context import VideoContext, WeightNames
from lvx_app.parallel.collectives import nbytes
from lvx_app.parallel.group import DistInfo
from lvx_models.api import VIDEO, CheckpointError, family_of

# (this rank's group info, the config) -> the attention every forward of the session calls
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
            # named before the weights load, so nothing is filed under weights newer than them
            names = WeightNames(model_config, config.video)
            family = family_of(model_config.path, model_config.revision)
            loaded = family.load(
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
        self.attn = parallelize(info, config) if sharded else None
        layout = config.parallel.layout
        self.conversation = Conversation(self.model, info, self.attn, layout)
        self.video = VideoContext(
            self.model,
            self.processor,
            model_config,
            self.conversation,
            names,
            self.dtype,
            config.parallel.rank_memory_gib,
        )
        step = decode_step(model_config, info.device, info.world_size)
        self.generator = Generator(self.conversation, self.processor.stop_ids, step)
        # the longest answer when the options name none: the checkpoint's own, else lvx's
        answer_length = self.processor.max_new_tokens or DEFAULT_MAX_NEW_TOKENS
        self.turns = Turns(
            self.conversation, self.video, self.generator, self.processor, self.attn, answer_length
        )
        longest = self.processor.tokenizer.longest_token_bytes()
        context = int(self.model.config.max_position_embeddings)
        self.question_chars = question_char_limit(context, longest)

    @property
    def last_answer(self) -> AnswerStats | None:
        return self.turns.last_answer

    # ---- commands (every rank, same order) -------------------------------------------------------
    def load_video(self, request: VideoRequest, progress: ProgressFn | None = None) -> VideoSummary:
        """Make the video resident and prefill its prompt; the conversation starts afresh. Rank
        0 then holds the cache folder to its size limit (what this load used stays)."""
        started = time.time() - 1.0  # a file's time stamp may lag the clock a little
        summary = self.video.load(request, progress)
        if self.video.info.rank == 0 and request.video.cache:
            keep_within_limit(request.video.cache_dir, request.video.cache_limit_gb, started)
        return summary

    def reset(self, keep_prompt: bool = True) -> None:
        """Forget the conversation; keep the video and (`keep_prompt`) its prefilled prompt, which
        the next turn that shows the video prefills again when it was dropped."""
        loaded = self.video.loaded
        if loaded is None or not keep_prompt:
            self.conversation.clear()
        else:  # a text-only chat may have replaced the video prompt: it is prefilled again
            self.turns.show_video(True)
            self.turns.hold(loaded.prefix_ids)

    def ask(
        self,
        question: str,
        generation: GenerationConfig,
        should_stop: Callable[[], bool] = never_stop,
    ) -> Iterator[str]:
        """Answer one turn; yields text pieces on rank 0 (other ranks yield nothing)."""
        self.turns.show_video(True)
        yield from self.turns.answer(self.turns.question_ids(question), generation, should_stop)

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
        answers, loaded = self.turns.answers, self.video.loaded
        room = self.turns.room_after_video()  # the same for every message: a resent one matches
        turns, self.turns.question_lines = lined_turns(
            turns, lambda text: lines_for(loaded, self.processor, text, room), VIDEO
        )
        ids, with_video = conversation_ids(self.processor, turns, loaded, answers)
        self.turns.show_video(with_video)
        keep = min(self.turns.keep(ids), int(ids.numel()) - 1)
        self.conversation.truncate(keep)
        yield from self.turns.answer(ids[keep:], generation, should_stop)

    def replay(self, turns: Sequence[tuple[str, Sequence[int]]]) -> None:
        """Feed earlier turns (a question, the token ids of its answer: `AnswerStats.tokens`) after
        the video prompt, generating nothing: a conversation rebuilt exactly as it was answered."""
        self.turns.replay(turns)

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
            "generation": self.model.config.generation_name,
            "world size": self.info.world_size,
            "device": str(self.info.device),
            "dtype": str(self.dtype).removeprefix("torch."),
            "layout": self.config.parallel.layout,
            "max new tokens": self.config.generation.max_new_tokens or self.turns.answer_length,
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
            if loaded.kv_choice is not None:
                out["kv choice"] = loaded.kv_choice.line()
            cached = loaded.kv_mode == "cache"
            out["visual K/V"] = loaded.visual_kv.line() if cached else "recomputed per forward"
        if self.last_answer is not None:
            last = self.last_answer
            out["last answer"] = f"TTFT {last.ttft_s:.2f} s, {last.tokens_per_s:.1f} tok/s"
        return out
