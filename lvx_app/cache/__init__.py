"""The cache store: what lvx keeps on disk so that reopening a video is quick.

    <cache dir>/                     --cache-dir, else $LVX_CACHE_DIR, else ~/.cache/lvx
      features/<id>/shard-RRRRR-of-NNNNN.safetensors   frame features, one file per rank
      prefixes/<id>/prompt-of-NNNNN.safetensors        saved video prompts (their text K/V)
      visual-kv/<id>/shard-RRRRR-of-NNNNN.safetensors  saved visual K/V, one file per rank
      transcripts/<id>/transcript.safetensors          a video's speech transcribed, all ranks
      encoder-fingerprints.json                        the encoder weights' fingerprints

Every kind of entry is a `Store` (`store.py`): a key whose hash names the entry, a manifest in each
file's header, a checksum, atomic writes (`files.py`), damaged files discarded with one warning, and
a failed write that never fails a load (`faults.py`). The kinds are thin: `features.py`,
`prompts.py`, `visual_kv.py`, `transcripts.py`; `fingerprints.py` keeps the file digests the
model's encoder fingerprint reads. `folder.py` is the whole folder for
`lvx cache ls | rm | clear`.
"""

from lvx_app.cache.faults import (
    CacheRemovalError,
    CacheWarning,
    CorruptEntry,
    removal_failed,
    warn_not_saved,
)
from lvx_app.cache.features import CachedShard, FeatureCache, FeatureKey, file_identity
from lvx_app.cache.folder import CacheFolder, short_ids
from lvx_app.cache.prompts import PrefixCache, PrefixKey, SavedPrefix
from lvx_app.cache.store import Entry, Store, cache_root, checksum, tensor_crc
from lvx_app.cache.transcripts import TranscriptCache, TranscriptKey
from lvx_app.cache.visual_kv import VisualKV, VisualKVCache, VisualKVKey

__all__ = [
    "CacheFolder",
    "CacheRemovalError",
    "CacheWarning",
    "CachedShard",
    "CorruptEntry",
    "Entry",
    "FeatureCache",
    "FeatureKey",
    "PrefixCache",
    "PrefixKey",
    "SavedPrefix",
    "Store",
    "TranscriptCache",
    "TranscriptKey",
    "VisualKV",
    "VisualKVCache",
    "VisualKVKey",
    "cache_root",
    "checksum",
    "file_identity",
    "removal_failed",
    "short_ids",
    "tensor_crc",
    "warn_not_saved",
]
