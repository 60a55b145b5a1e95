"""The ring P2P helper and the gloo rank spawner."""

import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from timing import scaled

from lvx_app.parallel import RingComm, get_rank, get_world_size
from lvx_app.parallel.torchrun import local_group
from lvx_app.parallel.world import World
from scripts import gloo_ranks
from scripts.gloo_ranks import RankFailed, run_ranks

ROOT = Path(__file__).resolve().parents[1]


def _ring_pass(rank: int, world: int, n: int):
    comm = RingComm()
    x = torch.full((n,), float(rank))
    seen = [rank]
    for _ in range(world - 1):
        nxt = torch.empty_like(x)
        comm.post([(x, nxt)])
        comm.wait()
        x = nxt
        seen.append(int(x[0]))
    return seen, comm.bytes_sent, get_rank(), get_world_size()


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_ring_visits_every_rank_and_counts_bytes(world):
    out = run_ranks(_ring_pass, world, 5)
    for rank, (seen, sent, r, w) in enumerate(out):
        assert (r, w) == (rank, world)
        assert seen == [(rank - k) % world for k in range(world)]
        assert sent == (world - 1) * 5 * 4


def _boom(rank: int, world: int):
    if rank == 1:
        raise ValueError("rank one exploded")
    return rank


def test_failure_on_a_rank_is_reported():
    with pytest.raises(RankFailed, match="rank one exploded"):
        run_ranks(_boom, 2)


def test_run_rank_names_the_failed_rank_and_records_the_trace(monkeypatch, capsys):
    from lvx_app.parallel.group import run_rank

    monkeypatch.setenv("RANK", "3")
    recorded = []

    def fail():
        raise ValueError("shard 3 is empty")

    assert run_rank(fail, "lvx worker", recorded.append) == 1
    err = capsys.readouterr().err
    assert err.splitlines()[0] == "lvx worker rank 3: ValueError: shard 3 is empty"
    assert "Traceback" in err
    assert (
        recorded
        and recorded[0].rstrip().endswith("ValueError: shard 3 is empty")
        and "in fail" in recorded[0]
    )
    assert run_rank(lambda: None, "lvx worker", recorded.append) == 0 and len(recorded) == 1
    with pytest.raises(SystemExit):
        run_rank(lambda: (_ for _ in ()).throw(SystemExit(0)), "lvx worker")


def test_run_rank_reports_user_errors_in_one_line(monkeypatch, capsys):
    from lvx_app.parallel.group import run_rank

    monkeypatch.setenv("RANK", "1")
    recorded = []

    def bad_video():
        raise FileNotFoundError("Video not found: clip.mp4; check the path.")

    assert (
        run_rank(bad_video, "lvx finetune", recorded.append, user_errors=(FileNotFoundError,)) == 1
    )
    err = capsys.readouterr().err
    assert (
        err
        == "lvx finetune rank 1: FileNotFoundError: Video not found: clip.mp4; check the path.\n"
    )
    assert "Traceback" in recorded[0], "the trace is still recorded for the launcher"


def test_first_failure_is_the_cause_not_a_consequence(tmp_path):
    """A survivor's lost-peer error and torchrun's SIGTERM to the survivors are consequences; a kill
    is a cause."""
    from lvx_app.parallel.failures import RankFailure, describe_failures, error_file

    killed = "rank 1 failed: killed by SIGKILL (out of memory, a crash, or by hand)"
    assert describe_failures([RankFailure(0, -15), RankFailure(1, -9)], tmp_path) == killed
    error_file(tmp_path, 0).write_text(
        "Traceback ...\nRuntimeError: [pair.cc:537] Read error: Connection reset by peer.\n"
    )
    assert describe_failures([RankFailure(0, 1), RankFailure(1, -9)], tmp_path) == killed
    # a real error on the first rank stays the reason, even if a peer was killed afterwards
    error_file(tmp_path, 0).write_text(
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n"
    )
    assert describe_failures([RankFailure(0, 1), RankFailure(1, -9)], tmp_path) == (
        "rank 0 failed: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
    )
    assert (
        describe_failures([RankFailure(2, -15)], None)
        == "rank 2 failed: killed by SIGTERM (out of memory, a crash, or by hand)"
    )
    assert describe_failures([], tmp_path) is None


def test_a_rank_that_exited_is_named_before_the_ranks_torchrun_stopped_in_the_same_second(tmp_path):
    """torchrun stamps failures to the second: a loaded machine sees the rank it stopped with
    SIGTERM at the same time as the rank that exited, and ties sort by rank."""
    from lvx_app.parallel.failures import RankFailure, describe_failures

    stopped_first = [RankFailure(0, -15), RankFailure(1, 1), RankFailure(2, -15)]
    assert describe_failures(stopped_first, tmp_path) == "rank 1 failed: exit code 1"


@pytest.mark.slow
def test_torchrun_wrapper_names_a_killed_rank_without_a_traceback(tmp_path):
    import subprocess

    script = tmp_path / "rank.py"
    script.write_text(
        "import os, signal, time\n"
        "if os.environ['RANK'] == '1':\n    os.kill(os.getpid(), signal.SIGKILL)\n"
        "time.sleep(20)\n"
    )
    res = subprocess.run(
        local_group(World(2), [str(script)])[0], capture_output=True, text=True, timeout=scaled(120)
    )
    assert res.returncode == 1, res.stderr
    assert "rank 1 failed: killed by SIGKILL" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr and "ChildFailedError" not in res.stderr, res.stderr
    ok = subprocess.run(
        local_group(World(2), ["-m", "json.tool", "--help"])[0],
        capture_output=True,
        text=True,
        timeout=scaled(120),
    )
    assert ok.returncode == 0, ok.stderr


@pytest.mark.slow
def test_crash_while_exiting_after_the_last_barrier_is_not_a_failure(tmp_path):
    """A rank that dies (SIGABRT, as gloo's teardown has done) after every rank met in run_rank's
    last barrier lost
    nothing: the launcher warns and exits 0. The same abort before the barrier fails the run and
    names the rank."""
    import os
    import subprocess

    from lvx_app.parallel.failures import RankFailure, crashed_after_done, done_file

    def launch(when: str) -> subprocess.CompletedProcess:
        script = tmp_path / f"rank_{when}.py"
        script.write_text(
            "import os, sys\nfrom lvx_app.parallel.group import init_distributed, run_rank\n"
            "def work():\n    init_distributed()\n"
            f"    if {when == 'before'!r} and os.environ['RANK'] == '1':\n        os.abort()\n"
            "code = run_rank(work, 'test', finish_together=True)\n"
            "if os.environ['RANK'] == '1':\n    os.abort()\n"
            "sys.exit(code)\n"
        )
        command, env = local_group(World(2), [str(script)], dict(os.environ, OMP_NUM_THREADS="1"))
        return subprocess.run(command, capture_output=True, text=True, timeout=scaled(120), env=env)

    after = launch("after")
    assert after.returncode == 0, after.stderr
    assert (
        "rank 1 failed: killed by SIGABRT" in after.stderr and "nothing was lost" in after.stderr
    ), after.stderr
    before = launch("before")
    assert before.returncode == 1, before.stderr
    assert "error: rank 1 failed: killed by SIGABRT" in before.stderr, before.stderr
    assert "Fatal Python error: Aborted" in before.stderr, "faulthandler prints where the rank died"
    # the rule itself: a signal death only counts as harmless with a done file; torchrun's SIGTERM
    # rides along
    done_file(tmp_path, 1).write_text("done")
    assert crashed_after_done([RankFailure(1, -6), RankFailure(0, -15)], tmp_path)
    assert not crashed_after_done([RankFailure(1, -6), RankFailure(0, 1)], tmp_path)
    assert not crashed_after_done([RankFailure(0, -6)], tmp_path)
    assert not crashed_after_done([RankFailure(1, -6)], None)


def _flight_records(rank, world_size):
    """How many collectives torch's flight recorder holds after this rank ran three."""
    import pickle

    import torch.distributed as dist
    from torch._C import _distributed_c10d

    t = torch.ones(2)
    for _ in range(3):
        dist.all_reduce(t)
    return len(pickle.loads(_distributed_c10d._dump_fr_trace())["entries"])


def test_ranks_keep_no_record_of_their_collectives():
    """Torch's flight recorder would keep every rank's last 2,000 collectives, each with its Python
    stack (host work on every collective, megabytes a rank never uses)."""
    from torch._C import _distributed_c10d

    if not hasattr(_distributed_c10d, "_dump_fr_trace"):
        pytest.skip("this torch has no flight recorder to read")
    assert run_ranks(_flight_records, 2) == [0, 0]


@pytest.mark.parametrize(
    "given", [{}, {"TORCH_FR_BUFFER_SIZE": "500"}, {"TORCH_NCCL_TRACE_BUFFER_SIZE": "100"}]
)
def test_the_flight_recorder_stays_as_the_user_sized_it(given):
    from lvx_app.parallel.group import flight_recorder_off_unless_asked

    env = dict(given)
    flight_recorder_off_unless_asked(env)
    assert env == (given or {"TORCH_FR_BUFFER_SIZE": "0"})


_DEAL_TEN = "from scripts.gloo_ranks import free_port; print(*[free_port() for _ in range(10)])"


def test_ports_dealt_at_once_to_several_processes_all_differ_and_lie_below_the_ephemeral_range(
    tmp_path, monkeypatch
):
    """Servers a test starts on dealt ports cannot find their port taken by another test's server,
    by a gloo pair or by the kernel's own choice for `bind(0)`."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # a counter of this test's own
    dealers = [
        subprocess.Popen([sys.executable, "-c", _DEAL_TEN], cwd=ROOT, stdout=subprocess.PIPE)
        for _ in range(4)
    ]
    ports = [int(p) for dealer in dealers for p in dealer.communicate()[0].split()]
    assert len(ports) == 40 and len(set(ports)) == 40, ports
    floor = gloo_ranks._ephemeral_floor()
    assert all(gloo_ranks.LOWEST_DEALT_PORT <= p < floor for p in ports), (ports, floor)


def test_a_port_in_use_is_not_dealt(tmp_path, monkeypatch):
    monkeypatch.setattr(gloo_ranks, "PORTS_DEALT", tmp_path / "dealt")
    first = gloo_ranks.free_port()
    with socket.socket() as held:
        held.bind(("127.0.0.1", first + 1))
        second = gloo_ranks.free_port()
    assert second == first + 2
