"""The memory plan at Llama-3.2-Vision's shapes: text K/V only in the self-attention layers, one
prompt position a frame (the processor's own prompt), and its acceptance check rehearsed on CPU."""

from __future__ import annotations

import json

import pytest

from lvx_app.engine.limits import PrefillShape, prefill_bytes
from lvx_app.engine.memory_plan import Workload, memory_plan, param_counts
from lvx_models.mllama.config import MllamaConfig
from lvx_models.mllama.processor import MllamaProcessor
from lvx_models.mllama.tiny import write_tiny_checkpoint
from lvx_models.mplug_owl3.config import Owl3Config
from lvx_models.surface import VIDEO
from scripts import check_mllama_11b
from scripts.memory_plan import largest_video, positions_minutes, time_plan


def test_the_plan_reads_the_11b_from_its_config() -> None:
    cfg = MllamaConfig()
    assert (cfg.text_kv_layers, cfg.prompt_positions_per_frame) == (32, 1)
    counts = param_counts(cfg)
    assert 10.6e9 < counts.total < 10.7e9  # "11B": 10.6B published
    hour = memory_plan(cfg, Workload(minutes=60), counts)
    # 8 cross layers; K and V, (tokens, 8*128) each, bf16
    assert hour.resident["visual K/V"] == 8 * 3600 * 1601 * 2 * 8 * 128 * 2
    prompt = 5 + 3600  # the header, one <|image|> a frame
    text = hour.resident["text K/V"]
    assert text % (32 * 2 * 8 * 128 * 2) == 0 and prompt < text // (32 * 2 * 8 * 128 * 2)
    shape = PrefillShape(world=1, position=0, element_bytes=2)
    assert prefill_bytes(100, cfg, shape) < prefill_bytes(100, _all_self(cfg), shape)


def test_the_plan_costs_the_towers_empty_tiles_but_keeps_one_tile_of_keys() -> None:
    """The tower runs a frame as 4 tiles of 1,608 tokens (its tile and the published empty
    ones); the frame keeps 1,601 keys. The plan's tower time and encode memory read the first,
    its K/V the second."""
    from dataclasses import replace

    from scripts.memory_plan import time_plan

    cfg = MllamaConfig()
    one = replace(cfg, vision=replace(cfg.vision, max_num_tiles=1))
    assert (cfg.vision_tokens_per_frame, one.vision_tokens_per_frame) == (6432, 1608)
    assert cfg.visual_tokens_per_frame == one.visual_tokens_per_frame == 1601
    counts, hour = param_counts(cfg), Workload(minutes=60)
    stage = "ingest (vision tower + projector)"
    ingest = [time_plan(c, hour, counts=counts)[stage] for c in (cfg, one)]
    assert ingest[0]["matmul_tflop"] > 5 * ingest[1]["matmul_tflop"]
    plans = [memory_plan(c, hour, counts) for c in (cfg, one)]
    assert plans[0].resident == plans[1].resident
    assert plans[0].stages["encode"] > plans[1].stages["encode"]


def _all_self(cfg: MllamaConfig) -> MllamaConfig:
    from dataclasses import replace

    return replace(cfg, text=replace(cfg.text, cross_attention_layers=[]))


def test_the_plans_prompt_is_the_processors(tmp_path) -> None:
    folder = write_tiny_checkpoint(tmp_path / "tiny")
    cfg = MllamaConfig.from_json(folder / "config.json")
    processor = MllamaProcessor.from_pretrained(folder)
    prompt = processor.build_chat_prompt(
        [{"role": "user", "content": f"{VIDEO}what happens?"}], videos=[7]
    )
    starts = prompt.media_starts
    # the tiny tokenizer splits "user" and "\n\n", each one token in the published one
    split = sum(len(processor.encode_text(t)) - 1 for t in ("user", "\n\n"))
    assert starts[0] - split == cfg.prompt_header_tokens
    assert starts[1] - starts[0] == cfg.prompt_positions_per_frame


def test_memory_not_positions_limits_the_11b_on_8_gpus() -> None:
    """131,072 positions hold 36 h at 1 fps; 3 h (10,800 frames) fit 8 GPUs only recomputed."""
    cfg = MllamaConfig()
    assert positions_minutes(cfg) > 36 * 60
    budget = 78 * 2**30
    for mode, fits in (("cache", False), ("recompute", True)):
        work = Workload(minutes=180, ranks=8, kv_mode=mode)
        assert (memory_plan(cfg, work).peak <= budget) == fits
        row = largest_video(cfg, Workload(minutes=1, ranks=8, kv_mode=mode), budget)
        assert row["set by"] == "memory" and (row["largest min"] >= 180) == fits


def test_the_header_features_are_planned_where_they_are_held() -> None:
    """The empty tiles' features the chat header attends to: beside a GPU on the host until the
    header is prefilled, a chunk of frames' K/V at a time on the device; on a CPU in the stages."""
    cfg = MllamaConfig()
    gpu = memory_plan(cfg, Workload(minutes=60, ranks=8))
    empty = 450 * 3 * 1601 * 4096 * 2  # 450 frames a rank, 3 empty tiles each, bf16
    assert gpu.host == {"header features": empty}
    kept = gpu.resident["weights"] + gpu.resident["visual K/V"]
    assert 0 < gpu.stages["header prefill"] - kept < 1e9  # a chunk of frames' K/V and its work
    cpu = memory_plan(cfg, Workload(minutes=60, ranks=8, device="cpu"))
    assert cpu.stages["encode"] - gpu.stages["encode"] == empty
    hours = time_plan(cfg, Workload(minutes=60, ranks=8))
    assert hours["header prefill"]["host_gb"] == pytest.approx(8 * empty / 1e9)
    owl3 = memory_plan(Owl3Config(), Workload(minutes=60, ranks=8))
    assert owl3.host == {"header features": 0} and "header prefill" not in owl3.stages


def test_the_11b_acceptance_check_rehearses_on_cpu(tmp_path) -> None:
    out = tmp_path / "decode_compile.json"
    argv = ["--device", "cpu", "--small", "--out", str(out), "--out-key", "mllama_11b"]
    assert check_mllama_11b.main(argv) == 0
    data = json.loads(out.read_text())["mllama_11b"]
    kernels = [r for r in data["rows"] if r["part"] == "kernels"]
    assert len(kernels) == 3 and all(r["ok"] and r["keys"] == 2 * 1601 for r in kernels)
    (memory,) = [r for r in data["rows"] if r["part"] == "memory"]
    assert memory["planned_gb"] > 0 and memory["measured_gb"] is None and data["ok"]
