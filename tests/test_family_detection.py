"""Which family a checkpoint is (`family_of`): its config.json's `model_type`, else the family
whose marker files are all at the top of the folder or hub repo (the hub's listing, or offline the
local Hugging Face cache), else one line naming what each family expects. A stub family marked by
`stub_weights.pt` (a published layout without config.json) is registered for the tests."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

import lvx_models.api as api
from lvx_models.api import FAMILIES, CheckpointError, family_of

# every family's config.json model_type, one folder each
TYPED = [(f.name, t) for f in FAMILIES.values() for t in f.model_types[:1]]


@pytest.fixture
def stub(monkeypatch):
    """A registered family whose checkpoints hold `stub_weights.pt` and no config.json."""
    family = replace(
        next(iter(FAMILIES.values())),
        name="stub",
        title="Stub",
        model_types=(),
        marker_files=("stub_weights.pt",),
    )
    monkeypatch.setitem(api.FAMILIES, "stub", family)
    return family


def _folder(root: Path, *files: str, config: object = None) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for name in files:
        (root / name).write_bytes(b"")
    if config is not None:
        (root / "config.json").write_text(json.dumps(config))
    return root


@pytest.mark.parametrize("name, model_type", TYPED)
def test_config_json_model_type_names_the_family(tmp_path, stub, name, model_type):
    folder = _folder(tmp_path, "stub_weights.pt", config={"model_type": model_type})
    assert family_of(folder) is FAMILIES[name]  # the config decides, whatever files lie beside


def test_a_folder_holding_only_stub_weights_pt_is_the_family_it_marks(tmp_path, stub):
    assert family_of(_folder(tmp_path, "stub_weights.pt")) is stub
    assert family_of(_folder(tmp_path / "more", "stub_weights.pt", "README.md")) is stub


def test_a_folder_that_matches_no_family_names_what_each_expects(tmp_path, stub):
    for folder in (_folder(tmp_path / "empty"), _folder(tmp_path / "other", "weights.bin")):
        with pytest.raises(CheckpointError) as e:
            family_of(folder)
        message = str(e.value)
        assert "\n" not in message and "no config.json" in message
        assert "Stub (stub_weights.pt)" in message
        for f in FAMILIES.values():
            assert f.title in message and all(t in message for t in f.model_types)


def test_without_the_stub_a_lone_stub_weights_pt_is_refused_not_sent_to_the_default(tmp_path):
    unmarked = {n: replace(f, marker_files=()) for n, f in FAMILIES.items()}
    with pytest.MonkeyPatch.context() as m:
        m.setattr(api, "FAMILIES", unmarked)
        with pytest.raises(CheckpointError, match="no config.json and no family's files"):
            family_of(_folder(tmp_path, "stub_weights.pt"))


def test_a_folder_marked_by_two_families_is_refused(tmp_path, stub, monkeypatch):
    monkeypatch.setitem(api.FAMILIES, "stub2", replace(stub, name="stub2", title="Stub Two"))
    with pytest.raises(CheckpointError, match="several families .Stub, Stub Two."):
        family_of(_folder(tmp_path, "stub_weights.pt"))


def test_an_unknown_model_type_is_refused_naming_the_families(tmp_path, stub):
    with pytest.raises(CheckpointError, match="model_type 'llava' is none lvx runs") as e:
        family_of(_folder(tmp_path, config={"model_type": "llava"}))
    assert "Stub (stub_weights.pt)" in str(e.value)


def test_an_unreadable_config_without_markers_goes_to_the_default_loader(tmp_path):
    folder = _folder(tmp_path)
    (folder / "config.json").write_text("[1, 2]")
    assert family_of(folder) is FAMILIES[api.DEFAULT_FAMILY]


def _hub(monkeypatch, tmp_path, listing=None, cached=()):
    """A fake hub: `snapshot_download` gives a folder of the config-less repo's `cached` files (as
    the HF cache holds them), `list_repo_files` gives `listing` (or fails when None)."""
    import huggingface_hub

    def download(repo_id, *, allow_patterns, local_files_only=False, **kwargs):
        if local_files_only and not cached:
            raise FileNotFoundError("not in the cache")
        return str(_folder(tmp_path / "hub" / repo_id, *cached))

    def listed(repo_id, revision=None, **kwargs):
        if listing is None:
            raise ConnectionError("no network")
        return listing

    monkeypatch.setattr(huggingface_hub, "snapshot_download", download)
    monkeypatch.setattr(huggingface_hub, "list_repo_files", listed)


def test_a_hub_repo_without_config_is_found_by_its_listing(tmp_path, stub, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    _hub(monkeypatch, tmp_path, ["README.md", "stub_weights.pt", "sub/config.json"])
    assert family_of("someone/flamingo-3b") is stub


def test_a_hub_listing_that_fails_is_one_line(tmp_path, stub, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    _hub(monkeypatch, tmp_path, listing=None)
    with pytest.raises(CheckpointError, match="listing its files on the Hugging Face hub failed"):
        family_of("someone/flamingo-3b")


def test_offline_the_local_cache_is_listed(tmp_path, stub, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _hub(monkeypatch, tmp_path, listing=None, cached=("stub_weights.pt",))
    assert family_of("someone/flamingo-3b") is stub


def test_offline_and_not_cached_is_one_line(tmp_path, stub, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _hub(monkeypatch, tmp_path, listing=None)
    with pytest.raises(CheckpointError, match="HF_HUB_OFFLINE is set") as e:
        family_of("someone/flamingo-3b")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("family", FAMILIES.values(), ids=list(FAMILIES))
def test_every_registered_family_can_be_told_apart(family):
    """Each family is found by a config.json model_type or by marker files, and no other family's
    markers are a part of its own (a folder of it would match both)."""
    assert family.model_types or family.marker_files, family.name
    mine = set(family.marker_files)
    for other in FAMILIES.values():
        if other is not family and other.marker_files and mine:
            assert not set(other.marker_files) <= mine, (family.name, other.name)
    assert not set(family.model_types) & {
        t for o in FAMILIES.values() if o is not family for t in o.model_types
    }
