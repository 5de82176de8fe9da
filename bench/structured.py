"""Structured output benchmark: schema-constrained replies of the embedded model, validity and the mask's cost.

    python -m bench.structured --out bench/results/2026-12-02-cpu-structured.json [--replies 50] [--max-tokens 64]
    [--decode-path cpu]   (CACHE_DIR and the other settings from the environment, as the app reads them)

--replies replies over the 10 SCHEMAS below (nested objects, enums, arrays; round robin), sampled (temperature
0.7, seed = reply number), through
ChatEngine.stream_chat with an llm_core.constraints.RowControl, exactly as /v1 response_format json_schema runs them.
Each reply is checked with jsonschema. The first --unmasked replies also run without the mask (same settings, seed
and path), so tokens/s with and without it compare on one loaded model in one run.

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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--replies", type=int, default=50)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--unmasked", type=int, default=10, help="replies also run without the mask (the first N)")
    parser.add_argument("--decode-path", default="cpu")
    args = parser.parse_args(argv)

    import jsonschema

    from llm_core.config import Settings
    from llm_core.constraints import OutputSpec, RowControl
    from llm_core.engine.chat import ChatEngine

    settings = Settings.from_env(environ={**os.environ, "DECODE_PATH": args.decode_path}, env_file=None)
    t0 = time.perf_counter()
    engine = ChatEngine.load(settings)
    load_s = time.perf_counter() - t0
    rows: list[dict[str, Any]] = []
    for i in range(args.replies):
        prompt, schema = SCHEMAS[i % len(SCHEMAS)]
        record: dict[str, Any] = {"schema_index": i % len(SCHEMAS), "prompt": prompt}
        for masked in (True, False)[:1 if i >= args.unmasked else 2]:
            control = RowControl.for_model(OutputSpec(json=True, json_schema=schema), engine.loaded) if masked \
                else None
            # each round over the schemas samples with its own seed: 50 replies, not 5 copies of 10 greedy ones
            gen = engine.request_options(max_new_tokens=args.max_tokens, do_sample=True, temperature=0.7, seed=i,
                                         control=control)
            final = list(engine.stream_chat(prompt, [], gen=gen, history_turns=0))[-1]
            stats = final.stats
            key = "masked" if masked else "unmasked"
            record[key] = {"text": final.text, "new_tokens": stats.new_tokens, "finish_reason": stats.finish_reason,
                           "decode_tokens_per_s": stats.decode_tokens_per_s,
                           "grammar_mask_ms_per_token": stats.grammar_mask_ms_per_token}
            if masked:
                try:
                    jsonschema.validate(json.loads(final.text), schema)
                    record["valid"] = True
                except (ValueError, jsonschema.ValidationError) as exc:
                    record["valid"], record["error"] = False, str(exc)[:200]
        rows.append(record)
        print(f"{i + 1}/{args.replies} valid={record['valid']} {record['masked']['text'][:70]!r}", flush=True)

    def median(key: str, side: str) -> float | None:
        values = [r[side][key] for r in rows if side in r and r[side][key] is not None]
        return round(statistics.median(values), 4) if values else None

    masks = [r["masked"]["grammar_mask_ms_per_token"] for r in rows]
    report = engine.report
    doc = {
        "benchmark": "structured", "command": "python -m bench.structured " + " ".join(argv or sys.argv[1:]),
        "machine": platform.platform(), "processor": platform.processor(), "model": report.model,
        "quantization": report.quantization, "decode_path": engine.backend.name, "load_s": round(load_s, 2),
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
