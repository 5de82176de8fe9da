"""Loading and generation with the real embedded model on CPU."""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from llm_core.engine.chat import ChatEngine
from llm_core.errors import ContextBudgetError, GenerationError, InputError, ModelLoadError, OutOfMemoryError
from llm_core.history import Turn, build_messages
from llm_core.loading import load_model
from tests.conftest import make_settings


def generate_reference(engine: ChatEngine, messages: list[dict[str, str]], max_new_tokens: int) -> list[int]:
    """Non-streamed greedy generate with the demo's defaults, as a plain transformers user would call it."""
    enc = engine.loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True,
                                                      return_tensors="pt")
    with torch.inference_mode():
        out = engine.loaded.model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                                           repetition_penalty=1.05, temperature=None, top_p=None, top_k=None)
    return out[0, enc["input_ids"].shape[-1]:].tolist()


def final(updates: Any) -> Any:
    """Drain a reply stream and return its last update."""
    return collections.deque(updates, maxlen=1)[0]


def no_generation_running(engine: ChatEngine) -> bool:
    return engine.generating == 0


def test_nf4_load_yields_4bit_layers_and_a_report(nf4_engine: ChatEngine) -> None:
    import bitsandbytes as bnb

    # A fresh load: on CPU bitsandbytes repacks the weights (and un-nests absmax) at the first forward.
    model = load_model(make_settings().model).model
    linear4 = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(linear4) == 30 * 7  # q, k, v, o, gate, up, down in each of the 30 layers
    weight = linear4[0].weight
    assert weight.quant_state.quant_type == "nf4" and weight.quant_state.nested  # nested = double quant
    assert weight.quant_state.dtype == torch.bfloat16  # compute dtype
    assert weight.dtype == torch.uint8 and weight.numel() * 2 == linear4[0].in_features * linear4[0].out_features
    report = nf4_engine.report
    assert (report.quantization, report.double_quant, report.attention) == ("nf4", True, "sdpa")
    assert report.quantized_linear_layers == 210 and report.context_length == 8192
    assert set(report.versions) == {"torch", "transformers", "accelerate", "bitsandbytes", "gradio"}
    assert report.warmup_s > 0 and report.decode_path in ("plain", "fast")


def test_nf4_weights_take_less_memory_than_fp32(nf4_engine: ChatEngine, fp32_engine: ChatEngine) -> None:
    assert nf4_engine.report.weights_bytes < 0.5 * fp32_engine.report.weights_bytes


def test_local_folder_loads_through_the_same_path(nf4_engine: ChatEngine) -> None:
    folder = nf4_engine.loaded.source.name_or_path
    loaded = load_model(make_settings(MODEL_ID=folder, QUANTIZATION="none", COMPUTE_DTYPE="float32").model)
    assert loaded.report.origin == "local" and loaded.report.quantized_linear_layers == 0


def test_missing_local_folder_is_a_clear_load_error(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(make_settings(MODEL_ID="./no-such-model").model)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(make_settings(MODEL_ID=str(tmp_path / "empty")).model)


def test_flash_attention_request_falls_back_with_a_note(nf4_engine: ChatEngine) -> None:
    from llm_core.loading import resolve_attention

    impl, note = resolve_attention(make_settings(ATTN_IMPLEMENTATION="flash_attention_2").model)
    assert impl == "sdpa" and note is not None and "flash-attn" in note


@pytest.mark.parametrize("engine_name", ["fp32_engine", "nf4_engine"])
def test_streamed_greedy_text_equals_non_streamed_generate(engine_name: str, request: pytest.FixtureRequest) -> None:
    engine: ChatEngine = request.getfixturevalue(engine_name)
    history = [Turn("Hi, who are you?", "I am a helpful assistant.")]
    gen = engine.request_options(max_new_tokens=40)
    done = final(engine.stream_chat("Name three primary colors.", history, gen=gen, system_prompt="Be brief."))
    reference = generate_reference(engine, build_messages("Be brief.", history, "Name three primary colors."), 40)
    assert list(done.token_ids) == reference
    assert done.text == engine.loaded.tokenizer.decode(reference, skip_special_tokens=True)


def test_max_new_tokens_is_honoured_and_stats_match_the_ids(fp32_engine: ChatEngine) -> None:
    gen = fp32_engine.request_options(max_new_tokens=12)
    done = final(fp32_engine.stream_chat("Write a long story about a dragon.", [], gen=gen))
    stats = done.stats
    assert done.done and stats.new_tokens == len(done.token_ids) == 12
    assert stats.finish_reason == "length"
    assert stats.prompt_tokens == fp32_engine.count_tokens(
        build_messages(fp32_engine.settings.chat.system_prompt, [], "Write a long story about a dragon."))
    assert stats.decode_tokens_per_s == pytest.approx((stats.new_tokens - 1) / stats.decode_s)
    assert 0 < stats.ttft_s < stats.end_to_end_s
    assert stats.ttft_s + stats.decode_s <= stats.end_to_end_s
    assert stats.peak_rss_bytes and stats.peak_rss_bytes > stats.weights_bytes
    # KV cache holds K and V for every position but the last generated one (it is never fed back).
    cfg = fp32_engine.loaded.model.config
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4  # float32
    assert stats.kv_cache_bytes == per_token * (stats.prompt_tokens + stats.new_tokens - 1)


def test_live_updates_report_ttft_as_soon_as_the_first_token_arrives(fp32_engine: ChatEngine) -> None:
    gen = fp32_engine.request_options(max_new_tokens=6)
    updates = list(fp32_engine.stream_chat("Say hello.", [], gen=gen))
    assert updates[0].stats.ttft_s is not None and not updates[0].done
    assert updates[-1].done and sum(u.done for u in updates) == 1


def test_stop_halts_the_worker_not_just_the_display(fp32_engine: ChatEngine) -> None:
    gen = fp32_engine.request_options(max_new_tokens=400)
    stream = fp32_engine.stream_chat("Count from one to five hundred in words.", [], gen=gen, request_id="session-a")
    updates = []
    for update in stream:
        updates.append(update)
        if len(updates) == 3:
            assert fp32_engine.stop("session-a") is True
    update = updates[-1]
    assert update.done and update.stats.finish_reason == "stopped"
    assert update.stats.new_tokens < 20
    assert no_generation_running(fp32_engine)
    assert fp32_engine.stop("session-a") is False  # nothing running any more


def test_closing_the_stream_halts_the_worker(fp32_engine: ChatEngine) -> None:
    stream = fp32_engine.stream_chat("Count to one hundred.", [], gen=fp32_engine.request_options(max_new_tokens=400))
    next(stream)
    t0 = time.perf_counter()
    stream.close()  # what Gradio does when a user presses Stop or leaves
    assert time.perf_counter() - t0 < 10 and no_generation_running(fp32_engine)


def test_replies_reuse_the_engines_worker_thread(fp32_engine: ChatEngine) -> None:
    """Generation runs on a long-lived worker (CUDA libraries keep per-thread state), not a new thread a reply."""
    names: list[str] = []
    real = fp32_engine.backend.run

    def spy(*args: Any) -> None:
        names.append(threading.current_thread().name)
        real(*args)

    fp32_engine.backend.run = spy
    try:
        for _ in range(2):
            final(fp32_engine.stream_chat("Hi", [], gen=replace(fp32_engine.settings.generation, max_new_tokens=2)))
    finally:
        fp32_engine.backend.run = real
    assert len(names) == 2 and names[0] == names[1] and names[0] != threading.current_thread().name
    assert fp32_engine.generating == 0


def test_worker_exception_surfaces_and_the_next_reply_works(fp32_engine: ChatEngine,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*args: Any) -> None:
        raise ValueError("kernel exploded")

    monkeypatch.setattr(fp32_engine.backend, "run", boom)
    with pytest.raises(GenerationError, match="kernel exploded"):
        final(fp32_engine.stream_chat("Hello", []))
    monkeypatch.undo()
    assert final(fp32_engine.stream_chat("Hello", [], gen=fp32_engine.request_options(max_new_tokens=3))).done


def test_out_of_memory_in_the_worker_becomes_a_clear_error(fp32_engine: ChatEngine,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    def oom(*args: Any) -> None:
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(fp32_engine.backend, "run", oom)
    with pytest.raises(OutOfMemoryError, match="ran out of memory"):
        final(fp32_engine.stream_chat("Hello", []))


def test_a_stalled_worker_cannot_hang_the_caller(fp32_engine: ChatEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    released = threading.Event()

    def stall(prepared: Any, streamer: Any, stop_event: threading.Event, cache: Any) -> None:
        stop_event.wait(30)  # never produces a token; honours stop like the real loops do
        released.set()

    monkeypatch.setattr(fp32_engine.backend, "run", stall)
    gen = fp32_engine.request_options(max_new_tokens=5)
    gen = type(gen)(**{**gen.__dict__, "stream_timeout_s": 1.0})
    t0 = time.perf_counter()
    with pytest.raises(GenerationError, match="No new token for 1 s"):
        final(fp32_engine.stream_chat("Hello", [], gen=gen))
    assert time.perf_counter() - t0 < 10 and released.wait(5)


@pytest.mark.parametrize("message", ["", "   ", "\x00\x1b"])
def test_empty_messages_are_refused(fp32_engine: ChatEngine, message: str) -> None:
    with pytest.raises(InputError, match="empty"):
        final(fp32_engine.stream_chat(message, []))


def test_message_longer_than_the_context_is_refused(fp32_engine: ChatEngine) -> None:
    with pytest.raises(ContextBudgetError, match="Shorten the message"):
        final(fp32_engine.stream_chat("1 " * 7999, []))  # under the character limit, over the token budget


def test_old_turns_are_dropped_to_fit_the_context_and_reported(fp32_engine: ChatEngine) -> None:
    long_turns = [Turn("tell me " * 1500, "sure " * 1500) for _ in range(3)]  # ~3k tokens each
    gen = fp32_engine.request_options(max_new_tokens=2)
    done = final(fp32_engine.stream_chat("And now?", long_turns, gen=gen, history_turns=10))
    assert done.stats.dropped_turns == 2 and done.stats.prompt_tokens <= 8192 - 2
    assert any("Left out the 2 oldest turns" in n for n in done.stats.notes)


@pytest.mark.parametrize(
    ("options", "named"),
    [({"max_new_tokens": 0}, "max_new_tokens"), ({"max_new_tokens": 10**6}, "max_new_tokens"),
     ({"temperature": -1.0}, "TEMPERATURE"), ({"top_p": 1.5}, "TOP_P"), ({"top_k": "many"}, "top_k"),
     ({"max_new_tokens": 2.5}, "max_new_tokens"), ({"bogus": 1}, "bogus")],
)
def test_out_of_range_options_are_refused(fp32_engine: ChatEngine, options: dict[str, Any], named: str) -> None:
    with pytest.raises(InputError, match=named):
        fp32_engine.request_options(**options)


def test_unicode_emoji_and_control_characters_get_a_reply(nf4_engine: ChatEngine) -> None:
    gen = nf4_engine.request_options(max_new_tokens=8)
    done = final(nf4_engine.stream_chat("Ça va? 你好 👋🏽 \x07 ok", [], gen=gen))
    assert done.done and done.stats.new_tokens > 0


def test_sampling_with_a_seed_is_reproducible(fp32_engine: ChatEngine) -> None:
    gen = fp32_engine.request_options(max_new_tokens=10, do_sample=True, temperature=0.9, seed=7)
    a = final(fp32_engine.stream_chat("Invent a word.", [], gen=gen)).token_ids
    b = final(fp32_engine.stream_chat("Invent a word.", [], gen=gen)).token_ids
    assert a == b and len(a) > 0


def test_stats_export_as_json(fp32_engine: ChatEngine, tmp_path: Path) -> None:
    import json

    from llm_core.metrics import export_json

    done = final(fp32_engine.stream_chat("Hi", [], gen=fp32_engine.request_options(max_new_tokens=3)))
    data = json.loads(export_json([done.stats], tmp_path / "stats.json").read_text())
    assert data[0]["new_tokens"] == done.stats.new_tokens and data[0]["ttft_s"] == done.stats.ttft_s


def test_the_model_panel_names_the_4bit_kernel_of_the_fast_path() -> None:
    """NF4 on the fast path: the decode-path reason says which 4-bit kernel runs (on CPU: bitsandbytes', the only
    one; on CUDA the start-up timing of each candidate is shown too)."""
    engine = ChatEngine.load(make_settings(DECODE_PATH="fast", PREFILL_GRAPH_TOKENS="128"))
    assert engine.backend.name == "fast"
    assert "4-bit kernel: bnb" in engine.report.decode_path_reason  # what the Model panel prints
    # PREFILL_GRAPH_TOKENS reaches the decoder: its padded prefill buffer covers the setting (graphs on CUDA only)
    decoder = engine.fast_decoder
    assert decoder.options.prefill_graph_tokens == 128 and decoder._pf_ids is not None
    assert decoder._pf_ids.numel() == 128 and decoder.describe()["prefill_graphs"] == []


def test_the_model_panel_lists_what_start_up_noted(fp32_engine: ChatEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """What start-up noted reaches the Model panel under "Start-up": the path's own notes (a re-sizing, a release)
    and its decoders' (a kernel switched off, a compile fall-back), each once, after warm-up and again after a
    re-plan; before, they reached only the benchmark records."""
    import llm_core.engine.chat as chat_module

    shared = fp32_engine.report
    # its own report, without notes earlier tests' warm-ups on the shared model left in it (warm-up replaces it)
    loaded = replace(fp32_engine.loaded, report=replace(shared, startup_notes=()))
    engine = ChatEngine(loaded, make_settings(QUANTIZATION="none", COMPUTE_DTYPE="float32", DECODE_PATH="plain"))
    assert engine.report.startup_notes == () and "**Start-up**" not in engine.report.as_markdown()
    slots = SimpleNamespace(slots=8, slot_tokens=1744,
                            notes=["batched CUDA graphs off (OutOfMemoryError)", "group prefill not warmed (X)"],
                            fast=SimpleNamespace(notes=["prefill eager: compiling it failed (X)",
                                                        "group prefill not warmed (X)"]))
    sized = "Sizing the 8 KV slots from measured memory: 1,824 -> 1,744 tokens each…"

    def warm(path: Any, *args: Any) -> Any:
        return replace(path, notes=(sized,), fast_scheduler=SimpleNamespace(runner=SimpleNamespace(decoder=slots)))

    monkeypatch.setattr(chat_module, "warm_decode_path", warm)
    engine.warmup()
    assert engine.report.startup_notes == (sized, "prefill eager: compiling it failed (X)",
                                           "group prefill not warmed (X)", "batched CUDA graphs off (OutOfMemoryError)")
    panel = engine.report.as_markdown()
    assert panel.index("**Start-up**") < panel.index(f"- {sized}") < panel.index("- batched CUDA graphs off")
    assert panel.count("group prefill not warmed") == 1
    engine._replan(lambda builder: builder._note("KV cache re-planned after a reply: 512 -> 448 tokens"))
    assert engine.report.startup_notes[:2] == (sized, "KV cache re-planned after a reply: 512 -> 448 tokens")
    assert fp32_engine.report is shared  # the shared model's report untouched


def test_prepare_tokenizes_each_message_list_once(fp32_engine: ChatEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Fitting the history counts tokens of the same message lists the prompt is then encoded from: each distinct
    list goes through the tokenizer once per request, and the prompt equals a fresh encoding."""
    tokenizer = fp32_engine.loaded.tokenizer
    original = tokenizer.apply_chat_template
    seen: list[tuple[tuple[str, str], ...]] = []

    def counting(messages: list[dict[str, str]], **kw: Any) -> Any:
        seen.append(tuple((m["role"], m["content"]) for m in messages))
        return original(messages, **kw)

    monkeypatch.setattr(tokenizer, "apply_chat_template", counting)
    gen = fp32_engine.settings.generation
    history = [Turn(f"question {i} " * 5, f"answer {i} " * 5) for i in range(5)]
    for turns in ([], history):
        seen.clear()
        message = f"a message never sent before {len(turns)}"
        prepared = fp32_engine.prepare(message, turns, gen=gen, history_turns=10, system_prompt="Be brief.")
        assert seen and len(seen) == len(set(seen)), seen  # no list tokenized twice
        fresh = original(build_messages("Be brief.", turns, message), add_generation_prompt=True,
                         return_dict=True, return_tensors="pt")
        assert torch.equal(prepared.input_ids.cpu(), fresh["input_ids"])
