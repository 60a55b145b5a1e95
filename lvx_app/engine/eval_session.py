"""The engine as a Video-MME evaluation session (see lvx_app.eval.runner.EvalSession)."""

from __future__ import annotations

from typing import Any

from lvx_app.engine.api import GenerationParams


def make_eval_session(*, model: str, revision: str | None, gpus: int | None, ranks: int | None) -> Any:
    """Start the model on the requested ranks; each question is then answered on a fresh conversation."""
    from lvx_app.engine.factory import open_engine, resolve_world
    from lvx_app.engine.runner import session_config
    from lvx_app.eval.runner import EngineEvalSession

    config = session_config(
        model=model, revision=revision, fps=1.0, max_frames=None, dtype="auto", kv_cache=None, timeout=300.0,
        use_cache=True, cache_dir=None,
    )  # fmt: skip
    nproc, cuda = resolve_world(gpus, ranks)
    return EngineEvalSession(open_engine(config, nproc, cuda), lambda n: GenerationParams(max_new_tokens=n))
