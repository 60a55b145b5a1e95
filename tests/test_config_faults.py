"""A checkpoint whose config files are wrong is one `CheckpointError` line naming the file and the
field, from `lvx info` (the family's inspection) and from loading the model alike, in both
families: never an AttributeError, a ZeroDivisionError, a KeyError, nor a model that loads with a
NaN epsilon and answers `!!!`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from lvx_app.cli.info import checkpoint_rows
from lvx_models.api import CheckpointError, family_of
from lvx_models.mllama.tiny import write_tiny_checkpoint as write_tiny_mllama
from lvx_models.mplug_owl3.tiny import write_tiny_checkpoint as write_tiny_owl3


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("config_faults")
    return {
        "owl3": Path(write_tiny_owl3(root / "owl3", "g2")),
        "mllama": Path(write_tiny_mllama(root / "mllama")),
    }


def _copy(tiny: Path, to: Path) -> Path:
    shutil.copytree(tiny, to)
    return to


def _set(config: dict, path: str, value) -> None:
    *sections, name = path.split(".")
    for section in sections:
        config = config[section]
    config[name] = value


def _one_line(folder: Path, *says: str) -> None:
    """`lvx info` and the family's loader both refuse `folder` in one line saying `says`."""
    for what in ("info", "load"):
        with pytest.raises(CheckpointError) as e:
            if what == "info":
                checkpoint_rows(str(folder))
            else:
                family_of(folder).load(str(folder))
        message = str(e.value)
        assert "\n" not in message and all(s in message for s in says), (what, message)


TEXT = {"owl3": "", "mllama": "text_config."}  # where each family keeps its language model's sizes


@pytest.mark.parametrize("family", ["owl3", "mllama"])
@pytest.mark.parametrize(
    "field, value, says",
    [
        ("{text}max_position_embeddings", "lots", "expected an int"),
        ("{text}num_attention_heads", 0, "expected an int above 0"),
        ("vision_config.patch_size", 0, "expected an int above 0"),
        ("{text}rms_norm_eps", float("nan"), "expected a float, finite and above 0"),
        ("{text}rms_norm_eps", float("inf"), "expected a float, finite and above 0"),
        ("{text}hidden_size", -8, "expected an int above 0"),
    ],
)
def test_a_bad_size_or_epsilon_is_one_line_naming_the_file_and_field(
    tiny, tmp_path, family, field, value, says
):
    folder = _copy(tiny[family], tmp_path / family)
    config = json.loads((folder / "config.json").read_text())
    field = field.format(text=TEXT[family])
    _set(config, field, value)
    (folder / "config.json").write_text(json.dumps(config))
    _one_line(folder, f"{folder / 'config.json'}: {field}", says)


@pytest.mark.parametrize("family", ["owl3", "mllama"])
def test_a_config_that_is_no_object_is_one_line(tiny, tmp_path, family):
    folder = _copy(tiny[family], tmp_path / family)
    (folder / "config.json").write_text("[1, 2]")
    _one_line(folder, f"{folder / 'config.json'} holds a JSON list")


def test_a_llama3_rope_scaling_of_factor_0_or_without_its_numbers_is_one_line(tiny, tmp_path):
    folder = _copy(tiny["mllama"], tmp_path / "mllama")
    config = json.loads((folder / "config.json").read_text())
    config["text_config"]["rope_scaling"]["factor"] = 0
    (folder / "config.json").write_text(json.dumps(config))
    _one_line(folder, "text_config.rope_scaling.factor is 0")
    del config["text_config"]["rope_scaling"]["low_freq_factor"]
    config["text_config"]["rope_scaling"]["factor"] = 8.0
    (folder / "config.json").write_text(json.dumps(config))
    _one_line(folder, "text_config.rope_scaling of rope_type llama3 has no low_freq_factor")


def test_a_missing_preprocessor_config_is_one_line_on_one_rank(tiny, tmp_path):
    folder = _copy(tiny["mllama"], tmp_path / "mllama")
    (folder / "preprocessor_config.json").unlink()
    with pytest.raises(CheckpointError) as e:
        family_of(folder).load(str(folder))
    assert str(e.value) == (
        f"{folder / 'preprocessor_config.json'} is missing (the image processor's settings): "
        "not a complete checkpoint"
    )
