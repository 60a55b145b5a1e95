"""The engine configs the tests use: a tiny checkpoint, one decode worker, no subtitles, the caches
in
a test folder (or off)."""

from __future__ import annotations

from dataclasses import fields, replace
from typing import Any

from lvx_app.config import Config, EvalConfig, TrainConfig


def engine_config(checkpoint: str, cache_dir: Any = None, **options: Any) -> Config:
    """A config for `checkpoint`; `cache_dir` None turns the caches off. `options` by field name."""
    base: dict[str, Any] = {"decode_workers": 1, "subtitles": "none"}
    base.update({"cache": False} if cache_dir is None else {"cache_dir": str(cache_dir)})
    return Config.from_options(model=str(checkpoint), **{**base, **options})


def train_config(checkpoint: str, **options: Any) -> Config:
    """A finetuning config: `train` is "lora" (with `lora_rank`, default 16), "hyper" or "all";
    model, video and parallel options by field name, the rest of the train section's."""
    train = {k: options.pop(k) for k in list(options) if k in _TRAIN_FIELDS}
    mode = train.pop("train", "hyper")
    if mode == "lora":
        train["lora_rank"] = train.get("lora_rank") or 16
    else:
        train["mode"], train["lora_rank"] = mode, None
    train.setdefault("data", "-")
    train.setdefault("out", "-")
    config = Config.from_options(model=str(checkpoint), **options)
    return replace(config, train=TrainConfig(**train))


_TRAIN_FIELDS = {f.name for f in fields(TrainConfig)} | {"train"}


def eval_config(data: Any, out: Any = None, **options: Any) -> Config:
    """A Video-MME run's config: the eval section's options by name (`subtitles` is the eval's),
    engine options by field name."""
    run = {k: options.pop(k) for k in list(options) if k in _EVAL_FIELDS}
    options.setdefault("max_new_tokens", 16)
    config = Config.from_options(model=str(options.pop("model", "tiny")), **options)
    out = None if out is None else str(out)
    return replace(config, eval=EvalConfig(data=str(data), out=out, **run))


_EVAL_FIELDS = {f.name for f in fields(EvalConfig)} - {"data", "out"}
