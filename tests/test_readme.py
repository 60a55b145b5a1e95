"""The README is short and every command and Python line in it works as written: each `lvx`
line parses with the real command's options, the torchrun line with torchrun's and the script line
with the script's, the demo line sets up as the test line CI runs, each Python block compiles and
calls lvx with option names the config knows, the `lvx.open` example and the `lvx serve` line with
its `openai` client example run on the tiny checkpoint (slow), and every link points at a page (and
heading) that exists. The lmms-eval line is another tool's (not installed here): not run."""

from __future__ import annotations

import ast
import re
import shlex
import shutil
from pathlib import Path

import pytest
import typer.main

from lvx_app.cli.main import app
from lvx_app.config import ENGINE_SECTIONS, SECTIONS, Config

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
MAX_LINES = 150


def _blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)\n```", README, flags=re.S)


def _lvx_lines() -> list[list[str]]:
    """The argument lists after `lvx` (or `-m lvx_app.cli`) in the README's bash blocks."""
    found = []
    for block in _blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            for start in ("lvx", "lvx_app.cli"):
                if start in words:
                    found.append(words[words.index(start) + 1 :])
                    break
    return found


def _command(words: list[str]):
    command = typer.main.get_command(app)
    while hasattr(command, "commands") and words and words[0] in command.commands:
        command, words = command.commands[words[0]], words[1:]
    return command, words


def test_the_readme_is_short() -> None:
    assert len(README.splitlines()) <= MAX_LINES


def test_the_readme_shows_every_command() -> None:
    shown = {" ".join(words[:2]) if words[0] == "eval" else words[0] for words in _lvx_lines()}
    expected = {"demo", "chat", "serve", "eval videomme", "eval report", "finetune"}
    assert expected <= shown


@pytest.mark.parametrize("words", _lvx_lines(), ids=lambda w: " ".join(w)[:60])
def test_every_lvx_line_parses_with_the_real_options(words: list[str]) -> None:
    command, args = _command(list(words))
    assert not hasattr(command, "commands"), f"`lvx {' '.join(words)}` names no command"
    command.make_context(command.name, args)  # an unknown option or a bad value raises


def _calls(tree: ast.AST, name: str) -> list[ast.Call]:
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == name
    ]


def test_python_blocks_compile_and_name_real_options() -> None:
    fields = {name: {f for f in SECTIONS[name].__dataclass_fields__} for name in SECTIONS}
    engine_options = set().union(*(fields[name] for name in ENGINE_SECTIONS))
    for block in _blocks("python"):
        tree = ast.parse(block)
        for call in _calls(tree, "open"):
            names = {k.arg for k in call.keywords}
            Config.from_options(model="m", **{n: _literal(call, n) for n in names})
            assert names <= engine_options
        for call in _calls(tree, "load_video"):
            assert {k.arg for k in call.keywords} <= fields["video"]
        for call in _calls(tree, "ask"):
            assert {k.arg for k in call.keywords} <= fields["generation"]


def _literal(call: ast.Call, name: str):
    return next(ast.literal_eval(k.value) for k in call.keywords if k.arg == name)


def _anchor(heading: str) -> str:
    return re.sub(r"[^a-z0-9 -]", "", heading.lower()).replace(" ", "-")


def test_every_link_points_at_a_page_and_heading_that_exist() -> None:
    for target in re.findall(r"\]\(([^)]+)\)", README):
        if target.startswith("http"):
            continue
        page, _, anchor = target.partition("#")
        path = ROOT / page
        assert path.exists(), target
        if anchor:
            headings = re.findall(r"^#+ (.+)$", path.read_text(), flags=re.M)
            assert anchor in {_anchor(h) for h in headings}, target


def _config_defaults() -> dict[str, list[object]]:
    """Every option's flag (each spelling of a --x/--no-x pair) and the config's defaults (one per
    section that has the flag)."""
    from lvx_app.config import cli_fields, field_default

    found: dict[str, list[object]] = {}
    for section in SECTIONS.values():
        for f in cli_fields(section):
            for flag in f.metadata["flag"].split("/"):
                found.setdefault(flag, []).append(field_default(f))
    return found


# `--flag` ... (default V) / `--flag`, default `V` / `--flag V` (default)
_STATED = (
    r"`(--[a-z-]+)(?: [^`]*)?`[^`(\n]{0,20}(?:\(default |, default )`?([\w.]+)`?",
    r"`(--[a-z-]+) ([\w.]+)` \(default\)",
)


def _stated_defaults() -> list[tuple[str, str, str]]:
    """(page, flag, value) of every default the README and docs/usage.md state for an option."""
    found = []
    for page in ("README.md", "docs/usage.md"):
        text = (ROOT / page).read_text()
        for pattern in _STATED:
            found += [(page, flag, value) for flag, value in re.findall(pattern, text)]
    return found


def _same(stated: str, default: object) -> bool:
    if isinstance(default, (int, float)) and not isinstance(default, bool):
        return float(stated) == float(default)
    return stated == str(default)


def test_the_defaults_the_pages_state_are_the_configs() -> None:
    defaults = _config_defaults()
    stated = _stated_defaults()
    flags = {flag for _, flag, _ in stated}
    # (--max-upload-mb and the memory budgets default to shares of the machine: said in words)
    assert {"--subtitle-tokens", "--send-timeout", "--decode-timeout", "--queue-size"} <= flags
    wrong = [
        f"{page}: {flag} (default {value}), the config's: {defaults.get(flag)}"
        for page, flag, value in stated
        if not any(_same(value, default) for default in defaults.get(flag, []))
    ]
    assert not wrong, "\n".join(wrong)


def test_the_demos_answer_length_is_the_one_the_readme_gives() -> None:
    from lvx_app.cli.demo import ANSWER_TOKENS

    said = re.search(r"two questions with LV-XAttn, at most (\d+)\s+tokens each", README)
    assert said and int(said.group(1)) == ANSWER_TOKENS


def _setup_lines() -> tuple[str, str]:
    """The README's two copy-paste lines: set up and run the demo; set up and run the tests."""
    demo, tests = _blocks("bash")[0].splitlines()
    return demo, tests


# the suite in two processes, each test file whole in one (its server or group fixture started once)
TEST_COMMAND = "python -m pytest -q -n 2 --dist loadfile"


# the OpenFlamingo reference for the parity tests, without its pins (torch 2.0.1)
REFERENCE_PACKAGES = (
    "pip install --no-deps open-flamingo==2.0.1 open_clip_torch==3.3.0 einops-exts==0.0.4"
)


def test_the_demo_line_sets_up_as_the_line_ci_runs() -> None:
    """CI runs the second line word for word (tests/test_house.py); the first is the same set-up
    without the test extras, then `lvx demo` (which the demo's own tests run)."""
    demo, tests = _setup_lines()
    assert tests.endswith(f" && {TEST_COMMAND}") and demo.endswith(" && lvx demo")
    without_tests = tests.replace(" chromium chromium-driver", "").replace('".[test]"', ".")
    without_tests = without_tests.replace(f" && {REFERENCE_PACKAGES}", "")
    assert demo == without_tests.removesuffix(TEST_COMMAND) + "lvx demo"


def _lines_after(word: str) -> list[list[str]]:
    """The words after `word` on each line of the README's bash blocks that has it."""
    found = []
    for block in _blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if word in words:
                found.append(words[words.index(word) + 1 :])
    return found


def test_the_torchrun_line_parses_with_torchruns_own_options() -> None:
    from torch.distributed.run import get_args_parser

    (words,) = _lines_after("torchrun")
    args = get_args_parser().parse_args(words)
    assert args.module and args.training_script == "lvx_app.cli"
    assert args.training_script_args[0] in {
        c.name for c in typer.main.get_command(app).commands.values()
    }


def test_every_script_line_parses_with_the_scripts_options() -> None:
    """`python3 scripts/NAME.py ARGS`: ARGS as the script's own parser reads them."""
    import importlib

    lines = [
        words for words in _lines_after("python3") if words and words[0].startswith("scripts/")
    ]
    assert lines
    for script, *args in lines:
        module = importlib.import_module(script.removesuffix(".py").replace("/", "."))
        module.parse_args(args)  # a bad option exits with argparse's usage line


def _as_run_here(text: str, stand_ins: dict[str, str]) -> str:
    """`text` with the README's model, files and machine replaced by this test's."""
    for said, here in stand_ins.items():
        assert said in text, f"the README no longer says {said!r}: update the stand-ins"
        text = text.replace(said, here)
    return text


def _python_block(word: str) -> str:
    return next(block for block in _blocks("python") if word in block)


MODEL = "mPLUG/mPLUG-Owl3-7B-241101"


@pytest.mark.slow
def test_the_python_example_runs_as_written(
    tiny_checkpoints, short_video, tmp_path, monkeypatch, capsys
) -> None:
    """The README's `lvx.open` example, with the tiny checkpoint, a short video and no GPU."""
    monkeypatch.setenv("LVX_CACHE_DIR", str(tmp_path / "cache"))
    code = _as_run_here(
        _python_block("lvx.open"),
        {
            repr(MODEL).replace("'", '"'): repr(tiny_checkpoints["g2"]),
            '"movie.mp4"': repr(short_video),
            "gpus=8": "gpus=0",
        },
    )
    exec(compile(code, "README.md", "exec"), {"__name__": "readme"})
    answer, *under = capsys.readouterr().out.rstrip("\n").split("\n")
    assert answer.strip() and "TTFT" not in answer, "the answer on a line of its own"
    assert re.fullmatch(r"seen at \d+:\d\d.*\(\d+%\)", under[0]), under  # as the chat says
    assert re.fullmatch(r"TTFT [\d.]+ s · [\d.]+ tok/s · \d+ tokens.*", under[1]), under


@pytest.mark.slow
def test_the_serve_line_and_the_api_example_run_as_written(
    tiny_checkpoints, short_video, tmp_path, monkeypatch, capsys
) -> None:
    """`lvx serve ...` as the README starts it (the tiny checkpoint, its own port), then the
    README's `openai` client example against it."""
    pytest.importorskip("openai")
    from test_serve import start_server, stop_server  # skips without gradio

    videos = tmp_path / "videos"
    videos.mkdir()
    shutil.copy(short_video, videos / "movie.mp4")
    (serve,) = [w for w in _lines_after("lvx") if w[0] == "serve" and "--no-ui" not in w]
    line = _as_run_here(
        shlex.join(serve[1:]),
        {"--gpus 8": "--gpus 0", MODEL: tiny_checkpoints["g2"], "/data/videos": str(videos)},
    )
    log = tmp_path / "serve.log"
    proc, url = start_server([*shlex.split(line), "--cache-dir", str(tmp_path / "cache")], log)
    try:
        code = _as_run_here(
            _python_block("OpenAI("),
            {"http://127.0.0.1:7860/v1": url + "v1", "file:///data/videos": f"file://{videos}"},
        )
        exec(compile(code, "README.md", "exec"), {"__name__": "readme"})
    finally:
        stop_server(proc, log)
    assert capsys.readouterr().out.strip()


def test_the_lmms_eval_lines_keep_the_no_subtitle_setting_and_a_read_only_data_folder() -> None:
    """The serve line for lmms-eval (README and docs) loads no subtitles (its task asks without
    them), and the documented task yaml keeps lmms-eval's datasets cache out of the data folder."""
    import yaml

    usage = (ROOT / "docs" / "usage.md").read_text()
    lines = [
        shlex.split(line.replace("\\\n", " "), comments=True)
        for text in (README, usage)
        for line in re.findall(r"^lvx serve .*--no-ui.*?(?:\\\n.*)?$", text, flags=re.M)
    ]
    assert len(lines) == 2, lines
    for words in lines:
        command, args = _command(words[1:])
        assert command.make_context(command.name, args).params["subtitles"] == "none", words
    (task,) = [b for b in re.findall(r"```yaml\n(.*?)\n```", usage, re.S) if "dataset_kwargs" in b]
    assert yaml.safe_load(task)["dataset_kwargs"]["video"] is True


def _lmms_eval_lines(text: str) -> list[str]:
    """The lmms-eval commands of the page's bash blocks, continuation lines joined."""
    blocks = "\n".join(re.findall(r"```bash\n(.*?)\n```", text, re.S)).replace("\\\n", " ")
    return re.findall(r"^(?:\S+=\S+ )*lmms-eval .*$", blocks, flags=re.M)


def test_every_lmms_eval_line_logs_its_samples_into_a_folder_of_its_own_and_is_checked() -> None:
    """Each documented lmms-eval run keeps its samples (`--log_samples`) in an `--output_path` no
    other line uses, in a mode that sends no duplicate frames (the video, or simple mode), and the
    failure check after it reads that folder through one `grep -c` (one number, not one per file);
    the README's serve line allows the folder the hub task keeps its videos in."""
    usage = (ROOT / "docs" / "usage.md").read_text()
    for text in (README, usage):
        runs = _lmms_eval_lines(text)
        assert runs, "no lmms-eval line"
        outputs = []
        for run in runs:
            words = shlex.split(run, comments=True)
            assert "--log_samples" in words, run
            outputs.append(words[words.index("--output_path") + 1].rstrip("/"))
            assert "pass_video_url=True" in run or "--force_simple" in words, run
        assert len(set(outputs)) == len(outputs), outputs
        checks = re.findall(r"^cat (\S+) \| grep -c LMMS_EVAL_REQUEST_FAILED", text, flags=re.M)
        assert checks and all(any(c.startswith(o + "/") for o in outputs) for c in checks), checks
    (serve,) = [x for x in README.splitlines() if x.startswith("lvx serve") and "--no-ui" in x]
    allowed = shlex.split(serve, comments=True)
    assert allowed[allowed.index("--allow-paths") + 1].endswith("/videomme/data")
    assert "$HF_HOME/videomme/data" in usage and "id(image)" in usage
