"""The entry point every rank of a local group runs: `python -m lvx_app.runtime.rank_main
--config JSON` (the `Config` as `Config.to_dict` writes it).

`lvx chat/serve/eval --gpus N` start it under torchrun (`launcher.RemoteEngine`): rank 0 connects
back to the frontend process over a local socket and serves its requests, the others follow rank 0's
commands. A benchmark runs its own attention by calling `run_rank_session` with its `parallelize`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from multiprocessing.connection import Client

from lvx_app.config import Config, ConfigError
from lvx_app.engine.parallelize import parallelize
from lvx_app.engine.session import Parallelize, RankSession
from lvx_app.parallel.group import init_distributed, run_rank
from lvx_app.runtime.control import ControlChannel
from lvx_app.runtime.driver import GroupDriver, worker_loop
from lvx_app.runtime.launcher import LINK_ENV, LINK_KEY_ENV, RUN_DIR_ENV, error_file
from lvx_app.runtime.socket_link import serve_link


def join_group(
    config: Config, parallelize: Parallelize = parallelize
) -> tuple[RankSession, ControlChannel]:
    """Join the group torchrun described and load this rank's session."""
    info = init_distributed(cuda=config.parallel.cuda, timeout_s=config.parallel.timeout_s)
    channel = ControlChannel()
    return RankSession(config, info, parallelize), channel


def run_rank_session(config: Config, parallelize: Parallelize = parallelize) -> None:
    """This rank's part: rank 0 serves the frontend's link, the others follow its commands."""
    session, channel = join_group(config, parallelize)
    if session.info.rank != 0:
        worker_loop(session, channel)
        return
    host, port = os.environ[LINK_ENV].rsplit(":", 1)
    conn = Client((host, int(port)), authkey=bytes.fromhex(os.environ[LINK_KEY_ENV]))
    conn.send(("ready", session.describe()))
    serve_link(GroupDriver(session, channel, config), conn)


def main(argv: list[str] | None = None, parallelize: Parallelize = parallelize) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", required=True, help="the Config as JSON")
    args = parser.parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    try:
        config = Config.from_dict(json.loads(args.config))
    except (ValueError, ConfigError) as exc:  # a hand-written --config: one line, on rank 0
        if rank == 0:
            print(f"error: --config: {exc}", file=sys.stderr)
        return 2
    run_dir = os.environ.get(RUN_DIR_ENV)

    def record(detail: str) -> None:
        if run_dir:
            error_file(run_dir, rank).write_text(detail)

    return run_rank(lambda: run_rank_session(config, parallelize), "lvx worker", record)


if __name__ == "__main__":
    sys.exit(main())
