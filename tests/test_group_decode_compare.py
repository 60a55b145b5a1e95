"""The group's static decode step against its eager loop, on two gloo ranks as the second
acceptance command runs it (`scripts/group_decode_compare.py`): both fed the same tokens, each
rank's steps compared as one process's are (bookkeeping, first layer, logits within a noise floor
measured on the group); a static step off on one rank fails it."""

from __future__ import annotations

from scripts.gloo_ranks import run_ranks

TOKENS = 6


def _group_comparison(rank: int, world: int, planted_on: int | None) -> dict:
    """The whole check on this rank; on rank `planted_on`, the static step's text attention output
    1% off (a step reading a stale or wrong buffer is far worse)."""
    from lvx_app.engine import static_decode
    from lvx_app.parallel.group import init_distributed
    from scripts import group_decode_compare

    if rank == planted_on:
        real = static_decode.attn_fwd_upto

        def one_percent_off(*args, **kwargs):
            out, lse = real(*args, **kwargs)
            return out * 1.01, lse

        static_decode.attn_fwd_upto = one_percent_off
    result = group_decode_compare.run(init_distributed(cuda=False), "small", 0.05, TOKENS)
    ((name, comparison),) = result["comparison"].items()
    return {"name": name, "rows": result["rows"], **comparison}


def test_the_groups_static_step_agrees_with_its_eager_loop_on_every_rank() -> None:
    got = run_ranks(_group_comparison, 2, None)
    assert got[0] == got[1], "every rank returns the group's result"
    group = got[0]
    assert group["name"] == "static step (uncaptured) on 2 ranks"
    assert "needs a GPU" in group["not_captured_because"] and not group["captured"]
    assert group["ok"] and group["steps"] == TOKENS and len(group["per_rank"]) == 2
    assert max(group["per_rank"]) <= group["bound"] < 1e-3
    assert [r["mode"] for r in group["rows"]] == ["eager", "static step (uncaptured)"]
    assert all(r["tokens_per_s"] > 0 for r in group["rows"])


def test_a_static_step_off_on_one_rank_fails_the_group() -> None:
    group = run_ranks(_group_comparison, 2, 1)[0]
    assert not group["ok"]
    assert group["per_rank"][1] > group["bound"], group["per_rank"]
    assert min(group["per_step"]) > group["bound"], "every step of the worst rank is past it"
