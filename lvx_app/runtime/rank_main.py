"""The entry point every rank of a local group runs: `python -m lvx_app.runtime.rank_main
--config JSON --world JSON` (the `Config` as `Config.to_dict` writes it, the `World` the frontend
resolved).

`lvx chat/serve/eval --gpus N` start it under torchrun (`launcher.RemoteEngine`): rank 0 connects
back to the frontend process over a local socket and serves its requests, the others follow rank 0's
commands. A benchmark runs its own attention by calling `run_rank_session` with its `parallelize`.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import warnings
from multiprocessing.connection import Client

import torch.distributed as dist

from lvx_app.config import Config, ConfigError
from lvx_app.engine.parallelize import parallelize
from lvx_app.engine.session import Parallelize, RankSession
from lvx_app.parallel.group import DistInfo, init_distributed, run_rank
from lvx_app.parallel.world import World
from lvx_app.runtime.control import ControlChannel
from lvx_app.runtime.driver import GroupDriver, worker_loop
from lvx_app.runtime.launcher import LINK_ENV, LINK_KEY_ENV, RUN_DIR_ENV, error_file
from lvx_app.runtime.socket_link import serve_link
from lvx_app.wire import Ready, Warned, send
from lvx_kernels.backends import prefer_backend


def set_up_rank(config: Config, world: World) -> DistInfo:
    """Join the group torchrun described (or run alone) on the devices `world` says, with the
    attention kernels the config asks for: what every rank does before loading a model."""
    prefer_backend(config.model.attn_backend)
    return init_distributed(cuda=world.cuda, timeout_s=config.parallel.timeout_s)


def join_group(
    config: Config, parallelize: Parallelize = parallelize, world: World | None = None
) -> tuple[RankSession, ControlChannel]:
    """Join the group torchrun described and load this rank's session (`world`: the one the
    frontend resolved; by default the one torchrun describes)."""
    info = set_up_rank(config, world or World.of_torchrun(config.parallel.gpus))
    channel = ControlChannel()
    return RankSession(config, info, parallelize), channel


def where_rank0_reads(channel: ControlChannel) -> str:
    """Rank 0's host and pid, known to every rank (a collective: every rank calls it)."""
    box = [f"{socket.gethostname()} (pid {os.getpid()})" if channel.rank == 0 else None]
    if channel.active:
        dist.broadcast_object_list(box, src=0, group=channel.commands)
    return box[0]


def follower_line(command: str, channel: ControlChannel) -> str | None:
    """What a rank other than 0 of a group the user started says: its own input is not read, and
    where to type instead (c10d orders ranks by host, so rank 0 may be on any node). None on rank
    0. A collective: every rank calls it."""
    reader = where_rank0_reads(channel)
    if channel.rank == 0:
        return None
    return (
        f"{command}: rank {channel.rank} on {socket.gethostname()} follows rank 0; questions are "
        f"read on {reader}, not here"
    )


def run_rank_session(
    config: Config, world: World | None = None, parallelize: Parallelize = parallelize
) -> None:
    """This rank's part: rank 0 serves the frontend's link, the others follow its commands. What
    rank 0 warned while it started (before the link) reaches the frontend before `Ready`, as one
    process would have shown it."""
    started: list[warnings.WarningMessage] = []
    try:
        with warnings.catch_warnings(record=True) as started:
            session, channel = join_group(config, parallelize, world)
    finally:  # the group's log keeps them too, also when the start failed
        for w in started:
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    if session.info.rank != 0:
        worker_loop(session, channel)
        return
    host, port = os.environ[LINK_ENV].rsplit(":", 1)
    conn = Client((host, int(port)), authkey=bytes.fromhex(os.environ[LINK_KEY_ENV]))
    for w in started:
        send(conn, Warned(str(w.message)))
    send(conn, Ready(session.describe()))
    serve_link(GroupDriver(session, channel, config), conn)


def rank_arguments(argv: list[str] | None, description: str) -> tuple[Config, World | None] | None:
    """The `--config` and `--world` a rank was started with; None when one is bad (said in one line
    on rank 0)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config", required=True, help="the Config as JSON")
    parser.add_argument("--world", help="the World as JSON (default: torchrun's)")
    args = parser.parse_args(argv)
    flag = "--config"
    try:
        config = Config.from_dict(json.loads(args.config))
        flag = "--world"
        world = World.from_dict(json.loads(args.world)) if args.world else None
    except (ValueError, TypeError, ConfigError) as exc:  # a hand-written one: one line, on rank 0
        if os.environ.get("RANK", "0") == "0":
            print(f"error: {flag}: {exc}", file=sys.stderr)
        return None
    return config, world


def main(argv: list[str] | None = None, parallelize: Parallelize = parallelize) -> int:
    given = rank_arguments(argv, __doc__)
    if given is None:
        return 2
    config, world = given
    rank = int(os.environ.get("RANK", "0"))
    run_dir = os.environ.get(RUN_DIR_ENV)

    def record(detail: str) -> None:
        if run_dir:
            error_file(run_dir, rank).write_text(detail)

    return run_rank(lambda: run_rank_session(config, world, parallelize), "lvx worker", record)


if __name__ == "__main__":
    sys.exit(main())
