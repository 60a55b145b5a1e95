"""The `lvx` command line. Commands stay thin: the work lives in importable modules."""

from __future__ import annotations

import typer

app = typer.Typer(
    name="lvx",
    help="Chat with hour-long videos: mPLUG-Owl3 with LV-XAttn distributed cross-attention.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def main() -> None:
    """lvx: long-video question answering."""


@app.command()
def info() -> None:
    """Versions, devices, attention backends and the cache location."""
    from lvx_app.info import print_info

    print_info()


if __name__ == "__main__":
    app()
