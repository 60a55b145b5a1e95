"""Several machines as the README starts them: two torchrun agents (`--nnodes 2`, one rank each, a
c10d rendezvous on 127.0.0.1) running `lvx chat` (rank 0 reads the questions, the other rank
follows it) and `lvx finetune` (both ranks train, rank 0 saves)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from scripts.gloo_ranks import free_port

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


def _two_agents(args: list[str], stdin: str = "") -> list[tuple[int, str]]:
    """Start two torchrun agents of one 2-node group on this machine with the same `lvx` command
    line; (exit code, output) of each. Which agent becomes rank 0 is the rendezvous' choice, so
    both get `stdin`: only rank 0 reads it."""
    port = free_port()
    launch = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2"]
    launch += ["--nproc-per-node", "1", "--rdzv-backend", "c10d"]
    launch += ["--rdzv-endpoint", f"127.0.0.1:{port}", "-m", "lvx_app.cli", *args]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LVX_LINK", "TORCHELASTIC"))}
    agents = [
        subprocess.Popen(
            launch,
            cwd=ROOT,
            env=env,
            text=True,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for _ in range(2)
    ]
    results = []
    try:
        for agent in agents:  # a safety net for a hang, not a measured deadline
            out, _ = agent.communicate(stdin, timeout=280)
            results.append((agent.returncode, out))
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
    return results


def test_chat_on_two_nodes(tiny_checkpoints, short_video):
    args = ["chat", short_video, "--model", tiny_checkpoints["g2"], "--gpus", "0"]
    args += ["--subtitles", "none", "--no-cache", "--max-new-tokens", "4"]
    results = _two_agents(args, stdin="What is shown?\n/quit\n")
    assert [code for code, _ in results] == [0, 0], "\n".join(out for _, out in results)
    # rank 0's agent held the conversation; the other rank printed none of it
    talks = [out for _, out in results if "you › What is shown?" in out]
    assert len(talks) == 1, "\n".join(out for _, out in results)
    assert "video: 10 frames" in talks[0] and "lvx ›" in talks[0] and "4 tokens" in talks[0]
    # the other agent's rank says it does not read its input, and where rank 0 reads it
    other = next(out for _, out in results if out is not talks[0])
    said = re.search(
        r"lvx chat: rank 1 on (\S+) follows rank 0; questions are read on (\S+) \(pid (\d+)\)",
        other,
    )
    assert said, other
    assert said.group(1) == said.group(2) == socket.gethostname()
    assert int(said.group(3)) != 0 and "follows rank 0" not in talks[0]


def test_finetune_on_two_nodes(tiny_checkpoints, short_video, tmp_path):
    data = tmp_path / "train.jsonl"
    name = os.path.basename(short_video)
    data.write_text(
        f'{{"video": "{name}", "question": "What is shown?", "answer": "A square."}}\n'
        f'{{"video": "{name}", "question": "Colours?", "answer": "Grey."}}\n'
    )
    out = tmp_path / "trained"
    args = ["finetune", "--model", tiny_checkpoints["g2"], "--gpus", "0", "--data", str(data)]
    args += ["--video-dir", os.path.dirname(short_video), "--out", str(out), "--steps", "2"]
    args += ["--cache-dir", str(tmp_path / "cache")]
    results = _two_agents(args)
    assert [code for code, _ in results] == [0, 0], "\n".join(o for _, o in results)
    assert sum("step 2/2  loss" in o for _, o in results) == 1  # rank 0 reports the steps
    assert (out / "model.safetensors").stat().st_size > 0 and (out / "loss.png").exists()
