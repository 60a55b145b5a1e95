"""The CLI surface that needs nothing else: help and info."""

from typer.testing import CliRunner

from lvx_app.cli.main import app


def test_info_lists_versions():
    result = CliRunner().invoke(app, ["info"])
    assert result.exit_code == 0, result.output
    assert "torch" in result.output and "lvx" in result.output


def test_info_model_names_generation_and_gate_form(tiny_checkpoints, tmp_path):
    from lvx_app.cli.info import checkpoint_rows

    assert checkpoint_rows(tiny_checkpoints["g1-gateproj"])["generation"].startswith(
        "g1-gateproj: G1 as 7B-240728"
    )
    assert (
        "constant per-channel gate self_attn.gate"
        in checkpoint_rows(tiny_checkpoints["g1"])["generation"]
    )
    assert checkpoint_rows(tiny_checkpoints["g2"])["generation"].startswith("g2: G2 as 7B-241101")
    result = CliRunner().invoke(app, ["info", "--model", tiny_checkpoints["g1-gateproj"]])
    assert result.exit_code == 0 and "g1-gateproj" in result.output, result.output
    bad = CliRunner().invoke(app, ["info", "--model", str(tmp_path)])
    assert bad.exit_code == 1 and "no config.json" in bad.output and "Traceback" not in bad.output


def test_lvx_warnings_are_one_line_and_others_keep_their_format(capsys):
    import warnings
    from pathlib import Path

    import lvx_app
    from lvx_app.warning_lines import install

    ours = str(Path(lvx_app.__file__).parent / "video" / "plan.py")
    theirs = str(Path(warnings.__file__))
    saved = warnings.showwarning
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            install()  # after catch_warnings, which restores showwarning on the way out
            warnings.warn_explicit(
                "--fps 100 is above the video's own 10 fps", UserWarning, ours, 219
            )
            warnings.warn_explicit("something deprecated", UserWarning, theirs, 7)
    finally:
        warnings.showwarning = saved
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "warning: --fps 100 is above the video's own 10 fps"
    assert err[1].startswith(f"{theirs}:7: UserWarning: something deprecated")
