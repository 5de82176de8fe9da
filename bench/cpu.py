"""CPU decode: our engine (default settings, through ChatEngine) beside llama.cpp on the same model, same prompt ids,
same thread count, in one run. Each engine runs in its own process (peak RSS is per process).

    python -m bench.cpu --llama-python /work/llamacpp-venv/bin/python      # embedded model + a 1B-class random model
    python -m bench.cpu --smoke                                            # CI: a tiny random model, ours only

Models: the embedded SmolLM2-135M-Instruct (ours loads its safetensors conversion; llama.cpp reads the Q4_1 GGUF we
ship) and a random-weight Llama-3.2-1B shape (hidden 2048, 16 layers, 32 heads, 8 KV heads, MLP 8192, vocab 128256,
tied embeddings), saved as bf16 safetensors for ours and written to GGUF (f16) with the gguf package, then made Q4_1
by llama_cpp.llama_model_quantize for llama.cpp. Ours runs the demo's defaults: QUANTIZATION=nf4 asked, which the
CPU path serves as int4 (docs/cpu.md); greedy, repetition penalty 1.05 on both sides.
Per reply: TTFT = stream_chat called -> first token (ours: chat template + tokenizing included; llama.cpp: from token
ids), decode tok/s = (N - 1) / (last token - first token), peak RSS = VmHWM reset just before the reply (whole
process: weights included). Medians over prompts x repeats.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
PROMPTS = (
    "What is the capital of France? Answer in one sentence.",
    "Write a short story about a robot learning to paint.",
    "Explain why the sky is blue to a ten-year-old, in three sentences.",
)
SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, rms_norm_eps=1e-5),
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, rope_theta=10000.0, rms_norm_eps=1e-5),
}
REPETITION_PENALTY = 1.05  # the demo's default


# --- models -------------------------------------------------------------------------------------------------------


def make_checkpoint(shape_name: str, folder: Path) -> Path:
    """A random-weight llama of `shape_name` with tied embeddings (bf16 safetensors + a word-level tokenizer t0..tV
    with a plain chat template), loaded by the demo like any local folder."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    if (folder / "config.json").is_file():
        return folder
    shape = dict(SHAPES[shape_name])
    theta = shape.pop("rope_theta")
    cfg = LlamaConfig(**shape, max_position_embeddings=8192, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                      tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": theta})
    torch.manual_seed(0)
    model = LlamaForCausalLM._from_config(cfg, dtype=torch.bfloat16)
    with torch.no_grad():  # std 0.02 everywhere: activations stay finite through every layer
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.02)
    model.save_pretrained(folder, safe_serialization=True)
    vocab = {f"t{i}": i for i in range(cfg.vocab_size)}
    tok = Tokenizer(WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", pad_token="t0", bos_token="t1",
                                   eos_token="t2")
    fast.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    fast.save_pretrained(folder)
    return folder


def write_gguf(folder: Path, out: Path) -> Path:
    """The checkpoint in folder as an f16 GGUF (llama architecture, tensors named and q/k permuted as llama.cpp's
    convert_hf_to_gguf.py writes them; the word-level vocabulary as a plain token list)."""
    import gguf
    from safetensors.torch import load_file
    from transformers import AutoConfig

    if out.is_file():
        return out
    cfg = AutoConfig.from_pretrained(folder)
    state = load_file(str(folder / "model.safetensors"))
    n_head, n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
    w = gguf.GGUFWriter(str(out), "llama")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_rope_dimension_count(cfg.hidden_size // n_head)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    w.add_tokenizer_model("llama")
    w.add_token_list([f"t{i}" for i in range(cfg.vocab_size)])
    w.add_token_scores([0.0] * cfg.vocab_size)
    w.add_token_types([gguf.TokenType.NORMAL] * cfg.vocab_size)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)

    def permute(t: torch.Tensor, heads: int) -> torch.Tensor:  # HF rotate-half layout -> GGML's interleaved RoPE
        return t.reshape(heads, 2, t.shape[0] // heads // 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)

    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    w.add_tensor("token_embd.weight", state["model.embed_tokens.weight"].to(torch.float16).numpy())
    w.add_tensor("output_norm.weight", state["model.norm.weight"].float().numpy())
    for i in range(cfg.num_hidden_layers):
        for hf, gg in names.items():
            t = state[f"model.layers.{i}.{hf}.weight"]
            if hf == "self_attn.q_proj":
                t = permute(t, n_head)
            elif hf == "self_attn.k_proj":
                t = permute(t, n_kv)
            arr = t.float().numpy() if t.dim() == 1 else t.to(torch.float16).numpy()
            w.add_tensor(f"blk.{i}.{gg}.weight", arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def gguf_types(path: Path) -> dict[str, int]:
    """Tensor type -> count in a GGUF file (what llama.cpp computes with)."""
    import gguf

    counts: dict[str, int] = {}
    for t in gguf.GGUFReader(str(path)).tensors:
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    return counts


# --- ours (a worker process) ----------------------------------------------------------------------------------------


def _status_bytes(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _vm_hwm() -> int:
    return _status_bytes("VmHWM")


def _vm_rss() -> int:
    """RSS with the runtime imported and no model: what the process holds before any weight."""
    return _status_bytes("VmRSS")


def run_ours(model: str | None, prompts: list[str], new_tokens: int, threads: int, repeats: int,
             cache_dir: str) -> dict[str, Any]:
    """The demo's defaults on CPU through ChatEngine: the same object app.py serves."""
    from llm_core.config import Settings
    from llm_core.engine.chat import ChatEngine

    torch.set_num_threads(threads)
    import transformers  # noqa: F401 - imported before the baseline, as the engine imports it

    baseline = _vm_rss()
    env = {"DEVICE": "cpu", "CACHE_DIR": cache_dir, **({"MODEL_ID": model} if model else {})}
    settings = Settings.from_env(environ=env, env_file=None)
    t0 = time.perf_counter()
    engine = ChatEngine.load(settings)
    load_s = time.perf_counter() - t0
    load_peak = _vm_hwm()
    gen = engine.request_options(max_new_tokens=new_tokens, min_new_tokens=new_tokens)
    replies, prompt_ids = [], []
    for p, text in enumerate(prompts):
        messages = [{"role": "system", "content": settings.chat.system_prompt}] if settings.chat.system_prompt else []
        ids = engine.count_tokens([*messages, {"role": "user", "content": text}])
        encoded = engine.encode_messages([*messages, {"role": "user", "content": text}])
        prompt_ids.append(encoded["input_ids"][0].tolist())
        for _ in range(repeats):
            final = collections.deque(engine.stream_chat(text, [], gen=gen, history_turns=0), maxlen=1)[0]
            assert final.done
            s = final.stats
            assert s.prompt_tokens == ids
            replies.append({"prompt": p, "prompt_tokens": s.prompt_tokens, "new_tokens": s.new_tokens,
                            "ttft_s": s.ttft_s, "decode_tokens_per_s": s.decode_tokens_per_s,
                            "peak_rss_bytes": s.peak_rss_bytes, "token_ids": list(final.token_ids[:16])})
    report = engine.report
    return {"engine": "ours", "decode_path": report.decode_path, "decode_path_reason": report.decode_path_reason,
            "quantization": report.quantization, "weights_bytes": report.weights_bytes, "load_s": load_s,
            "warmup_s": report.warmup_s, "baseline_rss_bytes": baseline, "load_peak_rss_bytes": load_peak,
            "threads": torch.get_num_threads(),
            "versions": report.versions, "replies": replies, "prompt_ids": prompt_ids}


# --- orchestration ---------------------------------------------------------------------------------------------


def _median(replies: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in replies if r.get(key) is not None]
    return statistics.median(values) if values else None


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    replies = result["replies"]
    return {"decode_tokens_per_s": _median(replies, "decode_tokens_per_s"), "ttft_s": _median(replies, "ttft_s"),
            "peak_rss_bytes": _median(replies, "peak_rss_bytes"),
            "load_peak_rss_bytes": result.get("load_peak_rss_bytes"),
            "baseline_rss_bytes": result.get("baseline_rss_bytes"), "replies": len(replies)}


def _worker(argv: list[str]) -> dict[str, Any]:
    out = subprocess.run(argv, capture_output=True, text=True, check=False, cwd=REPO)
    if out.returncode != 0:
        raise RuntimeError(f"{argv[:4]} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def machine() -> dict[str, Any]:
    cpu = platform.processor()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "load_avg_1_5_15": os.getloadavg(), "python": sys.version.split()[0],
            "torch": torch.__version__}


def bench_model(name: str, model: str | None, gguf_file: Path | None, prompts: list[str], args: argparse.Namespace,
                work: Path) -> dict[str, Any]:
    job = {"model": model, "prompts": prompts, "new_tokens": args.tokens, "threads": args.threads,
           "repeats": args.repeats, "cache_dir": str(args.cache_dir)}
    job_file = work / f"{name}-ours.json"
    job_file.write_text(json.dumps(job))
    load_before_ours = os.getloadavg()  # the 1/5/15-minute load as each side starts (the machine may be shared)
    ours = _worker([sys.executable, "-m", "bench.cpu", "--worker", str(job_file)])
    row: dict[str, Any] = {"model": name, "ours": ours, "ours_summary": summarize(ours),
                           "load_avg_1_5_15_before": {"ours": load_before_ours}}
    if gguf_file is not None and args.llama_python:
        ljob = work / f"{name}-llama.json"
        ljob.write_text(json.dumps({"prompts": ours["prompt_ids"], "new_tokens": args.tokens, "threads": args.threads,
                                    "repeats": args.repeats, "repetition_penalty": REPETITION_PENALTY}))
        row["load_avg_1_5_15_before"]["llama_cpp"] = os.getloadavg()
        llama = _worker([args.llama_python, str(REPO / "bench" / "cpu_llamacpp.py"), "run", str(gguf_file),
                         str(ljob)])
        llama["gguf_tensor_types"] = gguf_types(gguf_file)
        row["llama_cpp"] = llama
        row["llama_cpp_summary"] = summarize(llama)
        o, r = row["ours_summary"], row["llama_cpp_summary"]
        row["ratio_decode_ours_over_llama"] = o["decode_tokens_per_s"] / r["decode_tokens_per_s"]
        row["ratio_ttft_ours_over_llama"] = o["ttft_s"] / r["ttft_s"]
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny random model, ours only, a few tokens (CI)")
    ap.add_argument("--llama-python", help="python of a venv with llama-cpp-python (for the comparison)")
    ap.add_argument("--models", default="embedded,llama-3.2-1b")
    ap.add_argument("--tokens", type=int, default=128, help="new tokens per reply")
    ap.add_argument("--repeats", type=int, default=2, help="replies per prompt")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cache-dir", type=Path, default=Path(os.environ.get("LLM_CORE_BENCH_CACHE",
                                                                         REPO / ".cache" / "bench")))
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        job = json.loads(Path(args.worker).read_text())
        print(json.dumps(run_ours(job["model"], job["prompts"], job["new_tokens"], job["threads"], job["repeats"],
                                  job["cache_dir"])))
        return 0
    args.cache_dir.mkdir(parents=True, exist_ok=True)
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    load_at_start = os.getloadavg()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if args.smoke:
            folder = make_checkpoint("tiny", args.cache_dir / "tiny-cpu")
            args.tokens, args.repeats, args.llama_python = min(args.tokens, 8), 1, None
            rows.append(bench_model("tiny", str(folder), None, ["t5 t6 t7 t8 t9 t30 t31"], args, work))
        else:
            for name in args.models.split(","):
                if name == "embedded":
                    from llm_core.models import embedded_gguf_path

                    rows.append(bench_model(name, None, embedded_gguf_path(), list(PROMPTS), args, work))
                    continue
                folder = make_checkpoint(name, args.cache_dir / name)
                f16 = write_gguf(folder, args.cache_dir / f"{name}.f16.gguf")
                q4 = args.cache_dir / f"{name}.Q4_1.gguf"
                if args.llama_python and not q4.is_file():
                    subprocess.run([args.llama_python, str(REPO / "bench" / "cpu_llamacpp.py"), "quantize", str(f16),
                                    str(q4)], check=True)
                vocab = SHAPES[name]["vocab_size"]
                words = [" ".join(f"t{(97 * i + 13 * j) % (vocab - 10) + 10}" for j in range(40)) for i in range(3)]
                rows.append(bench_model(name, str(folder), q4, words, args, work))
    result = {"bench": "cpu", "started": started, "command": " ".join(["python -m bench.cpu", *(argv or sys.argv[1:])]),
              "machine": machine(), "load_avg_1_5_15_at_start": load_at_start, "new_tokens": args.tokens,
              "repeats": args.repeats, "threads": args.threads, "models": rows}
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    for row in rows:
        o = row["ours_summary"]
        line = (f"{row['model']}: ours {o['decode_tokens_per_s']:.1f} tok/s, TTFT {o['ttft_s'] * 1e3:.0f} ms, "
                f"peak RSS {o['peak_rss_bytes'] / 2**20:.0f} MiB")
        if "llama_cpp_summary" in row:
            r = row["llama_cpp_summary"]
            ratio = row["ratio_decode_ours_over_llama"]
            line += (f" | llama.cpp {r['decode_tokens_per_s']:.1f} tok/s, TTFT {r['ttft_s'] * 1e3:.0f} ms, "
                     f"peak RSS {r['peak_rss_bytes'] / 2**20:.0f} MiB | decode x{ratio:.2f}")
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
