"""The fast decode path: token-exact against generate on CPU (fp32), streaming/stop/EOS semantics, exact weight
fusion, and (GPU only, marked) the compiled CUDA-graph step and the Triton kernel."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from bench.probes import forced_scores
from llm_core.config import GenerationSettings
from llm_core.errors import GenerationError
from llm_core.fast import FastDecodeOptions, FastDecoder, bucket_list, fast_path_support, layer, pack, support
from llm_core.fast.kernels import attention
from llm_core.loading import load_model
from llm_core.types import LoadedModel
from tests.conftest import make_settings

PROMPTS = {
    "capital": "What is the capital of France? Answer in one sentence.",
    "haiku": "Write a haiku about the sea.",
    "primes": "List three prime numbers and explain why they are prime.",
}
NEW_TOKENS = 12


class RecordingStreamer:
    """Records what generate hands a streamer: the prompt first, then one tensor per token, then end()."""

    def __init__(self, on_token: Any = None) -> None:
        self.items: list[torch.Tensor] = []
        self.ended = False
        self.on_token = on_token

    def put(self, value: torch.Tensor) -> None:
        self.items.append(value)
        if self.on_token is not None and len(self.items) > 1:
            self.on_token(len(self.items) - 1)

    def end(self) -> None:
        self.ended = True

    @property
    def tokens(self) -> list[int]:
        return [int(t) for item in self.items[1:] for t in item.reshape(-1).tolist()]


@pytest.fixture(scope="module")
def fp32() -> Iterator[LoadedModel]:
    yield load_model(make_settings(QUANTIZATION="none", COMPUTE_DTYPE="float32").model)


@pytest.fixture(scope="module")
def decoder(fp32: LoadedModel) -> FastDecoder:
    dec = FastDecoder(fp32, compile=False, max_cache_len=1024)
    dec.warmup()
    return dec


def encode(loaded: LoadedModel, text: str) -> tuple[torch.Tensor, torch.Tensor]:
    enc = loaded.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                               return_dict=True, return_tensors="pt")
    return enc["input_ids"], enc["attention_mask"]


def reference(loaded: LoadedModel, ids: torch.Tensor, mask: torch.Tensor, new: int, **kw: Any) -> list[int]:
    with torch.inference_mode():
        out = loaded.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                                    temperature=None, top_p=None, top_k=None, **kw)
    return out[0, ids.shape[1]:].tolist()


def fast(dec: FastDecoder, ids: torch.Tensor, mask: torch.Tensor, new: int, gen: GenerationSettings | None = None,
         streamer: Any = None, stop: threading.Event | None = None, **kw: Any) -> list[int]:
    out = dec.generate(ids, mask, gen or GenerationSettings(), streamer, stop or threading.Event(), new, **kw)
    assert out.shape[0] == 1 and torch.equal(out[:, :ids.shape[1]], ids)
    return out[0, ids.shape[1]:].tolist()


# --- support -------------------------------------------------------------------------------------------------


def test_fast_path_is_refused_on_cpu_with_a_reason(fp32: LoadedModel) -> None:
    ok, reason = fast_path_support(fp32)
    assert not ok and "CPU" in reason
    ok, reason = fast_path_support(fp32, allow_cpu=True)
    assert ok, reason


def test_bucket_list_covers_the_cache_and_grows_coarser() -> None:
    buckets = bucket_list(20_000)
    assert buckets[0] == 256 and buckets[-1] == 20_000 and buckets == sorted(set(buckets))
    assert all(b - a == 256 for a, b in zip(buckets, buckets[1:], strict=False) if b <= 4096)
    assert bucket_list(100) == [100]


# --- token equality with generate (fp32, CPU, eager) ---------------------------------------------------------


@pytest.mark.parametrize(("prompt", "penalty"), [("capital", 1.05), ("haiku", 1.05), ("primes", 1.05),
                                                 ("haiku", 1.0)])
def test_greedy_tokens_equal_generate_token_for_token(fp32: LoadedModel, decoder: FastDecoder, prompt: str,
                                                      penalty: float) -> None:
    ids, mask = encode(fp32, PROMPTS[prompt])
    expected = reference(fp32, ids, mask, NEW_TOKENS, repetition_penalty=penalty)
    streamer = RecordingStreamer()
    got = fast(decoder, ids, mask, NEW_TOKENS, GenerationSettings(repetition_penalty=penalty), streamer)
    assert got == expected
    assert torch.equal(streamer.items[0], ids) and streamer.tokens == got and streamer.ended
    assert all(item.shape == (1,) for item in streamer.items[1:])


def test_eos_stops_generation_where_generate_stops(fp32: LoadedModel, decoder: FastDecoder) -> None:
    ids, mask = encode(fp32, PROMPTS["capital"])
    expected = reference(fp32, ids, mask, 60, repetition_penalty=1.05)
    got = fast(decoder, ids, mask, 60)
    eos = fp32.model.generation_config.eos_token_id
    assert got == expected and got[-1] == eos and len(got) < 60


def test_min_new_tokens_keeps_eos_away_like_generate(fp32: LoadedModel, decoder: FastDecoder) -> None:
    ids, mask = encode(fp32, PROMPTS["capital"])
    expected = reference(fp32, ids, mask, 11, repetition_penalty=1.05, min_new_tokens=11)
    assert fast(decoder, ids, mask, 11, min_new_tokens=11) == expected


def test_stop_event_halts_after_the_token_in_hand_and_ends_the_streamer(fp32: LoadedModel,
                                                                        decoder: FastDecoder) -> None:
    ids, mask = encode(fp32, PROMPTS["primes"])
    stop = threading.Event()
    streamer = RecordingStreamer(on_token=lambda n: stop.set() if n == 3 else None)
    got = fast(decoder, ids, mask, 50, streamer=streamer, stop=stop)
    assert len(got) == 3 and streamer.ended and streamer.tokens == got


def test_an_error_in_the_streamer_still_ends_it(fp32: LoadedModel, decoder: FastDecoder) -> None:
    ids, mask = encode(fp32, PROMPTS["haiku"])

    def boom(n: int) -> None:
        if n == 2:
            raise RuntimeError("consumer failed")

    streamer = RecordingStreamer(on_token=boom)
    with pytest.raises(RuntimeError, match="consumer failed"):
        fast(decoder, ids, mask, 10, streamer=streamer)
    assert streamer.ended
    assert fast(decoder, ids, mask, 4) == reference(fp32, ids, mask, 4, repetition_penalty=1.05)  # still usable


def test_sampling_with_a_seed_is_reproducible(fp32: LoadedModel, decoder: FastDecoder) -> None:
    ids, mask = encode(fp32, PROMPTS["haiku"])
    gen = GenerationSettings(do_sample=True, temperature=0.9, top_p=0.9, top_k=40, seed=7)
    first, second = fast(decoder, ids, mask, 6, gen), fast(decoder, ids, mask, 6, gen)
    assert first == second and len(first) >= 1


def test_request_longer_than_the_cache_is_a_clear_error(fp32: LoadedModel) -> None:

    dec = FastDecoder(fp32, compile=False, max_cache_len=64)
    ids, mask = encode(fp32, PROMPTS["haiku"])
    streamer = RecordingStreamer()
    with pytest.raises(GenerationError, match="KV cache"):
        fast(dec, ids, mask, 60, streamer=streamer)
    assert streamer.ended


def test_compiled_step_traces_as_one_graph_and_keeps_the_tokens(fp32: LoadedModel) -> None:
    """fullgraph=True fails on any graph break; backend 'eager' traces with dynamo without code generation."""
    dec = FastDecoder(fp32, compile=True, max_cache_len=512, options=FastDecodeOptions(compile_backend="eager"))
    dec.warmup()
    ids, mask = encode(fp32, PROMPTS["capital"])
    assert fast(dec, ids, mask, 8) == reference(fp32, ids, mask, 8, repetition_penalty=1.05)


def test_triton_dense_layer_form_keeps_generate_tokens(fp32: LoadedModel) -> None:
    """dense_gemv="triton" runs llm_core.dense_gemv (its torch reference on CPU) through the decode layer: greedy
    tokens equal generate's, also traced by dynamo (fullgraph, backend eager)."""
    opts = FastDecodeOptions(dense_gemv="triton")
    dec = FastDecoder(fp32, compile=False, max_cache_len=512, options=opts)
    dec.warmup()
    described = dec.describe()
    assert all(f == "dense/none/dense-triton" for f in described["linear_formats"])
    for prompt in ("capital", "primes"):
        ids, mask = encode(fp32, PROMPTS[prompt])
        want = reference(fp32, ids, mask, NEW_TOKENS, repetition_penalty=1.05)
        assert fast(dec, ids, mask, NEW_TOKENS, GenerationSettings(repetition_penalty=1.05)) == want
    traced = FastDecoder(fp32, compile=True, max_cache_len=512,
                         options=FastDecodeOptions(dense_gemv="triton", compile_backend="eager"))
    traced.warmup()
    ids, mask = encode(fp32, PROMPTS["capital"])
    assert fast(traced, ids, mask, 8) == reference(fp32, ids, mask, 8, repetition_penalty=1.05)


def test_padded_prefill_keeps_the_scores_and_the_tokens(fp32: LoadedModel) -> None:
    """prefill_graph_tokens: prompts are prefilled right-padded to a multiple of 64 (on CUDA from captured graphs;
    on CPU the same padded form eagerly). The real rows see no padding (causal), so the scores after the prompt and
    after each teacher-forced token equal the unpadded prefill's, for lengths below, at and past a bucket edge;
    the padding's K/V rows are written (the padded form ran) and later overwritten by the decode."""
    plain = FastDecoder(fp32, compile=False, max_cache_len=512, options=FastDecodeOptions(prefill_graph_tokens=0))
    plain.warmup()
    assert plain._pf_ids is None  # the unpadded prefill: the reference
    padded = FastDecoder(fp32, compile=False, max_cache_len=512, options=FastDecodeOptions(prefill_graph_tokens=128))
    padded.warmup()
    forced = [42, 7, 1000, 3]
    for length in (30, 64, 65):
        ids = torch.randint(3, 5000, (1, length), generator=torch.Generator().manual_seed(length))
        want = forced_scores(plain, ids, forced)
        padded._k.zero_()
        got = forced_scores(padded, ids, forced)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        bucket = -(-length // 64) * 64
        if bucket > length + len(forced):  # padding rows past what the decode overwrote: the padded form ran
            assert padded._k[0, length + len(forced):bucket].abs().sum() > 0
    long_ids = torch.randint(3, 5000, (1, 200), generator=torch.Generator().manual_seed(1))  # past the option: plain
    padded._k.zero_()
    torch.testing.assert_close(forced_scores(padded, long_ids, forced[:1]), forced_scores(plain, long_ids, forced[:1]),
                               rtol=1e-4, atol=1e-4)
    assert padded._k[0, 201:256].abs().sum() == 0
    ids, mask = encode(fp32, PROMPTS["primes"])
    want_tokens = reference(fp32, ids, mask, NEW_TOKENS, repetition_penalty=1.05)
    assert fast(padded, ids, mask, NEW_TOKENS, GenerationSettings(repetition_penalty=1.05)) == want_tokens


def test_dense_gemv_auto_is_cublas_on_cpu_and_unknown_names_are_refused(fp32: LoadedModel) -> None:
    assert FastDecodeOptions().resolved(torch.device("cpu"), 64).dense_gemv == "cublas"
    with pytest.raises(GenerationError, match="dense gemv"):
        FastDecodeOptions(dense_gemv="cutlass").resolved(torch.device("cpu"), 64)


def test_a_reply_from_a_worker_under_inference_mode_compiles_nothing(fp32: LoadedModel) -> None:
    """The engine generates on a worker thread under torch.inference_mode; tensors made there carry other dispatch
    keys, and dynamo used to recompile the prefill, head and prologue inside the first reply. Compilation belongs
    to warm-up: after it, such a reply must add no graph."""
    from torch._dynamo.utils import counters

    dec = FastDecoder(fp32, compile=True, max_cache_len=512, options=FastDecodeOptions(compile_backend="eager"))
    dec.warmup()
    ids, mask = encode(fp32, PROMPTS["capital"])
    want = fast(dec, ids, mask, 4)  # the first reply of this prompt length, on the caller's thread
    graphs = counters["stats"]["unique_graphs"]
    got: list[list[int]] = []

    def reply() -> None:
        with torch.inference_mode():
            got.append(fast(dec, ids, mask, 4))

    worker = threading.Thread(target=reply)
    worker.start()
    worker.join(120)
    assert got == [want]
    assert counters["stats"]["unique_graphs"] == graphs


# --- nf4 on CPU ----------------------------------------------------------------------------------------------


def test_nf4_on_cpu_runs_through_the_fast_path() -> None:
    """NF4 + bf16 compute on CPU: the fast path runs; with bitsandbytes' kernel it matched generate token for token
    on the prompts we tried (bf16 rounding differs between paths, so equality is not asserted)."""
    loaded = load_model(make_settings().model)
    dec = FastDecoder(loaded, compile=False, max_cache_len=512, options=FastDecodeOptions(gemv="bnb"))
    dec.warmup()
    assert any("nf4" in f for f in dec.describe()["linear_formats"])
    ids, mask = encode(loaded, PROMPTS["capital"])
    got = fast(dec, ids, mask, 8)
    expected = reference(loaded, ids, mask, 8, repetition_penalty=1.05)
    same = sum(a == b for a, b in zip(got, expected, strict=False))
    print(f"nf4 CPU agreement with generate: {same}/{min(len(got), len(expected))} tokens")
    assert 1 <= len(got) <= 8 and all(0 <= t < loaded.model.config.vocab_size for t in got)


# --- exact fusion of NF4 linears -----------------------------------------------------------------------------


def nf4_linear(n: int, k: int, seed: int, bias: bool = False) -> Any:
    bnb = pytest.importorskip("bitsandbytes")
    g = torch.Generator().manual_seed(seed)
    m = bnb.nn.Linear4bit(k, n, bias=bias, compute_dtype=torch.float32, compress_statistics=True, quant_type="nf4")
    w = torch.randn(n, k, generator=g) * (0.02 + 0.01 * seed)  # parts with different scales: different offsets
    m.weight = bnb.nn.Params4bit(w, requires_grad=False, compress_statistics=True, quant_type="nf4",
                                 module=m)._quantize("cpu")
    if bias:
        m.bias = torch.nn.Parameter(torch.randn(n, generator=g))
    m.support_avx512bf16_for_cpu = False
    return m


def dequantized(m: Any) -> torch.Tensor:
    from bitsandbytes.functional import dequantize_4bit

    return dequantize_4bit(m.weight.data, m.weight.quant_state).float()


@pytest.mark.parametrize(("shapes", "absmax", "exact"), [
    ([(256, 256), (128, 256), (128, 256)], "keep", True),  # 256-aligned nested absmax: concatenated as is
    ([(192, 576), (64, 576), (64, 576)], "keep", True),  # not aligned: dequantized to fp32 (exact)
    ([(256, 256), (128, 256), (128, 256)], "fp32", True),
    ([(256, 256), (128, 256), (128, 256)], "requant", False),  # one offset for all parts: requantized absmax
])
def test_fused_nf4_linear_equals_its_parts(shapes: list[tuple[int, int]], absmax: str, exact: bool) -> None:
    """Fused output vs the parts' outputs (same input). Bound: exact modes <= 1e-5 absolute (fp32 sums, same
    order per row, identical block scales); requant: relative L2 <= 1e-2 (8-bit requantized absmax)."""
    parts = [nf4_linear(n, k, seed=i, bias=(i == 1)) for i, (n, k) in enumerate(shapes)]
    x = torch.randn(1, shapes[0][1], generator=torch.Generator().manual_seed(9))
    before = [m(x) for m in parts]
    expected = torch.cat([x @ dequantized(m).t() + (m.bias if m.bias is not None else 0) for m in parts], -1)
    packed = pack.pack_linears(parts, FastDecodeOptions(absmax=absmax), "torch")
    got_decode = layer.linear_decode(packed.spec, x, packed.tensors)
    got_prefill = layer.linear_prefill(packed.spec, x[None], packed.tensors)[0]
    got_parts = layer.linear_prefill_parts(packed.spec, x[None], packed.tensors)  # one part dequantized at a time
    assert [t.shape[-1] for t in got_parts] == [n for n, _ in shapes]
    assert torch.equal(torch.cat(got_parts, -1)[0], got_prefill)  # the same rows, scales and bias: bit for bit
    err = (got_decode - expected).abs().max().item()
    rel = ((got_decode - expected).norm() / expected.norm()).item()
    if exact:
        assert err <= 1e-5, err
        assert (got_prefill - expected).abs().max().item() <= 1e-4
    else:
        assert rel <= 1e-2, rel
    if packed.spec.absmax == "nested" and absmax == "keep":  # the 8-bit block scales are held once, not twice
        scales = packed.tensors[1].untyped_storage().data_ptr(), packed.tensors[2].untyped_storage().data_ptr()
        assert all((m.weight.quant_state.absmax.untyped_storage().data_ptr(),
                    m.weight.quant_state.state2.absmax.untyped_storage().data_ptr()) == scales for m in parts)
    # the plain path reads views of the fused storage now, and its outputs did not change by one bit
    assert all(torch.equal(m(x), b) for m, b in zip(parts, before, strict=True))
    assert all(m.weight.data.untyped_storage().data_ptr() == packed.tensors[0].untyped_storage().data_ptr()
               for m in parts)


# --- int8 (bitsandbytes LLM.int8 weights, weight-only in the fast path) ---------------------------------------


def int8_linear(n: int, k: int, seed: int, bias: bool = False) -> Any:
    bnb = pytest.importorskip("bitsandbytes")
    g = torch.Generator().manual_seed(seed)
    ref = torch.nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(n, k, generator=g) * (0.02 + 0.01 * seed))
    m = bnb.nn.Linear8bitLt(k, n, bias=bias, has_fp16_weights=False, threshold=6.0)
    m.load_state_dict(ref.state_dict())
    return m.to("cpu")  # quantizes: weight int8 (CB), weight.SCB the row absmax


@pytest.mark.parametrize("forward_first", [False, True])  # bitsandbytes moves CB/SCB to its state on a forward
def test_fused_int8_linear_equals_its_parts(forward_first: bool) -> None:
    """Fused int8 projection vs x @ (CB * SCB / 127).T + bias of each part (bitsandbytes' dequantization), in
    the decode (llm_core.dense_gemv with row scales; its torch reference on CPU) and the prefill form. Bound: fp32
    sums of the same products, <= 1e-5 absolute. The plain path then reads the fused storage, unchanged."""
    parts = [int8_linear(n, 96, seed=i, bias=(i == 1)) for i, n in enumerate((64, 32, 32))]
    x = torch.randn(1, 96, generator=torch.Generator().manual_seed(9))
    before = [m(x) for m in parts] if forward_first else None
    assert all(support.is_int8_linear(m) and support.int8_scb(m) is not None for m in parts)
    expected = torch.cat([x @ support.int8_weight_fp32(m).t() + (m.bias if m.bias is not None else 0)
                          for m in parts], -1)
    packed = pack.pack_linears(parts, FastDecodeOptions(), "bnb")
    assert packed.spec.fmt == "int8" and packed.tensors[0].dtype == torch.int8 and layer.tensor_count(packed.spec) == 3
    got_decode = layer.linear_decode(packed.spec, x, packed.tensors)
    got_prefill = layer.linear_prefill(packed.spec, x[None].expand(1, 3, -1), packed.tensors)[0]
    got_parts = layer.linear_prefill_parts(packed.spec, x[None].expand(1, 3, -1), packed.tensors)
    assert [t.shape[-1] for t in got_parts] == [64, 32, 32]
    assert (got_decode - expected).abs().max().item() <= 1e-5
    assert (got_prefill - expected).abs().max().item() <= 1e-5
    assert (torch.cat(got_parts, -1)[0] - expected).abs().max().item() <= 1e-5
    after = [m(x) for m in parts]
    if before is not None:
        assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))
    fused = packed.tensors[0].untyped_storage().data_ptr()
    assert all(m.weight.data.untyped_storage().data_ptr() == fused for m in parts)
    assert all(m.state.CB.untyped_storage().data_ptr() == fused for m in parts)  # what bnb.matmul reads


def test_int8_fast_path_computes_with_the_dequantized_weights() -> None:
    """The embedded model loaded with QUANTIZATION=int8: the fast path's teacher-forced scores against the fp32
    model whose linears hold bitsandbytes' dequantized int8 weights (CB * SCB / 127). Weight-only int8, fp16
    activations: relative L2 <= 2e-2 per position (measured 0.005; bitsandbytes' own LLM.int8 matmul, which also
    quantizes the activations, is 0.42 from the same reference on CPU, so the bound tells the two apart)."""
    q = load_model(make_settings(QUANTIZATION="int8").model)
    reference = load_model(make_settings(QUANTIZATION="none", COMPUTE_DTYPE="float32").model).model
    modules = dict(q.model.named_modules())
    replaced = 0
    for name, m in reference.named_modules():
        src = modules.get(name)
        if src is not None and support.is_int8_linear(src):
            m.weight.data = support.int8_weight_fp32(src)
            replaced += 1
    assert replaced == 7 * q.model.config.num_hidden_layers  # every projection; lm_head stays unquantized
    dec = FastDecoder(q, compile=False, max_cache_len=256)
    dec.warmup()
    assert {f.split("/")[0] for f in dec.describe()["linear_formats"]} == {"int8"} and dec.dtype == torch.float16
    ids = q.tokenizer("The capital of France is", return_tensors="pt").input_ids
    forced = q.tokenizer(" Paris, and the capital of Germany is Berlin.", return_tensors="pt").input_ids[0].tolist()
    got = forced_scores(dec, ids, forced)
    with torch.no_grad():
        want = reference(torch.cat([ids, torch.tensor([forced])], 1)).logits[0, ids.shape[1] - 1:].float()
    rel = ((got - want).norm(dim=-1) / want.norm(dim=-1)).max().item()
    assert rel <= 2e-2, rel
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_bnb_kernel_reads_the_fused_linear_too() -> None:
    parts = [nf4_linear(256, 256, seed=i) for i in range(3)]
    x = torch.randn(1, 256)
    expected = torch.cat([x @ dequantized(m).t() for m in parts], -1)
    for mode in ("fp32", "requant"):
        packed = pack.pack_linears(parts, FastDecodeOptions(gemv="bnb", absmax=mode), "bnb")
        got = layer.linear_decode(packed.spec, x, packed.tensors)
        assert ((got - expected).norm() / expected.norm()).item() <= (1e-5 if mode == "fp32" else 1e-2)


def test_compiled_attention_form_equals_the_matmul_form() -> None:
    spec = layer.LayerSpec(8, 2, 16, 0.25, 1e-5, 1e-5, None, (), True, "reduce")
    g = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(8, 16, generator=g), torch.randn(40, 2, 16, generator=g), torch.randn(40, 2, 16, generator=g)
    pos = torch.tensor([29])
    a = layer.decode_attention(spec, q, k, v, pos)
    b = layer.decode_attention(layer.LayerSpec(8, 2, 16, 0.25, 1e-5, 1e-5, None, (), True, "matmul"), q, k, v, pos)
    assert (a - b).abs().max().item() <= 1e-5


# --- GPU only ------------------------------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("quantization", ["none", "nf4", "none-triton", "bf16-triton", "int8"])
def test_cuda_graph_step_matches_the_eager_step(tmp_path: Any, quantization: str) -> None:
    """Compiled step in CUDA graphs vs the same step eager, teacher-forced on the same tokens (a random tiny llama,
    so the test needs no download). Bound: relative L2 of the scores <= 1e-4 in fp32, 2e-2 in NF4 + bf16, in
    bf16 (the *-triton cases force llm_core.dense_gemv in the graphs; eager runs cuBLAS) and in
    int8 + fp16 (llm_core.dense_gemv with row scales in both)."""
    from bench.decode import load
    from bench.harness import make_random_checkpoint

    folder = make_random_checkpoint("tiny", tmp_path / "tiny", torch.device("cuda"), 1024)
    forced_opts = FastDecodeOptions(dense_gemv="triton") if quantization.endswith(
        "triton") else None
    dtype = {"none": "float32", "none-triton": "float32", "int8": "float16"}.get(quantization, "bfloat16")
    quantization = quantization if quantization in ("nf4", "int8") else "none"
    loaded = load(str(folder), quantization, "cuda", tmp_path / "cache", dtype)
    ids = torch.randint(3, 500, (1, 300), generator=torch.Generator().manual_seed(0)).cuda()
    forced = torch.randint(3, 500, (20,), generator=torch.Generator().manual_seed(1)).tolist()
    eager = FastDecoder(loaded, compile=False, max_cache_len=512,
                        options=FastDecodeOptions(gemv="torch", dense_gemv="cublas"))
    eager.warmup()
    want = forced_scores(eager, ids, forced)
    del eager
    graphs = FastDecoder(loaded, max_cache_len=512, options=forced_opts)
    graphs.warmup()
    if forced_opts is not None:
        assert graphs.options.dense_gemv == "triton"
    got = forced_scores(graphs, ids, forced)
    bound = 1e-4 if dtype == "float32" else 2e-2
    assert ((got - want).norm(dim=-1) / want.norm(dim=-1)).max().item() <= bound


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("quantization", ["none", "nf4"])
def test_prefill_graphs_match_the_compiled_prefill(tmp_path: Any, quantization: str) -> None:
    """Padded prefill replayed from CUDA graphs vs the compiled prefill without graphs, teacher-forced on the same
    tokens, for prompt lengths below, at and past a 64-token bucket edge and past the option (plain path)."""
    from bench.decode import load
    from bench.harness import make_random_checkpoint

    folder = make_random_checkpoint("tiny", tmp_path / "tiny", torch.device("cuda"), 1024)
    loaded = load(str(folder), quantization, "cuda", tmp_path / "cache", "bfloat16")
    forced = torch.randint(3, 500, (8,), generator=torch.Generator().manual_seed(1)).tolist()
    plain = FastDecoder(loaded, max_cache_len=512, options=FastDecodeOptions(prefill_graph_tokens=0))
    plain.warmup()
    assert plain.describe()["prefill_graphs"] == []  # the compiled prefill: the reference
    graphs = FastDecoder(loaded, max_cache_len=512, options=FastDecodeOptions(prefill_graph_tokens=256))
    graphs.warmup()
    assert graphs.describe()["prefill_graphs"] == [64, 128, 192, 256]
    # the prefill pool's blocks sit idle between replays: counted, since memory_allocated does not show them
    assert graphs.graph_pool_idle_bytes() > plain.graph_pool_idle_bytes() >= 0
    for length in (30, 64, 65, 300):
        ids = torch.randint(3, 500, (1, length), generator=torch.Generator().manual_seed(length)).cuda()
        want = forced_scores(plain, ids, forced)
        got = forced_scores(graphs, ids, forced)
        assert ((got - want).norm(dim=-1) / want.norm(dim=-1)).max().item() <= 2e-2, length


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("absmax", ["keep", "fp32"])
def test_fused_projection_on_the_nf4_kernel_matches_the_reference_on_gpu(absmax: str) -> None:
    """q/k/v-style parts fused (nested absmax kept exactly per part, or dequantized to fp32) through
    llm_core.nf4_gemv, against the torch formula on the same packing."""
    if attention.triton is None:
        pytest.skip("triton not installed")
    parts = [nf4_linear(n, 4096, seed=i).cuda() for i, n in enumerate((4096, 1024, 1024))]
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    ref = pack.pack_linears(parts, FastDecodeOptions(absmax=absmax), "torch")
    tri = pack.pack_linears(parts, FastDecodeOptions(absmax=absmax), "nf4")
    want = layer.linear_decode(ref.spec, x, ref.tensors).float()
    got = layer.linear_decode(tri.spec, x, tri.tensors).float()
    assert ((got - want).norm() / want.norm()).item() <= 1e-2


def test_fp32_reference_restores_the_model_and_calibrates_agreement(tmp_path: Any) -> None:
    """The bench's calibrated logit check: the same NF4 weights computing in fp32 are the reference; the model is
    put back exactly afterwards (same tensors, so storage shared with the fast path stays shared)."""
    from bench.decode import agreement, fp32_compute, load
    from bench.harness import make_random_checkpoint

    folder = make_random_checkpoint("tiny", tmp_path / "tiny", torch.device("cpu"), 256)
    loaded = load(str(folder), "nf4", "cpu", tmp_path / "cache", "bfloat16")
    model = loaded.model
    before = {name: p.data.data_ptr() for name, p in model.named_parameters()}
    ids = torch.randint(3, 500, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        bf16 = model(input_ids=ids).logits
        with fp32_compute(model):
            fp32 = model(input_ids=ids).logits
    assert bf16.dtype == torch.bfloat16 and fp32.dtype == torch.float32
    assert 0 < ((bf16.float() - fp32).norm() / fp32.norm()).item() < 0.05
    assert {name: p.data.data_ptr() for name, p in model.named_parameters()} == before
    assert all(p.dtype != torch.float32 for p in model.parameters() if p.is_floating_point())
    decoder = FastDecoder(loaded, compile=False, max_cache_len=128, options=FastDecodeOptions(gemv="bnb"))
    decoder.warmup()
    result = agreement(decoder, loaded, ids, [5, 6, 7, 8])
    assert result["seed_vs_fp32_max_rel_l2"] > 0 and result["ours_vs_fp32_max_rel_l2"] > 0
    assert result["within_calibrated_bound"]  # on CPU our bf16 path is as close to fp32 as the seed's


@pytest.mark.gpu
@needs_cuda
def test_re_sizing_the_cache_leaves_no_memory_behind(tmp_path: Any) -> None:
    """Start-up sizing re-allocates the cache and re-captures its graphs several times: back at the first size the
    device holds what it held there before (within 2 MiB). Each capture's warm-up on a new side stream used to keep
    a cuBLAS workspace per stream for good (32 MiB each on Hopper); FastDecoder.side_stream is reused instead."""
    from bench.decode import load
    from bench.harness import make_random_checkpoint

    folder = make_random_checkpoint("tiny", tmp_path / "tiny", torch.device("cuda"), 2048)
    loaded = load(str(folder), "nf4", "cuda", tmp_path / "cache", "bfloat16")
    decoder = FastDecoder(loaded, max_cache_len=2048, options=FastDecodeOptions(prefill_graph_tokens=256))
    decoder.warmup(512)
    decoder.resize_cache(1024)
    decoder.resize_cache(512)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    for tokens in (1024, 2048, 768, 512):
        decoder.resize_cache(tokens)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    assert torch.cuda.memory_allocated() - before <= 2 * 2**20, torch.cuda.memory_allocated() - before


@pytest.mark.parametrize("kv_cache", ["bf16", "int8"])
def test_later_prefill_chunks_read_the_prefix_back_a_head_group_at_a_time(tmp_path: Any, kv_cache: str) -> None:
    """A model with 16 K/V heads (more than PREFIX_HEADS): a prompt prefilled in 64-token chunks reads the cached
    prefix back 8 heads at a time (a quarter of the temporary for a 32-head model). The last position's scores equal
    the same chunks read back all heads at once exactly, and equal one whole-prompt pass (fp32, bf16 cache), or
    within the int8 cache's rounding."""
    from bench.decode import load
    from bench.harness import make_random_checkpoint
    from llm_core.fast import FastDecodeOptions
    from llm_core.fast import layer as layer_module

    shape = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=16,
                 num_key_value_heads=16, vocab_size=512, rope_theta=10000.0, rms_norm_eps=1e-5)
    folder = make_random_checkpoint(shape, tmp_path / "mha", torch.device("cpu"), 1024)
    loaded = load(str(folder), "none", "cpu", tmp_path / "cache", "float32")
    ids = torch.randint(3, 500, (300,), generator=torch.Generator().manual_seed(0))

    def scores(chunk: int | None, heads: int) -> torch.Tensor:
        options = FastDecodeOptions(prefill_chunk_tokens=chunk, kv_cache=kv_cache)
        dec = FastDecoder(loaded, compile=False, max_cache_len=512, options=options)
        dec.warmup()
        old, layer_module.PREFIX_HEADS = layer_module.PREFIX_HEADS, heads
        try:
            with dec.outside_reply():
                return dec.prefill_scores(ids, penalties=False).clone()
        finally:
            layer_module.PREFIX_HEADS = old

    grouped, together, whole = scores(64, 8), scores(64, 16), scores(None, 8)
    assert torch.equal(grouped, together)
    if kv_cache == "bf16":
        torch.testing.assert_close(grouped, whole, rtol=1e-4, atol=1e-4)
    else:
        assert (grouped - whole).norm() / whole.norm() < 0.05


@pytest.mark.parametrize("kv_cache", ["bf16", "int8"])
def test_later_prefill_chunks_with_split_prefix_attention_score_as_gather(tmp_path: Any, kv_cache: str,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """PREFIX_ATTENTION=split through the fast path's prefill (CPU, fp32, eager): every layer spec carries the split
    form, and a prompt prefilled in 64-token chunks (a split bucket of 96 keys: whole buckets and a rest of 0-95
    keys) scores as with the default (gather: the masked form), to fp32 rounding, for grouped K/V heads, with a
    bf16-rows or an int8 cache."""
    from bench.decode import load
    from bench.harness import make_random_checkpoint
    from llm_core.fast import FastDecodeOptions, generate

    monkeypatch.setattr(generate, "PREFIX_SPLIT_BUCKET", 96)

    shape = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
                 num_key_value_heads=2, vocab_size=512, rope_theta=10000.0, rms_norm_eps=1e-5)
    folder = make_random_checkpoint(shape, tmp_path / "gqa", torch.device("cpu"), 1024)
    loaded = load(str(folder), "none", "cpu", tmp_path / "cache", "float32")
    ids = torch.randint(3, 500, (300,), generator=torch.Generator().manual_seed(0))

    def scores(choice: str) -> torch.Tensor:
        options = FastDecodeOptions(prefill_chunk_tokens=64, kv_cache=kv_cache, prefix_attention=choice)
        dec = FastDecoder(loaded, compile=False, max_cache_len=512, options=options)
        dec.warmup()
        assert all(spec.prefix_split == ("flash" if choice == "split" else "") for spec in dec._layer_specs)
        assert all(spec.prefix_split_bucket == 96 for spec in dec._layer_specs)
        with dec.outside_reply():
            return dec.prefill_scores(ids, penalties=False).clone()

    torch.testing.assert_close(scores("split"), scores("gather"), rtol=1e-4, atol=1e-4)
