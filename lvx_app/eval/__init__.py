"""Video-MME batch evaluation: questions, prompts, answer extraction, resumable results, reports.

The engine is reached only through :class:`lvx_app.eval.runner.EvalSession`; everything here runs
without a model. Entry points: :func:`lvx_app.cli.evaluate.run_videomme` and the ``eval_app`` typer
app.
"""
