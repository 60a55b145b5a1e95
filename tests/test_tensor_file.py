"""A cache file's tensors come back equal, and each in memory of its own on the allocator's 64-byte
boundary, whatever the length of the header before them: CPU kernels round differently on data at
another alignment, so a tensor read back as a view at its offset in the file gave gradients that
differed in the last bits from those of the tensor as it was made."""

from __future__ import annotations

import pytest
import torch

from lvx_app.cache.files import atomic_save
from lvx_app.cache.tensor_file import read_tensors


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "features": torch.randn(5, 7, 3, generator=g),
        "frame_indices": torch.arange(5),
        "timestamps": torch.linspace(0, 4, 5, dtype=torch.float64),
        "odd": torch.randn(3, generator=g).to(torch.bfloat16),
        "flags": torch.tensor([True, False, True]),
        "none": torch.empty(0, 4),
    }


@pytest.mark.parametrize("pad", range(0, 64, 4))
def test_tensors_read_back_equal_and_aligned_whatever_the_header(tmp_path, pad):
    made = _tensors()
    path = tmp_path / "entry.safetensors"
    atomic_save(made, {"key": "x" * pad}, path)  # the manifest moves every tensor's offset
    got = read_tensors(path)
    assert set(got) == set(made)
    for name, tensor in made.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
        if tensor.numel():
            assert got[name].data_ptr() % 64 == 0, (name, got[name].data_ptr() % 64)


def test_a_file_cut_short_is_a_value_error(tmp_path):
    path = tmp_path / "entry.safetensors"
    atomic_save(_tensors(), {}, path)
    path.write_bytes(path.read_bytes()[:-8])
    with pytest.raises(ValueError):
        read_tensors(path)
    path.write_bytes(b"\x01\x00")
    with pytest.raises(ValueError, match="shorter than a safetensors header"):
        read_tensors(path)
