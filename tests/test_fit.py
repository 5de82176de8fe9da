"""Will it fit? (llm_core.fit): weights and KV bytes from config.json alone, the decode path and the longest prompt
for 8/12/16/24 GiB cards, the CLI on the embedded model's config, and the app's panel."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest
import torch
from transformers import LlamaConfig

from llm_core.fit import estimate_weights_bytes, fit_config, load_config, main
from llm_core.loading import load_model
from llm_core.memory.budget import max_context_tokens
from llm_core.memory.model import GiB, ModelMemoryFacts, human_bytes, model_weights_bytes
from llm_core.memory.plan import resolve_prefill_chunk_tokens, resolve_prefill_graph_tokens, static_cache_plan
from tests.conftest import MODEL_CACHE, make_settings

LLAMA2_7B = LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                        num_key_value_heads=32, vocab_size=32000, max_position_embeddings=32768)
LLAMA3_8B = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                        num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072)


def test_nf4_weights_from_the_config_by_hand() -> None:
    """Llama-2-7B: 32 layers x (4 x 4096^2 + 3 x 4096 x 11008) linear weights at half a byte, one uint8 absmax per
    64 and one fp32 per 256 absmax (double quant); embeddings and lm_head in bf16; 65 norms."""
    linear = 32 * (4 * 4096**2 + 3 * 4096 * 11008)
    blocks = linear // 64
    want = linear // 2 + blocks + blocks // 256 * 4 + 2 * 32000 * 4096 * 2 + 65 * 4096 * 2
    assert estimate_weights_bytes(LLAMA2_7B, "nf4") == want == 3_865_591_808
    assert estimate_weights_bytes(LLAMA2_7B, "none") == (linear + 2 * 32000 * 4096 + 65 * 4096) * 2
    # int8: a byte per weight + an fp32 scale per output row (q, k, v, o, down: 4096 rows; gate, up: 11008)
    assert estimate_weights_bytes(LLAMA2_7B, "int8") == linear + 32 * (5 * 4096 + 2 * 11008) * 4 + (
        2 * 32000 * 4096 + 65 * 4096) * 2


@pytest.mark.parametrize("config,measured_gib", [(LLAMA2_7B, 3.61), (LLAMA3_8B, 5.35)])
def test_nf4_weights_estimate_is_within_1_percent_of_the_h200_measurement(config: LlamaConfig,
                                                                          measured_gib: float) -> None:
    """shared/reference/2026-11-30-cap-probe.jsonl: weights_gib as bitsandbytes held them (rounded to 0.01)."""
    assert abs(estimate_weights_bytes(config, "nf4") / GiB - measured_gib) <= 0.01 * measured_gib


def test_weights_estimate_matches_the_loaded_embedded_model() -> None:
    """The embedded SmolLM2-135M loaded in NF4 on CPU: the config-only estimate is within 3% of its tensors."""
    loaded = load_model(make_settings().model)
    measured = model_weights_bytes(loaded.model, loaded.device)
    estimate = estimate_weights_bytes(loaded.model.config, "nf4", str(loaded.compute_dtype).removeprefix("torch."))
    assert abs(estimate - measured) <= 0.03 * measured, (estimate, measured)


@pytest.mark.parametrize("card_gib", [8, 12, 16, 24])
@pytest.mark.parametrize("config,name", [(LLAMA2_7B, "llama-2-7b"), (LLAMA3_8B, "llama-3-8b")])
@pytest.mark.parametrize("kv_cache,per_token", [("bf16", {"llama-2-7b": 524_288, "llama-3-8b": 131_072}),
                                                ("int8", {"llama-2-7b": 270_336, "llama-3-8b": 67_584})])
def test_fit_report_for_each_card(card_gib: int, config: LlamaConfig, name: str, kv_cache: str,
                                  per_token: dict[str, int]) -> None:
    """Fast path (llama, nf4); KV bytes per token exact (bf16 rows, or int8 rows of 132 bytes); the longest prompt
    is exactly the static cache plan's for a budget of card - 512 MiB: at least the seed recipe's from 12 GiB up;
    where it is less (8 GiB, as the H200 card runs measured), the report says plain generate would hold more."""
    report = fit_config(config, card_gib * GiB, model=name, kv_cache=kv_cache)
    assert report.fits and report.decode_path == "fast"
    assert report.kv_bytes_per_token == per_token[name]
    facts = ModelMemoryFacts.from_config(config, estimate_weights_bytes(config, "nf4", int8_tables=True), "bfloat16")
    fused, budget = replace(facts, fast_prefill=True), card_gib * GiB - 512 * 2**20
    chunk = resolve_prefill_chunk_tokens(None, fused, budget, max_new_tokens=256, kv_cache=kv_cache)
    assert report.prefill_chunk_tokens == chunk in (1024, 2048)
    graphs = resolve_prefill_graph_tokens(None, fused, budget, max_new_tokens=256, prefill_chunk_tokens=chunk,
                                          kv_cache=kv_cache)  # auto: smaller graphs where memory bounds the cache
    plan = static_cache_plan(fused, budget, max_new_tokens=256, prefill_chunk_tokens=chunk, kv_cache=kv_cache,
                             prefill_graph_tokens=graphs)
    assert report.static_cache_tokens == plan.tokens and report.longest_prompt_tokens == plan.max_prompt_tokens
    seed_facts = replace(facts, weights_bytes=estimate_weights_bytes(config, "nf4"))  # bf16 tables, as loaded
    assert report.seed_prompt_tokens == max_context_tokens(seed_facts, card_gib * GiB, 256)
    if card_gib >= 12:
        assert report.longest_prompt_tokens >= report.seed_prompt_tokens
        assert not report.tradeoff_note
    if report.longest_prompt_tokens < report.seed_prompt_tokens:
        assert "DECODE_PATH=plain" in report.tradeoff_note and "DECODE_PATH=plain" in report.summary()
        assert f"{report.seed_prompt_tokens:,}" in report.to_markdown()


def test_weights_that_do_not_fit_are_said_before_loading() -> None:
    report = fit_config(LLAMA3_8B, 4 * GiB, model="llama-3-8b")
    assert not report.fits and report.decode_path == "none" and report.longest_prompt_tokens == 0
    assert "the weights alone need 4.33 GiB of the 3.50 GiB budget" in report.summary()  # int8 tables
    assert "tokens/s" in report.offload_note


def test_plain_path_for_quantizations_the_fast_path_does_not_take() -> None:
    """fp4: plain generate; on 8 GiB memory bounds the context, so auto prefills in 1,024-token chunks there too
    (a smaller peak: more context than with 2,048, which the same card gives when set)."""
    report = fit_config(LLAMA2_7B, 8 * GiB, quantization="fp4")
    assert report.decode_path == "plain" and "fp4" in report.decode_path_reason
    facts = ModelMemoryFacts.from_config(LLAMA2_7B, estimate_weights_bytes(LLAMA2_7B, "fp4"), "bfloat16",
                                         weight_quantization="fp4")
    assert report.prefill_chunk_tokens == 1024
    assert report.longest_prompt_tokens == max_context_tokens(facts, 8 * GiB - 512 * 2**20, 256, "bf16",
                                                              prefill_chunk_tokens=1024)
    set_2048 = fit_config(LLAMA2_7B, 8 * GiB, quantization="fp4", prefill_chunk_tokens=2048)
    assert set_2048.prefill_chunk_tokens == 2048 and set_2048.longest_prompt_tokens < report.longest_prompt_tokens


def test_fit_cli_on_the_embedded_models_config(capsys: pytest.CaptureFixture[str]) -> None:
    """python -m llm_core.fit --gpu 8GiB with no model: the embedded model's config.json (no weights loaded)."""
    assert main(["--gpu", "8GiB", "--cache-dir", str(MODEL_CACHE), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    config = load_config("", cache_dir=str(MODEL_CACHE))
    assert report["fits"] and report["decode_path"] == "fast"
    assert report["weights_bytes"] == estimate_weights_bytes(config, "nf4", int8_tables=True)
    assert report["kv_bytes_per_token"] == 2 * 30 * 3 * 64 * 2 == 23_040
    assert report["static_cache_tokens"] == config.max_position_embeddings  # a 135M model fills no 8 GiB card
    assert main(["--gpu", "banana", "--cache-dir", str(MODEL_CACHE)]) == 2
    assert "not a size" in capsys.readouterr().err


def test_app_fit_panel_answers_in_markdown() -> None:
    from ui.fit import fit_answer

    text = fit_answer(None, 8, "nf4", "int8", 256, cache_dir=str(MODEL_CACHE))
    assert "Fast-path KV cache" in text and "Longest prompt" in text and torch is not None


@pytest.mark.parametrize(("card", "new_tokens", "says"), [
    ("abc", 256, "Card size 'abc' is not a size"),
    ("0", 256, "Card size must be more than 0"),
    ("-8", 256, "Card size must be more than 0"),
    (8, -5, "Max new tokens must be from 1"),
    (8, 0, "Max new tokens must be from 1"),
    (8, 2.5, "Max new tokens must be a whole number"),
    (8, None, "Max new tokens must be a whole number"),
    (8, 10**7, "Max new tokens must be from 1 to 8,191"),
])
def test_fit_inputs_are_refused_with_what_is_wrong(card: object, new_tokens: object, says: str) -> None:
    from llm_core.errors import InputError
    from llm_core.fit import card_bytes_of

    with pytest.raises(InputError, match=re.escape(says)):
        fit_config(load_config("", cache_dir=str(MODEL_CACHE)), card_bytes_of(card), max_new_tokens=new_tokens)


def test_fit_card_sizes_in_gib_or_with_a_unit() -> None:
    from llm_core.fit import card_bytes_of

    assert card_bytes_of(8) == card_bytes_of("8") == card_bytes_of("8GiB") == 8 * GiB
    assert card_bytes_of("12.5") == int(12.5 * GiB)


def test_offload_note_never_moves_more_bytes_than_the_model_has() -> None:
    """A 135M model on a card smaller than its weights: the bytes said to cross PCIe are at most its weights."""
    from llm_core.fit import offload_bytes

    config = load_config("", cache_dir=str(MODEL_CACHE))
    report = fit_config(config, 64 * 2**20, quantization="none")
    assert not report.fits and "cross PCIe" in report.offload_note
    assert offload_bytes(report.weights_bytes, report.budget_bytes) <= report.weights_bytes
    assert human_bytes(report.weights_bytes) in report.offload_note
    assert offload_bytes(10 * GiB, 8 * GiB) == 3 * GiB  # a big model: what leaves ~1 GiB of the budget free


def test_the_engine_says_weights_do_not_fit_before_loading_anything(monkeypatch: pytest.MonkeyPatch) -> None:
    """VRAM_BUDGET below the weights: ChatEngine.load refuses from config.json alone, never calling the loader;
    with a budget that holds them it goes on to load."""
    from llm_core.engine import chat
    from llm_core.errors import ModelLoadError

    class Loaded(Exception):
        pass

    def loader(*args: object, **kwargs: object) -> None:
        raise Loaded

    monkeypatch.setattr(chat, "load_model", loader)
    config = load_config("", cache_dir=str(MODEL_CACHE))
    weights = estimate_weights_bytes(config, "nf4")
    with pytest.raises(ModelLoadError, match=r"does not fit: its weights alone need about \d+ MiB"):
        chat.ChatEngine.load(make_settings(VRAM_BUDGET=str(weights // 2)))
    with pytest.raises(Loaded):
        chat.ChatEngine.load(make_settings(VRAM_BUDGET=str(weights * 4)))
    with pytest.raises(Loaded):  # offload places the weights itself: no refusal
        chat.ChatEngine.load(make_settings(VRAM_BUDGET=str(weights // 2), MAX_MEMORY="0=1GiB,cpu=8GiB"))
