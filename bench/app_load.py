"""Concurrent chats through the web app itself: N gradio_client sessions on /chat at once, the engine and the Gradio
server in one process as `python app.py` runs them, each UI_UPDATE_INTERVAL_S in turn on the same loaded engine;
what the users receive and what the server's process spent; one JSON document.

GPU (one call; the random checkpoint is written once to --ckpt):
    python -m bench.app_load --random llama-2-7b --chats 8,32 --intervals 0,0.05,0.05/128 --pairs 2 \
        [--host-variants default,switch-0.5ms] --out "$OUT/app-load.json"
CPU (the embedded model; MAX_BATCH_SIZE from --settings, else the app's default):
    python -m bench.app_load --chats 4 --new-tokens 32 --settings MAX_BATCH_SIZE=4 --out /tmp/app-load.json
A real chat of several turns: --turns 4 [--turn-tokens 64].

How: the engine is loaded once through llm_core's loader with the app's defaults (MODEL_ID = the checkpoint,
MAX_BATCH_SIZE = the most chats, FORWARDED_ALLOW_IPS = 127.0.0.1 so each session is its own person, --settings on
top). One demo per interval (and cap) is built over it (`ui.build_demo`, `app.launch`: the app's page, queue and
guard), each on its own port. A round = one interval, N chats: --client-procs client processes (clients outside the
server's GIL, as users' browsers are) create their gradio_client sessions, report ready, and on "go" each submits one
/chat (a distinct --prompt-tokens prompt per chat and round, so the prefix cache finds nothing; --new-tokens, greedy)
and reads every streamed update; with --turns T, each chat then sends T - 1 more messages (--turn-tokens each), one
after another, each with the history the page gave back, as a person in a real chat does (the page's history-turns
slider at its default). Rounds go interval A, B, then B, A, ... (--pairs pairs per chat count); with
--host-variants (bench.host_probe: e.g. switch-0.5ms, the GIL's switch interval at 0.5 ms), each interval under each
variant.

Records (`round`), per chat from the client (monotonic clock, one machine) and the reply's own stats:
  aggregate_tokens_per_s        sum over chats of (new_tokens - 1) / (latest final update - earliest first update):
                                the rate the users saw text arrive, the server's whole cost included
  engine_decode_tokens_per_s    {min, median} of the replies' decode tokens/s (the engine's clock, ReplyStats)
  ttft_p50_s / ttft_p95_s       the replies' TTFT (request received -> first token, ReplyStats)
  client_ttft_p50_s / _p95_s    submit -> first update with text, at the client
  updates_per_chat              {min, median, max} streamed updates a chat received
  server_cpu_s                  the server process's CPU time (every thread: engine, scheduler, Gradio) over the round
  server_cpu_ms_per_token       server_cpu_s / tokens generated
  per_turn (--turns > 1)        each turn's replies apart: TTFTs, decode rates, updates, prompt_tokens [min, max]
                                and cached_prompt_tokens_median (what the prefix cache held of the history)
With --turns, aggregate_tokens_per_s and the CPU per token cover every turn of the round.
Random weights: a reply can end early on an end token (about 1 in the vocabulary per token); counts are what ran.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

SYSTEM = "You are a helpful assistant."


# --- the client side (a child process) ----------------------------------------------------------------------------

def client_main(spec: dict[str, Any]) -> None:
    """Open one gradio_client session per chat, print "ready", wait for "go" on stdin, run the chats together and
    print their results as one JSON line."""
    from gradio_client import Client

    chats = spec["chats"]
    clients = [Client(spec["url"], verbose=False, headers={"X-Forwarded-For": chat["address"]}) for chat in chats]
    results: list[list[dict[str, Any]]] = [[] for _ in chats]
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        return

    def run(i: int) -> None:
        history: list[Any] = []
        for turn, message in enumerate(chats[i]["messages"], 1):  # a chat of several turns: each after the last
            out = {"turn": turn}
            results[i].append(out)
            final = one_turn(i, message, history, out)
            if "error" in out or final is None:
                return
            history = final[1] or []

    def one_turn(i: int, message: str, history: list[Any], out: dict[str, Any]) -> Any:
        chat = chats[i]
        out["submit_s"] = time.monotonic()
        updates, first_s, last_s, final = 0, None, None, None
        try:
            job = clients[i].submit(message, history, SYSTEM, chat["max_new_tokens"], chat["history_turns"], False,
                                    0.7, 0.95, 50, 1.0, "auto", api_name="/chat")
            # Polled, not iterated: gradio_client 2.7's Job.__next__ sleeps 1 ms while holding the lock its reader
            # thread needs to append an output, so an iterating client falls seconds behind the server at these rates.
            outputs: list[Any] = []
            while True:
                done = job.done()
                outputs = job.outputs()
                now = time.monotonic()
                for output in outputs[updates:]:
                    history = output[1] or []
                    if first_s is None and history and _text(history[-1].get("content")):
                        first_s = now
                    last_s, final = now, output
                updates = len(outputs)
                if done:
                    break
                time.sleep(0.002)
            job.result(timeout=600)
        except Exception as exc:  # recorded: a bench reports what failed, and the other chats go on
            out["error"] = f"{type(exc).__name__}: {exc}"[:300]
        stats = final[3] if final is not None and isinstance(final[3], dict) else {}
        out.update(first_s=first_s, last_s=last_s, updates=updates,
                   stats={k: stats.get(k) for k in ("new_tokens", "ttft_s", "decode_tokens_per_s", "finish_reason",
                                                    "prompt_tokens", "cached_prompt_tokens", "decode_path")})
        if not stats and "error" not in out:
            out["error"] = "the stream ended without the reply's stats"
        return final

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(chats))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(json.dumps(results), flush=True)


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content or [] if isinstance(part, dict))


# --- the server side --------------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_round(url: str, messages: list[list[str]], new_tokens: int, procs: int, first_address: int,
              history_turns: int = 8) -> dict[str, Any]:
    """One round: the chats (each its list of messages, one per turn) split over `procs` client processes, started
    together; the server's CPU time over it."""
    groups = [list(range(len(messages)))[p::procs] for p in range(min(procs, len(messages)))]
    children = []
    for group in groups:
        spec = {"url": url, "chats": [{"messages": messages[i], "max_new_tokens": new_tokens,
                                       "history_turns": history_turns,
                                       "address": f"10.88.{(first_address + i) // 250}.{(first_address + i) % 250 + 1}"}
                                      for i in group]}
        children.append(subprocess.Popen([sys.executable, "-m", "bench.app_load", "--client", json.dumps(spec)],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
    for child in children:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready", "a client process failed"
    cpu0, wall0 = time.process_time(), time.monotonic()
    for child in children:
        assert child.stdin is not None
        child.stdin.write("go\n")
        child.stdin.flush()
    per_chat: list[list[dict[str, Any]]] = [[] for _ in messages]
    for group, child in zip(groups, children, strict=True):
        out, _ = child.communicate(timeout=900)
        for i, result in zip(group, json.loads(out.strip().splitlines()[-1]), strict=True):
            per_chat[i] = result
    cpu_s, wall_s = time.process_time() - cpu0, time.monotonic() - wall0
    turns = [reply for chat in per_chat for reply in chat]
    record = summarize(turns, cpu_s, wall_s, chats=len(messages))
    most = max(len(m) for m in messages)
    if most > 1:  # each turn's replies apart: the history grows from one to the next
        record["per_turn"] = [{"turn": t, **summarize([r for r in turns if r["turn"] == t], cpu_s, wall_s,
                                                      per_turn=True)} for t in range(1, most + 1)]
    return record


def summarize(replies: list[dict[str, Any]], cpu_s: float, wall_s: float, chats: int | None = None,
              per_turn: bool = False) -> dict[str, Any]:
    """The round's numbers over `replies` (every turn of every chat; `chats` of them); per_turn: one turn's replies
    (what the round's CPU and wall time cover is not theirs alone, and chats drift apart by then: no aggregate)."""
    from bench.harness import percentile  # the benches' nearest rank (imports torch: the server side only)

    ok = [c for c in replies if "error" not in c and c.get("first_s") is not None]
    tokens = [int(c["stats"]["new_tokens"] or 0) for c in ok]
    record: dict[str, Any] = {"completed": len(ok), "errors": [c["error"] for c in replies if "error" in c][:5]}
    if not per_turn:
        record = {"chats": len(replies) if chats is None else chats, "replies": len(replies), **record,
                  "wall_s": round(wall_s, 3), "server_cpu_s": round(cpu_s, 3), "new_tokens": sum(tokens)}
    if not ok:
        return record
    rates = sorted(c["stats"]["decode_tokens_per_s"] for c in ok if c["stats"]["decode_tokens_per_s"])
    ttfts = sorted(c["stats"]["ttft_s"] for c in ok)
    client_ttfts = sorted(c["first_s"] - c["submit_s"] for c in ok)
    updates = sorted(c["updates"] for c in ok)
    prompts = sorted(int(c["stats"]["prompt_tokens"] or 0) for c in ok)
    cached = sorted(int(c["stats"].get("cached_prompt_tokens") or 0) for c in ok)
    if not per_turn:
        span = max(c["last_s"] for c in ok) - min(c["first_s"] for c in ok)
        record.update(aggregate_tokens_per_s=round(sum(t - 1 for t in tokens) / span, 1) if span > 0 else None,
                      server_cpu_ms_per_token=round(1e3 * cpu_s / max(1, sum(tokens)), 3),
                      decode_paths=sorted({str(c["stats"]["decode_path"]) for c in ok}))
    record.update(
        engine_decode_tokens_per_s={"min": round(rates[0], 1), "median": round(statistics.median(rates), 1)}
        if rates else None,
        ttft_p50_s=round(percentile(ttfts, 50) or 0, 3), ttft_p95_s=round(percentile(ttfts, 95) or 0, 3),
        client_ttft_p50_s=round(percentile(client_ttfts, 50) or 0, 3),
        client_ttft_p95_s=round(percentile(client_ttfts, 95) or 0, 3),
        updates_per_chat={"min": updates[0], "median": statistics.median(updates), "max": updates[-1]},
        prompt_tokens=[prompts[0], prompts[-1]], cached_prompt_tokens_median=statistics.median(cached),
    )
    return record


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--client", help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path)
    p.add_argument("--random", metavar="ARCH", help="a random-weight checkpoint of this shape (bench.harness)")
    p.add_argument("--ckpt", type=Path, help="where the random checkpoint is (written when missing)")
    p.add_argument("--chats", default="8", help="comma-separated chat counts")
    p.add_argument("--intervals", default="0,0.05",
                   help="comma-separated UI_UPDATE_INTERVAL_S values, each alone (no cap) or as INTERVAL/CAP with a "
                        "UI_MAX_UPDATES_PER_S (0.05/128: the app's defaults)")
    p.add_argument("--pairs", type=int, default=2, help="rounds of each interval per chat count")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--turns", type=int, default=1,
                   help="turns a chat: each later message sent with the history the page gave back (a real chat)")
    p.add_argument("--turn-tokens", type=int, default=64, help="tokens of each message after the first")
    p.add_argument("--client-procs", type=int, default=4)
    p.add_argument("--host-variants", default="default",
                   help="comma-separated bench.host_probe host variants (e.g. default,switch-0.5ms); every round runs "
                        "under each in turn")
    p.add_argument("--settings", nargs="*", default=[], metavar="KEY=VALUE", help="more settings for the engine")
    a = p.parse_args(argv)
    if a.client:
        client_main(json.loads(a.client))
        return 0
    if a.out is None:
        p.error("--out is required")

    import torch
    import transformers

    from app import launch
    from bench.batched import prompt_text
    from bench.harness import Recorder, checkpoint_ready, make_random_checkpoint
    from bench.host_probe import HOST_VARIANTS, host_variant
    from llm_core.config import Settings
    from llm_core.engine.chat import ChatEngine
    from ui import build_demo

    chats = [int(n) for n in a.chats.split(",")]
    variants = [v for v in a.host_variants.split(",") if v]
    if not variants or {part for v in variants for part in v.split("+")} - set(HOST_VARIANTS):
        p.error(f"--host-variants takes names from {HOST_VARIANTS}")
    intervals = [(float(v.split("/")[0]), int(v.split("/")[1]) if "/" in v else 0) for v in a.intervals.split(",")]
    cuda = torch.cuda.is_available()
    meta: dict[str, Any] = {
        "command": " ".join(shlex.quote(x) for x in [sys.executable, "-m", "bench.app_load", *sys.argv[1:]]),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "python": platform.python_version(),
        "torch": torch.__version__, "transformers": transformers.__version__,
        "device": torch.cuda.get_device_name(0) if cuda else "cpu", "cpus": os.cpu_count(),
        "model": f"{a.random}-shape-random" if a.random else "embedded", "new_tokens": a.new_tokens,
        "prompt_tokens": a.prompt_tokens, "client_procs": a.client_procs,
    }
    rec = Recorder(a.out, meta)
    environ = {"MAX_BATCH_SIZE": str(max(chats)), "FORWARDED_ALLOW_IPS": "127.0.0.1", "SESSION_MAX_WAITING": "1"}
    if a.random:
        ckpt = a.ckpt or Path(f"/tmp/app-load-{a.random}-random")
        if not checkpoint_ready(ckpt):
            make_random_checkpoint(a.random, ckpt, torch.device("cuda" if cuda else "cpu"), 4096, tokenizer="chatml")
        environ["MODEL_ID"] = str(ckpt)
    environ.update(dict(kv.split("=", 1) for kv in a.settings))
    settings = Settings.from_env(environ=environ, env_file=None)
    t = time.perf_counter()
    engine = ChatEngine.load(settings, progress=lambda m: print(m, flush=True))
    rec.add(phase="load", load_s=round(time.perf_counter() - t, 1), decode_path=engine.backend.name,
            max_batch_size=engine.max_concurrent_replies, settings=environ)
    # The system prompt's share (negative where the template's own default, used without one, is longer), so the
    # whole prompt is --prompt-tokens.
    one = [{"role": "user", "content": "a"}]
    user_tokens = a.prompt_tokens - (engine.count_tokens([{"role": "system", "content": SYSTEM}, *one])
                                     - engine.count_tokens(one))
    turn_tokens = a.turn_tokens + engine.count_tokens(one) - 1  # a later message's own tokens, not its template's
    demos, urls = [], {}
    for interval, cap in intervals:
        paced = settings.replace(server={"ui_update_interval_s": interval, "ui_max_updates_per_s": cap,
                                         "port": free_port()})
        demo = build_demo(engine, paced)
        launch(demo, paced, prevent_thread_lock=True, quiet=True)
        demos.append(demo)
        urls[(interval, cap)] = f"http://127.0.0.1:{paced.server.port}/"
    runner = getattr(getattr(engine, "fast_scheduler", None), "runner", None)
    cases = [(interval, variant) for interval in intervals for variant in variants]
    try:
        serial = 0
        for n in chats:
            for pair in range(a.pairs):
                for interval, variant in (cases if pair % 2 == 0 else cases[::-1]):
                    messages = [[prompt_text(engine, serial + i, user_tokens),
                                 *(prompt_text(engine, 100_000 * t + serial + i, turn_tokens)
                                   for t in range(1, a.turns))] for i in range(n)]
                    with host_variant(variant, runner, engine):
                        result = run_round(urls[interval], messages, a.new_tokens, a.client_procs, serial,
                                           settings.chat.history_turns)
                    serial += n
                    rec.add(phase="round", concurrent_chats=n, ui_update_interval_s=interval[0],
                            ui_max_updates_per_s=interval[1], host=variant, pair=pair, **result)
                    print({k: result.get(k) for k in ("chats", "completed", "aggregate_tokens_per_s",
                                                      "engine_decode_tokens_per_s", "ttft_p95_s", "updates_per_chat",
                                                      "server_cpu_ms_per_token", "errors")},
                          f"interval={interval[0]} cap={interval[1]} host={variant}", flush=True)
    finally:
        for demo in demos:
            demo.close()
        rec.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
