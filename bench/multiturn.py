"""A multi-turn chat through ChatEngine (default settings, the path the app runs) with PREFIX_CACHE on and then off,
in one run: TTFT per turn, cached_prompt_tokens, decode tok/s, and whether every reply is token-identical.

    python -m bench.multiturn --out bench/results/2026-12-01-cpu-multiturn.json          # embedded model, CPU
    python -m bench.multiturn --random llama-2-7b --card-gib 16 --message-tokens 2000 \\
        --out "$OUT/h200-multiturn.json"                                                   # CUDA, emulated card

Both engines get the same conversation: the first run (--first, default PREFIX_CACHE=on) chats (its replies
become the history), and the other replays its message lists, so each turn compares the two on one prompt. Greedy, so
any difference in tokens is the cache's doing. TTFT is the engine's own (stream_chat called -> first token on the
host: templating and tokenizing included); decode tok/s = (new - 1) / (last token - first token).

Messages: English-like text of about --message-tokens tokens (the embedded model), or one word per token on a
random-weight checkpoint of a real shape (--random, bench.harness.make_random_checkpoint), where a card is emulated
as bench.cards does: torch.cuda.set_per_process_memory_fraction(card) and VRAM_BUDGET = card - 0.5 GiB.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench.harness import Recorder, checkpoint_ready, make_random_checkpoint

GiB = 2**30
WORDS = ("the river model memory cache token answer question light garden window city music number paper story "
         "mountain engine signal winter summer market teacher student ocean forest bridge letter orange silver "
         "quiet rapid simple careful bright narrow ancient modern gentle honest").split()


def english(turn: int, tokens: int, count: Any) -> str:
    """A deterministic message of about `tokens` tokens (counted by the model's tokenizer)."""
    rng = random.Random(1000 + turn)
    words: list[str] = [f"Turn {turn}: please summarize these notes."]
    while count(" ".join(words)) < tokens:
        sentence = " ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 14)))
        words.append(sentence.capitalize() + ".")
    return " ".join(words)


def word_message(turn: int, tokens: int) -> str:
    """One word per token with the random checkpoints' word-level tokenizer."""
    return " ".join(f"t{(i * 7919 + turn * 104729) % 500 + 3}" for i in range(tokens))


def machine() -> dict[str, Any]:
    out: dict[str, Any] = {"platform": platform.platform(), "processor": platform.processor(),
                           "cores": os.cpu_count(), "load_avg_1_5_15": os.getloadavg(),
                           "python": sys.version.split()[0], "torch": torch.__version__}
    try:
        import transformers

        out["transformers"] = transformers.__version__
    except ImportError:
        pass
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name(0)
    return out


def load_engine(env: dict[str, str], prefix_cache: bool) -> Any:
    from llm_core.config import Settings
    from llm_core.engine.chat import ChatEngine

    return ChatEngine.load(Settings.from_env(environ={**env, "PREFIX_CACHE": "on" if prefix_cache else "off"},
                                             env_file=None))


def device_profile(prof: Any, top: int = 12) -> dict[str, Any]:
    """torch.profiler's device kernels (every thread's): their total and the largest by total time."""
    key = "self_device_time_total"
    events = sorted((e for e in prof.key_averages() if getattr(e, key, 0) > 0), key=lambda e: getattr(e, key),
                    reverse=True)
    return {"device_kernels_us": round(sum(getattr(e, key) for e in events), 1),
            "device_kernels": [{"name": e.key[:120], "calls": e.count, "us": round(getattr(e, key), 1)}
                               for e in events[:top]]}


def chat(engine: Any, messages: list[str], new_tokens: int, replay: list[Any] | None, rec: Recorder,
         mode: str, profile_turns: frozenset[int] = frozenset()) -> tuple[list[Any], list[dict[str, Any]]]:
    """Run every turn; `replay`: the histories to use per turn (else the replies so far); `profile_turns`: those
    turns run under torch.profiler (CUDA), their results carrying the device's kernels (the profiler's own cost is in
    their TTFT). Returns (histories, per-turn results)."""
    import contextlib
    from dataclasses import replace

    from llm_core.history import Turn

    gen = replace(engine.settings.generation, max_new_tokens=new_tokens)
    history: list[Any] = []
    histories, results = [], []
    for turn, text in enumerate(messages, start=1):
        if replay is not None:
            history = replay[turn - 1]
        histories.append(list(history))
        last = None
        profiled = turn in profile_turns and torch.cuda.is_available()
        prof: Any = None
        with contextlib.ExitStack() as stack:
            if profiled:
                from torch.profiler import ProfilerActivity, profile

                prof = stack.enter_context(profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]))
            for update in engine.stream_chat(text, history, gen=gen, request_id=f"{mode}-bench"):
                last = update
        assert last is not None and last.done
        s = last.stats
        result = {"mode": mode, "turn": turn, "prompt_tokens": s.prompt_tokens,
                  "cached_prompt_tokens": s.cached_prompt_tokens, "ttft_s": round(s.ttft_s, 4),
                  "decode_tokens_per_s": round(s.decode_tokens_per_s, 1) if s.decode_tokens_per_s else None,
                  "new_tokens": s.new_tokens, "dropped_turns": s.dropped_turns, "decode_path": s.decode_path,
                  "token_ids": list(last.token_ids)}
        if prof is not None:
            result["profile"] = device_profile(prof)
        results.append(result)
        rec.add("turn", **{k: v for k, v in result.items() if k != "token_ids"})
        history = [*history, Turn(text, last.text)]
    return histories, results


def first_difference(a: list[int], b: list[int]) -> dict[str, Any] | None:
    """Where two replies part (new-token index) and the two tokens there; None when they are the same."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return {"index": i, "on": x, "off": y}
    return None if len(a) == len(b) else {"index": min(len(a), len(b)), "lengths": [len(a), len(b)]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--turns", type=int, default=9)
    parser.add_argument("--message-tokens", type=int, default=570)
    parser.add_argument("--new-tokens", type=int, default=64, help="max new tokens per reply")
    parser.add_argument("--random", default="", help="a bench.harness.RANDOM_ARCHS shape (CUDA), e.g. llama-2-7b")
    parser.add_argument("--card-gib", type=float, default=16.0, help="--random: the emulated card")
    parser.add_argument("--max-positions", type=int, default=32768, help="--random: the checkpoint's context")
    parser.add_argument("--ckpt-dir", type=Path, default=Path("/tmp/multiturn-ckpt"))
    parser.add_argument("--first", choices=("on", "off"), default="on",
                        help="which PREFIX_CACHE run chats first (the other replays its conversation)")
    parser.add_argument("--only-first", action="store_true",
                        help="run the --first engine only (no replay with the other PREFIX_CACHE: a shorter call)")
    parser.add_argument("--profile-turns", default="", help="comma-separated turns of the 'on' run to run under "
                        "torch.profiler (CUDA): where their TTFT goes")
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                        help="a setting for both engines beyond the defaults (repeatable), e.g. KV_LAYOUT=paged")
    args = parser.parse_args(argv)

    env: dict[str, str] = {"HISTORY_TURNS": "64"}  # every turn kept: the history grows by one exchange per turn
    for item in args.set:
        name, sep, value = item.partition("=")
        if not sep or not name:
            parser.error(f"--set takes NAME=VALUE, not {item!r}")
        env[name] = value
    settings = "defaults + " + ", ".join(f"{k}={v}" for k, v in env.items())
    meta: dict[str, Any] = {"command": "python -m bench.multiturn " + " ".join(argv or sys.argv[1:]),
                            "machine": machine(), "turns": args.turns, "message_tokens": args.message_tokens,
                            "new_tokens": args.new_tokens, "settings": settings,
                            "first": args.first,
                            "ttft": "stream_chat called -> first token on the host (ChatEngine's ttft_s)"}
    if args.random:
        if not torch.cuda.is_available():
            parser.error("--random runs on CUDA (an emulated card)")
        folder = args.ckpt_dir / f"{args.random}-{args.max_positions}"
        if not checkpoint_ready(folder):  # a finished one from an earlier run is reused (13+ GB to write)
            make_random_checkpoint(args.random, folder, torch.device("cuda"), args.max_positions)
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.card_gib * GiB / total))
        env.update(MODEL_ID=str(folder), VRAM_BUDGET=f"{args.card_gib - 0.5}GiB",
                   CACHE_DIR=str(args.ckpt_dir / "cache"))
        meta.update(model=f"random {args.random} (NF4)", card_gib=args.card_gib,
                    cap="set_per_process_memory_fraction(card); VRAM_BUDGET=card-0.5GiB")
    else:
        env["CACHE_DIR"] = os.environ.get("CACHE_DIR", str(Path.home() / ".cache" / "llm_core"))
        meta.update(model="embedded SmolLM2-135M-Instruct")
    rec = Recorder(args.out, meta)

    runs: dict[str, list[dict[str, Any]]] = {}
    replay = None
    modes = (args.first,) if args.only_first else (args.first, "off" if args.first == "on" else "on")
    for mode in modes:
        t0 = time.perf_counter()
        engine = load_engine(env, mode == "on")
        rec.add("startup", mode=mode, load_s=round(time.perf_counter() - t0, 1), decode_path=engine.backend.name,
                reason=engine.backend.reason[:300], context_limit=engine.context_limit)
        if args.random:
            messages = [word_message(t, args.message_tokens) for t in range(1, args.turns + 1)]
        else:
            tok = engine.loaded.tokenizer

            def count(text: str, tok: Any = tok) -> int:
                return len(tok(text)["input_ids"])

            messages = [english(t, args.message_tokens, count) for t in range(1, args.turns + 1)]
        profiled = frozenset(int(t) for t in args.profile_turns.split(",") if t) if mode == "on" else frozenset()
        histories, runs[mode] = chat(engine, messages, args.new_tokens, replay, rec, mode, profiled)
        replay = histories
        engine.close()  # its batch loop's thread would keep the weights and KV alive for the next engine
        del engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    on, off = runs.get("on", []), runs.get("off", [])
    identical = [a["token_ids"] == b["token_ids"] for a, b in zip(on, off, strict=True)] if on and off else []

    def ratio(results: list[dict[str, Any]]) -> float | None:
        early = [r["ttft_s"] for r in results if r["turn"] in (2, 3)]
        return round(results[-1]["ttft_s"] / statistics.mean(early), 2) if len(early) == 2 else None

    def over_first(results: list[dict[str, Any]]) -> list[float]:
        return [round(r["ttft_s"] / results[0]["ttft_s"], 2) for r in results] if results else []

    rec.set_summary(
        ttft_s_on=[r["ttft_s"] for r in on], ttft_s_off=[r["ttft_s"] for r in off],
        prompt_tokens=[r["prompt_tokens"] for r in on], cached_prompt_tokens_on=[r["cached_prompt_tokens"] for r in on],
        decode_tokens_per_s_on=[r["decode_tokens_per_s"] for r in on],
        decode_tokens_per_s_off=[r["decode_tokens_per_s"] for r in off],
        last_over_turns_2_3_on=ratio(on), last_over_turns_2_3_off=ratio(off), ttft_over_turn_1_on=over_first(on),
        tokens_identical_per_turn=identical, all_identical=all(identical),
        first_difference=[first_difference(a["token_ids"], b["token_ids"]) for a, b in zip(on, off, strict=True)]
        if on and off else [],
        load_avg_after=os.getloadavg())
    return 0 if all(identical) else 1  # (only one run: nothing to compare, 0)


if __name__ == "__main__":
    raise SystemExit(main())
