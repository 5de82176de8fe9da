"""KV cache quality on the embedded model (CPU): what the fast path's int8 and int4 rows cost in logits.

    python -m bench.kv_quality [--tokens 4096] [--out bench/results/2026-12-02-cpu-kv-quality.json]

The embedded model (SmolLM2-135M-Instruct, fp32 weights and compute) reads real text (this repository's README and
docs, concatenated) in one teacher-forced pass. Every K and V row the attention reads is first passed through the
same quantize/dequantize the fast path's cache uses (llm_core.fast.kvquant: int8 rows, int4 rotated rows; bf16 =
rounded to bf16, what the default cache stores), as the decode kernel sees them: each position attends to the stored
form of every earlier position and of its own. Against each reference (the bf16 cache; int8's for int4), per
position: KL(reference || mode) of the next-token distributions, greedy (argmax) token agreement, and each mode's
perplexity on the text. One JSON document: meta, one record per (mode, reference), summary.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from bench.harness import Recorder
from llm_core.fast import kvquant

REPO = Path(__file__).resolve().parent.parent
ROUND_TRIPS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "fp32": lambda x: x,
    "bf16": lambda x: x.to(torch.bfloat16).to(x.dtype),
    "int8": lambda x: kvquant.dequantize_rows(kvquant.quantize_rows(x), x.dtype),
    "int4": lambda x: kvquant.dequantize_rows4(kvquant.quantize_rows4(x), x.dtype),
}


def corpus_text() -> str:
    return "\n\n".join(p.read_text() for p in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))])


def stored_cache(model: Any, round_trip: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """A DynamicCache whose K and V rows (the last dimension: head_dim, keys after RoPE) are stored round-tripped."""
    from transformers import DynamicCache

    class StoredCache(DynamicCache):
        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
                   *args: Any, **kwargs: Any) -> Any:
            return super().update(round_trip(key_states), round_trip(value_states), layer_idx, *args, **kwargs)

    return StoredCache(config=model.config)


@torch.no_grad()
def log_probs(model: Any, ids: torch.Tensor, mode: str) -> torch.Tensor:
    """(positions, vocab) next-token log-probabilities, fp32, with the cache stored as `mode`."""
    from llm_core.memory.kv_cache import cache_kwarg

    out = model(input_ids=ids, use_cache=True, **{cache_kwarg(model): stored_cache(model, ROUND_TRIPS[mode])})
    return out.logits[0].float().log_softmax(-1)


def compare(ref: torch.Tensor, got: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
    kl = (ref.exp() * (ref - got)).sum(-1)
    return {"kl_mean_nats": kl.mean().item(), "kl_p99_nats": kl.quantile(0.99).item(), "kl_max_nats": kl.max().item(),
            "greedy_agreement": (ref.argmax(-1) == got.argmax(-1)).float().mean().item(),
            "ppl_reference": ref.gather(-1, targets[:, None]).mean().neg().exp().item(),
            "ppl": got.gather(-1, targets[:, None]).mean().neg().exp().item()}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/2026-12-02-cpu-kv-quality.json")
    parser.add_argument("--cache-dir", default=None, help="CACHE_DIR of the converted embedded model")
    args = parser.parse_args(argv)
    from llm_core.config import Settings
    from llm_core.loading import library_versions, load_model

    torch.manual_seed(0)
    settings = Settings.from_env(environ={"QUANTIZATION": "none", "COMPUTE_DTYPE": "float32", "DEVICE": "cpu",
                                          "DECODE_PATH": "plain", **({"CACHE_DIR": args.cache_dir} if args.cache_dir
                                                                     else {})}, env_file=None)
    loaded = load_model(settings.model)
    ids = loaded.tokenizer(corpus_text(), return_tensors="pt")["input_ids"][:, :args.tokens]
    text = loaded.model.config
    meta = {"bench": "kv_quality", "command": " ".join(["python -m bench.kv_quality", *(argv or sys.argv[1:])]),
            "model": loaded.report.model, "tokens": int(ids.shape[1]), "head_dim": int(
                getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads),
            "text": "README.md + docs/*.md of this repository", "compute": "fp32 weights and compute, CPU",
            "int4_group": kvquant.INT4_GROUP, "versions": library_versions()}
    rec = Recorder(args.out, meta)
    lp = {mode: log_probs(loaded.model, ids, mode) for mode in ROUND_TRIPS}
    targets = ids[0, 1:]
    for mode, reference in (("bf16", "fp32"), ("int8", "bf16"), ("int4", "bf16"), ("int4", "int8")):
        rec.add(kind="pair", mode=mode, reference=reference, positions=int(targets.numel()),
                **compare(lp[reference][:-1], lp[mode][:-1], targets))
    summary = {f"{r['mode']}_vs_{r['reference']}": {k: r[k] for k in ("kl_mean_nats", "greedy_agreement", "ppl")}
               for r in rec.records if r.get("kind") == "pair"}
    rec.set_summary(**summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
