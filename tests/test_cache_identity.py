"""The feature cache is keyed on the weights that make the features, not on the --model string as
typed."""

from __future__ import annotations

import shutil
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

import lvx_app.cache.faults as cache_faults
from lvx_app.cache import CacheWarning, FeatureCache
from lvx_app.cache.fingerprints import MEMO_NAME, fingerprint_memo
from lvx_app.config import Config
from lvx_app.runtime.open import open_engine
from lvx_models import fingerprint
from lvx_models.fingerprint import encoder_fingerprint
from lvx_models.mplug_owl3.family import FAMILY, VISION_PREFIXES
from lvx_models.mplug_owl3.tiny import write_tiny_checkpoint


def _remembered(checkpoint, cache) -> str:
    """The encoder fingerprint as the engine makes it: the digests kept in the cache folder."""
    with fingerprint_memo(cache) as memo:
        return FAMILY.encoder_identity(str(checkpoint), None, memo)[1]


def _answer(checkpoint, video, cache_dir, *, cache=True):
    """(from_cache, answer) of one in-process engine that loads `video` and answers one question."""
    config = Config.from_options(
        model=str(checkpoint), cache_dir=str(cache_dir), cache=cache, decode_workers=1
    )
    engine = open_engine(config)
    try:
        summary = engine.load_video(video, subtitles=[])
        return summary.from_cache, "".join(engine.ask("what happens?", max_new_tokens=6))
    finally:
        engine.close()


def _bump(checkpoint, prefix: str) -> None:
    """Rewrite model.safetensors in place with every tensor under `prefix` changed (same keys,
    shapes, dtypes)."""
    path = checkpoint / "model.safetensors"
    tensors = load_file(str(path))
    for k in tensors:
        if k.startswith(prefix):
            tensors[k] = tensors[k] + 0.25
    save_file(tensors, str(path), metadata={"format": "pt"})


def test_weights_replaced_in_place_miss_the_cache(tmp_path, short_video):
    checkpoint = write_tiny_checkpoint(tmp_path / "ckpt", "g2", seed=0)
    cache = tmp_path / "cache"
    assert _answer(checkpoint, short_video, cache)[0] is False
    assert _answer(checkpoint, short_video, cache)[0] is True
    # another checkpoint at the same path (a finetune written over it)
    write_tiny_checkpoint(checkpoint, "g2", seed=1)
    from_cache, answer = _answer(checkpoint, short_video, cache)
    assert from_cache is False
    assert answer == _answer(checkpoint, short_video, cache, cache=False)[1]
    _bump(checkpoint, "vision2text_model.")  # only the projector changes
    from_cache, answer = _answer(checkpoint, short_video, cache)
    assert from_cache is False
    assert answer == _answer(checkpoint, short_video, cache, cache=False)[1]


def test_fingerprint_follows_the_encoder_weights_only(tmp_path, monkeypatch):
    a = write_tiny_checkpoint(tmp_path / "a", "g2", seed=0)
    memo = {}
    first = encoder_fingerprint(a, prefixes=VISION_PREFIXES, memo=memo)
    assert len(memo) == 1, "the one safetensors file's digest is remembered"
    b = tmp_path / "elsewhere" / "b"
    shutil.copytree(a, b)
    assert encoder_fingerprint(b, prefixes=VISION_PREFIXES) == first, (
        "the same weights elsewhere have the same fingerprint"
    )
    _bump(b, "language_model.")
    assert encoder_fingerprint(b, prefixes=VISION_PREFIXES) == first, (
        "the language model does not decide the visual features"
    )
    _bump(b, "vision_model.")
    assert encoder_fingerprint(b, prefixes=VISION_PREFIXES) != first

    def no_reads(*args):
        raise AssertionError("the memo should have answered")

    monkeypatch.setattr(fingerprint, "_tensor_digest", no_reads)
    assert encoder_fingerprint(a, prefixes=VISION_PREFIXES, memo=memo) == first


def test_the_cache_folder_remembers_the_digests(tmp_path, monkeypatch):
    """A later start only stats the weight files: the memo in the cache folder answers."""
    checkpoint = write_tiny_checkpoint(tmp_path / "ckpt", "g2", seed=0)
    cache = tmp_path / "cache"
    first = _remembered(checkpoint, cache)
    assert (cache / MEMO_NAME).is_file()
    saved = (cache / MEMO_NAME).stat().st_mtime_ns

    def no_reads(*args):
        raise AssertionError("the memo should have answered")

    monkeypatch.setattr(fingerprint, "_tensor_digest", no_reads)
    assert _remembered(checkpoint, cache) == first
    assert (cache / MEMO_NAME).stat().st_mtime_ns == saved, "nothing new: the memo is not rewritten"


def test_a_corrupt_cache_file_is_one_warning_line(tmp_path, short_video):
    checkpoint = write_tiny_checkpoint(tmp_path / "ckpt", "g2", seed=0)
    cache = tmp_path / "cache"
    _answer(checkpoint, short_video, cache)
    (shard,) = (cache / "features").rglob("shard-*.safetensors")
    shard.write_bytes(shard.read_bytes()[:100])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        from_cache, _ = _answer(checkpoint, short_video, cache)
    lines = [str(w.message) for w in caught if issubclass(w.category, CacheWarning)]
    assert from_cache is False
    assert (
        len(lines) == 1
        and "corrupt" in lines[0]
        and "re-encoding" in lines[0]
        and "\n" not in lines[0]
    ), lines
    assert len(FeatureCache(cache).entries()) == 1


def test_a_folder_where_the_fingerprints_belong_is_left_alone_and_gathers_no_temporary_files(
    tmp_path, monkeypatch
):
    """Each run (a process: the warning is said once per process) hashes the weights again, says
    once that the memo cannot be kept, and leaves the cache folder as it found it."""
    checkpoint = write_tiny_checkpoint(tmp_path / "ckpt", "g2", seed=0)
    cache = tmp_path / "cache"
    (cache / MEMO_NAME).mkdir(parents=True)
    (cache / MEMO_NAME / "notes.txt").write_text("someone's")
    before = sorted(p.name for p in cache.rglob("*"))
    fingerprints = set()
    for _ in range(3):
        monkeypatch.setattr(cache_faults, "_said", set())  # a new run
        with pytest.warns(CacheWarning, match=f"{MEMO_NAME} is a folder holding files") as caught:
            fingerprints.add(_remembered(checkpoint, cache))
        assert len(caught) == 1
        assert sorted(p.name for p in cache.rglob("*")) == before, "no temporary file is left"
    assert len(fingerprints) == 1 and (cache / MEMO_NAME / "notes.txt").read_text() == "someone's"
    (cache / MEMO_NAME / "notes.txt").unlink()  # an empty folder there is lvx's to replace
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _remembered(checkpoint, cache) in fingerprints
    assert (cache / MEMO_NAME).is_file()


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
