"""bench/compare_bench.py (issue 5) on CPU through its --cpu-smoke, and the engine option it relies on to make every
reply exactly max_new_tokens long (GenerationSettings.min_new_tokens)."""

from __future__ import annotations

import collections
import json
import statistics
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from bench.harness import make_random_checkpoint
from llm_core.config import Settings
from llm_core.engine.chat import ChatEngine
from llm_core.errors import InputError

REPO = Path(__file__).resolve().parent.parent
MODES = {"nf4": ("fast", "ours"), "none": ("fast", "ours"), "int8": ("plain", "seed")}  # smoke: path, bench recipe


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny") / "ckpt"
    return make_random_checkpoint("tiny", folder, torch.device("cpu"), 128)


def last(iterable: Any) -> Any:
    return collections.deque(iterable, maxlen=1)[0]


@pytest.mark.parametrize("decode_path", ["plain", "fast"])
def test_min_new_tokens_holds_eos_back_on_the_plain_and_fast_paths(tiny_checkpoint: Path, decode_path: str) -> None:
    settings = Settings.from_env(environ={"MODEL_ID": str(tiny_checkpoint), "QUANTIZATION": "none", "DEVICE": "cpu",
                                          "DECODE_PATH": decode_path, "CACHE_DIR": str(tiny_checkpoint.parent)},
                                 env_file=None)
    engine = ChatEngine.load(settings)
    assert engine.backend.name == decode_path
    if decode_path == "fast":  # the model panel says what runs, not the auto path's "plain generate is used"
        assert "DECODE_PATH=fast on CPU" in engine.backend.reason and "plain" not in engine.backend.reason
        # its memory prediction counts the preallocated static cache, which is all of max_cache_len
        assert engine.memory_facts.static_kv_tokens == engine.fast_decoder.cache_len > 0
    gen = replace(settings.generation, max_new_tokens=6, repetition_penalty=1.0)
    message = "t5 t6 t7 t8 t9 t30 t31"
    free = last(engine.stream_chat(message, [], gen=gen, history_turns=0, system_prompt=None))
    assert free.stats.new_tokens == 6
    # Make the model's first greedy token its EOS: without min_new_tokens the reply ends there.
    engine.loaded.model.generation_config.eos_token_id = free.token_ids[0]
    cut = last(engine.stream_chat(message, [], gen=gen, history_turns=0, system_prompt=None))
    assert (cut.stats.new_tokens, cut.stats.finish_reason) == (1, "eos")
    held = last(engine.stream_chat(message, [], gen=replace(gen, min_new_tokens=6), history_turns=0,
                                   system_prompt=None))
    assert (held.stats.new_tokens, held.stats.finish_reason) == (6, "length")
    assert free.token_ids[0] not in held.token_ids
    with pytest.raises(InputError, match="min_new_tokens"):
        engine.request_options(min_new_tokens=-1)
    assert engine.request_options(min_new_tokens=4.0).min_new_tokens == 4


def test_the_probe_times_a_scheduled_replys_start_at_its_submit() -> None:
    """A reply of the scheduler starts at backend.submit on the reply's own thread (ChatEngine._scheduled_texts), not
    at run() in a worker: the probe reads the decode start and the reply's clock there too, and passes the call on."""
    from types import SimpleNamespace

    from bench.compare_bench import Probe
    from llm_core.metrics import TokenClock

    calls: list[Any] = []
    backend = SimpleNamespace(run=lambda *a, **kw: calls.append(("run", a)) or 0,
                              submit=lambda *a, **kw: calls.append(("submit", a)) or "request")
    engine = SimpleNamespace(prepare=lambda *a, **kw: "prepared", backend=backend)
    probe = Probe(engine)  # type: ignore[arg-type]
    clock = TokenClock(start_s=12.5)
    streamer = SimpleNamespace(clock=clock)
    assert engine.backend.submit("prepared", streamer, "stop", "cache") == "request"
    assert calls == [("submit", ("prepared", streamer, "stop", "cache"))]
    assert probe.clock_start == 12.5 and probe.decode_start is not None and probe.decode_start > 12.5


def test_cpu_smoke_checks_every_mode_against_the_bench_on_the_same_model(tmp_path: Path) -> None:
    out = tmp_path / "compare.json"
    proc = subprocess.run([sys.executable, "-m", "bench.compare_bench", "--cpu-smoke",
                           "--work-dir", str(tmp_path / "w"),
                           "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["title"] and doc["date"] and doc["device"]
    meta = doc["meta"]
    assert "--cpu-smoke" in meta["command"] and meta["argv"][1:] == ["--cpu-smoke", "--work-dir",
                                                                     str(tmp_path / "w"), "--out", str(out)]
    assert meta["versions"]["torch"] and meta["versions"]["transformers"]
    plan = meta["plan"]
    assert plan["modes"] == list(MODES) and (plan["prompt_tokens"], plan["new_tokens"], plan["repeats"]) == (32, 8, 2)
    records = doc["records"]
    kinds = [r["kind"] for r in records]
    assert "error" not in kinds and "skipped" not in kinds and kinds[-1] == "done"
    checks = {r["mode"]: r for r in records if r["kind"] == "check"}
    assert list(checks) == list(MODES)
    for mode, (path, bench_recipe) in MODES.items():
        check = checks[mode]
        assert (check["decode_path"], check["bench_recipe"]) == (path, bench_recipe)
        runs = [r for r in records if r["kind"] == "run" and r["mode"] == mode]
        compare = [r for r in runs if r["recipe"] == "compare"]
        bench = [r for r in runs if r["recipe"] == "bench"]
        assert len(compare) == len(bench) == check["repeats"] == 2
        # interleaved, each side leading in turn, the third the bench's call on a long-lived worker thread
        assert [(r["repeat"], r["recipe"]) for r in runs] == [
            (0, "compare"), (0, "bench"), (0, "bench_worker"), (1, "bench"), (1, "bench_worker"), (1, "compare")]
        worker = check["bench_worker"]
        assert worker["runs"] == 2 and worker["vs_compare"]["decode_tokens_per_s"]["paired_ratio"] > 0
        assert all(r["thread"] == "worker" for r in runs if r["recipe"] == "bench_worker")
        assert all(r["process_cpu_s"] > 0 for r in runs)
        if path == "fast":  # each run says where its first token's time went (no CUDA events on CPU)
            for r in runs:
                assert r["prefill_gpu_s"] is None
                assert 0 < r["prefill_launch_s"] < r["first_token_s"] and r["entry_to_prefill_s"] > 0
            assert check["prefill_timing"]["bench_worker"]["prefill_launch_s"] > 0
        else:
            assert check["prefill_timing"] is None and "prefill_launch_s" not in runs[0]
        for r in runs:  # both sides decoded the same prompt on the same path, to full length
            assert (r["decode_path"], r["prompt_tokens"], r["new_tokens"]) == (path, 32, 8)
        assert all(r["finish_reason"] == "length" and r["stats"]["decode_path"] == path for r in compare)
        assert all(r["bench_recipe"] == bench_recipe for r in bench)
        assert check["prompt_ids_match"] and check["decode_path_match"] and check["full_length"]
        assert check["same_tokens"]  # greedy, same weights, same path: the same 8 tokens on both sides
        required = [name for name, m in check["metrics"].items() if m["required"]]
        assert required == ["ttft_from_decode_start_s", "decode_tokens_per_s", "peak_rss_bytes"]
        by_repeat = {side: sorted(rows, key=lambda r: r["repeat"]) for side, rows in (("c", compare), ("b", bench))}
        for name, m in check["metrics"].items():
            # the medians are those of the run records; the paired ratios are those of each repeat's two runs, and
            # the 5% verdict follows from their median
            assert m["compare"] == statistics.median(r[m["compare_key"]] for r in compare)
            assert m["bench"] == statistics.median(r[m["bench_key"]] for r in bench)
            assert m["compare"] > 0 and m["bench"] > 0, (mode, name)
            assert m["ratio"] == pytest.approx(m["compare"] / m["bench"], rel=1e-5)
            paired = [c[m["compare_key"]] / b[m["bench_key"]] for c, b in zip(by_repeat["c"], by_repeat["b"],
                                                                              strict=True)]
            assert m["paired_ratios"] == pytest.approx(paired, rel=1e-3)
            assert m["paired_ratio"] == pytest.approx(statistics.median(paired), rel=1e-5)
            assert m["within_5pct"] == (abs(statistics.median(paired) - 1) <= 0.05)
        assert check["all_within_5pct"] == all(check["metrics"][n]["within_5pct"] for n in required)
        assert check["weights_bytes"] > 0 and check["load_s"] > 0
        for r in compare:  # the TTFT split adds up
            assert r["prepare_s"] > 0 and r["handoff_s"] >= 0 and r["before_prepare_s"] >= 0
            assert r["ttft_from_decode_start_s"] == pytest.approx(
                r["ttft_s"] - r["before_prepare_s"] - r["prepare_s"] - r["handoff_s"], abs=1e-9)
        summary = doc["summary"][mode]
        assert summary["decode_path"] == path and summary["all_within_5pct"] == check["all_within_5pct"]
        assert summary["ttft_s_ratio"] == check["metrics"]["ttft_s"]["ratio"]
        assert summary["ttft_from_decode_start_s_paired_ratio"] == check["metrics"]["ttft_from_decode_start_s"][
            "paired_ratio"]
        unload = next(r for r in records if r["kind"] == "unload" and r["mode"] == mode)
        assert unload["resident_after"] == [] and unload["freed_bytes"] > 0
    assert doc["summary"]["all_modes_within_5pct"] == all(c["all_within_5pct"] for c in checks.values())
    assert doc["summary"]["modes_measured"] == list(MODES)
    for mode in MODES:  # the table printed at the end names every mode
        assert any(line.startswith(mode) for line in proc.stdout.splitlines())
    # --reanalyze recomputes every check from the run records alone: the same verdicts as the run's own
    again = tmp_path / "again.json"
    proc = subprocess.run([sys.executable, "-m", "bench.compare_bench", "--reanalyze", str(out), "--out", str(again)],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    redone = json.loads(again.read_text())
    for mode in MODES:
        first = checks[mode]
        second = next(r for r in redone["records"] if r["kind"] == "check" and r["mode"] == mode)
        assert second["metrics"] == first["metrics"] and second["all_within_5pct"] == first["all_within_5pct"]
    assert redone["summary"]["all_modes_within_5pct"] == doc["summary"]["all_modes_within_5pct"]
    assert redone["meta"]["reanalyzed"]["from"] == str(out)
