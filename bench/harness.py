"""What every benchmark shares: the JSON recorder, device sync and medians, and random-weight checkpoints of real
architectures (weights cannot travel to the GPU machine; these are built there in seconds).

Knows nothing of what is measured: each benchmark module (decode, compare_bench, memory_bench, ...) does that.
"""

from __future__ import annotations

import gc
import json
import math
import shutil
import statistics
from pathlib import Path
from typing import Any

import torch

RANDOM_ARCHS: dict[str, dict[str, Any]] = {
    "llama-2-7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=32, vocab_size=32000, rope_theta=10000.0, rms_norm_eps=1e-5),
    "llama-3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, rms_norm_eps=1e-5),
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, rope_theta=10000.0, rms_norm_eps=1e-5),
}
# Byte-level BPE vocabulary of the "chatml" tokenizer: these specials first, then the 256 byte symbols, then fillers.
CHATML_SPECIALS = ["<unk>", "<|im_start|>", "<|im_end|>"]
CHATML_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                   "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


# --- output --------------------------------------------------------------------------------------------------


class Recorder:
    """Collects records and rewrites the JSON document after each one, so a killed run keeps what it measured.

    The document: {**head, "meta": meta, "records": [...], "summary": {...}}. Records whose kind is in
    `stamp_kinds` carry the library versions and the command themselves (a measurement travels with how it was
    made)."""

    def __init__(self, path: Path | None, meta: dict[str, Any], *, head: dict[str, Any] | None = None,
                 stamp_kinds: tuple[str, ...] = ()) -> None:
        self.path = path
        self.meta = meta
        self.head = head or {}
        self.stamp_kinds = stamp_kinds
        self.records: list[dict[str, Any]] = []
        self.summary: dict[str, Any] = {}
        self.flush()

    def add(self, kind: str | None = None, **fields: Any) -> dict[str, Any]:
        rec = ({"kind": kind} if kind is not None else {}) | fields
        if kind in self.stamp_kinds:
            rec.setdefault("versions", self.meta.get("versions"))
            rec.setdefault("command", self.meta.get("command"))
        self.records.append(rec)
        self.flush()
        line = {k: v for k, v in rec.items()
                if k not in ("profile", "repeats", "describe", "table", "versions", "command")}
        print(json.dumps(line, default=str)[:600], flush=True)
        return rec

    def set_summary(self, **values: Any) -> None:
        self.summary.update(values)
        print(json.dumps({"summary": values}, default=str)[:600], flush=True)
        self.flush()

    def flush(self) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        doc = {**self.head, "meta": self.meta, "records": self.records, "summary": self.summary}
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc, indent=1, default=str) + "\n", encoding="utf-8")
        tmp.replace(self.path)


# --- timing --------------------------------------------------------------------------------------------------


def sync(device: torch.device) -> None:
    """Wait for the device before reading a host clock (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median(values: list[Any]) -> float | None:
    """Median of the values that are numbers (None and NaN left out); None if there are none."""
    clean = [float(v) for v in values if v is not None and v == v]
    return statistics.median(clean) if clean else None


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


# --- random-weight checkpoints -------------------------------------------------------------------------------


CHECKPOINT_DONE = ".complete"  # written last: a folder without it is half-written (a full disk, a killed run)


def checkpoint_ready(folder: Path) -> bool:
    """A checkpoint make_random_checkpoint finished; a folder with config.json but no weights is not one."""
    return (folder / CHECKPOINT_DONE).is_file()


def make_random_checkpoint(arch: str | dict[str, Any], folder: Path, device: torch.device, max_positions: int,
                           *, tokenizer: str = "word") -> Path:
    """A random-weight llama of a named shape (RANDOM_ARCHS) or a given one, saved as bf16 safetensors with a
    tokenizer, so every recipe loads it exactly as it loads a real checkpoint.

    tokenizer="word": word-level, "t<id>" <-> id exactly (prompts of a chosen length; bench.compare_bench's
    prompt_ids); "chatml": byte-level BPE with a ChatML template, so real text chats go through ChatEngine; a folder:
    that saved tokenizer (a real vocabulary, e.g. the embedded model's, for costs that scale with it such as the
    structured-output mask), the shape's vocab_size replaced by the tokenizer's.
    Written into a ".partial" folder first and renamed when whole, so `checkpoint_ready` never sees half of one."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    shape = dict(RANDOM_ARCHS[arch] if isinstance(arch, str) else arch)
    shape.pop("max_position_embeddings", None)
    rope_theta = shape.pop("rope_theta", 10000.0)
    tok = _tokenizer(tokenizer, int(shape["vocab_size"]))
    if tokenizer not in ("word", "chatml"):
        shape["vocab_size"] = -(-len(tok) // 64) * 64
    ids = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
               pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)
    cfg = LlamaConfig(**shape, max_position_embeddings=max_positions, **ids, tie_word_embeddings=False,
                      rope_parameters={"rope_type": "default", "rope_theta": rope_theta})
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM._from_config(cfg, dtype=torch.bfloat16)
    model.generation_config = GenerationConfig(**ids)
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial, safe_serialization=True)
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    tok.save_pretrained(partial)
    (partial / CHECKPOINT_DONE).write_text("ok\n")
    shutil.rmtree(folder, ignore_errors=True)  # a half-written one from an earlier run
    partial.rename(folder)
    return folder


def _tokenizer(kind: str, vocab_size: int) -> Any:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if kind == "word":
        vocab = {f"t{i}": i for i in range(vocab_size)}
        word = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
        word.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        tok = PreTrainedTokenizerFast(tokenizer_object=word, unk_token="t0", pad_token="t0", bos_token="t1",
                                      eos_token="t2")
        tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
        return tok
    if kind != "chatml":
        if not (Path(kind) / "tokenizer_config.json").is_file():
            raise ValueError(f"tokenizer must be 'word', 'chatml' or a saved tokenizer's folder, got {kind!r}")
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(kind)
    tokens = CHATML_SPECIALS + sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens += [f"<extra_{i}>" for i in range(vocab_size - len(tokens))]  # every model id decodes to something
    bpe = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[], unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>", bos_token="<|im_start|>",
                                  eos_token="<|im_end|>", pad_token="<|im_end|>")
    # The extra ids as added tokens: a reply's text ("<extra_12><extra_7>...") then tokenizes back to its own ids, as
    # a real model's reply mostly does, so the next turn's prompt holds it at its length and the prefix cache can
    # reuse it (as BPE vocabulary entries without merges, each came back as ~13 byte tokens).
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in tokens if t.startswith("<extra_")])
    tok.chat_template = CHATML_TEMPLATE
    return tok
