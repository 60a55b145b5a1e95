"""The gather the schedule calibrates is the one the engine runs: `bench_schedule.py` times the
engine's attention hooks (a replicated question's visual partials combined by
`ShardedAttention.combine`, a sharded one's rings by `ShardedAttention.ring`), both give the same
rows, and the attention package exports no kernel the product does not run."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import lvx_app.attention as attention
from lvx_app.attention import choose_schedule
from lvx_app.attention.schedule import crossovers, read_calibration
from scripts import bench_schedule
from scripts.gloo_ranks import run_ranks

ROOT = Path(__file__).resolve().parents[1]
TINY = dict(frames=2, q_heads=4, kv_heads=2, head_dim=8, dtype="float32", warmup=1, iters=2)


def _counted_bench(rank: int, world: int, cfg: dict) -> dict:
    """A tiny calibration's timing on this rank, counting the engine's calls it makes."""
    from lvx_app.engine.parallelize import ShardedAttention

    calls = {"combine": 0, "ring": 0}
    for name in calls:
        real = getattr(ShardedAttention, name)

        def counted(self, *args, _real=real, _name=name, **kwargs):
            calls[_name] += 1
            return _real(self, *args, **kwargs)

        setattr(ShardedAttention, name, counted)
    ms = bench_schedule._bench_rank(rank, world, cfg)
    return {"calls": calls, "ms": ms}


def test_the_calibration_times_the_engines_gather_and_ring():
    rows = [3, 8]
    cfg = {**TINY, "rows": rows}
    runs = 1 + TINY["iters"]
    for rank, got in enumerate(run_ranks(_counted_bench, 2, cfg)):
        # per round and size: the gather one visual combine, the ring a text and a visual ring
        assert got["calls"] == {"combine": runs * len(rows), "ring": 2 * runs * len(rows)}, rank
        assert set(got["ms"]) == {f"{r}/{n}" for r in rows for n in ("ring", "gather", "no-comm")}


def _both_schedules(rank: int, world: int, cfg: dict) -> list:
    """Every case's output rows under the sharded feed (this rank's) and the replicated one (this
    rank's slice of all rows): the hooks' text and visual results."""
    from lvx_app.engine.parallelize import ShardedAttention

    results = []
    for name in ("text", "visual"):
        outs = {}
        cases = bench_schedule._cases(rank, world, cfg, torch.device("cpu"), torch.float64)
        for kind in ("ring", "gather"):
            real = getattr(ShardedAttention, name)

            def keep(self, *args, _real=real, _kind=kind, **kwargs):
                outs[_kind] = _real(self, *args, **kwargs)
                return outs[_kind]

            setattr(ShardedAttention, name, keep)
            with torch.no_grad():
                cases[(cfg["rows"][0], kind)]()
            setattr(ShardedAttention, name, real)
        # numpy: a tensor sent back from a rank would be shared memory its end takes away
        results.append((name, *(tuple(t.numpy() for t in outs[k]) for k in ("ring", "gather"))))
    return results


@pytest.mark.parametrize("world", [2, 3])
def test_the_engines_gather_gives_the_rings_rows(world):
    rows = 7  # uneven over 2 and 3 ranks
    cfg = {**TINY, "rows": [rows]}
    for rank, results in enumerate(run_ranks(_both_schedules, world, cfg)):
        for name, ring, gather in results:
            (ring_out, ring_lse), (all_out, all_lse) = (
                map(torch.from_numpy, r) for r in (ring, gather)
            )
            mine = bench_schedule.slices(rows, world)[rank]
            assert ring_out.shape[1] == mine.stop - mine.start, (name, rank)
            torch.testing.assert_close(ring_out, all_out[:, mine], atol=1e-12, rtol=0)
            torch.testing.assert_close(ring_lse, all_lse[:, :, mine], atol=1e-12, rtol=0)


def test_a_tiny_calibration_writes_what_the_engine_reads(tmp_path, capsys):
    path = tmp_path / "calibration.json"
    bench_schedule.main(
        ["--ranks", "2", "--rows", "2", "4", "--frames", "2", "--q-heads", "4", "--kv-heads", "2",
         "--head-dim", "8", "--iters", "1", "--calibrate", "--calibration-file", str(path)]
    )  # fmt: skip
    assert set(read_calibration(path)) == {2}
    assert f"wrote {path}" in capsys.readouterr().out


# public kernels for callers outside the engine (benchmarks, a finetuning loop of one's own): the
# differentiable LV-XAttn and the pairwise lse merge
FOR_CALLERS = {"lv_xattn", "merge"}


def _names_used(tree: ast.AST) -> set[str]:
    used = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            used.add(node.id)
        elif isinstance(node, ast.Attribute):
            used.add(node.attr)
        elif isinstance(node, ast.ImportFrom):
            used.update(alias.name for alias in node.names)
    return used


def test_every_kernel_the_attention_package_exports_is_run_by_the_product():
    """A kernel only scripts and tests call is not part of the product: every exported name is
    used by product code other than where it is defined."""
    package = Path(attention.__file__).parent
    # the product's packages, and the attention package itself wherever it lives
    roots = (ROOT / "lvx_app", ROOT / "lvx_kernels", ROOT / "models", ROOT / "ui", package)
    files = {path for root in roots for path in root.rglob("*.py")} - {package / "__init__.py"}
    used: set[str] = set()
    for path in sorted(files):
        tree = ast.parse(path.read_text())
        defined = {
            n.name
            for n in tree.body
            if isinstance(n, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))
        }
        used |= _names_used(tree) - defined
    unused = sorted(set(attention.__all__) - used - FOR_CALLERS)
    assert not unused, f"exported by the attention package, run by no product code: {unused}"


def test_choose_schedule(tmp_path, monkeypatch):
    monkeypatch.setenv("LVX_CACHE_DIR", str(tmp_path))  # no calibration: the built-in table
    crossovers.cache_clear()
    assert choose_schedule(24, 4) == "gather"
    assert choose_schedule(10_000, 4) == "ring"
    assert choose_schedule(24, 1) == "ring"
    assert choose_schedule(10_000, 4, "gather") == "gather"
    # more ranks than measured: the largest measured crossover
    assert choose_schedule(1, 8) == "gather"
    with pytest.raises(ValueError, match="use one of auto, ring, gather"):
        choose_schedule(1, 2, "tree")
