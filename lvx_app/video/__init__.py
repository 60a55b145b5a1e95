"""Video ingestion: decord sampling at a chosen fps, sharded decode and encode (the features are
cached by `lvx_app.cache`).

    from lvx_app.video import ingest, VisualShard, VideoError, format_timestamp

    shard = ingest("movie.mp4", Encoder(model.encode_images, model_id=...), VideoConfig(fps=1))

decord itself is imported only inside decode worker processes (see decode.py), never here.
"""

from lvx_app.cache import FeatureCache, FeatureKey, file_identity
from lvx_app.defaults import default_cache_dir
from lvx_app.video.decode import DecodePool, check_video_path
from lvx_app.video.encode import ShardEncoder
from lvx_app.video.errors import (
    CorruptVideoError,
    DecodeTimeoutError,
    NotAVideoError,
    NoVideoStreamError,
    PlanTooLargeError,
    RemoteRankError,
    VideoError,
    VideoNotFoundError,
    VideoWarning,
)
from lvx_app.video.ingest import (
    Encoder,
    IngestProgress,
    IngestTuning,
    RichProgress,
    VisualShard,
    ingest,
)
from lvx_app.video.plan import PlanShard, SamplingPlan, build_plan, format_timestamp

__all__ = [
    "CorruptVideoError",
    "DecodePool",
    "DecodeTimeoutError",
    "Encoder",
    "FeatureCache",
    "FeatureKey",
    "IngestProgress",
    "IngestTuning",
    "NoVideoStreamError",
    "NotAVideoError",
    "PlanShard",
    "PlanTooLargeError",
    "RemoteRankError",
    "RichProgress",
    "SamplingPlan",
    "ShardEncoder",
    "VideoError",
    "VideoNotFoundError",
    "VideoWarning",
    "VisualShard",
    "build_plan",
    "check_video_path",
    "default_cache_dir",
    "file_identity",
    "format_timestamp",
    "ingest",
]
