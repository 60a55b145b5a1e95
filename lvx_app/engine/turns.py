"""The turns of a rank's conversation: a question's token ids after the video prompt, the checks
before it is fed, and its answer streamed token by token (every rank, same order).

A question first makes the cache hold the video prompt (the first turn after a load or a reset, or
after a chat without the video), then continues it; a later one follows the last answer. A question
too long to prefill is refused on every rank alike before anything is fed. The answer's tokens are
remembered, so a conversation can be rebuilt exactly (`replay`) and an assistant message of a chat
matched to the tokens generated for it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace

import torch

from lvx_app.config import GenerationConfig
from lvx_app.engine.chat_prompt import Answers
from lvx_app.engine.conversation import Conversation
from lvx_app.engine.evidence import EvidenceRecorder, answer_moments, answer_shares
from lvx_app.engine.generator import Generator, LoopOutcome
from lvx_app.engine.limits import (
    TURN_ROOM,
    PrefillShape,
    answer_tokens,
    conversation_full,
    question_limit,
    too_long,
)
from lvx_app.engine.parallelize import ShardedAttention
from lvx_app.engine.question_lines import lines_for
from lvx_app.engine.records import AnswerStats, EngineError, QuestionTooLong
from lvx_app.engine.video_context import VideoContext, oom_message
from lvx_app.engine.video_prompt import video_messages
from lvx_app.parallel.collectives import all_min
from lvx_app.video.ingest import rank_memory_budget


class Turns:
    """Feeds questions and earlier turns to the conversation and streams the answers."""

    def __init__(
        self,
        conversation: Conversation,
        video: VideoContext,
        generator: Generator,
        processor,
        attn: ShardedAttention | None,
        answer_length: int,
    ) -> None:
        self.conversation, self.video, self.generator = conversation, video, generator
        self.processor, self.attn, self.info = processor, attn, conversation.info
        self.answer_length = answer_length  # the longest answer when the options name none
        self.answers = Answers()  # the latest answers' tokens, by their text
        self.last_answer: AnswerStats | None = None
        self.last_shares: list[float] | None = None  # rank 0: the last answer's share per frame
        self.question_lines = 0  # transcript lines placed with the next answer's question

    def answer(
        self, ids: torch.Tensor, generation: GenerationConfig, should_stop: Callable[[], bool]
    ) -> Iterator[str]:
        """Prefill `ids` after what the cache holds, then generate the answer; yields text pieces
        on rank 0. The answer's text and tokens are remembered for a later `chat`."""
        conversation, leader, n = self.conversation, self.info.rank == 0, int(ids.numel())
        if generation.max_new_tokens is None:
            generation = replace(generation, max_new_tokens=self.answer_length)
        self.check_length(n)
        context = int(self.video.model.config.max_position_embeddings)
        asked = generation.max_new_tokens
        bound = answer_tokens(asked, context, conversation.position + n)
        generation = replace(generation, max_new_tokens=bound)
        t0 = time.perf_counter()
        stats = AnswerStats(prompt_tokens=conversation.position + n, prefill_tokens=n)
        stats.transcript_lines, self.question_lines = self.question_lines, 0
        whole = self.whole(n)
        recorder = self._recorder(generation, conversation.position + n - 1)
        hooks = None if recorder is None else recorder.hooks  # this answer's forwards call them
        try:
            logits, owner = conversation.prefill(ids, whole=whole, hooks=hooks)
        except torch.cuda.OutOfMemoryError as exc:
            message = oom_message(self.info.rank, self.info.device, "reading the question")
            raise RuntimeError(message) from exc
        outcome, decoder = LoopOutcome(), self.processor.stream()
        text = []
        tokens = self.generator.answer(
            logits, None if whole else owner, generation, outcome, should_stop, hooks
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
        stats.evidence = self._evidence(recorder, stats.new_tokens, whole)
        self.answers.remember("".join(text), stats.tokens)
        unfed = [] if outcome.unfed is None else [outcome.unfed]
        conversation.end_turn([*unfed, self.processor.stop_ids[0]])  # closed with <|im_end|>
        if outcome.first_token_at is not None:
            stats.ttft_s = outcome.first_token_at - t0
        stats.interrupted, stats.truncated = outcome.interrupted, outcome.truncated
        stats.context_full = outcome.truncated and bound < asked  # the positions ended it
        stats.total_s = time.perf_counter() - t0
        self.last_answer = stats

    def _recorder(self, generation: GenerationConfig, start: int) -> EvidenceRecorder | None:
        """The recorder of this answer's queries from position `start` (its last prompt token) on,
        or None: evidence off, no video shown, or the static step (no Python runs per token
        there)."""
        conversation = self.conversation
        static = self.generator.step.used_for(generation)
        if not generation.evidence or conversation.visual is None or static:
            return None
        return EvidenceRecorder(conversation.hooks, conversation.model.config, start)

    def _evidence(self, recorder: EvidenceRecorder | None, tokens: int, whole: bool):
        """The answer's moments on rank 0 (every rank computes its frames' shares alike), None
        without a recorder."""
        if recorder is None:
            return None
        layers = self.conversation.model.config.cross_layer_indices
        visual, world = self.conversation.visual, self.info.world_size
        shares = answer_shares(recorder, visual, layers, tokens, not whole, world)
        if self.info.rank != 0:
            return None
        self.last_shares = None if shares is None else shares.tolist()
        return answer_moments(shares, self.video.loaded.summary.timestamps)

    def replay(self, turns: Sequence[tuple[str, Sequence[int]]]) -> None:
        """Feed earlier turns (a question, the token ids of its answer: `AnswerStats.tokens`) after
        the video prompt, generating nothing: a conversation rebuilt exactly as it was answered."""
        conversation = self.conversation
        self.show_video(True)
        for question, answer in turns:
            ids = self.question_ids(question)
            n = int(ids.numel())
            self.check_length(n)
            conversation.prefill(ids, whole=self.whole(n))
            conversation.end_turn([*answer, self.processor.stop_ids[0]])

    def whole(self, n: int) -> bool:
        """Whether `n` new tokens are fed alike on every rank (else sharded over the ranks)."""
        return self.attn is None or self.attn.replicate_queries(n)

    def show_video(self, shown: bool) -> None:
        """Let the hyper layers attend to the loaded video or not (a conversation without it must
        not see it: a token sees every frame whose place in the loaded prompt comes before its
        position)."""
        loaded = self.video.loaded
        self.conversation.show_video(loaded.visual if shown and loaded is not None else None)

    def hold(self, ids: torch.Tensor) -> None:
        """Make the cache hold exactly `ids`: keep the longest prefix it holds, prefill the rest."""
        keep = self.keep(ids)
        if keep < ids.numel():
            self.conversation.prefill(ids[keep:], whole=self.whole(int(ids.numel()) - keep))

    def keep(self, ids: torch.Tensor) -> int:
        """Keep the longest prefix of `ids` the cache holds and return its length; where it is
        shorter than the loaded video prompt's header and `ids` start with it (the video shown),
        the header's text K/V the load made are put back first (its rows attended to what only
        the load had: Llama-3.2-Vision's empty tiles)."""
        conversation, loaded = self.conversation, self.video.loaded
        keep = conversation.held_prefix(ids.tolist())
        conversation.truncate(keep)
        if loaded is None or loaded.header_kv is None or conversation.visual is not loaded.visual:
            return keep
        h = loaded.header_kv[0][0].shape[1]
        if keep < h and torch.equal(ids[:h], loaded.prefix_ids[:h]):
            conversation.truncate(0)
            conversation.restore(loaded.header_kv, torch.arange(h), ids[:h].tolist())
            keep = h
        return keep

    def question_ids(self, question: str) -> torch.Tensor:
        """The ids to feed for `question` (with the transcript lines it is about, `question_lines`):
        the rest of the video prompt's first turn, or a follow-up after the last answer (its unfed
        tokens first)."""
        loaded, conversation = self.video.loaded, self.conversation
        if loaded is None:
            raise EngineError("no video is loaded; load one first")
        if not question.strip():
            raise EngineError("the question is empty")
        prefix = loaded.prefix_ids
        first = (
            conversation.position == prefix.numel()
            or conversation.held_prefix(prefix.tolist()) < prefix.numel()
        )  # the first turn after load or reset (or after a chat without the video)
        held = prefix.numel() if first else conversation.position + len(conversation.pending)
        question, self.question_lines = lines_for(
            loaded, self.processor, question, self.room_after(held)
        )
        if first:
            self.hold(prefix)
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

    def room_after(self, held: int) -> int:
        """The positions a question may take after `held` tokens, leaving room for an answer."""
        return int(self.video.model.config.max_position_embeddings) - held - TURN_ROOM

    def room_after_video(self) -> int:
        """`room_after` the loaded video's prompt (0 without one)."""
        loaded = self.video.loaded
        return 0 if loaded is None else self.room_after(int(loaded.prefix_ids.numel()))

    def check_length(self, n: int) -> None:
        """Refuse a question too long to prefill, on every rank alike: the ranks agree on the
        smallest budget first."""
        info = self.info
        budget = rank_memory_budget(info.device, self.video.memory_gib)
        if info.world_size > 1:
            budget = all_min(budget if budget is not None else 2**62, info.device)
        dtype = self.video.dtype
        shape = PrefillShape(info.world_size, self.conversation.position, dtype.itemsize)
        stated = self.video.memory_gib is not None
        memory = "the memory a rank may use (--rank-memory-gib)" if stated else None
        limit, why = question_limit(self.video.model.config, shape, budget, memory)
        if n > limit:
            raise QuestionTooLong(too_long(n, limit, why))
        context = int(self.video.model.config.max_position_embeddings)
        if self.conversation.position + n > context:
            raise QuestionTooLong(conversation_full(self.conversation.position + n, context))
