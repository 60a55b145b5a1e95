"""A family whose checkpoints are PyTorch weight files (`stub_weights.pt`, no config.json) is sized
by the fit check and fingerprinted for the feature cache through its `Family.weight_files`, as a
safetensors family is; such files are read as tensors only (never a pickle's code)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from test_family_detection import stub  # noqa: F401 - the stub family, a fixture

import lvx_models.api as api
from lvx_app.parallel.world import World
from lvx_app.runtime import fit
from lvx_models.api import FAMILIES, CheckpointError
from lvx_models.fingerprint import encoder_identity
from lvx_models.torch_files import torch_file_keys, torch_tensors


def _pt_files(folder):
    return torch_file_keys([folder / "stub_weights.pt"])


@pytest.fixture
def pt_stub(stub, monkeypatch):  # noqa: F811
    """`test_family_detection`'s stub family, reading its weights from `stub_weights.pt`."""
    family = replace(stub, weight_files=_pt_files)
    monkeypatch.setitem(api.FAMILIES, "stub", family)
    return family


def _write(folder, scale: float = 1.0):
    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    weights = {
        "perceiver.latents": torch.randn(4, 8, generator=g) * scale,
        "perceiver.norm.weight": torch.ones(8, dtype=torch.bfloat16),
        "lang_encoder.gated_cross_attn_layers.0.attn_gate": torch.zeros(1),
    }
    torch.save(weights, folder / "stub_weights.pt")
    return folder


def test_the_fit_check_counts_a_pt_checkpoints_weights(tmp_path, pt_stub):
    folder = _write(tmp_path / "ckpt")
    needs = fit.group_needs(str(folder), "float32", World(2, 0))
    assert needs.weight_bytes == (32 + 8 + 1) * 4


def test_the_fingerprint_reads_pt_weights_and_follows_them(tmp_path, pt_stub):
    prefixes = ("perceiver.",)
    ident = lambda f: encoder_identity(prefixes, str(f), None, weight_files=_pt_files)[1]  # noqa: E731
    a, b = _write(tmp_path / "a"), _write(tmp_path / "b")
    assert ident(a) == ident(b)
    assert ident(_write(tmp_path / "c", scale=2.0)) != ident(a)
    # a weight outside the prefixes changes nothing
    weights = torch_tensors(b / "stub_weights.pt")
    weights = {k: v.clone() for k, v in weights.items()}
    weights["lang_encoder.gated_cross_attn_layers.0.attn_gate"] += 1
    torch.save(weights, b / "stub_weights.pt")
    assert ident(b) == ident(a)


class _Code:
    def __reduce__(self):
        return (print, ("a pickle's code ran",))


def test_a_pt_file_holding_anything_but_tensors_is_one_line(tmp_path, capsys):
    torch.save({"w": torch.ones(1), "x": _Code()}, tmp_path / "code.pt")
    with pytest.raises(CheckpointError, match="not a PyTorch weight file of tensors only") as e:
        torch_tensors(tmp_path / "code.pt")
    assert "\n" not in str(e.value) and "ran" not in capsys.readouterr().out
    torch.save({"w": 1}, tmp_path / "int.pt")
    with pytest.raises(CheckpointError, match="not a flat dict of tensors"):
        torch_tensors(tmp_path / "int.pt")


def test_a_training_checkpoint_is_read_as_the_weights_it_keeps(tmp_path):
    """open_flamingo's training checkpoint keeps its weights under `model_state_dict` beside the
    step; those tensors are what it holds. A key that is no name is refused."""
    torch.save({"model_state_dict": {"w": torch.ones(2)}, "epoch": 3}, tmp_path / "train.pt")
    assert list(torch_tensors(tmp_path / "train.pt")) == ["w"]
    torch.save({0: torch.ones(2)}, tmp_path / "numbered.pt")
    with pytest.raises(CheckpointError, match="not a flat dict of tensors"):
        torch_tensors(tmp_path / "numbered.pt")


def test_a_finetuned_checkpoint_goes_to_the_familys_own_weights_file(
    tiny_checkpoints, tmp_path, monkeypatch
):
    """A family whose finetuned weights go to `stub_weights.pt` (tensors only, `torch.save`) gets
    them there, and every other file of its source checkpoint copied, safetensors too."""
    import filecmp
    from pathlib import Path

    from lvx_app.train import out_folder

    base = Path(tiny_checkpoints["g2"])
    family = replace(
        FAMILIES["mplug_owl3"],
        finetuned_file="stub_weights.pt",
        finetuned_replaces=("stub_weights.pt",),
    )
    monkeypatch.setattr(out_folder, "family_of", lambda path, revision=None: family)
    model = family.load(base, dtype=torch.float32).model
    out = out_folder.save_checkpoint(tmp_path / "out", model, base, {"step": 1})
    saved = torch_tensors(out / "stub_weights.pt")
    assert set(saved) == set(family.save_weights(model, base, None))
    for f in base.iterdir():
        assert filecmp.cmp(f, out / f.name, shallow=False), f.name
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [*(p.name for p in base.iterdir()), "stub_weights.pt", out_folder.STATE_FILE]
    )


def test_a_remembered_prefix_digest_reads_no_weights_again(tmp_path, monkeypatch):
    """A weight file's digest under a prefix is remembered by the file's identity: a later start
    with the memo reads no tensor; another prefix or a rewritten file is read again."""
    import lvx_models.fingerprint as fingerprint
    import lvx_models.torch_files as torch_files

    f = tmp_path / "checkpoint.pt"
    torch.save({"module.perceiver.w": torch.ones(2), "lm.w": torch.zeros(1)}, f)
    memo: dict[str, str] = {}
    first = fingerprint.prefix_digest(f, "perceiver.", memo)
    assert first != fingerprint.prefix_digest(f, "lm.", memo)

    def unread(path):
        raise AssertionError(f"{path} read again")

    monkeypatch.setattr(fingerprint, "torch_tensors", unread)
    monkeypatch.setattr(torch_files, "torch_tensors", unread)
    assert fingerprint.prefix_digest(f, "perceiver.", memo) == first
    monkeypatch.undo()
    torch.save({"module.perceiver.w": torch.full((2,), 2.0), "lm.w": torch.zeros(1)}, f)
    assert fingerprint.prefix_digest(f, "perceiver.", memo) != first


def test_a_first_prefix_digest_loads_its_pytorch_file_once(tmp_path, monkeypatch):
    """The keys under the prefix and their bytes come from one load of the file."""
    import lvx_models.fingerprint as fingerprint
    import lvx_models.torch_files as torch_files

    f = tmp_path / "checkpoint.pt"
    torch.save({"module.perceiver.w": torch.ones(2), "lm.w": torch.zeros(1)}, f)
    loads = []
    real = torch_files.torch_tensors
    for module in (fingerprint, torch_files):
        monkeypatch.setattr(module, "torch_tensors", lambda path: loads.append(path) or real(path))
    digest = fingerprint.prefix_digest(f, "perceiver.", {})
    assert loads == [f]
    assert digest == fingerprint.file_digest(f, ["module.perceiver.w"], {})  # the same digest
