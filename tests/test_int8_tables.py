"""The int8 token table and lm_head (llm_core.fast.tables): accuracy on the embedded model, the memory it saves,
the fast path reading it (CPU eager here; CUDA graphs, single and batched, in the `gpu` tests) and the int8_mm
kernel of the batched head.

Bound (docs/memory.md): on the embedded model (tied table, 49,152 x 576, NF4 layers, bf16), over 1,024 tokens of
docs/memory.md, the int8 table against the bf16 one: top-1 agreement >= 0.93 (measured 0.952), mean KL <= 0.01
(0.0042), max |logit diff| <= 2.5 (1.5; logits reach 43)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from bench.probes import forced_scores
from llm_core.fast import FastDecodeOptions, FastDecoder
from llm_core.fast.kernels import int8_mm as mm
from llm_core.fast.tables import (
    TableEmbedding,
    TableHead,
    dequantize_rows,
    embed_rows,
    quantize_rows_int8,
    quantize_token_tables,
)
from llm_core.loading import load_model, wants_int8_token_tables
from llm_core.memory.model import model_weights_bytes
from tests.conftest import REPO, make_settings

TINY = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=4096, rope_theta=10000.0, rms_norm_eps=1e-5)


def test_rows_quantize_symmetrically_per_row() -> None:
    """Each row's largest |w| maps to +-127; the dequantized table is within half a step of every weight."""
    w = torch.randn(300, 64) * torch.linspace(0.01, 3.0, 300)[:, None]
    q, scale = quantize_rows_int8(w)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (300,)
    assert torch.equal(q.abs().amax(-1), torch.full((300,), 127, dtype=torch.int8))
    assert ((dequantize_rows(q, scale, torch.float32) - w).abs() <= scale[:, None] / 2 + 1e-7).all()
    ids = torch.tensor([[3, 299, 0]])
    assert torch.equal(embed_rows(ids, [q, scale], torch.float32), dequantize_rows(q, scale, torch.float32)[ids])


def test_int8_table_on_the_embedded_model_is_within_the_stated_bound() -> None:
    """Plain forward of the embedded model (NF4, bf16) before and after quantize_token_tables on the same weights:
    the bound above holds; the tied table is one int8 table (half the bytes, counted by the memory guard's weight
    count), and greedy generate still runs on the replaced modules."""
    loaded = load_model(make_settings().model)  # DECODE_PATH=plain: tables as loaded
    model = loaded.model
    assert not isinstance(model.lm_head, TableHead)
    text = (REPO / "docs" / "memory.md").read_text()[:6000]
    ids = loaded.tokenizer(text, return_tensors="pt").input_ids[:, :1024]
    assert ids.shape[1] == 1024
    weights_before = model_weights_bytes(model)
    with torch.inference_mode():
        ref = model(input_ids=ids).logits.float()
        info = quantize_token_tables(model)
        got = model(input_ids=ids).logits.float()
        out = model.generate(input_ids=ids[:, :12], attention_mask=torch.ones_like(ids[:, :12]), max_new_tokens=4,
                             do_sample=False)
    assert info["tied"] and isinstance(model.model.embed_tokens, TableEmbedding)
    assert model.model.embed_tokens.table is model.lm_head.table  # one table for both
    vocab, hidden = 49152, 576
    assert info["bytes_before"] == vocab * hidden * 2 and info["bytes_after"] == vocab * hidden + vocab * 4
    # the guard counts storages: a loaded norm may share one with the old table (95% of the saving measured)
    saved = info["bytes_before"] - info["bytes_after"]
    assert 0.9 * saved <= weights_before - model_weights_bytes(model) <= saved
    assert out.shape == (1, 16)
    top1 = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    logp, logq = ref.log_softmax(-1), got.log_softmax(-1)
    kl = (logp.exp() * (logp - logq)).sum(-1).mean().item()
    assert top1 >= 0.93, top1
    assert kl <= 0.01, kl
    assert (got - ref).abs().max().item() <= 2.5


def test_int8_token_table_default_follows_the_fast_path() -> None:
    """auto: on for nf4/int8 where the CUDA fast path serves; off on CPU, with DECODE_PATH=plain, for unquantized
    weights and with MAX_MEMORY offload; true/false as set (never with offload)."""
    from llm_core.fit import load_config

    config = load_config("")
    cuda, cpu = torch.device("cuda"), torch.device("cpu")

    def want(device: torch.device, **values: str) -> bool:
        return wants_int8_token_tables(make_settings(**{"DECODE_PATH": "auto", **values}).model, device, config)

    assert want(cuda) and want(cuda, QUANTIZATION="int8")
    assert not want(cpu) and not want(cuda, DECODE_PATH="plain") and not want(cuda, QUANTIZATION="none")
    assert not want(cuda, MAX_MEMORY="0=4GiB,cpu=8GiB")
    assert want(cpu, INT8_TOKEN_TABLE="true") and not want(cuda, INT8_TOKEN_TABLE="false")


def test_fit_counts_the_int8_tables() -> None:
    """The fit report's weights: a byte per table weight plus an fp32 scale per row on the fast path (Llama-3-8B:
    two 128,256 x 4096 tables, 1.05 GB less than bf16); INT8_TOKEN_TABLE=false keeps bf16."""
    from transformers import LlamaConfig

    from llm_core.fit import estimate_weights_bytes, fit_config

    cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072,
                      tie_word_embeddings=False)
    bf16, int8 = estimate_weights_bytes(cfg), estimate_weights_bytes(cfg, int8_tables=True)
    assert bf16 - int8 == 2 * (128256 * 4096 * 2 - (128256 * 4096 + 128256 * 4))
    on, off = fit_config(cfg, 8 * 2**30), fit_config(cfg, 8 * 2**30, int8_token_table=False)
    assert on.weights_bytes == int8 and off.weights_bytes == bf16
    assert "token table and lm_head int8" in on.decode_path_reason
    assert on.static_cache_tokens > off.static_cache_tokens


def _tiny_loaded(tmp_path: Path, device: str, **values: str) -> Any:
    from bench.harness import make_random_checkpoint

    ckpt = make_random_checkpoint(TINY, tmp_path / "ckpt", torch.device(device), 1024)
    settings = make_settings(MODEL_ID=str(ckpt), DEVICE=device, INT8_TOKEN_TABLE="true", **values).model
    return load_model(settings)


def _plain_scores(model: Any, ids: torch.Tensor, forced: list[int]) -> torch.Tensor:
    """The plain forward's logits (the int8 modules' own torch form) at the positions forced_scores scores."""
    full = torch.cat([ids, torch.tensor([forced], device=ids.device)], dim=1)
    with torch.inference_mode():
        logits = model(input_ids=full).logits[0].float()
    return logits[ids.shape[1] - 1:]


def test_fast_path_reads_the_int8_tables_on_cpu(tmp_path: Any) -> None:
    """The eager fast path on CPU over an int8-table model (untied): its head and embedding read the int8 rows in
    place (no half-precision copy) and its teacher-forced scores equal the plain forward's on the same modules."""
    loaded = _tiny_loaded(tmp_path, "cpu", QUANTIZATION="none", COMPUTE_DTYPE="float32")
    assert isinstance(loaded.model.lm_head, TableHead) and not loaded.extra["token_tables"]["tied"]
    dec = FastDecoder(loaded, compile=False, max_cache_len=256, options=FastDecodeOptions(prefill_graph_tokens=0))
    assert dec._head_spec.lm.fmt == "int8" and dec._lm_tensors[0] is loaded.model.lm_head.table.q
    assert dec._embed[0] is loaded.model.model.embed_tokens.table.q
    ids = torch.randint(3, 4000, (1, 40), generator=torch.Generator().manual_seed(0))
    forced = torch.randint(3, 4000, (6,), generator=torch.Generator().manual_seed(1)).tolist()
    got = forced_scores(dec, ids, forced)
    torch.testing.assert_close(got, _plain_scores(loaded.model, ids, forced), atol=1e-4, rtol=1e-4)


def test_each_decoder_compiles_its_own_code(tmp_path: Any) -> None:
    """Dynamo keeps at most recompile_limit graphs per code object: decoders sharing the closure's code ran the
    later ones' prefill into the limit (fullgraph: on the H200's test run the prefill graphs of the bf16 case were
    then off). Each decoder's compiled functions get a code object of their own: with a limit of 5 (one decoder
    needs at most 5 prefill graphs), three decoders of different specs all compile their prefill (with the shared
    code the second one failed)."""
    from dataclasses import replace

    loaded = _tiny_loaded(tmp_path, "cpu", QUANTIZATION="none", COMPUTE_DTYPE="float32")
    ids = torch.randint(3, 4000, (1, 20), generator=torch.Generator().manual_seed(0))
    opts = FastDecodeOptions(compile_backend="eager", prefill_graph_tokens=0)
    with torch._dynamo.config.patch(recompile_limit=5):
        for o in (opts, replace(opts, fuse=False), replace(opts, kv_cache="int8")):
            dec = FastDecoder(loaded, compile=True, max_cache_len=256, options=o)
            dec.warmup()
            forced_scores(dec, ids, [5, 6])
            assert dec._prefill_compiled_ok and not any("prefill eager" in n for n in dec.notes), dec.notes


# --- GPU ------------------------------------------------------------------------------------------------------------

needs_gpu = pytest.mark.skipif(not (torch.cuda.is_available() and mm.triton is not None),
                               reason="needs a CUDA GPU with Triton")


@pytest.mark.skipif(mm.triton is None, reason="needs the triton package (requirements-dev.txt)")
@pytest.mark.parametrize("config", mm.CONFIGS if mm.triton is not None else [])
def test_int8_mm_kernel_compiles_for_hopper(config: tuple[int, int, int, int]) -> None:
    """Compile (not run) every autotuning config for sm_90 on CPU, with the argument types int8_mm passes."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    bn, bk, _, _ = config
    signature = {"x_ptr": "*bf16", "w_ptr": "*i8", "s_ptr": "*fp32", "y_ptr": "*bf16", "M": "i32", "N": "i32",
                 "K": "i32"}
    for block_m in (16, 32):
        constexprs = dict(BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=bk)
        sig = {**signature, **{name: "constexpr" for name in constexprs}}
        mm.triton.compile(ASTSource(fn=mm._int8_mm_kernel, signature=sig, constexprs=constexprs),
                          target=GPUTarget("cuda", 90, 32))


@pytest.mark.gpu
@needs_gpu
def test_gpu_int8_mm_matches_the_torch_form_at_every_m() -> None:
    """Llama-3-8B's head shape (128,256 x 4096) and a ragged one: llm_core.int8_mm against the chunked dequantize +
    fp32 matmul at M = 2..32, and inside a CUDA graph."""
    for n, k in ((128256, 4096), (1000, 576)):
        q, scale = quantize_rows_int8(torch.randn(n, k, device="cuda"))
        ref_w = dequantize_rows(q, scale, torch.float32)
        for m in range(2, 33):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            got = torch.ops.llm_core.int8_mm(x, q, scale).float()
            want = x.float() @ ref_w.T
            assert ((got - want).norm() / want.norm()).item() < 5e-3, (n, m)
    x = torch.randn(8, 4096, device="cuda", dtype=torch.bfloat16)
    q, scale = quantize_rows_int8(torch.randn(128256, 4096, device="cuda"))
    eager = torch.ops.llm_core.int8_mm(x, q, scale)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.ops.llm_core.int8_mm(x, q, scale)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


@pytest.mark.gpu
@needs_gpu
def test_gpu_fast_path_with_int8_tables_matches_the_plain_forward(tmp_path: Any) -> None:
    """CUDA graphs, NF4 layers, int8 tables: the single-reply step's teacher-forced scores against the plain forward
    of the same modules (relative L2 <= 2e-2 per position, bf16), and the batched head at 4 rows equal to each row's
    own single-row head (greedy tokens)."""
    from llm_core.fast.batched import head_rows

    loaded = _tiny_loaded(tmp_path, "cuda", QUANTIZATION="nf4")
    dec = FastDecoder(loaded, max_cache_len=512, options=FastDecodeOptions(prefill_graph_tokens=128))
    dec.warmup()
    assert dec._head_spec.lm.fmt == "int8" and dec.describe()["prefill_graphs"] == [64, 128]
    ids = torch.randint(3, 4000, (1, 100), generator=torch.Generator().manual_seed(0)).cuda()
    forced = torch.randint(3, 4000, (12,), generator=torch.Generator().manual_seed(1)).tolist()
    got = forced_scores(dec, ids, forced)
    want = _plain_scores(loaded.model, ids, forced)
    assert ((got - want).norm(dim=-1) / want.norm(dim=-1)).max().item() <= 2e-2
    hn = torch.randn(4, TINY["hidden_size"], device="cuda", dtype=torch.bfloat16)
    seen = torch.zeros(4, TINY["vocab_size"], dtype=torch.bool, device="cuda")
    ones, bias = torch.ones(4, 1, device="cuda"), torch.zeros(4, TINY["vocab_size"], device="cuda")
    scores, tokens = head_rows(dec._head_spec, hn, dec._lm_tensors, seen, ones, bias)
    for r in range(4):
        one, tok = head_rows(dec._head_spec, hn[r:r + 1], dec._lm_tensors, seen[r:r + 1], ones[r:r + 1],
                             bias[r:r + 1])
        torch.testing.assert_close(scores[r:r + 1], one, atol=2e-2, rtol=1e-2)
        assert int(tok) == int(tokens[r])


def test_cpu_interpreter_runs_the_int8_mm_kernel() -> None:
    """The kernel's arithmetic under Triton's interpreter in a child process (TRITON_INTERPRET is read at import):
    ragged N and K, M = 2 and 17, against the torch form."""
    if mm.triton is None:
        pytest.skip("Triton is not installed")
    import os
    import subprocess
    import sys

    code = (
        "import torch\n"
        "from llm_core.fast.kernels.int8_mm import int8_mm, int8_rows_reference\n"
        "from llm_core.fast.tables import quantize_rows_int8\n"
        "torch.manual_seed(0)\n"
        "for m in (2, 17):\n"
        "    q, s = quantize_rows_int8(torch.randn(200, 160))\n"
        "    x = torch.randn(m, 160)\n"
        "    got = int8_mm(x, q, s, config=(64, 64, 4, 1))\n"
        "    want = x @ (q.float() * s[:, None]).T\n"
        "    assert ((got - want).norm() / want.norm()).item() < 1e-5, m\n"
        "    assert torch.allclose(int8_rows_reference(x, q, s, chunk_rows=64), want, atol=1e-4)\n"
        "print('ok')\n")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0 and "ok" in run.stdout, run.stdout[-2000:] + run.stderr[-3000:]


