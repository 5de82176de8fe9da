"""Memory guard: KV bytes from configs, the peak predictor, the reply planner, the KV-cache modes, OOM recovery.

CPU only. The real embedded model (SmolLM2-135M-Instruct, NF4, bf16 compute) where a model is needed; configs
without weights for Llama-2-7B / Llama-3-8B; a tiny random llama for the allocation trace.
"""

from __future__ import annotations

import os
import weakref
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, StoppingCriteria

from llm_core.config import Settings
from llm_core.errors import ContextBudgetError, SettingsError
from llm_core.loading import load_model
from llm_core.memory.budget import (
    MemoryBudget,
    default_budget_bytes,
    max_context_tokens,
    plan_reply,
    refit_reserve,
    require_fit,
)
from llm_core.memory.device import OOMInjector, PeakMeter, free_memory, is_oom_error
from llm_core.memory.kv_cache import cache_bytes, cache_kwarg, make_cache, prefill_in_chunks, returned_cache
from llm_core.memory.model import (
    GiB,
    MiB,
    ModelMemoryFacts,
    QuantizedKVSpec,
    forward_activation_bytes,
    kv_bytes,
    kv_bytes_per_token,
    predict_peak_bytes,
    resident_extra_bytes,
)
from llm_core.types import LoadedModel

REPO = Path(__file__).resolve().parent.parent
MODEL_CACHE = Path(os.environ.get("LLM_CORE_TEST_CACHE", REPO / ".cache" / "test-models"))

LLAMA2_7B: dict[str, Any] = dict(
    hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=32, vocab_size=32000, max_position_embeddings=131072)
LLAMA3_8B: dict[str, Any] = dict(
    hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072)

# Held prompts for the quantized-KV closeness test: long enough (>= 100 tokens) that most of the prompt is
# quantized (groups of 64 tokens), not left in the full-precision residual.
HELD_PROMPTS = (
    "The water cycle describes how water moves between the oceans, the air and the land. The sun heats the surface"
    " of lakes and seas, and some of the water evaporates into vapour. As the vapour rises it cools and condenses "
    "into tiny droplets that form clouds. When the droplets grow heavy they fall as rain or snow, which feeds rivers"
    " and soaks into the ground. Summarise this in two sentences for a ten-year-old.",
    "A small bakery sells bread, croissants and cakes. On Monday it sold 40 loaves of bread, 25 croissants and 6 "
    "cakes. On Tuesday it sold 35 loaves, 30 croissants and 9 cakes. Bread costs 3 dollars, a croissant 2 dollars "
    "and a cake 15 dollars. The owner wants to know which day earned more and by how much, and which product "
    "brought in the most money over both days. Explain your reasoning step by step.",
)


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    torch.manual_seed(0)
    settings = Settings.from_env(environ={"CACHE_DIR": str(MODEL_CACHE), "DECODE_PATH": "plain"}, env_file=None)
    return load_model(settings.model)


def chat_ids(loaded: LoadedModel, text: str) -> torch.Tensor:
    messages = [{"role": "user", "content": text}]
    out = loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                               return_dict=True)
    return out["input_ids"]


def greedy(loaded: LoadedModel, ids: torch.Tensor, new: int, cache: Any, **kw: Any) -> Any:
    model = loaded.model
    return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                          min_new_tokens=new, do_sample=False, return_dict_in_generate=True,
                          pad_token_id=loaded.tokenizer.eos_token_id, **{cache_kwarg(model): cache}, **kw)


# --- KV bytes: hand computations -------------------------------------------------------------------------------


def test_kv_bytes_per_token_llama2_7b_is_half_a_mib_in_bf16() -> None:
    # 2 (K, V) x 32 layers x 32 KV heads x 128 head_dim x 2 bytes
    assert kv_bytes_per_token(LlamaConfig(**LLAMA2_7B), torch.bfloat16) == 2 * 32 * 32 * 128 * 2 == 524288
    assert kv_bytes_per_token(LlamaConfig(**LLAMA2_7B), "float32") == 1048576


def test_kv_bytes_per_token_llama3_8b_counts_kv_heads_not_query_heads() -> None:
    # GQA: 8 KV heads serve 32 query heads: 2 x 32 x 8 x 128 x 2
    assert kv_bytes_per_token(LlamaConfig(**LLAMA3_8B), torch.bfloat16) == 2 * 32 * 8 * 128 * 2 == 131072


def test_kv_bytes_per_token_embedded_model_in_its_compute_dtype(loaded: LoadedModel) -> None:
    config = loaded.model.config  # SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64; computes in bfloat16
    assert loaded.compute_dtype == torch.bfloat16
    assert kv_bytes_per_token(config, loaded.compute_dtype) == 2 * 30 * 3 * 64 * 2 == 23040


def test_kv_bytes_per_token_quantized_is_nbits_plus_scale_and_zero_per_group() -> None:
    # 4 bits + (bf16 scale + bf16 zero) / 64 elements = 0.5625 bytes per element
    elements = 2 * 32 * 32 * 128
    assert kv_bytes_per_token(LlamaConfig(**LLAMA2_7B), torch.bfloat16, "int4") == elements * 9 // 16 == 147456
    spec8 = QuantizedKVSpec(nbits=8, group_size=32)
    assert kv_bytes_per_token(LlamaConfig(**LLAMA2_7B), torch.bfloat16, "int8", spec8) == elements * 9 // 8


def test_kv_bytes_sliding_window_layers_hold_at_most_a_window() -> None:
    config = MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=256, sliding_window=16)
    per_token = 2 * 2 * 2 * 16 * 4  # K+V x layers x kv heads x head_dim x fp32
    assert kv_bytes(config, 10, torch.float32) == 10 * per_token
    assert kv_bytes(config, 1000, torch.float32) == 16 * per_token
    # ...and a real DynamicCache after a generate holds exactly that
    torch.manual_seed(0)
    model = MistralForCausalLM(config).eval()
    ids = torch.randint(0, 256, (1, 30))
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, min_new_tokens=5,
                         do_sample=False, return_dict_in_generate=True, pad_token_id=0)
    assert cache_bytes(returned_cache(out)) == kv_bytes(config, 34, torch.float32) == 16 * per_token


def test_kv_bytes_mixed_layer_types_counts_each_layer() -> None:
    from transformers import Qwen2Config

    config = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256, use_sliding_window=True, sliding_window=8,
                         max_window_layers=2)
    windows = [w for w in (config.layer_types or [])]
    sliding = sum(kind == "sliding_attention" for kind in windows)
    full = len(windows) - sliding
    per_layer_token = 2 * 2 * 16 * 2
    assert kv_bytes(config, 100, torch.bfloat16) == (full * 100 + sliding * 8) * per_layer_token


# --- caches measured after real replies --------------------------------------------------------------------------


def test_dynamic_cache_after_generate_holds_exactly_prompt_plus_new_minus_one_tokens(loaded: LoadedModel) -> None:
    ids = chat_ids(loaded, "Name three colours of the rainbow.")
    prompt, new = ids.shape[1], 6
    plain = greedy(loaded, ids, new, make_cache("bf16", loaded.model))
    cache = returned_cache(plain)
    # the last generated token is returned but never fed back, so it has no K/V yet
    assert cache.get_seq_length() == prompt + new - 1
    assert cache_bytes(cache) == kv_bytes(loaded.model.config, prompt + new - 1, loaded.compute_dtype)

    chunked_cache = make_cache("bf16", loaded.model)
    assert prefill_in_chunks(loaded.model, ids, chunked_cache, chunk_tokens=13) == prompt - 1
    chunked = greedy(loaded, ids, new, chunked_cache)
    assert torch.equal(chunked.sequences, plain.sequences)  # chunked prefill changes memory, not the reply
    assert cache_bytes(returned_cache(chunked)) == cache_bytes(cache)


def test_quantized_cache_holds_exactly_its_predicted_bytes(loaded: LoadedModel) -> None:
    ids = chat_ids(loaded, HELD_PROMPTS[1])
    prompt, new = ids.shape[1], 6
    spec = QuantizedKVSpec()
    cache = make_cache("int8", loaded.model, capacity_tokens=prompt + new, quant=spec)
    out = greedy(loaded, ids, new, cache)
    held = returned_cache(out)
    assert held.get_seq_length() == prompt + new - 1
    config, dtype = loaded.model.config, loaded.compute_dtype
    kv_dim = config.num_key_value_heads * config.head_dim
    scratch = 2 * (prompt + new) * kv_dim * dtype.itemsize  # one layer's K and V, dequantized (shared)
    assert cache_bytes(held) == kv_bytes(config, prompt + new, dtype, "int8", spec) + scratch
    # the 64-token full-precision residual dominates this short reply; at length the 4-bit storage is 3.5x smaller
    assert kv_bytes(config, 8192, dtype, "int8", spec) < kv_bytes(config, 8192, dtype) / 3.4


@torch.no_grad()
def teacher_forced_logits(loaded: LoadedModel, ids: torch.Tensor, steps: int, cache: Any,
                          forced: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of `steps` positions; each step feeds `forced` tokens (or the argmax when None)."""
    model, name = loaded.model, cache_kwarg(loaded.model)
    out = model(input_ids=ids, use_cache=True, logits_to_keep=1, **{name: cache})
    logits, tokens = [out.logits[0, -1].float()], []
    for i in range(steps - 1):
        token = logits[-1].argmax() if forced is None else forced[i]
        tokens.append(token)
        out = model(input_ids=token.view(1, 1), use_cache=True, **{name: cache})
        logits.append(out.logits[0, -1].float())
    tokens.append(logits[-1].argmax())
    return torch.stack(logits), torch.stack(tokens)


def test_quantized_kv_replies_stay_close_to_the_dynamic_cache(loaded: LoadedModel) -> None:
    """4-bit KV (group 64) vs bf16 KV on held prompts, teacher-forced on the bf16 greedy reply. Measured on these
    prompts: greedy-token agreement 0.81-0.94 (this 135M model has many near-ties), mean KL 0.007-0.014 nats,
    max KL <= 0.036. Asserted with margin: agreement >= 0.70 pooled, mean KL <= 0.03, max KL <= 0.10."""
    steps, agree, kls = 16, 0, []
    for text in HELD_PROMPTS:
        ids = chat_ids(loaded, text)
        ref_logits, ref_tokens = teacher_forced_logits(loaded, ids, steps, make_cache("bf16", loaded.model))
        cache = make_cache("int8", loaded.model, capacity_tokens=ids.shape[1] + steps)
        logits, _ = teacher_forced_logits(loaded, ids, steps, cache, forced=ref_tokens)
        assert cache.layers[0].n_quantized >= 64  # the prompt really went through quantization
        agree += int((logits.argmax(-1) == ref_tokens).sum())
        p_ref, p_q = torch.log_softmax(ref_logits, -1), torch.log_softmax(logits, -1)
        kls.append((p_ref.exp() * (p_ref - p_q)).sum(-1))
    kl = torch.cat(kls)
    assert agree / (steps * len(HELD_PROMPTS)) >= 0.70
    assert kl.mean().item() <= 0.03
    assert kl.max().item() <= 0.10


@pytest.mark.parametrize("nbits", [2, 4, 8])
def test_quantized_layer_round_trip_error_shrinks_with_bits(nbits: int) -> None:
    from llm_core.memory.kv_cache import GroupQuantizedLayer, _Scratch, pack_codes, unpack_codes

    codes = torch.randint(0, 2**nbits, (1, 2, 5, 64), dtype=torch.uint8)
    assert torch.equal(unpack_codes(pack_codes(codes, nbits), nbits), codes)
    torch.manual_seed(0)
    keys, values = torch.randn(2, 1, 2, 100, 64, dtype=torch.bfloat16)
    layer = GroupQuantizedLayer(QuantizedKVSpec(nbits, 32), 128, _Scratch())
    layer.update(keys[:, :, :70], values[:, :, :70])  # a prefill: 64 quantized + 6 residual
    for t in range(70, 100):  # decode steps: a group completes at 96
        out_k, out_v = layer.update(keys[:, :, t:t + 1], values[:, :, t:t + 1])
    assert (layer.n_quantized, layer.n_residual, layer.get_seq_length()) == (96, 4, 100)
    assert torch.equal(out_k[:, :, 96:], keys[:, :, 96:])  # the residual is exact
    # RMS error of uniform quantization is step / sqrt(12), step = range / (2**nbits - 1), range ~ 4 sigma over a
    # group of 32 Gaussian samples: 0.385 / 0.077 / 0.0045 (+ bf16 rounding); measured 0.384 / 0.076 / 0.0060
    bound = {2: 0.42, 4: 0.085, 8: 0.008}[nbits]
    for out, ref in ((out_k, keys), (out_v, values)):
        assert ((out.float() - ref.float()).norm() / ref.float().norm()).item() < bound


def test_make_cache_rejects_unknown_modes_and_missing_backends(loaded: LoadedModel) -> None:
    with pytest.raises(SettingsError, match="KV_CACHE"):
        make_cache("paged", loaded.model)
    with pytest.raises(SettingsError, match="CUDA"):
        make_cache("offload", loaded.model)  # the embedded model runs on CPU here
    with pytest.raises(SettingsError, match="backend"):
        make_cache("int8", loaded.model, backend="nope")
    import importlib.util

    if importlib.util.find_spec("hqq") is None:
        with pytest.raises(SettingsError, match="pip install hqq"):
            make_cache("int8", loaded.model, backend="hqq")


# --- the activation model against a real allocation trace -------------------------------------------------------


class LiveTensorBytes(TorchDispatchMode):
    """Peak bytes of tensor storages created inside the mode and still alive (CPU's analogue of
    torch.cuda.max_memory_allocated, without the allocator's rounding)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self.seen: set[int] = set()

    def _free(self, key: int, nbytes: int) -> None:
        self.live -= nbytes
        self.seen.discard(key)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key, nbytes = storage.data_ptr(), storage.nbytes()
                if nbytes and key not in self.seen:
                    self.seen.add(key)
                    self.live += nbytes
                    weakref.finalize(storage, self._free, key, nbytes)
                    self.peak = max(self.peak, self.live)
        return out


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_prefill_activation_formula_matches_a_tensor_allocation_trace(kv_heads: int) -> None:
    """Same code path as the GPU (transformers Llama, SDPA, DynamicCache, logits for the last position), bf16
    weights so no bitsandbytes temporary: the traced peak of one prefill pass equals KV + activation(q) (to the
    byte on transformers 5.24; 5.17 keeps 64 bytes more). Under inference_mode: with only no_grad, CPU bf16
    linears also copy their weight, which CUDA does not."""
    config = LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=kv_heads, vocab_size=512, max_position_embeddings=4096)
    torch.manual_seed(0)
    model = cast(Any, LlamaForCausalLM(config)).to(torch.bfloat16).eval()
    prompt = 1024
    ids = torch.randint(0, 512, (1, prompt))
    with torch.inference_mode(), LiveTensorBytes() as trace:
        cache = make_cache("bf16", model)
        model(input_ids=ids, use_cache=True, logits_to_keep=1, **{cache_kwarg(model): cache})
    facts = ModelMemoryFacts.from_config(config, 0, torch.bfloat16, weight_quantization="none", device_type="cpu")
    predicted = kv_bytes(config, prompt, torch.bfloat16) + forward_activation_bytes(facts, prompt)
    assert abs(trace.peak - predicted) <= 1024


# --- calibration against the recorded H200 peaks -----------------------------------------------------------------

# (model shape, weights GiB as recorded, cuBLAS workspace still to come?, prompt, new tokens, peak GiB recorded)
# baseline.jsonl measured weights after a warm-up reply (workspace already included); cap-probe.jsonl measured
# them right after loading, and ran Llama-2 first in the process (its first matmul adds the 32 MiB workspace).
H200_PEAKS = [
    ("llama-2-7b", 3.64, False, 512, 128, 4.02),
    ("llama-2-7b", 3.64, False, 4096, 128, 6.03),
    ("llama-2-7b", 3.64, False, 16384, 64, 13.16),
    ("llama-2-7b", 3.61, True, 1024, 128, 4.30),
    ("llama-2-7b", 3.61, True, 2048, 128, 4.88),
    ("llama-2-7b", 3.61, True, 4096, 128, 6.03),
    ("llama-3-8b", 5.35, False, 1024, 128, 5.67),
    ("llama-3-8b", 5.35, False, 2048, 128, 5.89),
    ("llama-3-8b", 5.35, False, 4096, 128, 6.31),
    ("llama-3-8b", 5.35, False, 6144, 128, 6.78),
    ("llama-3-8b", 5.35, False, 8192, 128, 7.26),
]


def h200_facts(model: str, weights_gib: float, workspace_to_come: bool) -> ModelMemoryFacts:
    shape = LLAMA2_7B if model == "llama-2-7b" else LLAMA3_8B
    return ModelMemoryFacts.from_config(LlamaConfig(**shape), int(weights_gib * GiB), torch.bfloat16,
                                        weight_quantization="nf4", device_type="cuda",
                                        workspace_bytes=32 * MiB if workspace_to_come else 0)


@pytest.mark.parametrize(("model", "weights_gib", "workspace", "prompt", "new", "peak_gib"), H200_PEAKS)
def test_predictor_reproduces_the_recorded_h200_peaks(model: str, weights_gib: float, workspace: bool,
                                                      prompt: int, new: int, peak_gib: float) -> None:
    """Calibration test on recorded numbers (shared/reference/2026-11-30-{baseline,cap-probe}.jsonl: NF4 + double
    quant, bf16, SDPA, plain generate, peak = torch.cuda.max_memory_allocated). The issue's goal is 5% or 128 MiB;
    the model lands within 10 MiB of every point (the recordings are rounded to 0.01 GiB), asserted at 24 MiB."""
    predicted = predict_peak_bytes(h200_facts(model, weights_gib, workspace), prompt, new, "bf16")
    error = predicted.peak_allocated_bytes - peak_gib * GiB
    assert abs(error) <= 24 * MiB
    assert abs(error) <= max(0.05 * peak_gib * GiB, 128 * MiB)


@pytest.mark.parametrize(("model", "weights_gib", "workspace", "fits", "fails"),
                         [("llama-2-7b", 3.61, True, 4096, 6144), ("llama-3-8b", 5.35, False, 8192, 10240)])
def test_default_reserve_agrees_with_the_recorded_oom_boundary_under_8_gib(
        model: str, weights_gib: float, workspace: bool, fits: int, fails: int) -> None:
    """cap-probe.jsonl: under an 8 GiB cap the seed recipe ran `fits` tokens (+128) and died at `fails`."""
    facts = h200_facts(model, weights_gib, workspace)
    assert predict_peak_bytes(facts, fits, 128).total_bytes <= 8 * GiB
    assert predict_peak_bytes(facts, fails, 128).total_bytes > 8 * GiB


def test_chunked_prefill_flattens_the_predicted_peak() -> None:
    facts = h200_facts("llama-2-7b", 3.61, True)
    single = predict_peak_bytes(facts, 16384, 128)
    chunked = predict_peak_bytes(facts, 16384, 128, prefill_chunk_tokens=1024)
    assert single.phase == "prefill" and single.prefill_activation_bytes > 1.4 * GiB
    assert chunked.prefill_activation_bytes < 0.5 * GiB
    assert chunked.total_bytes < single.total_bytes


# --- budget and plan ---------------------------------------------------------------------------------------------


@pytest.fixture
def facts_7b() -> ModelMemoryFacts:
    return h200_facts("llama-2-7b", 3.61, True)


def test_plan_keeps_a_reply_that_fits_unchanged(facts_7b: ModelMemoryFacts) -> None:
    plan = plan_reply(facts_7b, 8 * GiB, 1000, 128)
    assert plan.fits and (plan.allowed_prompt_tokens, plan.allowed_new_tokens) == (1000, 128)
    assert plan.message == "" and not plan.trims_prompt and not plan.lowers_new_tokens
    assert require_fit(plan) is plan


def test_plan_drops_old_turns_before_lowering_max_new_tokens(facts_7b: ModelMemoryFacts) -> None:
    budget = 6 * GiB
    plan = plan_reply(facts_7b, budget, 8000, 256, min_prompt_tokens=300)
    assert plan.fits and plan.trims_prompt and not plan.lowers_new_tokens
    assert plan.allowed_prompt_tokens == max_context_tokens(facts_7b, budget, 256)
    assert plan.predicted.total_bytes <= budget
    assert predict_peak_bytes(facts_7b, plan.allowed_prompt_tokens + 1, 256).total_bytes > budget
    assert "dropped" in plan.message and "8,000" in plan.message


def test_plan_lowers_max_new_tokens_when_the_newest_message_alone_is_too_big(facts_7b: ModelMemoryFacts) -> None:
    budget = 6 * GiB
    most = max_context_tokens(facts_7b, budget, 1024)
    plan = plan_reply(facts_7b, budget, most + 500, 1024, min_prompt_tokens=most + 200)
    assert plan.fits and plan.lowers_new_tokens
    assert plan.allowed_prompt_tokens == most + 200
    assert 1 <= plan.allowed_new_tokens < 1024
    assert plan.predicted.total_bytes <= budget
    assert predict_peak_bytes(facts_7b, most + 200, plan.allowed_new_tokens + 1).total_bytes > budget
    assert "max_new_tokens was lowered from 1,024" in plan.message


def test_plan_refuses_a_message_that_cannot_fit_and_require_fit_raises(facts_7b: ModelMemoryFacts) -> None:
    budget = 5 * GiB
    plan = plan_reply(facts_7b, budget, 20000, 128, min_prompt_tokens=20000)
    assert not plan.fits and plan.allowed_prompt_tokens == 0
    with pytest.raises(ContextBudgetError, match="does not fit in memory"):
        require_fit(plan)


def test_max_context_tokens_is_monotonic_in_the_budget_and_maximal(facts_7b: ModelMemoryFacts) -> None:
    previous = 0
    for budget_gib in [3.5, 4, 4.5, 5, 6, 7, 8, 12, 24, 80]:
        budget = int(budget_gib * GiB)
        most = max_context_tokens(facts_7b, budget, 128)
        assert most >= previous
        previous = most
        if 0 < most < facts_7b.context_length - 128:
            assert predict_peak_bytes(facts_7b, most, 128).total_bytes <= budget
            assert predict_peak_bytes(facts_7b, most + 1, 128).total_bytes > budget
    assert max_context_tokens(facts_7b, 1 * GiB, 128) == 0  # the weights alone do not fit


def test_int4_kv_fits_at_least_two_and_a_half_times_the_context(facts_7b: ModelMemoryFacts) -> None:
    budget = 8 * GiB - 256 * MiB
    dynamic = max_context_tokens(facts_7b, budget, 128)
    quantized = max_context_tokens(facts_7b, budget, 128, "int4", prefill_chunk_tokens=2048)
    assert quantized >= 2.5 * dynamic


def test_plan_on_the_embedded_model_trims_under_an_artificial_budget(loaded: LoadedModel) -> None:
    facts = ModelMemoryFacts.from_loaded(loaded)
    assert facts.weights_bytes >= loaded.report.weights_bytes  # + the bitsandbytes absmax/code states
    budget = predict_peak_bytes(facts, 600, 64).total_bytes  # room for exactly 600 prompt tokens
    plan = plan_reply(facts, budget, 2000, 64, min_prompt_tokens=100)
    assert plan.fits and plan.allowed_prompt_tokens == 600 and plan.allowed_new_tokens == 64


def test_refit_reserve_learns_the_uncovered_bytes_as_a_fixed_term(facts_7b: ModelMemoryFacts) -> None:
    """A reply that reserved 2 GiB above its predicted peak: the next plan of the same reply covers it (with 10%
    headroom), and a short reply's plan grows by the same bytes, not by a multiple of its small activations
    (issue 17: learned as a fraction from the 2-token warm-up reply it refused every 2k-token message)."""
    pred = predict_peak_bytes(facts_7b, 4096, 128)
    higher = refit_reserve(facts_7b, pred, pred.peak_allocated_bytes + 2 * GiB)
    assert higher.reserve_fraction == facts_7b.reserve_fraction
    uncovered = pred.peak_allocated_bytes + 2 * GiB - pred.total_bytes
    assert higher.reserve_fixed_bytes == facts_7b.reserve_fixed_bytes + int(1.1 * uncovered)
    assert predict_peak_bytes(higher, 4096, 128).total_bytes >= pred.peak_allocated_bytes + 2 * GiB
    short_before, short_after = predict_peak_bytes(facts_7b, 16, 2), predict_peak_bytes(higher, 16, 2)
    assert short_after.total_bytes - short_before.total_bytes == int(1.1 * uncovered)
    assert refit_reserve(facts_7b, pred, pred.peak_allocated_bytes) == facts_7b
    assert refit_reserve(facts_7b, pred, pred.total_bytes) == facts_7b  # covered: nothing to learn


def test_budget_from_the_cpu_is_positive_and_validated() -> None:
    import psutil

    budget = default_budget_bytes("cpu", margin_bytes=0)
    assert 0 < budget <= psutil.virtual_memory().total + psutil.Process().memory_info().rss
    assert MemoryBudget.from_device("cpu").budget_bytes < budget
    with pytest.raises(SettingsError):
        MemoryBudget(0)


@pytest.mark.parametrize("high_water_mark", [True, False])
def test_peak_meter_on_cpu_sees_a_temporary_allocation(high_water_mark: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Exact (the kernel's RSS high-water mark, reset at start) and, where that reset is refused, sampled."""
    import mmap
    import time

    from llm_core.memory import device as memory

    if not high_water_mark:
        monkeypatch.setattr(memory, "reset_rss_high_water_mark", lambda: False)
    elif not memory.reset_rss_high_water_mark():
        pytest.skip("this kernel does not let a process reset its RSS high-water mark")
    with PeakMeter("cpu", interval_s=0.001) as meter:
        # Fresh anonymous pages, all touched: a tensor could reuse heap pages that are already resident.
        block = mmap.mmap(-1, 64 * MiB)
        block.write(b"\x01" * (64 * MiB))
        time.sleep(0.05)
        block.close()
    assert meter.result is not None
    assert meter.result.delta_bytes >= 48 * MiB
    assert meter.result.reply_fields() == {"peak_rss_bytes": meter.result.peak_allocated_bytes}


# --- OOM -------------------------------------------------------------------------------------------------------


def test_is_oom_error_recognises_the_allocators_errors() -> None:
    assert is_oom_error(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert is_oom_error(MemoryError())
    assert is_oom_error(RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory"))
    assert is_oom_error(RuntimeError("CUDA error: out of memory"))
    wrapped = RuntimeError("generation failed")
    wrapped.__cause__ = torch.OutOfMemoryError("CUDA out of memory")
    assert is_oom_error(wrapped)
    assert not is_oom_error(ValueError("out of range"))
    assert not is_oom_error(RuntimeError("shape mismatch"))


class _FaultAtDecode(StoppingCriteria):
    """Calls the injector after every generated token: the 'decode' point of a reply."""

    def __init__(self, faults: OOMInjector) -> None:
        self.faults = faults

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs: Any) -> torch.BoolTensor:
        self.faults.check("decode")
        return cast(torch.BoolTensor, torch.zeros(input_ids.shape[0], dtype=torch.bool))


def test_injected_oom_is_recognised_freed_and_the_next_reply_works(loaded: LoadedModel) -> None:
    from transformers import StoppingCriteriaList

    ids = chat_ids(loaded, "Say hello.")
    faults = OOMInjector()
    stop = StoppingCriteriaList([_FaultAtDecode(faults)])
    expected = greedy(loaded, ids, 3, make_cache("bf16", loaded.model), stopping_criteria=stop).sequences

    faults.arm("decode")
    with pytest.raises(torch.OutOfMemoryError) as caught:
        greedy(loaded, ids, 3, make_cache("bf16", loaded.model), stopping_criteria=stop)
    assert is_oom_error(caught.value) and faults.fired == ["decode"]
    free_memory(loaded.device)

    again = greedy(loaded, ids, 3, make_cache("bf16", loaded.model), stopping_criteria=stop).sequences
    assert torch.equal(again, expected)  # disarmed after firing once: the next reply is the same reply


def test_injector_scoped_arming_and_points() -> None:
    faults = OOMInjector()
    faults.check("prefill")  # unarmed: nothing happens
    with faults.armed_for("prefill", times=2):
        for _ in range(2):
            with pytest.raises(torch.OutOfMemoryError, match="injected at 'prefill'"):
                faults.check("prefill")
        faults.check("prefill")  # fired twice: spent
        faults.check("decode")
    assert faults.armed == {} and faults.fired == ["prefill", "prefill"]


def test_fast_path_prediction_counts_its_whole_static_cache_whatever_the_reply_length() -> None:
    """The fast path allocates its KV cache once for static_kv_tokens; a reply's predicted KV is that block (the
    exact bytes FastDecoder allocates), not a cache growing to prompt + new tokens."""
    from llm_core.memory.model import kv_cache_exact_bytes

    config = LlamaConfig(**LLAMA2_7B)
    growing = ModelMemoryFacts.from_config(config, 4 * GiB, torch.bfloat16, weight_quantization="nf4")
    static = replace(growing, static_kv_tokens=4096)
    block = kv_cache_exact_bytes(config, 4096, torch.bfloat16)
    for prompt in (16, 512, 3000):
        fast, plain = predict_peak_bytes(static, prompt, 128), predict_peak_bytes(growing, prompt, 128)
        assert fast.kv_bytes == block  # 2 GiB for Llama-2-7B at 4096 tokens, from the first token on
        assert plain.kv_bytes == kv_bytes(growing, prompt + 128 if plain.phase == "decode" else prompt,
                                          growing.cache_dtype)
        assert fast.peak_allocated_bytes > plain.peak_allocated_bytes
    # quantized and offloaded caches run on the plain path beside the static block, which stays resident: their
    # prediction is the plain one plus exactly that block (issue 17: it was left out)
    for mode in ("int8", "offload"):
        beside, alone = predict_peak_bytes(static, 512, 128, mode), predict_peak_bytes(growing, 512, 128, mode)
        assert beside.total_bytes - alone.total_bytes == block
        assert beside.kv_bytes == alone.kv_bytes and beside.reserve_bytes == alone.reserve_bytes


def test_what_the_fast_path_holds_beyond_weights_and_cache_is_measured_once_and_counted_in_every_peak() -> None:
    """H200, Llama-2-7B NF4, 704-token static cache (bench/results/2026-11-30-h200-compare.json, run 3): weights
    3,762,823,680 B, allocated after the engine's warm-up 4,442,634,240 B; a reply's measured peak was 4,662,581,248
    B against the engine's prediction of 4,401,393,536 B without this term (with it: 4,712,105,344). The term is
    the warm-up's allocation less the KV block the facts already count, whatever else (another engine) was
    allocated before."""
    config = LlamaConfig(**LLAMA2_7B)
    facts = replace(ModelMemoryFacts.from_config(config, 3_762_823_680, torch.bfloat16, weight_quantization="nf4"),
                    static_kv_tokens=704)
    block = 704 * 32 * 2 * 4096 * 2  # 369,098,752 B
    other_engine = 5 * GiB
    extra = resident_extra_bytes(facts, other_engine + 3_762_823_680, other_engine + 4_442_634_240)
    assert extra == 4_442_634_240 - 3_762_823_680 - block  # 310,711,808 B
    assert resident_extra_bytes(facts, 10 * GiB, 10 * GiB) == 0  # nothing allocated: never negative
    # CUDA graph pools keep blocks between replays that memory_allocated leaves out: they are added
    assert resident_extra_bytes(facts, 10 * GiB, 10 * GiB, held_idle=64 * 2**20) == 64 * 2**20
    assert resident_extra_bytes(facts, other_engine + 3_762_823_680, other_engine + 4_442_634_240,
                                held_idle=2**20) == extra + 2**20
    with_extra = replace(facts, resident_extra_bytes=extra)
    before, after = predict_peak_bytes(facts, 512, 128), predict_peak_bytes(with_extra, 512, 128)
    assert after.total_bytes - before.total_bytes == extra and after.resident_extra_bytes == extra
    assert after.peak_allocated_bytes - before.peak_allocated_bytes == extra


def test_the_fast_paths_prefill_dequantizes_one_h_by_i_weight_at_a_time() -> None:
    """The fast path's prefill dequantizes one fused part (gate or up: h x I) at a time, so its weight temporary is
    bitsandbytes' for 4-bit weights; for int8, where LLM.int8 multiplies in int8 and makes none, it is one h x I
    half-precision copy, which the activation peak of a 512-token prefill then contains."""
    config = LlamaConfig(**LLAMA2_7B)
    h_i = 4096 * 11008
    cases = (("int8", 0, h_i * 2), ("nf4", h_i * 2 + h_i // 64 * 4, h_i * 2 + h_i // 64 * 4))
    for quant, plain, fast_bytes in cases:
        facts = ModelMemoryFacts.from_config(config, 4 * GiB, torch.float16 if quant == "int8" else torch.bfloat16,
                                             weight_quantization=quant)
        assert facts.dequant_weight_bytes == plain
        fast = replace(facts, fast_prefill=True)
        assert fast.dequant_weight_bytes == fast_bytes
        after = predict_peak_bytes(fast, 512, 128)
        # the 4-bit-matmul moment sets the prefill's peak: its activations, the one weight copy, the rotary tables
        assert after.prefill_activation_bytes == 512 * (4 * 4096 + 2 * 11008) * 2 + fast_bytes + 512 * (2 * 128 * 2 + 8)
