"""Compare view: configurations side by side on the embedded model, residency within memory, stats export."""

from __future__ import annotations

import collections
import json
import threading
import weakref
from pathlib import Path
from typing import Any

import pytest

from llm_core.engine.chat import ChatEngine
from llm_core.engine.compare import CompareConfig, Comparison, EnginePool, first_difference, main, memory_in_use
from llm_core.errors import InputError
from llm_core.loading import estimate_weights_bytes
from llm_core.metrics import export_csv, read_csv
from tests.conftest import make_settings

NF4 = CompareConfig(None, "nf4")
NONE = CompareConfig(None, "none")


def last(iterable: Any) -> Any:
    return collections.deque(iterable, maxlen=1)[0]


@pytest.fixture(scope="module")
def pool(nf4_engine: ChatEngine) -> EnginePool:
    return EnginePool(nf4_engine.settings, primary=nf4_engine)


def test_two_modes_answer_the_same_prompt_with_their_own_stats(pool: EnginePool) -> None:
    comparison = Comparison(pool, pool.settings)
    gen = pool.primary().request_options(max_new_tokens=12)
    steps = list(comparison.run([NF4, NONE], "Name a fruit.", gen))
    done = steps[-1]
    assert done.done and [r.config for r in done.results] == [NF4, NONE]
    streamed_sides = {s.index for s in steps if s.update is not None}
    assert streamed_sides == {0, 1}  # each side streamed its reply
    finals = [s.update.stats for s in steps if s.update is not None and s.update.done]
    assert finals == [r.stats for r in done.results]  # a side's panel shows its final numbers before the summary
    nf4, none = done.results
    assert nf4.text and none.text
    assert (nf4.stats.quantization, none.stats.quantization) == ("nf4", "none")
    assert nf4.stats.weights_bytes < none.stats.weights_bytes
    assert nf4.load_s is None and none.load_s is not None and none.load_s > 0  # nf4 was already resident
    assert done.difference == first_difference([nf4.text, none.text])
    row = none.summary_row()
    assert row["configuration"] == "embedded · none · sdpa" and row["new_tokens"] == none.stats.new_tokens
    # Peak memory is process-wide: each side's summary subtracts what the other loaded configuration held.
    assert none.others_resident_bytes == pool.others_resident_bytes(NONE) > 0  # nf4 stayed loaded beside it
    assert none.own_peak_bytes == max(0, none.stats.peak_memory_bytes - none.others_resident_bytes)
    assert row["peak_memory_mib"] == round(none.own_peak_bytes / 2**20, 1)
    assert none.stats.others_resident_bytes == none.others_resident_bytes  # carried by the stats every view reads
    assert not any("other loaded" in n for n in none.stats.notes)  # said once, by the stats panel


def test_same_configuration_twice_or_only_one_side_is_refused(pool: EnginePool) -> None:
    gen = pool.primary().request_options(max_new_tokens=2)
    with pytest.raises(InputError, match="same configuration"):
        last(Comparison(pool, pool.settings).run([NF4, NF4], "hi", gen))
    with pytest.raises(InputError, match="at least two"):
        last(Comparison(pool, pool.settings).run([NF4], "hi", gen))


def test_models_outside_the_configured_list_are_refused(pool: EnginePool) -> None:
    gen = pool.primary().request_options(max_new_tokens=2)
    with pytest.raises(InputError, match="not in the configured list"):
        last(Comparison(pool, pool.settings).run([NF4, CompareConfig("gpt2", "none")], "hi", gen))


@pytest.mark.parametrize("path", ["single", "fast-batched", "cpu"])
def test_unload_really_frees_memory(path: str) -> None:
    """After replies (the worker threads that ran them wait for the next job; a scheduler loop's thread runs on) the
    unloaded engine and its model are gone and their memory released. On the batched fast path the loop's thread held
    the model's weights until unload stopped it (10 MB freed of ~540 MB before; on a GPU the next model ran out of
    memory). The CPU path's loop (its one-row runner over the CPU decoder) is stopped too."""
    paths = {"fast-batched": ({"DECODE_PATH": "fast", "MAX_BATCH_SIZE": "2"}, "fast-batch"),
             "cpu": ({"DECODE_PATH": "cpu"}, "cpu-decode")}
    extra, loop_name = paths.get(path, ({}, None))
    settings = make_settings(QUANTIZATION="none", COMPUTE_DTYPE="float32", **extra)
    own_pool = EnginePool(settings)
    earlier = set(threading.enumerate())
    engine, _ = own_pool.get(NONE)
    assert engine.backend.name == (path if loop_name else "plain")
    last(engine.stream_chat("Hello", [], gen=engine.request_options(max_new_tokens=3)))
    weights = engine.report.weights_bytes
    device = engine.loaded.device
    alive, model = weakref.ref(engine), weakref.ref(engine.loaded.model)
    loops = [t for t in set(threading.enumerate()) - earlier if t.name == loop_name]  # this engine's loop
    assert len(loops) == (1 if loop_name else 0)
    del engine
    before = memory_in_use(device)
    freed = own_pool.unload(NONE)
    after = memory_in_use(device)
    assert own_pool.resident() == []
    assert freed >= 0.8 * weights and before - after >= 0.8 * weights  # RSS really dropped (malloc_trim)
    assert alive() is None and model() is None
    assert not any(t.is_alive() for t in loops)


def test_a_config_that_does_not_fit_beside_the_others_unloads_them_first(monkeypatch: pytest.MonkeyPatch) -> None:
    from llm_core.engine import compare

    settings = make_settings()
    own_pool = EnginePool(settings, reserve_bytes=0)
    sizes = {c: estimate_weights_bytes(c.apply(settings).model) for c in (NF4, NONE)}
    capacity = sizes[NF4] + sizes[NONE] - 1  # each fits alone, not both: a simulated small device
    monkeypatch.setattr(compare, "memory_available",
                        lambda device: capacity - sum(sizes[c] for c in own_pool.resident()))
    own_pool.get(NF4)
    _, notes = own_pool.get(NONE)
    assert own_pool.resident() == [NONE]
    assert len(notes) == 1 and notes[0].startswith("Unloaded embedded · nf4 · sdpa (freed")
    assert "run one after another" in notes[0]
    own_pool.unload(NONE)


def test_weight_estimate_is_within_five_percent_of_the_measured_footprint(nf4_engine: ChatEngine,
                                                                          fp32_engine: ChatEngine) -> None:
    for engine in (nf4_engine, fp32_engine):
        estimate = estimate_weights_bytes(engine.settings.model)
        assert abs(estimate - engine.report.weights_bytes) <= 0.05 * engine.report.weights_bytes


def test_first_difference_names_the_position() -> None:
    assert first_difference(["same", "same"]) == "All 2 outputs are identical (4 characters)."
    text = first_difference(["The sky is blue.", "The sky is grey."])
    assert text.startswith("Outputs first differ at character 11 (word 4)")


def test_stats_export_round_trips_through_csv(pool: EnginePool, tmp_path: Path) -> None:
    engine = pool.primary()
    done = last(engine.stream_chat("Hello", [], gen=engine.request_options(max_new_tokens=3)))
    rows = read_csv(export_csv([done.stats], tmp_path / "stats.csv"))
    assert len(rows) == 1
    row = rows[0]
    assert row["reply_id"] == done.stats.reply_id and int(row["new_tokens"]) == done.stats.new_tokens
    assert float(row["ttft_s"]) == pytest.approx(done.stats.ttft_s)
    assert row["quantization"] == "nf4" and row["attention"] == "sdpa" and row["device"] == "CPU"
    assert "torch " in row["versions"] and "bitsandbytes " in row["versions"]


def test_command_line_twin_writes_the_same_json(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.conftest import MODEL_CACHE

    monkeypatch.setenv("CACHE_DIR", str(MODEL_CACHE))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Say hi.\n\nSay bye.\n")
    out = tmp_path / "compare.json"
    assert main(["--config", "nf4", "--config", "none", "--prompt-file", str(prompts), "--max-new-tokens", "4",
                 "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    records = data["records"]
    assert [r["configuration"] for r in records if "configuration" in r] == ["embedded · nf4 · sdpa",
                                                                            "embedded · none · sdpa"] * 2
    assert sum("difference" in r for r in records) == 2
    assert all(r["new_tokens"] > 0 for r in records if "configuration" in r)
    assert data["command"].startswith("python -m llm_core.engine.compare --config nf4")


def test_stop_and_chat_never_wait_for_a_load_in_progress(pool: EnginePool) -> None:
    import time

    loading = threading.Event()
    release = threading.Event()

    def slow_load() -> None:
        with pool._lock:  # what get() holds for the whole of a model load
            loading.set()
            release.wait(10)

    loader = threading.Thread(target=slow_load)
    loader.start()
    try:
        assert loading.wait(5)
        t0 = time.perf_counter()
        engines = pool.engines()
        assert time.perf_counter() - t0 < 0.5 and engines  # the chat engine, listed without waiting
        t0 = time.perf_counter()
        primary = pool.primary()  # a chat message during a comparison's load: its engine is resident
        assert time.perf_counter() - t0 < 0.5 and primary in engines
    finally:
        release.set()
        loader.join()
