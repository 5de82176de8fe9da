"""llama.cpp's side of bench.cpu, run by the Python that has llama-cpp-python (a separate venv: it is not a dependency
of the demo). Standalone: imports only llama_cpp and the standard library.

    python bench/cpu_llamacpp.py quantize SRC.gguf DST.gguf          # Q4_1, as the embedded model's file
    python bench/cpu_llamacpp.py run MODEL.gguf JOB.json              # prints one JSON object

JOB: {"prompts": [[ids...], ...], "new_tokens": N, "threads": T, "repeats": R, "repetition_penalty": P}.
Per reply: TTFT = generate() called -> first token yielded (prompt as token ids: prefill + first sample);
decode tok/s = (N - 1) / (token N's arrival - token 1's); peak RSS = the process's VmHWM, reset (clear_refs 5) just
before the reply, as llm_core's PeakMeter does for ours. EOS does not end a reply (N tokens each, as min_new_tokens
does on our side).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def _status_bytes(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _reset_hwm() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def quantize(src: str, dst: str) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_1
    params.nthread = 2
    rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), params)
    if rc != 0:
        raise SystemExit(f"llama_model_quantize failed: {rc}")


def run(model: str, job_file: str) -> dict:
    import llama_cpp
    from llama_cpp import Llama

    job = json.loads(Path(job_file).read_text())
    baseline = _status_bytes("VmRSS")  # llama_cpp imported, no model
    threads, n = int(job["threads"]), int(job["new_tokens"])
    t0 = time.perf_counter()
    llm = Llama(model_path=model, n_threads=threads, n_threads_batch=threads, n_ctx=int(job.get("n_ctx", 2048)),
                verbose=False)
    load_s = time.perf_counter() - t0
    load_peak = _status_bytes("VmHWM")
    replies = []
    for p, ids in enumerate(job["prompts"]):
        for _ in range(int(job["repeats"])):
            llm.reset()
            hwm_reset = _reset_hwm()
            times, tokens = [], []
            start = time.perf_counter()
            for token in llm.generate(ids, temp=0.0, top_k=1, repeat_penalty=float(job["repetition_penalty"])):
                times.append(time.perf_counter())
                tokens.append(int(token))
                if len(tokens) == n:
                    break
            replies.append({"prompt": p, "prompt_tokens": len(ids), "new_tokens": len(tokens),
                            "ttft_s": times[0] - start,
                            "decode_tokens_per_s": (len(tokens) - 1) / (times[-1] - times[0]),
                            "peak_rss_bytes": _status_bytes("VmHWM") if hwm_reset else None,
                            "token_ids": tokens[:16]})
    return {"engine": "llama.cpp", "llama_cpp_python": llama_cpp.__version__, "model_file": model,
            "load_s": load_s, "baseline_rss_bytes": baseline, "load_peak_rss_bytes": load_peak,
            "process_peak_rss_bytes": _status_bytes("VmHWM"),
            "threads": threads, "replies": replies}


if __name__ == "__main__":
    if sys.argv[1] == "quantize":
        quantize(sys.argv[2], sys.argv[3])
    else:
        print(json.dumps(run(sys.argv[2], sys.argv[3])))
