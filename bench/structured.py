"""Structured output benchmark: schema-constrained replies of the embedded model, validity and the mask's cost.

    python -m bench.structured --out bench/results/2026-12-02-cpu-structured.json [--replies 50] [--max-tokens 64]
    [--decode-path cpu]   (CACHE_DIR and the other settings from the environment, as the app reads them)

--replies replies over the 10 SCHEMAS below (nested objects, enums, arrays; round robin), sampled (temperature
0.7, seed = reply number), through
ChatEngine.stream_chat with an llm_core.constraints.RowControl, exactly as /v1 response_format json_schema runs them.
Each reply is checked with jsonschema. The first --unmasked replies also run without the mask (same settings, seed
and path), so tokens/s with and without it compare on one loaded model in one run.

GPU (the mask's cost per step on the fast path, batch 1 and 8): a random-weight checkpoint of a real shape with a
real tokenizer (the mask's work scales with the vocabulary), replies run N at a time (rows of one batch):

    python -m bench.structured --random llama-2-7b --tokenizer TOKENIZER_DIR --concurrent 8 --out OUT.json
    (DECODE_PATH=fast MAX_BATCH_SIZE=8 in the environment; random weights: validity comes from the mask alone)

Records: valid_percent, finished_by_eos (the JSON closed and EOS followed), decode tokens/s median over replies
(ReplyStats.decode_tokens_per_s: (new - 1) / decode time) masked and unmasked, grammar_mask_ms_per_token median and
max (the mask's own time per masked step: llguidance's mask, its unpacking and the masked fill), and every reply's
text and numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

SCHEMAS: list[tuple[str, dict[str, Any]]] = [
    ("Describe a person.", {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                            "required": ["name", "age"], "additionalProperties": False}),
    ("Pick a color.", {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}},
                       "required": ["color"], "additionalProperties": False}),
    ("Tag this post about cooking pasta.", {"type": "object", "properties": {"tags": {
        "type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 3}}, "required": ["tags"],
        "additionalProperties": False}),
    ("Make a user record.", {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "id": {"type": "integer"}, "active": {"type": "boolean"}}, "required": ["id", "active"],
        "additionalProperties": False}}, "required": ["user"], "additionalProperties": False}),
    ("How far is it from Paris to Lyon?", {"type": "object", "properties": {"answer": {"type": "number"},
                                                                             "unit": {"enum": ["km", "mi"]}},
                                           "required": ["answer", "unit"], "additionalProperties": False}),
    ("Plan a two-step recipe.", {"type": "object", "properties": {"steps": {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"n": {"type": "integer"}, "text": {"type": "string", "maxLength": 40}},
        "required": ["n", "text"], "additionalProperties": False}}}, "required": ["steps"],
        "additionalProperties": False}),
    ("Rate this movie.", {"type": "object", "properties": {"stars": {"enum": [1, 2, 3, 4, 5]},
                                                           "verdict": {"enum": ["good", "bad", "mixed"]}},
                          "required": ["stars", "verdict"], "additionalProperties": False}),
    ("Give an address.", {"type": "object", "properties": {"address": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 30}, "zip": {"type": "string", "maxLength": 10},
        "country": {"enum": ["FR", "DE", "US"]}}, "required": ["city", "country"], "additionalProperties": False}},
        "required": ["address"], "additionalProperties": False}),
    ("List three numbers.", {"type": "object", "properties": {"numbers": {"type": "array", "items": {"type": "integer"},
                                                                          "minItems": 3, "maxItems": 3}},
                             "required": ["numbers"], "additionalProperties": False}),
    ("Is the sky blue? Answer with a reason.", {"type": "object", "properties": {
        "answer": {"type": "boolean"}, "reason": {"type": "string", "maxLength": 60},
        "confidence": {"enum": ["low", "medium", "high"]}}, "required": ["answer", "reason", "confidence"],
        "additionalProperties": False}),
]


class _Reply:
    """One schema's reply, masked and (the first --unmasked ones) not, with the same settings and seed."""

    def __init__(self, index: int, engine: Any, max_tokens: int, unmasked: bool) -> None:
        self.index, self.engine, self.max_tokens, self.unmasked = index, engine, max_tokens, unmasked
        self.prompt, self.schema = SCHEMAS[index % len(SCHEMAS)]
        self.record: dict[str, Any] = {"schema_index": index % len(SCHEMAS), "prompt": self.prompt}

    def run(self, masked: bool) -> None:
        from llm_core.constraints import OutputSpec, RowControl

        engine = self.engine
        control = RowControl.for_model(OutputSpec(json=True, json_schema=self.schema), engine.loaded) if masked \
            else None
        # each round over the schemas samples with its own seed: 50 replies, not 5 copies of 10 greedy ones
        gen = engine.request_options(max_new_tokens=self.max_tokens, do_sample=True, temperature=0.7, seed=self.index,
                                     control=control)
        final = list(engine.stream_chat(self.prompt, [], gen=gen, history_turns=0,
                                        request_id=f"structured-{self.index}-{masked}"))[-1]
        stats = final.stats
        self.record["masked" if masked else "unmasked"] = {
            "text": final.text, "new_tokens": stats.new_tokens, "finish_reason": stats.finish_reason,
            "decode_tokens_per_s": stats.decode_tokens_per_s,
            "grammar_mask_ms_per_token": stats.grammar_mask_ms_per_token, "peak_batch_rows": stats.peak_batch_rows}


def _device_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--replies", type=int, default=50)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--unmasked", type=int, default=10, help="replies also run without the mask (the first N)")
    parser.add_argument("--decode-path", default=None, help="DECODE_PATH (default: the environment's, else cpu)")
    parser.add_argument("--random", default=None, help="a random-weight checkpoint of this bench.harness shape")
    parser.add_argument("--tokenizer", default="chatml", help="with --random: a saved tokenizer's folder")
    parser.add_argument("--ckpt", default="/tmp/structured-ckpt", help="with --random: where it is written")
    parser.add_argument("--concurrent", type=int, default=1, help="replies run N at a time (rows of one batch)")
    args = parser.parse_args(argv)

    import jsonschema

    from llm_core.config import Settings
    from llm_core.engine.chat import ChatEngine

    environ = {**os.environ, "DECODE_PATH": args.decode_path or os.environ.get("DECODE_PATH", "cpu")}
    if args.random:
        import torch

        from bench.harness import checkpoint_ready, make_random_checkpoint
        folder = Path(args.ckpt)
        if not checkpoint_ready(folder):
            make_random_checkpoint(args.random, folder, torch.device("cuda" if torch.cuda.is_available() else "cpu"),
                                   4096, tokenizer=args.tokenizer)
        environ["MODEL_ID"] = str(folder)
    settings = Settings.from_env(environ=environ, env_file=None)
    t0 = time.perf_counter()
    engine = ChatEngine.load(settings)
    load_s = time.perf_counter() - t0
    rows: list[dict[str, Any]] = []
    for start in range(0, args.replies, args.concurrent):
        group = [_Reply(i, engine, args.max_tokens, i < args.unmasked) for i in range(
            start, min(start + args.concurrent, args.replies))]
        for masked in (True, False):
            threads = [threading.Thread(target=r.run, args=(masked,)) for r in group if masked or r.unmasked]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        for reply in group:
            record = reply.record
            try:
                jsonschema.validate(json.loads(record["masked"]["text"]), reply.schema)
                record["valid"] = True
            except (ValueError, jsonschema.ValidationError) as exc:
                record["valid"], record["error"] = False, str(exc)[:200]
            rows.append(record)
            print(f"{reply.index + 1}/{args.replies} valid={record['valid']} {record['masked']['text'][:70]!r}",
                  flush=True)

    def median(key: str, side: str) -> float | None:
        values = [r[side][key] for r in rows if side in r and r[side][key] is not None]
        return round(statistics.median(values), 4) if values else None

    masks = [r["masked"]["grammar_mask_ms_per_token"] for r in rows]
    report = engine.report
    doc = {
        "benchmark": "structured", "command": "python -m bench.structured " + " ".join(argv or sys.argv[1:]),
        "machine": platform.platform(), "processor": platform.processor(), "model": report.model,
        "quantization": report.quantization, "decode_path": engine.backend.name, "load_s": round(load_s, 2),
        "device": _device_name(), "random_shape": args.random, "concurrent": args.concurrent,
        "peak_batch_rows_max": max((r["masked"].get("peak_batch_rows") or 1) for r in rows),
        "replies": len(rows), "schemas": len(SCHEMAS), "max_new_tokens": args.max_tokens,
        "valid_percent": round(100 * sum(r["valid"] for r in rows) / len(rows), 1),
        "finished_by_eos_percent": round(100 * sum(r["masked"]["finish_reason"] == "eos" for r in rows) / len(rows),
                                         1),
        "unmasked_replies": sum("unmasked" in r for r in rows),
        "decode_tokens_per_s_masked_median": median("decode_tokens_per_s", "masked"),
        "decode_tokens_per_s_masked_median_same_replies": round(statistics.median(
            r["masked"]["decode_tokens_per_s"] for r in rows if "unmasked" in r), 4),
        "decode_tokens_per_s_unmasked_median": median("decode_tokens_per_s", "unmasked"),
        "grammar_mask_ms_per_token_median": round(statistics.median(masks), 4),
        "grammar_mask_ms_per_token_max": round(max(masks), 4),
        "rows": rows,
    }
    Path(args.out).write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
    print(json.dumps({k: v for k, v in doc.items() if k != "rows"}, indent=1))
    return 0 if doc["valid_percent"] == 100.0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
