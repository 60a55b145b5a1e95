"""The resolved world is a value of its own, beside a config that stays as the user gave it, and one
builder makes the command line of every local torchrun group."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from lvx_app.config import Config, ParallelConfig
from lvx_app.engine.records import EngineError
from lvx_app.parallel.torchrun import local_group
from lvx_app.parallel.world import World
from lvx_app.runtime.open import resolve_world


def _gpus(monkeypatch, count: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def test_the_world_on_a_machine_without_gpus(monkeypatch):
    _gpus(monkeypatch, 0)
    assert resolve_world(ParallelConfig()) == World(1, 0)
    assert resolve_world(ParallelConfig(ranks=3)) == World(3, 0)
    assert resolve_world(ParallelConfig(gpus=0, ranks=2)) == World(2, 0)
    with pytest.raises(EngineError, match="--gpus 2 asked for GPUs but no GPU is visible"):
        resolve_world(ParallelConfig(gpus=2))


def test_the_world_on_a_machine_with_gpus(monkeypatch):
    _gpus(monkeypatch, 4)
    assert resolve_world(ParallelConfig()) == World(1, 1)
    world = resolve_world(ParallelConfig(gpus=4))
    assert world == World(4, 4) and world.cuda
    with pytest.raises(EngineError, match="only 4 GPU"):
        resolve_world(ParallelConfig(gpus=8))
    with pytest.raises(EngineError, match="--ranks only applies to CPU runs"):
        resolve_world(ParallelConfig(gpus=2, ranks=3))


def test_a_world_is_one_or_more_ranks_with_no_gpu_or_one_each(monkeypatch):
    for bad in ((0, 0), (2, 1)):
        with pytest.raises(ValueError, match="a world has"):
            World(*bad)
    assert World.from_dict(json.loads(json.dumps(World(2, 2).to_dict()))) == World(2, 2)
    monkeypatch.setenv("WORLD_SIZE", "4")  # a group the user started under torchrun
    assert World.of_torchrun(None) == World(4, 0) and World.of_torchrun(1) == World(4, 4)


def test_one_builder_starts_every_local_group(monkeypatch):
    command, env = local_group(World(3), ["-m", "lvx_app.runtime.rank_main"], {"PATH": "/bin"})
    assert command == [
        *(sys.executable, "-m", "lvx_app.parallel.torchrun", "--standalone"),
        *("--nproc-per-node=3", "--monitor-interval=0.5", "-m", "lvx_app.runtime.rank_main"),
    ]
    assert env["PATH"] == "/bin" and int(env["OMP_NUM_THREADS"]) >= 1  # CPU ranks share cores
    _, on_gpus = local_group(World(2, 2), ["x.py"], {})
    assert "OMP_NUM_THREADS" not in on_gpus
    _, given = local_group(World(2), ["x.py"], {"OMP_NUM_THREADS": "7"})
    assert given["OMP_NUM_THREADS"] == "7"


def test_finetuning_starts_its_group_with_the_builder_and_the_world(monkeypatch, tmp_path):
    """`lvx finetune`'s group: the same command line, the config as the user gave it, the world
    beside it."""
    from lvx_app.train import launch

    started = {}

    class Launched:
        returncode = 0

        def __init__(self, command, env, pass_fds=(), start_new_session=False):
            started.update(command=command, env=env, own_session=start_new_session)

        def wait(self, timeout=None):
            return 0

    monkeypatch.setattr(launch.subprocess, "Popen", Launched)
    config = Config.from_dict({"parallel": {"gpus": None, "ranks": 2}})
    assert launch.run_group(config, World(2)) == 0
    command = started["command"]
    expected, _ = local_group(World(2), ["-m", "lvx_app.train.train_rank"])
    assert command[: len(expected)] == expected
    given = dict(zip(command[len(expected) :: 2], command[len(expected) + 1 :: 2]))
    assert Config.from_dict(json.loads(given["--config"])) == config
    assert World.from_dict(json.loads(given["--world"])) == World(2)
    assert started["own_session"], "Ctrl-C reaches torchrun from lvx finetune only"
