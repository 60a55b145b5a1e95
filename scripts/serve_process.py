"""`lvx serve --no-ui` on CPU ranks as a child process of a benchmark, started and waited for in one
place: the soak and the API benchmark measure the same server the same way."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from scripts.gloo_ranks import free_port


def start_serve(
    checkpoint: Path, ranks: int, allow: Path, cache: Path, log: Path
) -> tuple[subprocess.Popen, int]:
    """The server (its output in `log`) and its port, once it says it is ready; a server that
    exits first ends the script with its log, and Ctrl-C while it starts leaves no server."""
    port = free_port()
    args = [sys.executable, "-m", "lvx_app.cli", "serve", "--no-ui", "--gpus", "0"]
    args += ["--ranks", str(ranks), "--model", str(checkpoint), "--port", str(port)]
    args += ["--allow-paths", str(allow), "--cache-dir", str(cache)]
    with open(log, "wb") as out:
        server = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
    try:
        while "ready on" not in log.read_text(errors="replace"):
            if server.poll() is not None:
                raise SystemExit(log.read_text(errors="replace"))
            time.sleep(0.2)
    except BaseException:
        server.terminate()
        server.wait(timeout=60)
        raise
    return server, port
