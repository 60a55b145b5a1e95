"""Memory of `lvx serve` under steady mixed load: does every process plateau after its warm-up?

Starts `lvx serve --no-ui` on loopback (CPU ranks, the tiny random-weight checkpoint, a few short
synthetic videos), runs several clients against its OpenAI-compatible API for a bounded time and
number of requests (streaming and not, evidence on and off, some paths the server must refuse,
some clients leaving mid-stream), samples each process's resident memory (the server, the
torchrun agent, each rank, each decode worker) and reports it over time, with each process's
slope after the warm-up (a least-squares line through the samples, MB a minute). It stops by
itself: at `--minutes` or `--max-requests`, whichever comes first.

    OMP_NUM_THREADS=1 python scripts/soak_serve.py --minutes 5 --warm-up 1.5 --out soak.json
"""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

if not __package__:  # `python3 scripts/NAME.py`: this checkout's packages, installed or not
    sys.path[0] = str(Path(__file__).resolve().parents[1])
    import scripts  # noqa: F401

from scripts.harness import Rows, command_line, dumps, machine, show
from scripts.serve_process import start_serve

QUESTIONS = ["What happens in the video?", "When does the scene change?", "Describe the colours."]


# ----------------------------------------------------------------------------- processes


def _children() -> dict[int, list[int]]:
    """Every process's children, from /proc."""
    tree: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            tree.setdefault(ppid, []).append(int(entry.name))
    return tree


def process_tree(root: int) -> list[int]:
    """`root` and every process below it."""
    tree, out, todo = _children(), [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += tree.get(pid, [])
    return out


def rss_mb(pid: int) -> float | None:
    """The process's resident memory in MB (None once it has gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def role(pid: int, server: int) -> str:
    """A name for the process that stays the same between samples: server, torchrun, rank N,
    or the command's short name with its pid."""
    if pid == server:
        return "server"
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return f"pid {pid}"
    rank = next((e[5:].decode() for e in env if e.startswith(b"RANK=")), None)
    text = b" ".join(cmd).decode(errors="replace")
    if "torchrun" in text or "torch.distributed.run" in text:
        return "torchrun"
    if rank is not None and "rank_main" in text:
        return f"rank {rank}"
    if rank is not None:
        return f"rank {rank} child {pid}"
    return f"{Path(cmd[0].decode(errors='replace')).name} {pid}"


def sample(server: int) -> dict[str, float]:
    """Resident memory of every process in the server's tree, by role."""
    out = {}
    for pid in process_tree(server):
        mb = rss_mb(pid)
        if mb is not None:
            out[role(pid, server)] = mb
    return out


def slope_mb_per_min(points: list[tuple[float, float]]) -> float | None:
    """The least-squares slope of (seconds, MB) points, in MB a minute."""
    if len(points) < 3:
        return None
    n = len(points)
    mt = sum(t for t, _ in points) / n
    mm = sum(m for _, m in points) / n
    var = sum((t - mt) ** 2 for t, _ in points)
    if var == 0:
        return None
    return 60 * sum((t - mt) * (m - mm) for t, m in points) / var


# ----------------------------------------------------------------------------- load


class Load:
    """The clients: each thread sends one kind of request after another until `deadline` or until
    `max_requests` have been sent by all of them together."""

    def __init__(self, port: int, videos: list[Path], deadline: float, max_requests: int):
        self.url = f"http://127.0.0.1:{port}/v1/chat/completions"
        self.videos, self.deadline, self.max_requests = videos, deadline, max_requests
        self.counts: Counter[str] = Counter()
        self.latencies: list[float] = []
        self.lock = threading.Lock()

    def _take(self) -> bool:
        with self.lock:
            if time.monotonic() >= self.deadline or self.counts["sent"] >= self.max_requests:
                return False
            self.counts["sent"] += 1
            return True

    def _count(self, what: str, seconds: float | None = None) -> None:
        with self.lock:
            self.counts[what] += 1
            if seconds is not None:
                self.latencies.append(seconds)

    def client(self, seed: int) -> None:
        import httpx

        rng = random.Random(seed)
        with httpx.Client(timeout=120) as http:
            while self._take():
                try:
                    self._one(http, rng)
                except httpx.HTTPError as exc:
                    self._count(f"transport error {type(exc).__name__}")

    def _body(self, rng: random.Random) -> tuple[dict, str]:
        kind = rng.random()
        video = rng.choice(self.videos)
        url = f"file://{video}"
        what = "answered"
        if kind < 0.08:  # a path the server must refuse
            url, what = rng.choice(["file:///etc/passwd", f"file://{video}.missing"]), "refused"
        elif kind < 0.15:
            what = "left"
        content = [{"type": "video_url", "video_url": {"url": url}}]
        content.append({"type": "text", "text": rng.choice(QUESTIONS)})
        body = {
            "model": "m",
            "messages": [{"role": "user", "content": content}],
            "max_tokens": rng.choice([4, 8, 16]),
            "stream": what == "left" or rng.random() < 0.5,
            "lvx_evidence": rng.random() < 0.3,
            "user": f"u{rng.randrange(4)}",
        }
        return body, what

    def _one(self, http, rng: random.Random) -> None:
        body, what = self._body(rng)
        t0 = time.perf_counter()
        if not body["stream"]:
            r = http.post(self.url, json=body)
            self._count(_outcome(r.status_code, what), time.perf_counter() - t0)
            return
        with http.stream("POST", self.url, json=body) as r:
            if r.status_code != 200:
                r.read()
                self._count(_outcome(r.status_code, what))
                return
            for line in r.iter_lines():
                if what == "left" and line.startswith("data: {"):
                    self._count("left mid-stream")  # closing the stream leaves
                    return
            self._count("answered", time.perf_counter() - t0)


def _outcome(status: int, meant: str) -> str:
    if status == 200:
        return "answered"
    if 400 <= status < 500:
        return f"refused ({status})" if meant == "refused" else f"unexpected {status}"
    return f"server error {status}"


# ----------------------------------------------------------------------------- the run


def start_server(work: Path, checkpoint: Path, ranks: int) -> tuple[subprocess.Popen, int, Path]:
    log = work / "serve.log"
    server, port = start_serve(checkpoint, ranks, work / "videos", work / "cache", log)
    return server, port, log


def soak(args: argparse.Namespace, work: Path, rows: Rows) -> tuple[list[dict], Load]:
    from lvx_app.video.synthetic import make_video
    from lvx_models.mplug_owl3.tiny import write_tiny_checkpoint

    checkpoint = write_tiny_checkpoint(work / "tiny-g2", "g2")
    videos = []
    for i in range(args.videos):
        path = work / "videos" / f"video{i}.mp4"
        path.parent.mkdir(exist_ok=True)
        videos.append(make_video(path, num_frames=24 + 8 * i, fps=2, width=96, height=64))
    server, port, log = start_server(work, checkpoint, args.ranks)
    try:
        t0 = time.monotonic()
        load = Load(port, videos, t0 + 60 * args.minutes, args.max_requests)
        clients = [
            threading.Thread(target=load.client, args=(args.seed + i,), daemon=True)
            for i in range(args.clients)
        ]
        for c in clients:
            c.start()
        samples = []
        while any(c.is_alive() for c in clients):
            at = time.monotonic() - t0
            row = {
                "seconds": round(at, 1),
                **{k: round(v, 2) for k, v in sample(server.pid).items()},
            }
            samples.append(row)
            rows.add(row)
            print(dumps(row), flush=True)
            for c in clients:
                c.join(timeout=args.every / len(clients))
        samples.append({"seconds": round(time.monotonic() - t0, 1), **sample(server.pid)})
        return samples, load
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
        if args.keep_log:
            args.keep_log.write_bytes(log.read_bytes())


def slopes(samples: list[dict], warm_up_s: float) -> list[dict]:
    """Per process: memory at the first sample after the warm-up, at the end, and the slope."""
    names = dict.fromkeys(k for s in samples for k in s if k != "seconds")
    out = []
    for name in names:
        points = [(s["seconds"], s[name]) for s in samples if name in s]
        after = [(t, m) for t, m in points if t >= warm_up_s]
        slope = slope_mb_per_min(after)
        half = len(after) // 2
        early, late = slope_mb_per_min(after[: half + 1]), slope_mb_per_min(after[half:])
        out.append(
            {
                "process": name,
                "MB at start": points[0][1],
                "MB after warm-up": after[0][1] if after else None,
                "MB at end": points[-1][1],
                "MB/min after warm-up": None if slope is None else round(slope, 3),
                "MB/min, first half": None if early is None else round(early, 3),
                "MB/min, second half": None if late is None else round(late, 3),
                "samples after warm-up": len(after),
            }
        )
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=5.0, help="how long the load runs")
    parser.add_argument("--max-requests", type=int, default=20000)
    parser.add_argument("--warm-up", type=float, default=1.5, help="minutes left out of slopes")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--videos", type=int, default=3)
    parser.add_argument("--every", type=float, default=10.0, help="seconds between samples")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--keep-log", type=Path, default=None, help="copy the server's log here")
    args = parser.parse_args(argv)
    extra = {"command": command_line(), "args": {k: str(v) for k, v in vars(args).items()}}
    rows = Rows(args.out, **extra, machine=machine())
    with tempfile.TemporaryDirectory(prefix="soak-serve-") as tmp:
        samples, load = soak(args, Path(tmp), rows)
    names = list(dict.fromkeys(k for s in samples for k in s if k != "seconds"))
    step = max(1, len(samples) // 12)
    show("resident memory (MB) over time", samples[::step] + samples[-1:], ["seconds", *names])
    summary = slopes(samples, 60 * args.warm_up)
    show(f"slopes after {args.warm_up:g} min of warm-up", summary)
    lat = sorted(load.latencies)
    outcomes = dict(load.counts)
    if lat:
        outcomes |= {"p50 s": lat[len(lat) // 2], "p95 s": lat[int(0.95 * (len(lat) - 1))]}
    show("requests", [outcomes])
    rows.save(slopes=summary, requests=outcomes)


if __name__ == "__main__":
    main()
