"""The CLI surface that needs nothing else: help and info."""

import re
from pathlib import Path

from typer.testing import CliRunner

from lvx_app.cli.main import app

ROOT = Path(__file__).resolve().parents[1]


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
    g2 = checkpoint_rows(tiny_checkpoints["g2"])
    assert g2["generation"].startswith("g2: G2 as 7B-241101")
    # what --kv-mode auto would choose for an hour here, with its figures on a GPU
    assert g2["kv mode auto, 1 h at 1 fps on one device"] == "cache (auto, not a GPU)"
    result = CliRunner().invoke(app, ["info", "--model", tiny_checkpoints["g1-gateproj"]])
    assert result.exit_code == 0 and "g1-gateproj" in result.output, result.output
    bad = CliRunner().invoke(app, ["info", "--model", str(tmp_path)])
    assert bad.exit_code == 2 and "no config.json" in bad.output and "Traceback" not in bad.output


def test_info_model_names_the_prompt_rules_and_where_they_came_from(tiny_checkpoints, tmp_path):
    import shutil

    from lvx_app.cli.info import checkpoint_rows

    rows = checkpoint_rows(tiny_checkpoints["g1"])
    assert rows["video prompt"] == (
        "<|start_video_frame|> + <|image|> per frame + <|end_video_frame|> "
        "(processing_mplugowl3.py)"
    )
    assert rows["images beside a video"] == "cut as asked (processing_mplugowl3.py)"
    assert rows["cut prompt"] == "v3_global (image_processing_mplugowl3.py)"
    assert rows["published as"].startswith("no published mPLUG-Owl3 checkpoint")
    bare = tmp_path / "no-processor-files"
    shutil.copytree(tiny_checkpoints["g1-gateproj"], bare)
    for name in ("processing_mplugowl3.py", "image_processing_mplugowl3.py"):
        (bare / name).unlink()
    rows = checkpoint_rows(str(bare))
    assert rows["video prompt"] == "<|image|> per frame, no span (published default of 7B-240728)"
    assert rows["images beside a video"].startswith("never cut")
    assert rows["cut prompt"] == "v2_global (published default of 7B-240728)"
    result = CliRunner().invoke(app, ["info", "--model", str(bare)])
    assert result.exit_code == 0 and "published default of" in result.output, result.output


# config.json of mPLUG/mPLUG-Owl3-2B-241014 (reference mplug_owl3.md §10.2)
CONFIG_2B_241014 = {
    "architectures": ["mPLUGOwl3Model"],
    "hidden_act": "silu",
    "hidden_size": 1536,
    "intermediate_size": 8960,
    "max_position_embeddings": 32768,
    "model_type": "mplugowl3",
    "num_attention_heads": 12,
    "num_hidden_layers": 28,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "vocab_size": 151851,
    "hyper_layers": [7, 15, 23, 26],
    "vision_config": {
        "hidden_size": 1152,
        "image_size": 384,
        "intermediate_size": 4304,
        "model_type": "siglip_vision_model",
        "num_attention_heads": 16,
        "num_hidden_layers": 27,
        "patch_size": 14,
    },
}


def test_info_recognizes_the_2b_241014_checkpoint(tiny_checkpoints, monkeypatch):
    """The weights' form (constant gate, linear projector) and config.json name the release."""
    import dataclasses

    from lvx_app.cli.info import checkpoint_rows
    from lvx_models.api import FAMILIES
    from lvx_models.mplug_owl3 import loader
    from lvx_models.mplug_owl3.config import Owl3Config
    from lvx_models.mplug_owl3.published import RELEASES, recognize

    keys = {"generation": "g1", "projector": "linear", "gate_form": "channel"}
    cfg = Owl3Config.from_dict(CONFIG_2B_241014, **keys)
    assert recognize(cfg) == "mPLUG-Owl3-2B-241014"
    assert recognize(dataclasses.replace(cfg, gate_form="proj")) is None  # not how 2B was published
    assert recognize(dataclasses.replace(cfg, hyper_layers=[6, 13, 20, 22])) is None
    assert [recognize(c) for c in RELEASES.values()] == list(RELEASES)
    family = FAMILIES["mplug_owl3"]  # the tiny g1 checkpoint, with the 2B config in its place
    inspect = lambda *a: dataclasses.replace(loader.inspect_checkpoint(*a), config=cfg)  # noqa: E731
    monkeypatch.setitem(FAMILIES, family.name, dataclasses.replace(family, inspect=inspect))
    rows = checkpoint_rows(tiny_checkpoints["g1"])
    assert rows["published as"] == "this looks like mPLUG-Owl3-2B-241014"
    assert rows["sizes"].startswith("hidden 1536, 28 layers, 12 heads / 2 kv heads")


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


def test_brackets_in_a_path_or_an_answer_are_printed_as_they_are(tmp_path, capsys):
    """Rich reads `[...]` as markup: a path like `/data/[final]/x.mp4` lost its folder in an error
    line, and `[/x]` in a path or a model's answer stopped the command with a traceback."""
    from rich.console import Console

    from lvx_app.cli.chat import run_chat_command
    from lvx_app.config import Config

    console = Console(width=200, force_terminal=False)
    for folder in ("[final]", "[/x]"):
        video = tmp_path / folder / "movie.mp4"
        assert run_chat_command(str(video), Config(), console) == 2
        out = capsys.readouterr().out
        assert f"Video not found: {video}" in out, out


def test_control_characters_in_an_answer_are_shown_as_escapes():
    """A random-weight model emits control tokens: shown as visible escapes, never raw (a raw one
    garbles the terminal), newlines and tabs kept."""
    from lvx_app.engine.describe import printable

    shown = printable("a\x13b\n\tc\x1b[31m\x7f\x9b\x00é")
    assert shown == "a\\x13b\n\tc\\x1b[31m\\x7f\\x9b\\x00é"
    assert not [c for c in shown if c not in "\n\t" and (ord(c) < 32 or 0x7F <= ord(c) < 0xA0)]


def _commands(command, path=("lvx",)):
    """Every command of `lvx` with its path, groups' commands included."""
    yield path, command
    for name, sub in getattr(command, "commands", {}).items():
        yield from _commands(sub, (*path, name))


def test_no_option_states_two_defaults():
    """An option's help says its default once: in its own words ("Default: ...", when typer has
    none to show) or typer's `[default: ...]`, never both (they disagreed)."""
    import typer.main

    twice = []
    for path, command in _commands(typer.main.get_command(app)):
        ctx = command.context_class(command, info_name=" ".join(path))
        for param in command.params:
            record = param.get_help_record(ctx) if param.param_type_name == "option" else None
            if record and "Default:" in record[1] and "[default:" in record[1]:
                twice.append(f"{' '.join(path)} {record[0]}: {record[1]}")
    assert not twice, "\n".join(twice)


def test_the_command_list_is_whole_at_80_columns():
    out = CliRunner().invoke(app, ["--help"], env={"COLUMNS": "80"}, terminal_width=80).output
    commands = out[out.index("Commands:") :]
    assert "..." not in commands and "serve" in commands, out
    assert "OpenAI-compatible API" in out, out


def test_the_api_key_is_named_as_the_docs_name_it():
    out = CliRunner().invoke(app, ["serve", "--help"], terminal_width=100).output
    assert "--api-key KEY" in out and "--api-key TEXT" not in out, out
    assert "--api-key KEY" in (ROOT / "docs" / "usage.md").read_text()


def test_the_video_line_gives_the_rate_the_frames_were_taken_at():
    """--max-frames 3 on a 12 s video at --fps 1 takes a frame every 4 s: the line says 0.25 fps."""
    from lvx_app.engine.describe import describe_video
    from lvx_app.engine.records import VideoSummary

    def line(frames: int, fps: float, duration_s: float) -> str:
        summary = VideoSummary("v.mp4", frames, fps, duration_s, frames * 4, False, 1.0)
        return describe_video(summary)

    assert line(3, 1.0, 12.0).startswith("3 frames at 0.25 fps over 12 s")
    assert line(10, 1.0, 10.0).startswith("10 frames at 1 fps over 10 s")
    assert line(11, 1.0, 10.5).startswith("11 frames at 1 fps")  # a last frame before the end
    assert line(4, 0.5, 7.0).startswith("4 frames at 0.5 fps")


def _mistakes(tmp: Path, video: str) -> list[list[str]]:
    return [
        ["chat"],  # a missing argument (click's own error)
        ["chat", "--bogus", video],  # an unknown option (click's)
        ["nosuch"],  # an unknown command (click's)
        ["chat", "--fps", "abc", video],  # a value of the wrong type (click's)
        ["chat", "--fps", "-1", video],  # a value out of range (the config's)
        ["chat", str(tmp / "missing.mp4"), "--gpus", "0"],  # a path that does not exist
        ["info", "--model", str(tmp)],  # a folder that is no checkpoint
        ["eval", "report", str(tmp / "missing.jsonl")],
        ["eval", "report", str(tmp / "missing.jsonl"), "--scoring", "loose"],
        ["cache", "rm", "--dir", str(tmp / "cache")],  # nothing named
        ["cache", "rm", "abcd", "--dir", str(tmp / "cache")],  # an id that is not there
        ["demo", "--generation", "g9", "--workdir", str(tmp / "demo")],
    ]


def test_every_mistake_is_one_error_line_and_exit_2(tmp_path, short_video):
    """One form for every mistake in a command line, whoever finds it (click or lvx):
    `error: ...` and exit code 2."""
    for argv in _mistakes(tmp_path, short_video):
        result = CliRunner().invoke(app, argv)
        said = result.output
        errors = [line for line in said.splitlines() if line.lower().startswith("error")]
        assert result.exit_code == 2, (argv, said)
        assert [e[:6] for e in errors] == ["error:"], (argv, said)
        assert "Traceback" not in said and "Error:" not in said, (argv, said)


def test_the_command_line_starts_without_torch():
    """Parsing a command imports no torch (nor the models, which import it), so Ctrl-C while a
    command starts is the CLI's to handle and `--help` answers at once."""
    import subprocess
    import sys

    code = (
        "import sys, lvx_app.cli.main\n"
        "print(sorted(m for m in ('torch', 'lvx_models') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_help_wraps_between_words_never_inside_a_model_id():
    """Every command's help at 80 columns: no line ends in a hyphen split off its word (a model id
    such as mPLUG/mPLUG-Owl3-7B-241101 or a name such as LV-XAttn stays whole), none is wider."""
    import typer.main

    for path, _ in _commands(typer.main.get_command(app)):
        argv = [*path[1:], "--help"]
        out = CliRunner().invoke(app, argv, env={"COLUMNS": "80"}, terminal_width=80).output
        assert not re.search(r"\w-\n", out), f"{' '.join(path)} --help:\n{out}"
        assert max(map(len, out.splitlines())) <= 80, out
    out = CliRunner().invoke(app, ["chat", "--help"], env={"COLUMNS": "80"}).output
    assert "mPLUG/mPLUG-Owl3-7B-241101" in out and "\u2011" not in out
