"""The engine as a Video-MME evaluation session (see lvx_app.eval.runner.EvalSession)."""

from __future__ import annotations

from typing import Any

from lvx_app.defaults import DEFAULT_DECODE_TIMEOUT_S
from lvx_app.engine.api import GenerationParams


def make_eval_session(
    *, model: str, revision: str | None, gpus: int | None, ranks: int | None, timeout: float = 300.0,
    decode_timeout: float = DEFAULT_DECODE_TIMEOUT_S, cache_dir: str | None = None,
) -> Any:
    """Start the model on the requested ranks; each question is then answered on a fresh conversation."""
    from lvx_app.engine.factory import open_engine, resolve_world
    from lvx_app.engine.runner import session_config
    from lvx_app.eval.runner import EngineEvalSession

    config = session_config(
        model=model, revision=revision, fps=1.0, max_frames=None, dtype="auto", kv_cache=None, timeout=timeout,
        use_cache=True, cache_dir=cache_dir, decode_timeout=decode_timeout,
    )  # fmt: skip
    nproc, cuda = resolve_world(gpus, ranks)
    return EngineEvalSession(open_engine(config, nproc, cuda), lambda n: GenerationParams(max_new_tokens=n))
