"""The worker entry point every rank runs: `python -m lvx_app.frontends.worker`.

Local groups are started by `lvx chat/serve/eval --gpus N`; multi-node groups use the same module
under `torchrun --nnodes ... --rdzv-endpoint ...` with `--frontend chat VIDEO`, so rank 0 runs the
terminal chat itself.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from multiprocessing.connection import Client

from lvx_app.engine.control import ControlChannel
from lvx_app.engine.driver import GroupDriver, worker_loop
from lvx_app.engine.launch import LINK_ENV, LINK_KEY_ENV, RUN_DIR_ENV, error_file
from lvx_app.engine.link import serve_link
from lvx_app.engine.session import Session, SessionConfig
from lvx_app.frontends.terminal import run_chat
from lvx_app.parallel.group import init_distributed, run_rank
from lvx_app.subtitles import SubtitleError, resolve_subtitles


def run_worker(
    config: dict,
    frontend: str = "link",
    video: str | None = None,
    subtitles: tuple[str, str | None, str | None] = ("auto", None, None),
) -> int | None:
    """This rank's part: rank 0 serves the link (or runs the terminal chat, resolving `subtitles` =
    (--subtitles, --subtitle-lang, --subtitle-encoding) for its video, and returns the chat's exit
    code), the others follow its commands."""
    cfg = SessionConfig(**config)
    info = init_distributed(cuda=cfg.cuda, timeout_s=cfg.timeout_s)
    channel = ControlChannel()
    session = Session(cfg, info)
    if info.rank != 0:
        worker_loop(session, channel)
        return
    driver = GroupDriver(session, channel)
    if frontend == "link":
        host, port = os.environ[LINK_ENV].rsplit(":", 1)
        conn = Client((host, int(port)), authkey=bytes.fromhex(os.environ[LINK_KEY_ENV]))
        conn.send(("ready", session.describe()))
        serve_link(driver, conn)
    else:
        try:
            track = resolve_subtitles(video, *subtitles) if video else None
            for note in track.notes if track else []:
                print(f"warning: {note}", file=sys.stderr)
            return run_chat(
                driver, video=video, fps=cfg.fps, max_frames=cfg.max_frames, subtitles=track
            )
        except SubtitleError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        finally:
            driver.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", required=True, help="SessionConfig as JSON")
    parser.add_argument("--frontend", choices=["link", "chat"], default="link")
    parser.add_argument("video", nargs="?")
    parser.add_argument(
        "--subtitles", default="auto", help="auto, none or a subtitle file (--frontend chat)"
    )
    parser.add_argument(
        "--subtitle-lang", default=None, help="language of the subtitles --subtitles auto picks"
    )
    parser.add_argument(
        "--subtitle-encoding", default=None, help="text encoding of the subtitle file"
    )
    args = parser.parse_args(argv)
    run_dir = os.environ.get(RUN_DIR_ENV)
    rank = int(os.environ.get("RANK", "0"))

    def record(detail: str) -> None:
        if run_dir:
            error_file(run_dir, rank).write_text(detail)

    subtitles = (args.subtitles, args.subtitle_lang, args.subtitle_encoding)
    return run_rank(
        lambda: run_worker(json.loads(args.config), args.frontend, args.video, subtitles),
        "lvx worker",
        record,
    )


if __name__ == "__main__":
    sys.exit(main())
