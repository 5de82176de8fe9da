"""Prefix reuse across replies: the bookkeeping alone, then replies through ChatEngine on the CPU path, the fast
decoder's eager loop and the plain path, each token-identical (fp32, greedy) to the same reply from a cold cache."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from llm_core.config import GenerationSettings
from llm_core.engine.chat import ChatEngine, ReplyUpdate
from llm_core.errors import GenerationError, OutOfMemoryError
from llm_core.history import Turn
from llm_core.prefix_cache import PrefixCache, common_prefix
from tests.conftest import make_settings

GEN = GenerationSettings(max_new_tokens=12, repetition_penalty=1.05)
SYSTEM = "You are a helpful assistant who answers briefly."


# --- the bookkeeping -----------------------------------------------------------------------------------------

def test_reusable_is_the_longest_common_prefix() -> None:
    cache = PrefixCache()
    cache.commit([1, 2, 3, 4, 5])
    assert cache.reusable([1, 2, 3, 9, 9, 9]) == 3
    assert cache.reusable([7, 2, 3]) == 0
    assert common_prefix([1, 2], [1, 2, 3]) == 2


def test_reusable_leaves_at_least_one_prompt_token_to_prefill() -> None:
    cache = PrefixCache()
    cache.commit([1, 2, 3, 4, 5])
    assert cache.reusable([1, 2, 3]) == 2  # the whole prompt is cached: its last token still runs (logits)
    assert cache.reusable([1, 2, 3, 4, 5]) == 4
    assert cache.reusable([1]) == 0
    assert cache.reusable([]) == 0


def test_another_key_reuses_nothing() -> None:
    cache = PrefixCache()
    cache.commit([1, 2, 3, 4], key=("model-a", "bf16"))
    assert cache.reusable([1, 2, 3, 4, 5], key=("model-a", "bf16")) == 4
    assert cache.reusable([1, 2, 3, 4, 5], key=("model-a", "int8")) == 0
    assert cache.begin([1, 2, 3, 4, 5], key=("model-a", "int8")) == 0
    assert cache.ids == ()


def test_begin_keeps_only_the_reused_ids_marked() -> None:
    cache = PrefixCache()
    cache.commit([1, 2, 3, 4, 5, 6])
    assert cache.begin([1, 2, 8, 9]) == 2
    assert cache.ids == (1, 2)  # rows 2.. are overwritten by this reply: not reusable until it commits
    cache.commit([1, 2, 8, 9, 10])
    assert cache.reusable([1, 2, 8, 9, 10, 11]) == 5


def test_invalidate_forgets_everything() -> None:
    cache = PrefixCache()
    cache.commit([1, 2, 3])
    cache.invalidate()
    assert cache.ids == ()
    assert cache.reusable([1, 2, 3, 4]) == 0


# --- replies through the engine --------------------------------------------------------------------------------

def _engine(decode_path: str, **extra: str) -> ChatEngine:
    torch.manual_seed(0)
    return ChatEngine.load(make_settings(QUANTIZATION="none", COMPUTE_DTYPE="float32", DECODE_PATH=decode_path,
                                         **extra))


@pytest.fixture(scope="module")
def cpu_fp32() -> Iterator[ChatEngine]:
    """The CPU path (DECODE_PATH=auto on CPU) with dense fp32 weights and cache: the token-equality reference."""
    engine = _engine("auto")
    assert engine.backend.name == "cpu"
    yield engine


@pytest.fixture(scope="module")
def fast_fp32() -> Iterator[ChatEngine]:
    """The fast path's FastDecoder run eagerly on CPU: the single-reply CUDA loop's prefix code, without a GPU."""
    engine = _engine("fast")
    assert engine.backend.name == "fast"
    yield engine


@pytest.fixture(scope="module")
def plain_fp32() -> Iterator[ChatEngine]:
    """transformers' generate with the kept DynamicCache."""
    yield _engine("plain")


PATHS = ["cpu_fp32", "fast_fp32", "plain_fp32"]


def _forget(engine: ChatEngine) -> None:
    """Make the next reply start from a cold cache (the reference every reused reply must equal)."""
    decoder = getattr(engine.backend, "decoder", None)
    if decoder is not None:
        decoder.prefix_cache.invalidate()
    if engine.path.plain_prefix is not None:
        engine.path.plain_prefix.drop()


def _prefix_ids(engine: ChatEngine) -> tuple[int, ...]:
    decoder = getattr(engine.backend, "decoder", None)
    return decoder.prefix_cache.ids if decoder is not None else engine.path.plain_prefix.prefix.ids


def _prompt(engine: ChatEngine, message: str, history: list[Turn], turns: int, system: str) -> list[int]:
    prepared = engine.prepare(message, history, gen=GEN, history_turns=turns, system_prompt=system)
    return prepared.input_ids[0].tolist()


def _reply(engine: ChatEngine, message: str, history: list[Turn], *, turns: int = 8, system: str = SYSTEM,
           stop_after: int | None = None) -> ReplyUpdate:
    rid = f"r{threading.get_ident()}"
    last = None
    for update in engine.stream_chat(message, history, gen=GEN, history_turns=turns, system_prompt=system,
                                     request_id=rid):
        last = update
        if stop_after is not None and not update.done and update.stats.new_tokens >= stop_after:
            engine.stop(rid)
    assert last is not None and last.done
    return last


def _expected_cached(prev_prompt: list[int], prev_new: tuple[int, ...], prompt: list[int]) -> int:
    """Computed from the ids alone: what the last reply left in the cache is its prompt and every new id but the
    last (never fed back); the prompt's last token is always prefilled."""
    held = prev_prompt + list(prev_new[:-1])
    n = 0
    while n < min(len(held), len(prompt)) and held[n] == prompt[n]:
        n += 1
    return min(n, len(prompt) - 1)


def _check_warm_equals_cold(engine: ChatEngine, message: str, history: list[Turn], *, turns: int = 8,
                            system: str = SYSTEM) -> ReplyUpdate:
    """Reply with whatever the cache holds, then the same from a cold cache: same tokens; the cold one reused 0."""
    warm = _reply(engine, message, history, turns=turns, system=system)
    _forget(engine)
    cold = _reply(engine, message, history, turns=turns, system=system)
    assert cold.stats.cached_prompt_tokens == 0
    assert warm.token_ids == cold.token_ids
    return warm


@pytest.mark.parametrize("path", PATHS)
def test_a_continued_chat_reuses_the_history_and_equals_a_cold_start(path: str, request: Any) -> None:
    engine: ChatEngine = request.getfixturevalue(path)
    _forget(engine)
    history: list[Turn] = []
    messages = ["Name three colours.", "Which of them is the warmest?", "And the coldest?", "Thanks. One more?"]
    prev_prompt: list[int] = []
    prev_new: tuple[int, ...] = ()
    for i, message in enumerate(messages):
        prompt = _prompt(engine, message, history, 8, SYSTEM)
        update = _check_warm_equals_cold(engine, message, history)
        if i:
            want = _expected_cached(prev_prompt, prev_new, prompt)
            assert want > len(prev_prompt) // 2  # the whole earlier history is shared
            assert update.stats.cached_prompt_tokens == want
            assert update.stats.prompt_tokens == len(prompt)
        prev_prompt, prev_new = prompt, update.token_ids
        history = [*history, Turn(message, update.text)]


@pytest.mark.parametrize("path", PATHS)
def test_regenerate_reuses_all_but_the_last_prompt_token(path: str, request: Any) -> None:
    engine: ChatEngine = request.getfixturevalue(path)
    _forget(engine)
    history = [Turn("Hi there.", "Hello! How can I help?")]
    first = _reply(engine, "Tell me a fact about owls.", history)
    prompt = _prompt(engine, "Tell me a fact about owls.", history, 8, SYSTEM)
    again = _check_warm_equals_cold(engine, "Tell me a fact about owls.", history)
    assert again.stats.cached_prompt_tokens == len(prompt) - 1
    assert again.token_ids == first.token_ids


@pytest.mark.parametrize("path", PATHS)
def test_a_trimmed_history_reuses_only_what_still_matches(path: str, request: Any) -> None:
    engine: ChatEngine = request.getfixturevalue(path)
    _forget(engine)
    history = [Turn("First question about cats?", "Cats sleep a lot."),
               Turn("Second question about dogs?", "Dogs like walks.")]
    before = _reply(engine, "Third question about birds?", history, turns=2)
    before_prompt = _prompt(engine, "Third question about birds?", history, 2, SYSTEM)
    history = [*history, Turn("Third question about birds?", before.text)]
    # two turns kept of three: the oldest drops, so the prompt diverges right after the system prompt
    prompt = _prompt(engine, "Fourth question about fish?", history, 2, SYSTEM)
    want = _expected_cached(before_prompt, before.token_ids, prompt)
    assert 0 < want < len(before_prompt) // 2
    after = _check_warm_equals_cold(engine, "Fourth question about fish?", history, turns=2)
    assert after.stats.cached_prompt_tokens == want
    assert after.stats.dropped_turns == 1


def test_beyond_the_history_limit_old_turns_go_in_steps_and_the_next_reply_still_reuses_the_prompt(
        cpu_fp32: ChatEngine) -> None:
    engine = cpu_fp32
    assert engine.settings.chat.history_trim_step == 0.25  # the default: with 8 turns kept, they go two at a time
    _forget(engine)
    history = [Turn(f"Question {i}: name an animal.", f"Animal {i}: a cat.") for i in range(9)]
    first = _reply(engine, "Question 9: name a bird.", history, turns=8)
    assert first.stats.dropped_turns == 2  # one over the limit, one more so the next reply keeps the same start
    first_prompt = _prompt(engine, "Question 9: name a bird.", history, 8, SYSTEM)
    history = [*history, Turn("Question 9: name a bird.", first.text)]
    prompt = _prompt(engine, "Question 10: name a fish.", history, 8, SYSTEM)
    want = _expected_cached(first_prompt, first.token_ids, prompt)
    assert want >= len(first_prompt) - 1  # the whole earlier prompt is shared
    second = _check_warm_equals_cold(engine, "Question 10: name a fish.", history, turns=8)
    assert second.stats.cached_prompt_tokens == want and second.stats.dropped_turns == 2


@pytest.mark.parametrize("path", PATHS)
def test_a_second_user_reuses_the_shared_system_prompt(path: str, request: Any) -> None:
    engine: ChatEngine = request.getfixturevalue(path)
    _forget(engine)
    alice = _reply(engine, "Alice asks: what is a prime number?", [])
    alice_prompt = _prompt(engine, "Alice asks: what is a prime number?", [], 8, SYSTEM)
    prompt = _prompt(engine, "Bob asks about the moon.", [], 8, SYSTEM)
    want = _expected_cached(alice_prompt, alice.token_ids, prompt)
    system_only = _prompt(engine, "x", [], 8, SYSTEM)
    assert want >= common_prefix(system_only, prompt) > 0
    bob = _check_warm_equals_cold(engine, "Bob asks about the moon.", [])
    assert bob.stats.cached_prompt_tokens == want


@pytest.mark.parametrize("path", PATHS)
def test_a_stopped_reply_leaves_only_what_it_wrote_reusable(path: str, request: Any) -> None:
    engine: ChatEngine = request.getfixturevalue(path)
    _forget(engine)
    stopped = _reply(engine, "Count slowly from one to twenty.", [], stop_after=3)
    assert stopped.stats.finish_reason == "stopped"
    prompt = _prompt(engine, "Count slowly from one to twenty.", [], 8, SYSTEM)
    assert len(_prefix_ids(engine)) == len(prompt) + len(stopped.token_ids) - 1
    history = [Turn("Count slowly from one to twenty.", stopped.text)]
    next_prompt = _prompt(engine, "Go on.", history, 8, SYSTEM)
    after = _check_warm_equals_cold(engine, "Go on.", history)
    assert after.stats.cached_prompt_tokens == _expected_cached(prompt, stopped.token_ids, next_prompt) > 0


@pytest.mark.parametrize("path", PATHS)
def test_an_error_mid_reply_leaves_nothing_reusable(path: str, request: Any,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    engine: ChatEngine = request.getfixturevalue(path)
    _forget(engine)
    first = _reply(engine, "Say hello.", [])
    assert _prefix_ids(engine)
    history = [Turn("Say hello.", first.text)]
    if path == "plain_fp32":  # an OOM after the prefill wrote the cache, raised from generate's stopping criterion
        with engine.oom_injector.armed_for("decode", times=1), pytest.raises(OutOfMemoryError):
            _reply(engine, "Now say goodbye.", history)
    else:  # the decode step fails after the prefill wrote the cache's rows
        decoder = engine.backend.decoder
        name = "_decode" if path == "cpu_fp32" else "_run_step"

        def boom(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("injected decode failure")

        monkeypatch.setattr(decoder, name, boom)
        with pytest.raises(GenerationError):
            _reply(engine, "Now say goodbye.", history)
        monkeypatch.undo()
    assert _prefix_ids(engine) == ()
    after = _reply(engine, "Now say goodbye.", history)
    assert after.stats.cached_prompt_tokens == 0


def test_reallocating_the_cpu_cache_forgets_the_prefix(cpu_fp32: ChatEngine) -> None:
    _reply(cpu_fp32, "Say hello.", [])
    assert _prefix_ids(cpu_fp32)
    cpu_fp32.backend.decoder.warmup()  # writes and re-allocates the static cache
    assert _prefix_ids(cpu_fp32) == ()
    assert _reply(cpu_fp32, "Say hello.", []).stats.cached_prompt_tokens == 0


def test_prefix_cache_off_prefills_every_prompt_whole() -> None:
    engine = _engine("plain", PREFIX_CACHE="off")
    assert engine.path.plain_prefix is None
    first = _reply(engine, "Say hello.", [])
    again = _reply(engine, "Say hello.", [])
    assert first.stats.cached_prompt_tokens == again.stats.cached_prompt_tokens == 0
    assert first.token_ids == again.token_ids


def test_openai_usage_reports_the_cached_tokens() -> None:
    from llm_core.metrics import ReplyStats
    from llm_core.web.openai_api import _usage

    usage = _usage(ReplyUpdate("hi", ReplyStats(prompt_tokens=40, cached_prompt_tokens=31, new_tokens=3), True))
    assert usage["prompt_tokens_details"] == {"cached_tokens": 31}
    assert usage["prompt_tokens"] == 40 and usage["total_tokens"] == 43


# --- GPU: the CUDA fast path's captured graphs around a reused prefix -------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("prompt_tokens", [200, 1500])  # inside the padded prefill graphs / past them, chunked
def test_cuda_fast_decoder_reply_after_a_cached_prefix_equals_a_cold_one(tmp_path: Any, prompt_tokens: int) -> None:
    """A random tiny llama in fp32, compiled with CUDA graphs: a second turn (first turn's prompt + reply + new
    tokens) prefilled after the cached prefix gives the tokens the same decoder gives from a cold cache."""
    from bench.decode import load
    from bench.harness import make_random_checkpoint
    from llm_core.fast import FastDecodeOptions, FastDecoder

    folder = make_random_checkpoint("tiny", tmp_path / "tiny", torch.device("cuda"), 4096)
    loaded = load(str(folder), "none", "cuda", tmp_path / "cache", "float32")
    prefix = PrefixCache()
    dec = FastDecoder(loaded, max_cache_len=4096, prefix_cache=prefix,
                      options=FastDecodeOptions(prefill_graph_tokens=1024, prefill_chunk_tokens=512))
    dec.warmup()
    gen = GenerationSettings(repetition_penalty=1.05)
    ids = torch.randint(3, 500, (1, prompt_tokens), generator=torch.Generator().manual_seed(0)).cuda()
    out = dec.generate(ids, None, gen, None, threading.Event(), 16)
    extra = torch.randint(3, 500, (1, 300), generator=torch.Generator().manual_seed(1)).cuda()
    turn2 = torch.cat([out, extra], dim=1)
    info: dict[str, int] = {}
    warm = dec.generate(turn2, None, gen, None, threading.Event(), 24, info=info)
    assert info["cached_prompt_tokens"] == out.shape[1] - 1
    prefix.invalidate()
    cold_info: dict[str, int] = {}
    cold = dec.generate(turn2, None, gen, None, threading.Event(), 24, info=cold_info)
    assert cold_info["cached_prompt_tokens"] == 0
    assert warm.tolist() == cold.tolist()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kv_heads", [8, 2])  # Llama-2-like (no grouping) / grouped K/V (Llama-3-like)
def test_a_later_chunk_attends_by_flash_as_by_the_explicit_mask(kv_heads: int) -> None:
    """LayerSpec.prefix_flash: a later prefill chunk's attention over the cached prefix by flash attention with a
    bottom-right causal mask = SDPA with the explicit (S, T) mask (computed in fp32 as the reference), in bf16."""
    from llm_core.fast import layer

    assert layer.prefix_flash_ok(torch.device("cuda"), torch.bfloat16, 128)
    assert not layer.prefix_flash_ok(torch.device("cuda"), torch.float32, 128)
    heads, dim, start, seq = 8, 128, 700, 300
    spec = layer.LayerSpec(heads, kv_heads, dim, dim ** -0.5, 1e-5, 1e-5, None, (), True, "triton", True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, heads, seq, dim, device="cuda", generator=gen).bfloat16()
    keys, values = (torch.randn(1, kv_heads, start + seq, dim, device="cuda", generator=gen).bfloat16()
                    for _ in range(2))
    mask = torch.arange(start + seq, device="cuda")[None, :] <= torch.arange(start, start + seq, device="cuda")[:, None]
    ref = layer._prefill_attention(spec, q.float(), keys.float(), values.float(), mask)
    got = layer._prefix_flash_attention(spec, q, keys, values)
    assert got.shape == ref.shape == (1, seq, heads * dim)
    assert (got.float() - ref).abs().max().item() < 2e-2
    # the first query sees the prefix and itself only: not the chunk's later keys (a top-left mask would hide
    # all but the first key from it)
    assert (got[0, 0].float() - ref[0, 0]).abs().max().item() < 2e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bf16_chunked_prefill_compiles_the_flash_prefix_attention_and_scores_as_the_masked_one(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fast path in bf16 on CUDA: a prompt prefilled in 256-token chunks runs its later chunks through the
    compiled flash form (LayerSpec.prefix_flash; the warm-up compiled it, no eager fall-back), and its last
    position's scores equal, within bf16 rounding, a decoder whose later chunks use the explicit mask."""
    from bench.decode import load
    from bench.harness import make_random_checkpoint
    from llm_core.fast import FastDecodeOptions, FastDecoder, generate

    folder = make_random_checkpoint("tiny", tmp_path / "tiny", torch.device("cuda"), 4096)
    loaded = load(str(folder), "none", "cuda", tmp_path / "cache", "bfloat16")
    ids = torch.randint(3, 500, (1000,), generator=torch.Generator().manual_seed(0)).cuda()
    scores = {}
    for flash in (True, False):
        if not flash:
            monkeypatch.setattr(generate, "prefix_flash_ok", lambda *args: False)
        dec = FastDecoder(loaded, max_cache_len=2048,
                          options=FastDecodeOptions(prefill_graph_tokens=128, prefill_chunk_tokens=256))
        dec.warmup()
        assert all(spec.prefix_flash == flash for spec in dec._layer_specs)
        assert dec._prefill_compiled_ok, dec.notes
        with dec.outside_reply():
            scores[flash] = torch.log_softmax(dec.prefill_scores(ids, penalties=False).float(), dim=-1)
        del dec
    assert (scores[True] - scores[False]).abs().max().item() < 0.05


def test_two_attentions_merged_by_their_log_sum_exp_equal_one_over_all_the_keys() -> None:
    """layer.attention_lse + merge_attention: attention over keys A and over keys B, merged by their log-sum-exp,
    = one attention over A and B together (fp32), and the log-sum-exp is the log of the softmax denominator."""
    from llm_core.fast import layer

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 9, 16, generator=gen)
    k, v = torch.randn(1, 4, 30, 16, generator=gen), torch.randn(1, 4, 30, 16, generator=gen)
    k[..., 3, :] *= 8  # one key far above the rest: the merge must not overflow
    out_a, lse_a = layer.attention_lse(q, k[:, :, :21], v[:, :, :21], 0.25, False)
    out_b, lse_b = layer.attention_lse(q, k[:, :, 21:], v[:, :, 21:], 0.25, False)
    scores = (q @ k.transpose(-1, -2)) * 0.25
    assert torch.allclose(lse_a, torch.logsumexp(scores[..., :21], -1), atol=1e-5)
    got = layer.merge_attention(out_a, lse_a, out_b, lse_b)
    want = torch.softmax(scores, -1) @ v
    assert (got - want).abs().max().item() < 1e-5


@pytest.mark.parametrize("rows", ["fp32", "bf16", "int8"])
@pytest.mark.parametrize("kv_heads", [8, 2])
@pytest.mark.parametrize("bucket", [16, 45, 64])
def test_a_split_later_chunk_attends_as_the_masked_one(rows: str, kv_heads: int, bucket: int) -> None:
    """PREFIX_ATTENTION=split's form (LayerSpec.prefix_split): a later chunk's queries over the cached prefix's
    whole buckets (unmasked) and over the rest of it and their own keys (causal, bottom-right), merged = the
    explicit-mask form over the same cache; fp32 to 1e-5, bf16 and int8 rows to bf16 rounding; the chunk's first
    query does not see the chunk's later keys. Bucket 16: a part of the prefix goes with the chunk; 45 (= the
    prefix): none does; 64 (over the prefix): the gather form serves the chunk."""
    from llm_core.fast import layer
    from llm_core.fast.kvquant import quantize_rows

    heads, dim, start, seq = 8, 32, 45, 19
    dtype = torch.float32 if rows == "fp32" else torch.bfloat16
    gen = torch.Generator().manual_seed(1)
    k, v = (torch.randn(start + seq + 3, kv_heads, dim, generator=gen).to(dtype) for _ in range(2))
    if rows == "int8":
        k, v = quantize_rows(k), quantize_rows(v)
    q = torch.randn(1, seq, heads, dim, generator=gen).to(dtype).transpose(1, 2)
    masked = layer.LayerSpec(heads, kv_heads, dim, dim ** -0.5, 1e-5, 1e-5, None, (), True, "matmul")
    split = layer.LayerSpec(heads, kv_heads, dim, dim ** -0.5, 1e-5, 1e-5, None, (), True, "matmul", False, "flash",
                            prefix_split_bucket=bucket)
    want = layer.prefix_attention_over_cache(masked, q, k, v, start).float()
    got = layer.prefix_attention_over_cache(split, q, k, v, start).float()
    assert got.shape == want.shape == (1, seq, heads * dim)
    assert (got - want).abs().max().item() < (1e-5 if rows == "fp32" else 2e-2)
    # a cache whose rows after the chunk's first position were different would change every query but the first
    changed = k.clone()
    changed[start + 1:] = changed[start + 1:].flip(0)
    first = layer.prefix_attention_over_cache(split, q, changed, v, start).float()
    assert (first[0, 0] - got[0, 0]).abs().max().item() == 0
    assert (first[0, 1:] - got[0, 1:]).abs().max().item() > 1e-3
    if bucket > start:  # no whole bucket: the gather form's very bits
        assert torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", ["flash", "cudnn"])
@pytest.mark.parametrize("kv_heads", [8, 2])
def test_the_split_form_on_cuda_attends_as_the_fp32_mask(backend: str, kv_heads: int) -> None:
    """The split form's CUDA backends (flash, and cuDNN where prefix_split_backend finds it) over a bf16 cache =
    the explicit mask in fp32, within bf16 rounding."""
    from llm_core.fast import layer

    if backend == "cudnn" and layer.prefix_split_backend(torch.device("cuda"), torch.bfloat16, 128) != "cudnn":
        pytest.skip("PyTorch's cuDNN attention does not run here")
    heads, dim, start, seq = 8, 128, 700, 300
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, seq, heads, dim, device="cuda", generator=gen).bfloat16().transpose(1, 2)
    k, v = (torch.randn(start + seq, kv_heads, dim, device="cuda", generator=gen).bfloat16() for _ in range(2))
    spec = layer.LayerSpec(heads, kv_heads, dim, dim ** -0.5, 1e-5, 1e-5, None, (), True, "triton", True, backend,
                           prefix_split_bucket=256)  # 512 keys unmasked (300 queries padded to 512 for cuDNN)
    mask = torch.arange(start + seq, device="cuda")[None, :] <= torch.arange(start, start + seq, device="cuda")[:, None]
    ref = layer._prefill_attention(spec, q.float(), k.float().transpose(0, 1)[None], v.float().transpose(0, 1)[None],
                                   mask)
    got = layer.prefix_attention_over_cache(spec, q, k, v, start)
    assert (got.float() - ref).abs().max().item() < 2e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bf16_chunked_prefill_with_split_prefix_attention_compiles_and_scores_as_gather(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """PREFIX_ATTENTION=split on CUDA in bf16: every layer spec carries the split backend, the compiled prefill
    serves it (no eager fall-back), and a prompt prefilled in 256-token chunks (a split bucket of 512 keys: chunks
    under it, at it and past it) scores as with the default."""
    from bench.decode import load
    from bench.harness import make_random_checkpoint
    from llm_core.fast import FastDecodeOptions, FastDecoder, generate

    monkeypatch.setattr(generate, "PREFIX_SPLIT_BUCKET", 512)

    folder = make_random_checkpoint("tiny", tmp_path / "tiny", torch.device("cuda"), 4096)
    loaded = load(str(folder), "none", "cuda", tmp_path / "cache", "bfloat16")
    ids = torch.randint(3, 500, (1000,), generator=torch.Generator().manual_seed(0)).cuda()
    scores = {}
    for choice in ("gather", "split"):
        dec = FastDecoder(loaded, max_cache_len=2048,
                          options=FastDecodeOptions(prefill_graph_tokens=128, prefill_chunk_tokens=256,
                                                    prefix_attention=choice))
        dec.warmup()
        assert all(bool(spec.prefix_split) == (choice == "split") for spec in dec._layer_specs)
        assert all(spec.prefix_split_bucket == 512 for spec in dec._layer_specs)
        assert dec._prefill_compiled_ok, dec.notes
        with dec.outside_reply():
            scores[choice] = torch.log_softmax(dec.prefill_scores(ids, penalties=False).float(), dim=-1)
        del dec
    assert (scores["split"] - scores["gather"]).abs().max().item() < 0.05
