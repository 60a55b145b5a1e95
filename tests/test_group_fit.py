"""A group whose ranks cannot fit the machine's memory, or whose model cannot fit a GPU, is refused
in one line with the number that fits, before any rank starts (a stand-in for the machine's
available memory)."""

from __future__ import annotations

import re

import pytest
import torch
from typer.testing import CliRunner

import lvx_app.runtime.fit as fit
import lvx_app.runtime.open as opening
from lvx_app.cli.main import app
from lvx_app.engine.records import EngineError
from lvx_app.runtime.fit import GROUP_BYTES, RANK_BYTES, GroupNeeds, check_group_fits, usable

GiB = 2**30


@pytest.fixture
def no_rank_starts(monkeypatch):
    """Any rank started fails the test."""

    def started(*args, **kwargs):
        raise AssertionError("a rank was started")

    monkeypatch.setattr(opening, "RemoteEngine", started)
    monkeypatch.setattr(opening, "set_up_rank", started)


def test_lvx_chat_with_more_ranks_than_memory_is_one_line_before_any_rank(
    monkeypatch, no_rank_starts, tiny_checkpoints, short_video, tmp_path
):
    monkeypatch.setattr(fit, "available_memory_bytes", lambda: 8 * GiB)
    args = ["chat", short_video, "--model", tiny_checkpoints["g2"], "--gpus", "0"]
    result = CliRunner().invoke(app, [*args, "--ranks", "64", "--cache-dir", str(tmp_path)])
    said = result.output
    assert result.exit_code == 2 and "Traceback" not in said, said
    line = " ".join(said.split())
    assert "64 CPU ranks need about" in line and "8.0 GiB is available" in line, said
    fits = int(re.search(r"use --ranks (\d+) or fewer", line).group(1))
    room = usable(8 * GiB)
    assert 0.85 * 8 * GiB < room < 8 * GiB
    assert fits * RANK_BYTES + GROUP_BYTES <= room < (fits + 1) * RANK_BYTES + GROUP_BYTES


def test_each_cpu_rank_counts_its_own_copy_of_the_weights(tiny_checkpoints):
    """The tiny checkpoint's weights in float32 are counted once per rank."""
    world = opening.World(4, 0)
    needs = fit.group_needs(tiny_checkpoints["g2"], "auto", world)
    elements = sum(p.numel() for p in _tiny_parameters(tiny_checkpoints["g2"]))
    assert needs.weight_bytes == elements * 4
    assert needs.host_bytes(cuda=False) == GROUP_BYTES + 4 * (RANK_BYTES + elements * 4)
    big = GroupNeeds(8, 30 * GiB)  # a 7B model in float32 on CPU ranks
    with pytest.raises(EngineError, match=r"8 CPU ranks need about .* use --ranks 2 or fewer"):
        check_group_fits(big, cuda=False, available=100 * GiB)
    with pytest.raises(EngineError, match=r"use one rank \(--ranks 1\), or free memory"):
        check_group_fits(big, cuda=False, available=60 * GiB)
    check_group_fits(big, cuda=False, available=300 * GiB)


def test_a_model_larger_than_a_gpus_free_memory_is_refused():
    needs = GroupNeeds(2, 15 * GiB)  # a 7B model in bfloat16 on each of 2 GPUs
    with pytest.raises(EngineError, match="GPU 1 has 10.0 GiB free"):
        check_group_fits(needs, cuda=True, available=64 * GiB, gpu_free=[70 * GiB, 10 * GiB])
    check_group_fits(needs, cuda=True, available=64 * GiB, gpu_free=[70 * GiB, 70 * GiB])


def _tiny_parameters(path: str) -> list[torch.Tensor]:
    from safetensors.torch import load_file

    return list(load_file(f"{path}/model.safetensors").values())


def test_a_finetuning_group_larger_than_memory_is_refused_before_any_rank(
    monkeypatch, tiny_checkpoints, tmp_path
):
    from engine_configs import train_config

    from lvx_app.train.launch import FinetuneError, check_run

    monkeypatch.setattr(fit, "available_memory_bytes", lambda: 4 * GiB)
    data = tmp_path / "data.jsonl"
    data.write_text("")
    config = train_config(
        tiny_checkpoints["g2"], gpus=0, ranks=64, data=str(data), out=str(tmp_path / "out")
    )
    with pytest.raises(FinetuneError, match=r"64 CPU ranks need about .* use --ranks \d+ or fewer"):
        check_run(config)


def test_gpu_free_memory_comes_from_the_driver_or_the_check_is_skipped(monkeypatch):
    """Free GPU memory is total minus what the driver (NVML) reports used, asked without a CUDA
    context per GPU; with no NVML the GPU check is skipped (each rank's own line says an OOM)."""
    total = type("Props", (), {"total_memory": 80 * GiB})()
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: total)
    monkeypatch.setattr(torch.cuda, "device_memory_used", lambda i: (i + 1) * 10 * GiB)
    assert fit.gpu_free_bytes(2) == [70 * GiB, 60 * GiB]

    def no_nvml(i):
        raise ModuleNotFoundError("pynvml")

    monkeypatch.setattr(torch.cuda, "device_memory_used", no_nvml)
    assert fit.gpu_free_bytes(2) is None
