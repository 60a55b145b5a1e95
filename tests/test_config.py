"""The one typed config: parsed once from the options, checked in one place with one-line errors,
sent whole to the ranks, and the source of every command's options."""

from __future__ import annotations

import importlib
import json
import math

import pytest
import typer

from lvx_app.config import (
    SECTIONS,
    Config,
    ConfigError,
    GenerationConfig,
    VideoConfig,
    cli_fields,
    updated,
)


def test_a_config_travels_to_the_ranks_and_back_unchanged():
    config = Config.from_options(model="m", fps=2.5, max_frames=7, ranks=3, temperature=0.5)
    again = Config.from_dict(json.loads(json.dumps(config.to_dict())))
    assert again == config and again.video.fps == 2.5 and again.parallel.ranks == 3


@pytest.mark.parametrize(
    "data, message",
    [
        ({"video": {"fsp": 1}}, "unknown config key 'fsp'; valid: fps, max_frames"),
        ({"vidoe": {}}, "unknown config section 'vidoe'; valid: model, video, parallel"),
        ({"video": 3}, "config section VideoConfig must be an object"),
        ([1, 2], "a config is a JSON object with the sections model, video"),
    ],
)
def test_a_hand_written_config_with_a_wrong_key_is_one_line_listing_the_valid_ones(data, message):
    with pytest.raises(ConfigError) as e:
        Config.from_dict(data)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_flat_options_find_their_section_and_a_wrong_one_lists_the_valid_names():
    config = Config.from_options(model="m", gpus=0, layout="striped", kv_mode="recompute")
    assert (config.model.path, config.parallel.layout, config.video.kv_mode) == (
        "m",
        "striped",
        "recompute",
    )
    with pytest.raises(ConfigError, match="unknown option 'fpss'; valid: .*fps"):
        Config.from_options(model="m", fpss=1)
    with pytest.raises(ConfigError, match="unknown option 'fpss'; valid: fps, max_frames"):
        updated(VideoConfig(), fpss=1)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"fps": 0}, "--fps must be above 0"),
        ({"fps": math.nan}, "--fps must be above 0"),
        ({"max_frames": 0}, "--max-frames must be 1 or more"),
        ({"temperature": -1}, "--temperature must be 0 (greedy) or a finite number above 0"),
        ({"temperature": math.nan}, "--temperature must be 0"),
        ({"top_p": 2}, "--top-p must be above 0 and at most 1"),
        ({"top_p": -0.5}, "--top-p must be above 0 and at most 1"),
        ({"max_new_tokens": 0}, "--max-new-tokens must be 1 or more"),
        ({"timeout_s": 0}, "--timeout must be a number of seconds above 0"),
        ({"layout": "diagonal"}, "unknown --layout 'diagonal'; use one of contiguous"),
        ({"kv_mode": "both"}, "unknown --kv-mode 'both'; use one of auto, cache, recompute"),
        (
            {"media_attention": "latest"},
            "unknown --media-attention 'latest'; use one of every-frame-before, latest-frame",
        ),
        ({"dtype": "int8"}, "unknown --dtype 'int8'"),
        ({"gpus": -1}, "--gpus must be 0 (CPU) or a positive number of GPUs"),
        ({"gpus": "0"}, "--gpus takes a whole number, not '0'"),
        ({"gpus": True}, "--gpus takes a whole number, not True"),
        ({"ranks": 2.5}, "--ranks takes a whole number, not 2.5"),
        ({"ranks": "2"}, "--ranks takes a whole number, not '2'"),
        ({"max_frames": "3"}, "--max-frames takes a whole number, not '3'"),
        ({"seed": "1"}, "--seed takes a whole number, not '1'"),
        ({"subtitle_tokens": -1}, "--subtitle-tokens must be 0 (no subtitles) or more"),
        ({"rank_memory_gib": 0}, "--rank-memory-gib must be a number of GiB above 0"),
        ({"rank_memory_gib": math.inf}, "--rank-memory-gib must be a number of GiB above 0"),
    ],
)
def test_every_value_is_checked_once_with_a_line_naming_the_option(options, message):
    with pytest.raises(ConfigError) as e:
        Config.from_options(model="m", **options)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_sampling_values_are_checked_when_an_answer_overrides_them():
    with pytest.raises(ConfigError, match="--top-p"):
        updated(GenerationConfig(), top_p=0)
    assert updated(GenerationConfig(), temperature=0.7).temperature == 0.7


def test_the_worker_entry_refuses_a_bad_config_in_one_line(capsys):
    from lvx_app.runtime.rank_main import main

    assert main(["--config", json.dumps({"video": {"fsp": 1}})]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [err[0]] and err[0].startswith("error: --config: unknown config key 'fsp'")
    assert main(["--config", "{not json"]) == 2
    assert "error: --config:" in capsys.readouterr().err


def _flags(command) -> set[str]:
    click_command = typer.main.get_command(command)
    return {flag for p in click_command.params for flag in p.opts}


def test_every_config_field_with_a_flag_is_an_option_of_the_commands_that_take_its_section():
    """One field is one option: chat takes the whole model, video, parallel and generation
    sections."""
    from lvx_app.cli.main import app

    chat = next(c for c in typer.main.get_command(app).commands.values() if c.name == "chat")
    flags = {flag for p in chat.params for flag in p.opts}
    for section in ("model", "video", "parallel", "generation"):
        for f in cli_fields(SECTIONS[section]):
            assert f.metadata["flag"].split("/")[0] in flags, (section, f.name)


def test_the_memory_a_rank_may_use_is_stated_or_measured(monkeypatch):
    """--rank-memory-gib (or LVX_RANK_MEMORY_GIB) is what a rank plans a video's features and a
    question's prefill with; unstated, it is what is free now."""
    import torch

    from lvx_app.cli.main import app

    ingest = importlib.import_module("lvx_app.video.ingest")  # the package names a function so

    cpu = torch.device("cpu")
    monkeypatch.setattr(ingest, "auto_memory_budget", lambda device: 123)
    assert ingest.rank_memory_budget(cpu, None) == 123
    assert ingest.rank_memory_budget(cpu, 1.5) == 3 * 2**29
    command = typer.main.get_command(app).commands["chat"]
    monkeypatch.setenv("LVX_RANK_MEMORY_GIB", "2.5")
    assert command.make_context("chat", ["movie.mp4"]).params["rank_memory_gib"] == 2.5
