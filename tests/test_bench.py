"""bench.decode (issue 3's benchmark) on CPU: its smoke run writes the records the issue asks for, and the variant
it measures at every prompt length is chosen as stated."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.decode import pick_best

REPO = Path(__file__).resolve().parent.parent
REQUIRED = ("recipe", "model", "quantization", "prompt_tokens", "new_tokens", "ttft_s", "decode_tokens_per_s",
            "peak_vram_bytes", "device", "versions", "command")


def test_cpu_smoke_writes_seed_and_ours_records_with_the_required_fields(tmp_path: Path) -> None:
    out = tmp_path / "decode.json"
    proc = subprocess.run([sys.executable, "-m", "bench.decode", "--cpu-smoke", "--out", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    runs = [r for r in doc["records"] if r["kind"] == "run"]
    cases = {(r["recipe"], r["quantization"], r["prompt_tokens"]) for r in runs}
    for quant in ("nf4", "none", "int8"):  # both recipes at both prompt lengths, in one process and one run
        assert {(recipe, quant, p) for recipe in ("seed", "ours") for p in (32, 64)} <= cases
    for r in runs:
        missing = [k for k in REQUIRED if k not in r]
        assert not missing, (missing, r)
        assert r["new_tokens"] == 8 and r["ttft_s"] > 0 and r["decode_tokens_per_s"] > 0
        assert r["versions"]["torch"] and "--cpu-smoke" in r["command"] and r["device"] == "cpu"
    assert doc["records"][-1]["kind"] == "done"
    # int8: the fp32 reference multiplies by the dequantized int8 weights, which the fast path computes with (weight
    # only) and LLM.int8 approximates (it also quantizes the activations): ours is the closer of the two
    int8 = next(r for r in doc["records"] if r["kind"] == "variant" and r["quantization"] == "int8")["agreement"]
    assert int8["within_calibrated_bound"] is True
    assert int8["ours_vs_fp32_max_rel_l2"] < int8["seed_vs_fp32_max_rel_l2"]


def test_pick_best_keeps_the_default_unless_another_variant_is_clearly_faster() -> None:
    assert pick_best({"auto": 324.4, "nf4-fused-dqoff": 324.7, "bnb": 250.2}) == "auto"  # within 1%: the default
    assert pick_best({"auto": 250.0, "nf4-fused-dq": 324.0}) == "nf4-fused-dq"
    assert pick_best({"bnb-fused-dq-requant": 1.0, "torch-fused-dq": 2.0}) == "torch-fused-dq"  # no default run


def test_memory_breakdown_sums_segments_by_kind_and_allocations_by_owner() -> None:
    """bench.memory_breakdown's summary of a CUDA allocator snapshot (this shape is what torch.cuda.memory._snapshot
    returns): reserved/allocated/free per segment kind, the largest free block, and allocated bytes by the first
    llm_core/transformers/bitsandbytes frame."""
    from bench.memory_breakdown import summarize_snapshot

    def block(size: int, state: str, filename: str = "", line: int = 0) -> dict[str, object]:
        frames = [{"filename": "/usr/lib/python3/site-packages/torch/cuda/memory.py", "line": 1, "name": "alloc"},
                  {"filename": filename, "line": line, "name": "f"}] if filename else []
        return {"size": size, "state": state, "frames": frames}

    snapshot = {"segments": [
        {"total_size": 100, "allocated_size": 60, "segment_pool_id": (0, 0), "is_expandable": False, "stream": 0,
         "blocks": [block(40, "active_allocated", "/x/site-packages/bitsandbytes/functional.py", 7),
                    block(20, "active_allocated", "/repo/llm_core/fast/generate.py", 370),
                    block(30, "inactive"), block(10, "inactive")]},
        {"total_size": 50, "allocated_size": 50, "segment_pool_id": (0, 0), "is_expandable": False, "stream": 0,
         "blocks": [block(50, "active_allocated", "/repo/llm_core/fast/generate.py", 370)]},
        {"total_size": 64, "allocated_size": 4, "segment_pool_id": (1, 2), "is_expandable": False, "stream": 7,
         "blocks": [block(4, "active_allocated"), block(60, "inactive")]},
    ]}
    out = summarize_snapshot(snapshot)
    default, pool = out["by_segment_kind"]["default stream 0"], out["by_segment_kind"]["graph pool stream 7"]
    assert (default["segments"], default["reserved"], default["allocated"], default["free"]) == (2, 150, 110, 40)
    assert default["largest_free_block"] == 30 and pool["free"] == 60 and pool["largest_free_block"] == 60
    assert (out["reserved"], out["allocated"]) == (214, 114)
    assert out["allocated_by_owner"] == {"llm_core/fast/generate.py:370 f": 70,
                                         "bitsandbytes/functional.py:7 f": 40, "(no python frame recorded)": 4}
    assert out["repeated_block_sizes"] == []  # no size occurs twice on one stream here
    snapshot["segments"][1]["blocks"].append(block(40, "active_allocated"))
    assert summarize_snapshot(snapshot)["repeated_block_sizes"] == [{"bytes": 40, "stream": 0, "count": 2}]


def test_cards_smoke_fills_the_reported_context_to_within_a_few_tokens(tmp_path: Path) -> None:
    """bench.cards' fill message: one prompt sized to the context the engine reported for the case (not whole turns,
    whose granularity left 2k tokens of an 8 GiB card's fit unmeasured), answered, and summarised beside the seed."""
    out = tmp_path / "cards.json"
    proc = subprocess.run([sys.executable, "-m", "bench.cards", "--cpu-smoke", "--out", str(out), "--ckpt-dir",
                           str(tmp_path / "ckpt")], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    fills = [r for r in doc["records"] if r.get("what") == "fill"]
    assert {r["kv_cache"] for r in fills} == {"default", "int8"}  # each ours case, never the seed
    for r in fills:
        assert r["outcome"] == "ok", r
        assert r["context_fit_tokens"] - 8 < r["prompt_tokens"] <= r["context_fit_tokens"]
        assert r["new_tokens"] == 8 and r["decode_tokens_per_s"] > 0
    summary = doc["summary"]["cards"][0]
    default_fill = next(r for r in fills if r["kv_cache"] == "default")
    assert summary["ours_fill_prompt_tokens"] == default_fill["prompt_tokens"]
    assert summary["fill_ratio_to_seed"] == round(default_fill["prompt_tokens"] / summary["seed_longest_prompt_tokens"],
                                                  3)
    assert summary["ours_fill_failures"] == 0


def test_prefill_gemm_summary_sums_each_familys_best_per_layer_and_keys_round_trip() -> None:
    """bench.prefill_gemm: a config's record key parses back to the same launch, and the summary adds, per arch and
    M, each linear's fastest gemm config, its dequantize + matmul and its bf16 time, with their ratios."""
    from bench.prefill_gemm import config_of, key_of, summarize
    from llm_core.fast.kernels.nf4_mm import GemmConfig

    cfg = GemmConfig(64, 256, 32, 4, 5, scale16=False)
    assert config_of(key_of(cfg, "gather")) == (cfg, "gather")
    records = [{"arch": "a", "linear": "qkv", "m": 512,
                "us": {"gemm:128x128x128/w8/st3/s16:asm": 30.0, "gemm:64x64x128/w4/st3/s16:asm": 20.0,
                       "dequant+matmul": 50.0, "bf16_cublas": 16.0}},
               {"arch": "a", "linear": "o", "m": 512,
                "us": {"gemm:128x128x128/w8/st3/s16:asm": 10.0, "dequant+matmul": 10.0, "bf16_cublas": 4.0}}]
    row = summarize(records)["a"]["512"]
    assert row["linears"] == ["qkv", "o"]
    assert (row["gemm_us"], row["dequant+matmul_us"], row["bf16_us"]) == (30.0, 60.0, 20.0)
    assert row["dequant+matmul_over_gemm"] == 2.0 and row["gemm_over_bf16"] == 1.5


def test_cards_stops_a_chat_once_trimming_holds_its_context() -> None:
    """bench.cards' turns end once PLATEAU_TURNS replies in a row had older turns dropped from their history (the
    kept context no longer grows), not after one or two such replies, nor while whole histories still fit. The
    2026-12-06 run's sequence (trimming from turn 6, 12 turns more) stops at turn 9."""
    from bench.cards import PLATEAU_TURNS, plateaued

    assert PLATEAU_TURNS == 3
    assert not plateaued([0, 0, 0, 0, 0, 0])  # nothing trimmed yet
    assert not plateaued([0, 0, 0, 2, 0, 2])  # not three in a row
    assert not plateaued([0, 0, 0, 2, 2])  # two
    assert plateaued([0, 0, 0, 2, 2, 4])  # three
    run = [0, 0, 0, 0, 0, 0, 2, 2, 4, 4, 5, 7, 7, 8, 10, 10, 11, 13]
    assert next(turn for turn in range(len(run) + 1) if plateaued(run[:turn])) == 9


def test_app_load_serves_concurrent_chats_through_the_app_at_each_update_interval(tmp_path: Path) -> None:
    """bench.app_load on the embedded model: two chats of two turns at once through the app's own server, each
    interval on the same engine; every reply completes with its numbers, the second turn's prompt holds the first
    turn and its reply (the history the page gave back), and the 1 s interval sends one update a second at most."""
    out = tmp_path / "app-load.json"
    proc = subprocess.run([sys.executable, "-m", "bench.app_load", "--chats", "2", "--new-tokens", "16",
                           "--prompt-tokens", "64", "--turns", "2", "--turn-tokens", "16", "--pairs", "1",
                           "--intervals", "0,1", "--client-procs", "1",
                           "--settings", "MAX_BATCH_SIZE=2", "--out", str(out)], cwd=REPO, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rounds = {r["ui_update_interval_s"]: r for r in json.loads(out.read_text())["records"] if r.get("phase") == "round"}
    assert sorted(rounds) == [0.0, 1.0]
    for r in rounds.values():
        assert r["chats"] == 2 and r["completed"] == 4 and not r["errors"] and r["new_tokens"] == 64, r
        assert r["aggregate_tokens_per_s"] > 0 and r["engine_decode_tokens_per_s"]["min"] > 0 and r["server_cpu_s"] > 0
        assert r["ttft_p95_s"] <= r["client_ttft_p95_s"]
        first, second = r["per_turn"]
        assert first["prompt_tokens"] == [64, 64] and first["completed"] == second["completed"] == 2
        assert second["prompt_tokens"][0] >= 64 + 16 + 16, second  # turn 1, its 16-token reply, a 16-token message
    # 1 s: the first token's update, the end's, and one a second between them at most
    assert 2 <= rounds[1.0]["updates_per_chat"]["max"] <= 3 + rounds[1.0]["wall_s"]


def test_slim_wheel_drops_the_named_members_and_their_record_lines(tmp_path: Path) -> None:
    import zipfile

    from bench.slim_wheel import slim

    wheel = tmp_path / "pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("pkg/__init__.py", "x = 1\n")
        z.writestr("pkg/lib_cuda118.so", b"\0" * 100)
        z.writestr("pkg/lib_cuda130.so", b"\1" * 100)
        z.writestr("pkg-1.0.dist-info/RECORD", "pkg/__init__.py,sha256=a,6\npkg/lib_cuda118.so,sha256=b,100\n"
                                               "pkg/lib_cuda130.so,sha256=c,100\npkg-1.0.dist-info/RECORD,,\n")
    target, kept, dropped = slim(wheel, tmp_path / "out", ["pkg/lib_cuda1[12]*"])
    with zipfile.ZipFile(target) as z:
        assert sorted(z.namelist()) == ["pkg-1.0.dist-info/RECORD", "pkg/__init__.py", "pkg/lib_cuda130.so"]
        assert z.read("pkg/lib_cuda130.so") == b"\1" * 100
        assert "lib_cuda118" not in z.read("pkg-1.0.dist-info/RECORD").decode()
    assert (kept, dropped) == (3, 1)


def test_attention_bucket_choice_weighs_every_row_count_of_a_bucket_and_the_engine_takes_it() -> None:
    """bench.attention_rows' bucket suggestion: per format and rows bucket, the launch with the lowest geometric mean
    of its time over the default's across every (rows, tokens) case of the bucket that it was timed at all of; and
    bench.batched --attention-launch puts such a choice into ATTENTION_LAUNCHES (and refuses a malformed one)."""
    import pytest
    import torch

    from bench.attention_rows import bucket_suggestions, launch_name
    from bench.batched import set_attention_launches
    from llm_core.fast.kernels import attention

    default = attention.AttentionLaunch()
    d, a, b, c = launch_name(default), "l64-w2-s2-p8", "l32-w4-sd-p2", "l128-w8-s3-p16"
    times = {  # (rows, tokens) -> launch -> µs; 16 and 32 rows share the 64 bucket, 8 rows has its own
        (16, 576): {d: 100, a: 50, b: 90, c: 10}, (32, 576): {d: 100, a: 150, b: 60},
        (32, 4096): {d: 100, a: 70, b: 80}, (8, 576): {d: 100, a: 120, b: 95},
    }
    records = [{"phase": "full", "format": "int8", "rows": rows, "tokens": t, "launch": name, "us": us}
               for (rows, t), by in times.items() for name, us in by.items()]
    records.append({"phase": "probe", "format": "int8", "rows": 32, "tokens": 576, "launch": a, "us": 1.0})
    got = {(s["format"], s["bucket"]): s for s in bucket_suggestions(records, default, attention.LAUNCH_ROW_BUCKETS)}
    # 64 bucket: a 0.5*1.5*0.7 = 0.525, b 0.9*0.6*0.8 = 0.432 (cube roots), c is not timed at every case: b wins
    assert got[("int8", 64)]["launch"] == b
    assert got[("int8", 64)]["time_vs_default_geomean"] == round(0.432 ** (1 / 3), 3)
    assert got[("int8", 8)]["launch"] == b and got[("int8", 64)]["arg"] == f"int8:64={b}"
    saved = dict(attention.ATTENTION_LAUNCHES)
    try:
        assert set_attention_launches([f"int8:64={b}"]) == {"int8:64": b}
        assert attention.ATTENTION_LAUNCHES[("int8", 64)] == attention.AttentionLaunch(32, 4, None, 2)
        assert attention.attention_launch("int8", 20, torch.device("cpu")) == attention.AttentionLaunch(32, 4, None, 2)
        for bad in ("int8:32=" + b, "fp8:64=" + b, "int8:64=l64-w2-s2"):
            with pytest.raises(SystemExit, match="attention-launch"):
                set_attention_launches([bad])
    finally:
        attention.ATTENTION_LAUNCHES.clear()
        attention.ATTENTION_LAUNCHES.update(saved)


def test_frag_config_replaces_the_fields_it_names_in_every_nf4_frag_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """bench.batched --frag-config: nf4_frag's default_config (which the engine's op calls at every launch) takes the
    named FragConfig fields, booleans as booleans, and keeps the rule's own for the rest; a field it does not know
    (or the forms, which the op sets itself) is refused."""
    from bench.batched import set_frag_config
    from llm_core.fast.kernels import nf4_frag

    monkeypatch.setattr(nf4_frag, "default_config", nf4_frag.default_config)  # restored after the test
    rule = nf4_frag.default_config(4096, 11008, 132, 8)
    assert set_frag_config("") == {} and nf4_frag.default_config(4096, 11008, 132, 8) == rule
    assert set_frag_config("depth=2,early=1") == {"depth": 2, "early": 1}
    got = nf4_frag.default_config(4096, 11008, 132, 8)
    assert got == nf4_frag.FragConfig(rule.warps, rule.split, rule.prefetch, depth=2, early=True)
    assert got.early is True
    for bad in ("table_regs=1", "depth", "width=2"):
        with pytest.raises(SystemExit, match="frag-config"):
            set_frag_config(bad)
