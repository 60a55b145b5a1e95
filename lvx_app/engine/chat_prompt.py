"""A whole conversation, as the OpenAI-compatible API sends it with every request, turned into the
token ids the engine feeds, so that the cache keeps the longest prefix it already holds.

The ids are the chat template's, built in pieces: the opening (system message, the first user
message with the video) by `build_chat_prompt`, then each earlier answer and the messages after it
(`build_continuation`), ending with the assistant header of the answer to generate. An assistant
message that is word for word an answer this rank generated is fed as the tokens it generated:
tokenizing its text again may split it differently, and the held prefix would end there.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch

from lvx_app.engine.records import EngineError
from lvx_app.engine.video_context import LoadedVideo
from lvx_app.engine.video_prompt import video_text
from lvx_models.api import VIDEO  # where the loaded video goes in a user message


class Answers:
    """The latest answers this rank generated, their text -> their token ids (the same on every
    rank: every rank decodes the agreed tokens)."""

    def __init__(self, keep: int = 64) -> None:
        self.keep = keep
        self._ids: OrderedDict[str, list[int]] = OrderedDict()

    def remember(self, text: str, ids: Sequence[int]) -> None:
        if not text:
            return
        self._ids[text] = list(ids)
        self._ids.move_to_end(text)
        while len(self._ids) > self.keep:
            self._ids.popitem(last=False)

    def ids(self, text: str, processor) -> list[int]:
        """The tokens of an assistant message: those generated for it, else its text tokenized."""
        known = self._ids.get(text)
        return list(known) if known is not None else processor.encode_text(text)


def conversation_ids(
    processor, turns: Sequence[dict], loaded: LoadedVideo | None, answers: Answers
) -> tuple[torch.Tensor, bool]:
    """(the ids of `turns` ({"role", "content"} dicts; the last is the user's) up to the header of
    the answer to generate, whether they hold the video). A user message of the opening may hold
    `<|video|>`: the loaded video (its frames and subtitle block) goes there, and the ids must then
    start with its prompt."""
    turns = [{"role": t["role"], "content": t["content"]} for t in turns]
    if not turns or turns[-1]["role"] != "user":
        raise EngineError("the last message must be the user's")
    first = next((i for i, t in enumerate(turns) if t["role"] == "assistant"), len(turns))
    videos = _place_video(turns, first, loaded)
    try:
        ids = processor.build_chat_prompt(turns[:first], videos=videos).input_ids.tolist()
        rest = turns[first:]
        while rest:
            answer, rest = rest[0], rest[1:]
            after = next((i for i, t in enumerate(rest) if t["role"] == "assistant"), len(rest))
            if not after:
                raise EngineError("two assistant messages in a row; merge them into one")
            ids += answers.ids(answer["content"], processor) + [processor.stop_ids[0]]
            ids += processor.build_continuation(rest[:after], offset=len(ids)).input_ids.tolist()
            rest = rest[after:]
    except ValueError as exc:  # a stray media marker, an unknown role
        raise EngineError(str(exc)) from None
    out = torch.tensor(ids, dtype=torch.int64)
    if videos:
        prefix = loaded.prefix_ids
        if not torch.equal(out[: prefix.numel()], prefix):
            raise EngineError(
                "the conversation does not open as the video was loaded; load it again with the "
                "messages before it"
            )
    return out, bool(videos)


def _place_video(turns: list[dict], first_answer: int, loaded: LoadedVideo | None) -> list[int]:
    """Put the loaded video (and its subtitle block) at the `<|video|>` of the opening's user
    message, in place; returns `videos` for the prompt: [its frame count], or [] without one."""
    marked = [i for i, t in enumerate(turns) if VIDEO in t["content"]]
    if not marked:
        return []
    i = marked[0]
    text = turns[i]["content"]
    if len(marked) > 1 or text.count(VIDEO) > 1:
        raise EngineError("one video per conversation: only one message may hold it")
    if i >= first_answer or turns[i]["role"] != "user":
        raise EngineError("the video goes in the first user message, before any answer")
    if loaded is None:
        raise EngineError("no video is loaded; load one first")
    before, _, after = text.partition(VIDEO)
    turns[i]["content"] = before + video_text(loaded.subtitle_block, after)
    return [loaded.summary.frames]
