"""How many tokens one question may have, decided before any rank allocates for its prefill.

A pasted book (a 1,000,000-character question) once made rank 0 allocate 11.5 GB and get OOM-killed,
taking the group with it. A question is capped by the model's context (`max_position_embeddings`)
and by what the prefill would need on one rank (`memory_plan.prefill_bytes`, the one estimate's:
activations and the text K/V it adds grow linearly, and a ring step's score or additive mask block
of its local queries against one rank's share of the text keys grows with the conversation).
Visual tokens are left out: the question sees every frame, so those tiles take the unmasked kernels.
The budget is the one `ingest` also plans with: `--rank-memory-gib` when given, else the free
memory.

Before any of that, every frontend refuses a question by its characters alone
(`question_char_limit`), so that a pasted 10 MB text is never tokenized on every rank (gigabytes of
token ids per rank, held after the refusal) nor sent to them.
"""

from __future__ import annotations

from lvx_app.engine.memory_plan import PrefillShape, prefill_bytes
from lvx_app.engine.records import EngineError
from lvx_models.api import ModelConfig

# the key of `RankSession.describe()` that carries `question_char_limit` to the frontends
MAX_QUESTION_CHARS = "max question chars"


def question_char_limit(context: int, longest_token_bytes: int) -> int:
    """The most characters a question may have, checked before it is tokenized: a character is at
    least one byte, so a question of more characters than the context holds tokens times the most
    bytes one token stands for needs more tokens than the context, and the token cap would refuse it
    anyway. No question the token cap allows is refused."""
    return context * longest_token_bytes


def too_many_chars(chars: int, limit: int) -> str:
    """The one line a user sees for a question over the character cap."""
    return (
        f"the question is {chars:,} characters, more than the {limit:,} any question may have "
        "with this model; shorten it, or ask about a part of it at a time"
    )


def question_limit(
    cfg: ModelConfig, shape: PrefillShape, budget_bytes: int | None, memory: str | None = None
) -> tuple[int, str]:
    """(most tokens a question may have, what sets it: "the model's context" or `memory`, what the
    budget is: by default "the free memory of a rank")."""
    context = int(cfg.max_position_embeddings)
    if budget_bytes is None or prefill_bytes(context, cfg, shape) <= budget_bytes:
        return context, "the model's context"
    lo, hi = 0, context  # prefill_bytes grows with n: the largest n that fits
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if prefill_bytes(mid, cfg, shape) <= budget_bytes else (lo, mid - 1)
    return lo, memory or "the free memory of a rank"


def too_long(tokens: int, limit: int, why: str) -> str:
    """The one line a user sees for a question over the cap."""
    return (
        f"the question is {tokens:,} tokens, over the {limit:,} tokens a question may have here "
        f"({why}); shorten it, or ask about a part of it at a time"
    )


def answer_tokens(requested: int, context: int, filled: int) -> int:
    """The most tokens an answer may take: its own bound, and the positions the model's context has
    left after the `filled` ones (an answer's last token is never fed, so it may take one more
    token than positions are left). However large `--max-new-tokens` or `max_tokens` is, no
    answer runs past the positions the model was trained for."""
    return max(1, min(requested, context - filled + 1))


def conversation_full(filled: int, context: int) -> str:
    """The one line a user sees when a question would run past the model's context."""
    return (
        f"the conversation would be {filled:,} tokens, past the {context:,} tokens of the model's "
        "context; start it afresh (reset) or ask a shorter question"
    )


# positions a video's prompt must leave free in the model's context: a short question and its answer
TURN_ROOM = 64


def frames_that_fit(context: int, tokens: int, frames: int, per_frame: int) -> int:
    """The most frames whose video prompt leaves `TURN_ROOM` of the model's `context` positions: a
    prompt of `tokens` holding `frames` frames costs `per_frame` positions per frame (its
    placeholder; the visual tokens take none) over a fixed part."""
    fixed = tokens - frames * per_frame
    return max(0, (context - TURN_ROOM - fixed) // per_frame)


def video_prompt_too_long(tokens: int, frames: int, context: int, most: int) -> str:
    """The one line a user sees when a video's prompt leaves no room in the model's context."""
    if most < 1:  # not even one frame fits: fewer frames cannot help (0 would mean no cap)
        return (
            f"the model's context of {context:,} positions leaves no room for a single frame of "
            f"this video with a question (its prompt is {tokens:,} tokens for {frames:,} "
            "frames); use a checkpoint with a longer context"
        )
    return (
        f"the video's prompt is {tokens:,} tokens ({frames:,} frames), too many for the "
        f"{context:,} positions the model was trained on with room for a question; use at most "
        f"{most:,} frames (--max-frames {most}, or a lower --fps)"
    )


def check_video_prompt(context: int, tokens: int, frames: int, per_frame: int) -> None:
    """Refuse a video whose prompt would leave no room for a question within the `context`
    positions the model was trained on (past them RoPE still runs, on positions it never
    learned)."""
    if tokens + TURN_ROOM > context:
        most = frames_that_fit(context, tokens, frames, per_frame)
        raise EngineError(video_prompt_too_long(tokens, frames, context, most))
