"""The engine's per-rank compute: one video and one conversation held by every rank of a group.

`RankSession` composes the `Conversation` (the replicated text K/V cache), the `VideoContext` (this
rank's frames and the prefilled video prompt), the `Generator` (an answer's token loop) and the
`Turns` (a question's tokens and its answer), the conversation handing every forward the sharded
attention `parallelize` made. A load is one `VideoRequest`. How a frontend drives a group of them is
`lvx_app.runtime`.
"""

from lvx_app.engine.records import (
    AnswerStats,
    EngineError,
    EngineWarning,
    GroupFailed,
    VideoRequest,
    VideoSummary,
)

__all__ = [
    "AnswerStats",
    "EngineError",
    "EngineWarning",
    "GroupFailed",
    "VideoRequest",
    "VideoSummary",
]
