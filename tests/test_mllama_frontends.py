"""Every front door takes a Llama-3.2-Vision checkpoint as it takes an mPLUG-Owl3 one: `lvx demo
--model-family mllama`, `lvx info --model`, the Python API (`lvx_app.open`) and the
OpenAI-compatible API, each on the tiny random-weight checkpoint and one in-process rank."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner
from videos import make_video

import lvx_app as lvx
from lvx_app.cli.main import app
from lvx_models.api import FAMILIES, family_named, family_of

QUESTION = "What happens in this video?"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return str(FAMILIES["mllama"].write_tiny(tmp_path_factory.mktemp("mllama") / "tiny"))


@pytest.fixture(scope="module")
def video(tmp_path_factory) -> str:
    """6 s at 4 fps: 6 frames at 1 fps."""
    folder = tmp_path_factory.mktemp("videos")
    return str(make_video(folder / "clip.mp4", num_frames=24, fps=4, width=64, height=48))


def test_info_model_gives_the_family_sizes_and_cross_layers(checkpoint):
    from lvx_app.cli.info import checkpoint_rows

    rows = checkpoint_rows(checkpoint)
    assert rows["family"] == "Llama-3.2-Vision (mllama)"
    assert rows["generation"].startswith("3.2: Llama-3.2-Vision")
    assert rows["cross-attention layers (0-based)"] == "1, 3"
    assert rows["sizes"].startswith("hidden 64, 5 layers, 4 heads / 2 kv heads")
    result = CliRunner().invoke(app, ["info", "--model", checkpoint], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    for words in ("Llama-3.2-Vision (mllama)", "cross-attention layers (0-based)", "hidden 64"):
        assert words in result.output, result.output


def test_a_family_is_named_by_its_title_or_id_in_any_case(tiny_checkpoints, checkpoint):
    """What `lvx demo --help` and `lvx info` show is what --model-family takes; both families
    number their cross-attention layers from 0, as their weights' keys do."""
    from lvx_app.cli.info import checkpoint_rows, collect_info

    for name in ("mPLUG-Owl3", "mplug_owl3", "MPLUG-OWL3", "mplug-owl3"):
        assert family_named(name) is FAMILIES["mplug_owl3"], name
    for name in ("Llama-3.2-Vision", "llama-3.2-vision", "mllama", "MLLAMA"):
        assert family_named(name) is FAMILIES["mllama"], name
    listed = collect_info()["model families"]
    assert listed == ", ".join(f"{f.title} ({f.name})" for f in FAMILIES.values())
    assert listed.startswith("mPLUG-Owl3 (mplug_owl3), Llama-3.2-Vision (mllama)")
    assert "OpenFlamingo (openflamingo)" in listed
    help_text = " ".join(CliRunner().invoke(app, ["demo", "--help"]).output.split())
    assert "one of the families `lvx info` lists" in help_text
    assert "Default: mPLUG-Owl3." in help_text  # a name --model-family takes
    owl = checkpoint_rows(tiny_checkpoints["g2"])
    assert owl["family"] == "mPLUG-Owl3 (mplug_owl3)"
    want = [
        i - 1
        for i in family_of(tiny_checkpoints["g2"])
        .inspect(tiny_checkpoints["g2"])
        .config.hyper_layers
    ]
    assert owl["cross-attention layers (0-based)"] == ", ".join(map(str, want))
    assert not any("1-based" in key for key in (*owl, *checkpoint_rows(checkpoint)))


def test_both_tiny_families_answer_as_long_by_default(tiny_checkpoints, checkpoint):
    """The tiny checkpoints name the same answer length in their generation_config.json, and both
    families read it (a published checkpoint names none: lvx's default applies)."""
    lengths = {
        family_of(path).load(path).processor.max_new_tokens
        for path in (tiny_checkpoints["g2"], checkpoint)
    }
    assert lengths == {32}


def test_the_demo_writes_into_the_cache_folder_lvx_cache_dir_names(tmp_path, monkeypatch):
    from lvx_app.cli import demo

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("LVX_CACHE_DIR", str(tmp_path / "cache"))

    class Made(Exception):
        pass

    def prepare(workdir, family, generation):
        raise Made(workdir)

    monkeypatch.setattr(demo, "prepare", prepare)
    with pytest.raises(Made) as made:
        CliRunner().invoke(app, ["demo"], catch_exceptions=False)
    assert made.value.args[0] == tmp_path / "cache" / "demo"
    assert not (tmp_path / "home").exists()


def test_a_family_or_generation_the_demo_has_not_is_one_error_line(tmp_path):
    for argv, said in (
        (
            ["--model-family", "llava"],
            "model family must be one of mPLUG-Owl3 (mplug_owl3), Llama-3.2-Vision (mllama)",
        ),
        (["--model-family", "mllama", "--generation", "g2"], "Llama-3.2-Vision generations are"),
    ):
        result = CliRunner().invoke(app, ["demo", *argv, "--workdir", str(tmp_path)])
        assert result.exit_code == 2 and said in result.output, result.output
        assert "Traceback" not in result.output
    assert not list(tmp_path.iterdir()), "nothing is written before the choice is checked"


@pytest.mark.slow
def test_demo_on_the_tiny_llama_answers_with_its_moments(tmp_path):
    argv = ["demo", "--model-family", "mllama", "--ranks", "1", "--workdir", str(tmp_path)]
    result = CliRunner().invoke(app, argv, env={"COLUMNS": "200"})
    said = result.output
    assert result.exit_code == 0, said
    assert "tiny random-weight Llama-3.2-Vision (3.2)" in said
    checkpoint = tmp_path / "tiny-mllama-3.2"
    assert family_of(checkpoint) is FAMILIES["mllama"]
    assert "lvx demo timings (1 cpu rank(s))" in said and "answer 2 (TTFT)" in said
    assert len(re.findall(r"^seen at \d+:\d\d.* \(\d+%\)", said, re.MULTILINE)) == 2, said
    assert f"lvx info --model {checkpoint}" in said


@pytest.mark.parametrize("finetunes", [True, False])
def test_the_demo_prints_a_finetuning_line_only_for_a_family_lvx_finetunes(tmp_path, finetunes):
    from lvx_app.cli.examples import ready_lines

    names = ("example", "videomme", "train")
    files = {name: tmp_path / "examples" / name for name in names}
    lines = ready_lines(tmp_path / "ckpt", tmp_path / "demo.mp4", files, finetunes=finetunes)
    assert any(line.startswith("lvx finetune") for line in lines) == finetunes
    assert any(line.startswith("lvx eval videomme") for line in lines)


@pytest.mark.slow
def test_open_loads_a_video_and_answers_with_evidence(checkpoint, video):
    options = dict(gpus=0, ranks=1, cache=False, decode_workers=1, subtitles="none")
    with lvx.open(checkpoint, max_new_tokens=4, **options) as engine:
        summary = engine.load_video(video, fps=1)
        assert summary.frames == 6
        answer = "".join(engine.ask(QUESTION))
        last = engine.last_answer
        assert answer and 1 <= last.new_tokens <= 4
        assert last.evidence and all(0 <= m.start <= m.end <= 6 for m in last.evidence)
        assert "".join(engine.ask("and then?")) and engine.last_answer.new_tokens >= 1


@pytest.mark.slow
def test_the_openai_api_and_the_page_answer_about_a_video(checkpoint, video, tmp_path):
    """A chat completion with a `video_url` part, /v1/models naming the checkpoint, and the
    browser page's load and chat, all on one engine."""
    from engine_configs import engine_config
    from fastapi import FastAPI
    from starlette.testclient import TestClient

    from lvx_app.runtime.open import open_engine
    from lvx_app.runtime.service import EngineService
    from lvx_ui.app import ChatApp
    from lvx_ui.openai_request import VideoFiles
    from lvx_ui.openai_routes import OpenAIApi

    folder = tmp_path / "videos"
    folder.mkdir()
    clip = shutil.copy(video, folder / "clip.mp4")
    config = engine_config(checkpoint, tmp_path / "cache", max_new_tokens=3)
    engine = open_engine(config)
    service = EngineService(engine)
    web = FastAPI()
    files = VideoFiles([str(folder)], 10.0, tmp_path / "uploads")
    OpenAIApi(service, config, files, report=lambda line: None).mount(web)
    try:
        client = TestClient(web)
        (model,) = client.get("/v1/models").json()["data"]
        assert model["id"] == checkpoint and model["object"] == "model"
        content = [
            {"type": "video_url", "video_url": {"url": f"file://{clip}"}},
            {"type": "text", "text": QUESTION},
        ]
        body = {"model": checkpoint, "messages": [{"role": "user", "content": content}]}
        reply = client.post("/v1/chat/completions", json={**body, "max_tokens": 3})
        assert reply.status_code == 200, reply.text
        (choice,) = reply.json()["choices"]
        assert choice["message"]["content"] and 1 <= reply.json()["usage"]["completion_tokens"] <= 3
        assert engine.loaded.frames == 6
        page = ChatApp(service, config, allow_paths=[str(folder)])  # the page, on the same engine
        status = page.load(None, str(clip), 1.0, 0, owner="tab", progress=lambda *a, **k: None)[0]
        assert "6 frames" in status, status
        history = list(page.chat(QUESTION, [], 3, "tab"))[-1][0]
        assert history[-1]["role"] == "assistant" and "error" not in str(history[-1]["content"])
    finally:
        service.close()


def test_a_hub_id_fetches_every_file_the_llama_loader_reads(checkpoint, tmp_path, monkeypatch):
    """`--model meta-llama/...`: the files the hub download keeps are enough to load the model
    (the download copies only what its patterns match, as the hub does)."""
    import fnmatch

    import huggingface_hub

    def download(repo_id, *, allow_patterns, **kwargs):
        folder = tmp_path / "hub" / repo_id
        folder.mkdir(parents=True, exist_ok=True)
        for file in Path(checkpoint).iterdir():
            if any(fnmatch.fnmatch(file.name, p) for p in allow_patterns):
                shutil.copy(file, folder / file.name)
        return str(folder)

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", download)
    hub_id = "meta-llama/Llama-3.2-11B-Vision-Instruct"
    family = family_of(hub_id)
    assert family is FAMILIES["mllama"]
    _, config, processor = family.load(hub_id)
    assert config.cross_layer_indices == [1, 3] and processor.frame_prep.size == 28
