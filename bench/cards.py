"""Small cards: the demo's own path (ChatEngine, default settings) and the seed recipe (plain generate,
no guard) on emulated 8/12/16/24 GiB cards, a chat growing by ~2k tokens a turn to 32k tokens of history, or until
history trimming has held ours' context for PLATEAU_TURNS turns (a `turns-end` record says so).

A card is emulated with torch.cuda.set_per_process_memory_fraction(cap) and VRAM_BUDGET = cap - 0.5 GiB (what the
demo derives on a real card). Random-weight checkpoints of real shapes (bench.harness.make_random_checkpoint). Per
turn one JSON record with: recipe ("ours"/"seed"), card_gib, model, max_positions, quantization, kv_cache, turn,
prompt_tokens, dropped_turns, ttft_s, decode_tokens_per_s, predicted_peak_vram_bytes, peak_vram_bytes,
peak_reserved_bytes, outcome (ok/refused/crashed/startup_failed), device, versions, command. Both recipes get the
same conversation: ours runs first and its message lists (untrimmed) are replayed to the seed. After the chat the
engine answers two of its turns again: `repeat` records give the TTFT of a second reply at the same length (the first
at a new length is the turn itself), and a `fill` record is one message on a fresh chat sized to the context the
engine reported room for (`context_fit_tokens`): the longest prompt kept, to the token. The JSON file is
rewritten after every record, so a run cut short keeps what it measured.

    python -m bench.cards --out "$OUT/cards.json" [--budget-s 500] [--only SUBSTRING] [--extra]

The plan is the issue's: Llama-2-7B (32k positions) and Llama-3-8B (128k) on 8, 12 and 16 GiB, ours with DEFAULT
settings (no KV_CACHE, no INT8_TOKEN_TABLE: what the demo does out of the box) beside the seed recipe on the same
card. A fresh device machine per call writes each checkpoint once, so split by model, one call each:

    python -m bench.cards --out "$OUT/cards-llama2.json" --budget-s 290 --words-per-turn 3000 --only llama-2-7b
    python -m bench.cards --out "$OUT/cards-llama3.json" --budget-s 290 --words-per-turn 3000 --only llama-3-8b

(H200: one ours case of Llama-3-8B at 8 GiB took 105 s on a fresh machine, checkpoint 27 s and start-up 62 s
included; later start-ups reuse the compile cache. A case not started before --budget-s minus 60 s is recorded as
skipped, and the turn loop stops at --budget-s, so leave the call ~60 s beyond it.)

`--extra` adds the earlier ablations (KV_CACHE=quantized, 24 GiB, a 4k-position Llama-2-7B). The summary (in the
JSON's "summary") has per card and model: ours' longest prompt kept over the turns and decode tok/s there, the fill's
prompt and decode tok/s with their ratios to the seed's, the seed's longest that ran and the one that crashed, their
ratio, crashes and refusals of ours (and refusals the seed answered), and the largest |predicted - measured| /
measured peak over ours' answered turns."""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch._dynamo

from bench.harness import Recorder, checkpoint_ready, make_random_checkpoint
from bench.probes import prefill_timing

GiB = 2**30


@dataclass
class Scale:
    """Sizes of one run: the GPU run, or --cpu-smoke (a tiny random llama on the CPU, no cap, fast path eager)."""

    words_per_turn: int = 2000  # the word-level tokenizer of the random checkpoints: one token per word
    new_tokens: int = 64
    history_limit_tokens: int = 32768
    device: str = "cuda"
    seed_expandable: bool = False  # --seed-expandable: the seed recipe with expandable segments too


SCALE = Scale()
# ours' turns stop once this many in a row dropped older turns: history trimming then holds the kept context at the
# card's limit, and each further turn measures the same length again (2026-12-06: 12 such turns took the run's budget
# before the seed recipe ran)
PLATEAU_TURNS = 3


def plateaued(dropped_per_turn: list[int], turns: int = PLATEAU_TURNS) -> bool:
    """Whether each of the last `turns` replies had older turns dropped from its history (`dropped_turns` > 0)."""
    tail = dropped_per_turn[-turns:]
    return len(tail) == turns and all(d > 0 for d in tail)


@dataclass(frozen=True)
class Case:
    model: str  # bench.harness.RANDOM_ARCHS key
    positions: int
    card_gib: int
    recipe: str  # ours | seed
    kv_cache: str = "default"  # ours: default (KV_CACHE not set) | bf16 | int8 | int4 (the static cache)
    quantization: str = "nf4"

    @property
    def name(self) -> str:
        return f"{self.recipe}-{self.model}-{self.positions}-{self.card_gib}gib-{self.quantization}-{self.kv_cache}"


# In order of importance: the run stops starting cases when --budget-s is spent. Seed cases replay the
# conversation of the ours case before them with the same model and positions (each card its own conversation:
# ours' trimming differs by card).
PLAN = [Case(model, positions, card, recipe) for model, positions in (("llama-2-7b", 32768), ("llama-3-8b", 131072))
        for card in (8, 12, 16) for recipe in ("ours", "seed")]
EXTRA = [
    Case("llama-2-7b", 32768, 8, "ours", "int8"),
    Case("llama-2-7b", 32768, 24, "ours", "bf16"),
    Case("llama-3-8b", 131072, 8, "ours", "int8"),
    Case("llama-2-7b", 4096, 8, "ours", "bf16"),
]


def versions() -> dict[str, str]:
    import transformers

    out = {"torch": torch.__version__, "transformers": transformers.__version__}
    for name in ("bitsandbytes", "triton"):
        try:
            out[name] = __import__(name).__version__
        except Exception:  # noqa: BLE001 - recorded as missing
            out[name] = "missing"
    return out


def cap_card(card_gib: int) -> None:
    if SCALE.device != "cuda":
        return
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, card_gib * GiB / total))


def set_allocator(expandable: bool) -> str:
    """The CUDA caching allocator's mode for the next case: ours runs as the app does (expandable segments, set by
    llm_core.loading.configure_cuda_allocator); the seed recipe as published (the default allocator) unless
    --seed-expandable. Applies to segments made from now on; release() has returned the old ones."""
    if SCALE.device != "cuda":
        return ""
    from llm_core.loading import set_allocator_settings

    conf = f"expandable_segments:{expandable}"
    set_allocator_settings(conf)
    return conf


def release() -> None:
    gc.collect()
    if SCALE.device != "cuda":
        return
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(1.0)


def message(turn: int, words: int | None = None) -> str:
    """Turn `turn`'s message: SCALE.words_per_turn words (or `words`) of the word-level tokenizer's vocabulary."""
    count = SCALE.words_per_turn if words is None else max(1, words)
    return " ".join(f"t{(i * 7919 + turn * 104729) % 500 + 3}" for i in range(count))


def run_ours(case: Case, folder: Path, rec: Recorder, base: dict[str, Any],
             conversations: dict[tuple[str, int], list[Any]], deadline: float) -> None:
    from llm_core.config import Settings
    from llm_core.engine.chat import ChatEngine
    from llm_core.errors import ContextBudgetError, OutOfMemoryError
    from llm_core.history import Turn

    base["alloc_conf"] = set_allocator(True)
    cap_card(case.card_gib)
    env = {"MODEL_ID": str(folder), "QUANTIZATION": case.quantization, "VRAM_BUDGET": f"{case.card_gib - 0.5}GiB",
           "HISTORY_TURNS": "64", "MAX_NEW_TOKENS": str(SCALE.new_tokens), "CACHE_DIR": "/tmp/llm_core_cache",
           "MAX_MESSAGE_CHARS": "1000000"}  # the fill is one message of the whole fit (35k characters at 8 GiB)
    if case.kv_cache != "default":
        env["KV_CACHE"] = case.kv_cache
    if SCALE.device != "cuda":  # smoke: the same engine path on the CPU (fast path eager, fp32)
        env.update(DEVICE="cpu", DECODE_PATH="fast", COMPUTE_DTYPE="float32", PREFILL_CHUNK_TOKENS="64",
                   PREFILL_GRAPH_TOKENS="64")
    t0 = time.perf_counter()
    failure = ""
    try:
        engine = ChatEngine.load(Settings.from_env(environ=env, env_file=None))
    except Exception as exc:  # noqa: BLE001 - a start-up failure is a result
        failure = f"{type(exc).__name__}: {exc}"[:400]
    if failure:  # outside the except block: its traceback's frames hold the failed engine's tensors until then
        rec.add(**base, what="startup", outcome="startup_failed", error=failure)
        release()
        return
    decoder = engine.fast_decoder
    rec.add(**base, what="startup", outcome="ok", load_s=round(time.perf_counter() - t0, 1),
            decode_path=engine.backend.name, reason=engine.backend.reason[:300],
            static_cache_tokens=decoder.cache_len if decoder else None,
            warmup_s=engine.report.warmup_s, resident_extra_bytes=engine.memory_facts.resident_extra_bytes,
            fast_memory_profile=engine.fast_memory_profile,
            prefill_graph_tokens=decoder.options.prefill_graph_tokens if decoder else None,
            graph_pool_idle_bytes=decoder.graph_pool_idle_bytes() if decoder else None,
            memory_budget_bytes=engine.memory_budget.budget_bytes, weights_bytes=engine.memory_facts.weights_bytes,
            token_tables=engine.loaded.extra.get("token_tables"), load_notes=list(engine.loaded.report.notes),
            startup_notes=list(engine.path.notes),
            allocated_after_startup_bytes=torch.cuda.memory_allocated() if SCALE.device == "cuda" else None,
            reserved_after_startup_bytes=torch.cuda.memory_reserved() if SCALE.device == "cuda" else None)
    history: list[Any] = []
    sent: list[list[Any]] = []  # the (untrimmed) conversation before each turn, for the seed
    gen = engine.request_options(max_new_tokens=SCALE.new_tokens, min_new_tokens=SCALE.new_tokens)
    per_turn = SCALE.words_per_turn + SCALE.new_tokens
    turn = 0
    replies: dict[int, Any] = {}
    dropped: list[int] = []  # each answered turn's dropped_turns
    while turn * per_turn < SCALE.history_limit_tokens and time.perf_counter() < deadline:
        if plateaued(dropped):
            rec.add(**base, what="turns-end", turn=turn,
                    reason=f"history trimmed on {PLATEAU_TURNS} turns in a row: the kept context stopped growing")
            break
        text = message(turn)
        sent.append(list(history))
        record = dict(base, what="turn", turn=turn, history_tokens=turn * per_turn + SCALE.words_per_turn)
        try:
            last, fields = answer(engine, text, history, gen)
            rec.add(**record, outcome="ok", **fields, decode_path=last.stats.decode_path,
                    context_fit_tokens=last.stats.context_fit_tokens, notes=last.stats.notes,
                    **_prefill_timing(engine))
            replies[turn] = last.text
            history = history + [Turn(text, last.text)]
            dropped.append(int(fields.get("dropped_turns") or 0))
        except ContextBudgetError as exc:
            rec.add(**record, outcome="refused", error=str(exc)[:400])
            history = history + [Turn(text, "ok")]
        except OutOfMemoryError as exc:
            rec.add(**record, outcome="crashed", error=str(exc)[:400])
            history = history + [Turn(text, "ok")]
        turn += 1
    conversations[(case.model, case.positions, case.card_gib)] = [(message(i), sent[i]) for i in range(len(sent))]
    fill(engine, case, rec, base, gen, deadline)
    # A second reply at the length of two turns already answered: TTFT of first vs second at that length.
    for again in sorted({1, turn - 1} & set(replies)):
        if time.perf_counter() > deadline:
            break
        last = None
        for update in engine.stream_chat(message(again), sent[again], gen=gen):
            last = update
        assert last is not None
        first = next(r for r in rec.records if r.get("what") == "turn" and r.get("turn") == again
                     and r.get("recipe") == "ours" and r.get("kv_cache") == case.kv_cache
                     and r.get("card_gib") == case.card_gib and r.get("model") == case.model)
        rec.add(**base, what="repeat", turn=again, outcome="ok", prompt_tokens=last.stats.prompt_tokens,
                ttft_s=last.stats.ttft_s, first_ttft_s=first.get("ttft_s"),
                first_over_second=(first.get("ttft_s") or 0) / max(last.stats.ttft_s or 1e-9, 1e-9),
                decode_tokens_per_s=last.stats.decode_tokens_per_s, **_prefill_timing(engine),
                first_first_token_s=first.get("first_token_s"))
    engine.close()
    del engine, decoder
    release()


def answer(engine: Any, text: str, history: list[Any], gen: Any) -> tuple[Any, dict[str, Any]]:
    """One reply streamed to its end: (the last update, the reply's fields of a turn or fill record)."""
    last = None
    for update in engine.stream_chat(text, history, gen=gen):
        last = update
    assert last is not None
    s = last.stats
    return last, dict(prompt_tokens=s.prompt_tokens, new_tokens=s.new_tokens, dropped_turns=s.dropped_turns,
                      ttft_s=s.ttft_s, decode_tokens_per_s=s.decode_tokens_per_s,
                      predicted_peak_vram_bytes=s.predicted_peak_bytes, peak_vram_bytes=s.peak_vram_allocated_bytes,
                      peak_reserved_bytes=s.peak_vram_reserved_bytes, kv_cache_bytes=s.kv_cache_bytes)


def fill_text(engine: Any, tokens: int) -> str:
    """A message whose prompt (the chat template and the default system prompt, which stream_chat adds for an empty
    one) is `tokens` long or a few under: message(0)'s words, their count corrected from the engine's own token
    count a few times."""
    from llm_core.history import build_messages

    words, best = tokens, 1
    for _ in range(6):
        n = engine.count_tokens(build_messages(engine.settings.chat.system_prompt, [], message(0, words)))
        if n <= tokens:
            best = max(best, words)
            if n > tokens - 8:
                break
        words = max(1, int(words * tokens / max(n, 1)) - (1 if n > tokens else 0))
    return message(0, best)


def fill(engine: Any, case: Case, rec: Recorder, base: dict[str, Any], gen: Any, deadline: float) -> None:
    """One message that fills the context the engine reported (`context_fit_tokens`: the prompt tokens a reply of
    max_new_tokens leaves room for), sent on a fresh chat: the longest prompt ours keeps, measured to the token
    rather than at a whole turn's granularity (turns of 1,500 words kept 8,970 tokens of a 10,944-token fit on
    8 GiB: the next turn did not fit whole, so the oldest was dropped). Refused: tried once 256 tokens shorter."""
    from llm_core.errors import ContextBudgetError, InputError, OutOfMemoryError

    fits = [r.get("context_fit_tokens") or 0 for r in rec.records
            if r.get("case") == base["case"] and r.get("what") == "turn" and r.get("outcome") == "ok"]
    target = max(fits, default=0)
    for _ in range(2):
        if target <= 0 or time.perf_counter() > deadline:
            return
        record = dict(base, what="fill", turn=None, target_tokens=target, context_fit_tokens=max(fits))
        try:
            rec.add(**record, outcome="ok", **answer(engine, fill_text(engine, target), [], gen)[1])
            return
        except (ContextBudgetError, InputError) as exc:
            rec.add(**record, outcome="refused", error=str(exc)[:400])
            target -= 256
        except OutOfMemoryError as exc:
            rec.add(**record, outcome="crashed", error=str(exc)[:400])
            return


def _prefill_timing(engine: Any) -> dict[str, Any]:
    """The fast decoder's own clock of the last reply (generate() entered -> token 0 on the host; the prefill's
    device time): TTFT without the chat's tokenization, so a compile inside the reply shows alone."""
    decoder = engine.fast_decoder
    if decoder is None or engine.backend.name != "fast":
        return {}
    timing = prefill_timing(decoder)
    return {"first_token_s": timing.get("first_token_s"), "prefill_gpu_s": timing.get("prefill_gpu_s")}


class _FirstTokenClock:
    """A streamer for generate: stamps the first generated token and the last one."""

    def __init__(self) -> None:
        self.calls = 0
        self.first: float | None = None
        self.last: float | None = None
        self.count = 0

    def put(self, value: torch.Tensor) -> None:
        self.calls += 1
        if self.calls == 1:  # the prompt
            return
        now = time.perf_counter()
        self.first = self.first or now
        self.last = now
        self.count += int(value.numel())

    def end(self) -> None:
        pass


def run_seed(case: Case, folder: Path, rec: Recorder, base: dict[str, Any],
             conversations: dict[tuple[str, int], list[Any]], deadline: float) -> None:
    """The seed recipe: from_pretrained with NF4 + double quant + bf16 compute + sdpa, plain generate on the whole
    conversation (no trimming, no guard), under the same cap."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

    from llm_core.history import build_messages
    from llm_core.memory.model import ModelMemoryFacts, model_weights_bytes, predict_peak_bytes

    base["alloc_conf"] = set_allocator(SCALE.seed_expandable)
    cap_card(case.card_gib)
    q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                           bnb_4bit_compute_dtype=torch.bfloat16)
    cuda = SCALE.device == "cuda"
    try:
        model = AutoModelForCausalLM.from_pretrained(str(folder), quantization_config=q if cuda else None,
                                                     dtype=torch.bfloat16 if cuda else torch.float32,
                                                     device_map=SCALE.device, attn_implementation="sdpa").eval()
    except Exception as exc:  # noqa: BLE001
        rec.add(**base, what="startup", outcome="startup_failed", error=f"{type(exc).__name__}: {exc}"[:400])
        model = None
    if model is None:
        release()
        return
    tok = AutoTokenizer.from_pretrained(str(folder))
    facts = ModelMemoryFacts.from_config(model.config, model_weights_bytes(model, SCALE.device), torch.bfloat16,
                                         device_type=SCALE.device)
    rec.add(**base, what="startup", outcome="ok", weights_bytes=facts.weights_bytes)
    system = "You are a helpful assistant."
    for turn, (text, history) in enumerate(conversations.get((case.model, case.positions, case.card_gib), [])):
        if time.perf_counter() > deadline:
            break
        encoded: Any = tok.apply_chat_template(build_messages(system, history, text), add_generation_prompt=True,
                                               return_dict=True, return_tensors="pt")
        ids = encoded["input_ids"].to(SCALE.device)
        record = dict(base, what="turn", turn=turn, prompt_tokens=int(ids.shape[1]), dropped_turns=0,
                      predicted_peak_vram_bytes=predict_peak_bytes(facts, int(ids.shape[1]), SCALE.new_tokens)
                      .peak_allocated_bytes)
        clock = _FirstTokenClock()
        crashed = False
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        try:
            with torch.inference_mode():
                start = time.perf_counter()
                model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=SCALE.new_tokens,
                               min_new_tokens=SCALE.new_tokens, do_sample=False, use_cache=True, pad_token_id=0,
                               streamer=clock)
                if cuda:
                    torch.cuda.synchronize()
            rate = (clock.count - 1) / (clock.last - clock.first) if (
                clock.count > 1 and clock.first and clock.last) else None
            rec.add(**record, outcome="ok", new_tokens=clock.count, ttft_s=(clock.first or start) - start,
                    decode_tokens_per_s=rate, peak_vram_bytes=torch.cuda.max_memory_allocated() if cuda else None,
                    peak_reserved_bytes=torch.cuda.max_memory_reserved() if cuda else None)
        except torch.OutOfMemoryError:
            rec.add(**record, outcome="crashed", error="CUDA out of memory")
            crashed = True
        if crashed:
            release()
            break  # the conversation only grows: every later turn would crash too
    del model
    release()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--budget-s", type=float, default=500.0, help="stop starting new cases after this")
    parser.add_argument("--only", default="", help="run only cases whose name contains one of these (comma-separated)")
    parser.add_argument("--ckpt-dir", type=Path, default=Path("/tmp/cards-ckpt"))
    parser.add_argument("--seed-expandable", action="store_true",
                        help="run the seed recipe with expandable segments too (default: the allocator as published)")
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny random llama on the CPU: checks the harness")
    parser.add_argument("--extra", action="store_true", help="also the earlier ablations (EXTRA)")
    parser.add_argument("--words-per-turn", type=int, default=SCALE.words_per_turn,
                        help="tokens each turn adds (fewer turns reach a long history: less device time)")
    args = parser.parse_args(argv)
    SCALE.words_per_turn = int(args.words_per_turn)
    plan = PLAN + (EXTRA if args.extra else [])
    SCALE.seed_expandable = bool(args.seed_expandable)
    if not args.cpu_smoke:
        from llm_core.loading import configure_cuda_allocator

        configure_cuda_allocator()  # as the app does, before anything touches CUDA (the cap would initialise it)
    if args.cpu_smoke:
        SCALE.words_per_turn, SCALE.new_tokens, SCALE.history_limit_tokens, SCALE.device = 100, 8, 700, "cpu"
        plan = [Case("tiny", 512, 8, "ours"), Case("tiny", 512, 8, "seed"), Case("tiny", 512, 8, "ours", "int8")]

    # Several engines (models, KV formats) in one process: each FastDecoder's compiled layer shares its code object
    # with the others', and dynamo's default limit of 8 entries per code object would silently leave the later
    # engines' prefill eager. One engine per process (the demo) never gets near it.
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 64)
    start = time.perf_counter()
    deadline = start + args.budget_s
    meta = {"bench": "cards", "command": " ".join(["python -m bench.cards", *(argv or sys.argv[1:])]),
            "device": torch.cuda.get_device_name(0) if SCALE.device == "cuda" else "cpu", "versions": versions(),
            "new_tokens_per_turn": SCALE.new_tokens, "words_per_turn": SCALE.words_per_turn,
            "cap": "set_per_process_memory_fraction(card); VRAM_BUDGET=card-0.5GiB"}
    rec = Recorder(args.out, {}, head=meta)
    conversations: dict[tuple[str, int], list[Any]] = {}
    for case in plan:
        if args.only and not any(part and part in case.name for part in args.only.split(",")):
            continue
        base = dict(recipe=case.recipe, card_gib=case.card_gib, model=case.model, max_positions=case.positions,
                    quantization=case.quantization, kv_cache=case.kv_cache if case.recipe == "ours" else "bf16",
                    device=meta["device"], versions=meta["versions"], command=meta["command"], case=case.name)
        if time.perf_counter() > deadline - 60:  # a case's start-up alone takes ~20-75 s
            rec.add(**base, what="skipped", outcome="skipped", reason="device-time budget of this run spent")
            continue
        folder = args.ckpt_dir / f"{case.model}-{case.positions}"
        try:
            if not checkpoint_ready(folder):
                t = time.perf_counter()
                make_random_checkpoint(case.model, folder, torch.device(SCALE.device), case.positions)
                rec.add(what="checkpoint", model=case.model, positions=case.positions,
                        seconds=round(time.perf_counter() - t, 1))
            (run_ours if case.recipe == "ours" else run_seed)(case, folder, rec, base, conversations, deadline)
        except Exception as exc:  # noqa: BLE001 - record and go on with the next case
            rec.add(**base, what="error", outcome="crashed", error=f"{type(exc).__name__}: {exc}"[:600],
                    trace=traceback.format_exc()[-1500:])
        release()  # after the except block, whose traceback holds the case's frames
    rec.set_summary(cards=summarize(rec.records))
    rec.add(what="done", seconds=round(time.perf_counter() - start, 1))
    return 0


def summarize(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (model, card): ours (default settings) beside the seed recipe, from the turn records."""
    out = []
    pairs = sorted({(r["model"], r["card_gib"]) for r in records if r.get("what") == "turn"})
    for model, card in pairs:
        mine = [r for r in records if r.get("what") == "turn" and r.get("model") == model and r.get("card_gib") == card]
        ours = [r for r in mine if r.get("recipe") == "ours" and r.get("kv_cache") == "default"]
        seed = [r for r in mine if r.get("recipe") == "seed"]
        if not ours:
            continue
        ok = [r for r in ours if r.get("outcome") == "ok"]
        longest = max(ok, key=lambda r: r.get("prompt_tokens") or 0, default=None)
        seed_ok = [r for r in seed if r.get("outcome") == "ok"]
        seed_longest = max((r.get("prompt_tokens") or 0 for r in seed_ok), default=0)
        seed_rate = next((r.get("decode_tokens_per_s") for r in seed_ok if r.get("prompt_tokens") == seed_longest),
                         None)
        seed_crash = min((r.get("prompt_tokens") or 0 for r in seed if r.get("outcome") == "crashed"), default=None)
        seed_answered = {r["turn"] for r in seed_ok}
        errors = [abs(r["predicted_peak_vram_bytes"] - r["peak_vram_bytes"]) / r["peak_vram_bytes"] for r in ok
                  if r.get("predicted_peak_vram_bytes") and r.get("peak_vram_bytes")]
        kept = (longest or {}).get("prompt_tokens") or 0
        rate = (longest or {}).get("decode_tokens_per_s")
        fills = [r for r in records if r.get("what") == "fill" and r.get("model") == model
                 and r.get("card_gib") == card and r.get("recipe") == "ours" and r.get("kv_cache") == "default"]
        filled = next((r for r in fills if r.get("outcome") == "ok"), None)
        fill_tokens = (filled or {}).get("prompt_tokens") or 0
        out.append({
            "model": model, "card_gib": card, "ours_longest_prompt_tokens": kept, "ours_decode_tokens_per_s": rate,
            "ours_fill_prompt_tokens": fill_tokens or None,
            "ours_fill_decode_tokens_per_s": (filled or {}).get("decode_tokens_per_s"),
            "fill_ratio_to_seed": round(fill_tokens / seed_longest, 3) if fill_tokens and seed_longest else None,
            "fill_decode_ratio_to_seed": round(filled["decode_tokens_per_s"] / seed_rate, 2)
            if filled and filled.get("decode_tokens_per_s") and seed_rate else None,
            "ours_fill_failures": sum(r.get("outcome") != "ok" for r in fills),
            "seed_longest_prompt_tokens": seed_longest, "seed_decode_tokens_per_s": seed_rate,
            "seed_crashed_at_prompt_tokens": seed_crash, "ratio_to_seed": round(kept / seed_longest, 3)
            if seed_longest else None, "decode_ratio_to_seed": round(rate / seed_rate, 2) if rate and seed_rate
            else None, "ours_crashes": sum(r.get("outcome") == "crashed" for r in ours),
            "ours_refusals": sum(r.get("outcome") == "refused" for r in ours),
            "refusals_the_seed_answers": sum(r.get("outcome") == "refused" and r["turn"] in seed_answered
                                             for r in ours),
            "max_peak_prediction_error": round(max(errors), 4) if errors else None,
            "peak_prediction_error_at_longest": round(abs(longest["predicted_peak_vram_bytes"] - longest[
                "peak_vram_bytes"]) / longest["peak_vram_bytes"], 4) if longest and longest.get(
                "predicted_peak_vram_bytes") and longest.get("peak_vram_bytes") else None,
        })
    return out


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
