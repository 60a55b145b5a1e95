"""The CLI surface that needs nothing else: help and info."""

from typer.testing import CliRunner

from lvx_app.cli import app


def test_info_lists_versions():
    result = CliRunner().invoke(app, ["info"])
    assert result.exit_code == 0, result.output
    assert "torch" in result.output and "lvx" in result.output
