"""Issue 25's attacks, re-run against the served app: `app.start` with AUTH=alice:pw1,bob:pw2 on 127.0.0.1 (CPU,
embedded model), bob attacking as the issue's table did. Each row records what the server answered; the last row is
the flood (`flood`): bob's 30 chats by Gradio's queue (30 session hashes) and 30 by /v1 (30 `user` fields), each
with its own forged X-Forwarded-For, against alice's 32-token reply, with the order the scheduler gave and the times.

    python -m bench.security --cache-dir .cache/test-models --out bench/results/2026-12-02-cpu-security.json

Only HTTP from this process (httpx, gradio_client); no wall-clock threshold is judged here: the times are recorded.
tests/test_security.py runs the same `flood` and asserts its order.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx

USERS = {"alice": "pw1", "bob": "pw2"}
MODEL = "SmolLM2-135M-Instruct"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def logged_in(url: str, user: str, address: str = "127.0.0.1") -> httpx.Client:
    http = httpx.Client(base_url=url, timeout=120, transport=httpx.HTTPTransport(local_address=address))
    assert http.post("login", data={"username": user, "password": USERS[user]}).status_code == 200
    return http


Event = tuple[str, str, int]  # (what: ready / waits / starts, person, requests ahead) as the scheduler saw it


@contextlib.contextmanager
def scheduler_events() -> Iterator[list[Event]]:
    """Records every request's turn in the engines' ReplySlots while inside: ready, each change of how many go
    first (waits), and its start, with the person it counts for."""
    from llm_core.engine.admission import ReplySlots

    events: list[Event] = []
    original = ReplySlots._wait_turn

    def recording(self: ReplySlots, ticket: Any, on_wait: Callable[[int], None] | None = None) -> None:
        def told(ahead: int) -> None:
            events.append(("waits", ticket.session_id, ahead))
            if on_wait is not None:
                on_wait(ahead)

        events.append(("ready", ticket.session_id, -1))
        original(self, ticket, told)
        events.append(("starts", ticket.session_id, -1))

    ReplySlots._wait_turn = recording  # type: ignore[method-assign]
    try:
        yield events
    finally:
        ReplySlots._wait_turn = original  # type: ignore[method-assign]


def timeline(jobs: dict[str, Any], timeout_s: float) -> dict[str, dict[str, float]]:
    """When each gradio_client job was submitted, streamed its first output and finished (monotonic seconds)."""
    seen: dict[str, dict[str, float]] = {name: {"submitted": time.monotonic()} for name in jobs}
    deadline = time.monotonic() + timeout_s
    while not all(job.done() for job in jobs.values()):
        assert time.monotonic() < deadline, "jobs still running"
        now = time.monotonic()
        for name, job in jobs.items():
            if job.outputs() and "first" not in seen[name]:
                seen[name]["first"] = now
            if job.done() and "done" not in seen[name]:
                seen[name]["done"] = now
        time.sleep(0.01)
    now = time.monotonic()
    for name, job in jobs.items():
        seen[name].setdefault("done", now)
        if job.outputs():
            seen[name].setdefault("first", now)
    return seen


def gradio_event(http: httpx.Client, session: str, fn: int, data: list[Any]) -> dict[str, Any]:
    """One event through Gradio's queue by hand (queue/join, then queue/data for that session): its
    process_completed message."""
    body = json.dumps({"data": data, "fn_index": fn, "session_hash": session, "event_data": None,
                       "trigger_id": None}, ensure_ascii=True)  # lone surrogates travel as JSON escapes
    joined = http.post("gradio_api/queue/join", content=body, headers={"content-type": "application/json"})
    assert joined.status_code == 200, joined.text
    event_id = joined.json()["event_id"]
    with http.stream("GET", "gradio_api/queue/data", params={"session_hash": session}) as stream:
        for line in stream.iter_lines():
            if line.startswith("data:"):
                message = json.loads(line[5:])
                if message.get("event_id") == event_id and message.get("msg") == "process_completed":
                    return dict(message)
    raise AssertionError("the event stream ended without completing the event")


def chat_inputs(message: str, max_new_tokens: int, history: list[Any] | None = None,
                system_prompt: str = "") -> list[Any]:
    """The chat event's inputs in the order the page sends them (greedy, dynamic KV cache)."""
    return [message, history or [], system_prompt, max_new_tokens, 8, False, 0.7, 0.95, 50, 1.05, "bf16", "", None]


def order_facts(events: list[Event], person: str) -> dict[str, Any]:
    """What the scheduler's order says about `person`'s first request: the persons seen, the most requests it was
    told go first, and how many others started between its arrival and its start."""
    mine = [i for i, (_, who, _) in enumerate(events) if who == person]
    ready = mine[0]
    start = next(i for i in mine if events[i][0] == "starts")
    waited = [ahead for what, who, ahead in events[ready:start] if what == "waits" and who == person]
    return {"persons": sorted({who for _, who, _ in events}), "ahead_when_ready": max(waited, default=0),
            "others_started_before_it": sum(1 for what, _, _ in events[ready:start] if what == "starts")}


def flood(url: str, passwords: dict[str, str], chat_fn: int, model: str, n: int = 30,
          system_prompt: str = "") -> dict[str, Any]:
    """Alice's 32-token reply on a quiet server, one of bob's 48-token replies alone (the "one reply"), then bob's
    n chats by Gradio's queue (each its own session hash) and n by /v1 (each its own `user` field), every one with
    its own forged X-Forwarded-For, and alice's same reply while they are in. Returns the times, the counts and
    the scheduler's order (`order_facts` of alice's request and the raw `events`)."""
    from gradio_client import Client

    def client(user: str) -> Any:
        return Client(url, verbose=False, auth=(user, passwords[user]))

    def submit(c: Any, message: str, tokens: int) -> Any:
        return c.submit(message=message, history=[], system_prompt=system_prompt, max_new_tokens=tokens,
                        history_turns=8, do_sample=False, api_name="/chat")

    alice = client("alice")
    quiet = timeline({"alice": submit(alice, "Count from one to twenty in words.", 32)}, 120)["alice"]
    bob_alone = timeline({"bob": submit(client("bob"), "Count from one to forty in words.", 48)}, 120)["bob"]
    bob = httpx.Client(base_url=url, timeout=300)
    assert bob.post("login", data={"username": "bob", "password": passwords["bob"]}).status_code == 200
    results: dict[str, Any] = {}

    def by_gradio(i: int) -> None:
        headers = {"X-Forwarded-For": f"10.0.0.{i}"}  # not believed: the connection is not a listed proxy
        with httpx.Client(base_url=url, timeout=300, cookies=bob.cookies, headers=headers) as http:
            results[f"gradio{i}"] = gradio_event(http, uuid.uuid4().hex, chat_fn,
                                                 chat_inputs(f"Count from {i} to {i + 40}.", 48, None, system_prompt))

    def by_api(i: int) -> None:
        results[f"api{i}"] = httpx.post(url + "v1/chat/completions", timeout=300, json={
            "model": model, "max_tokens": 48, "user": f"end-user-{i}",
            "messages": [{"role": "user", "content": f"Count from {i} to {i + 40}."}]}, headers={
            "Authorization": f"Bearer bob:{passwords['bob']}", "X-Forwarded-For": f"10.0.1.{i}"})

    with scheduler_events() as events:
        threads = [threading.Thread(target=f, args=(i,), daemon=True) for i in range(n) for f in (by_gradio, by_api)]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 120
        while not any(what == "starts" and who == "user:bob" for what, who, _ in events):
            assert time.monotonic() < deadline, "none of bob's requests started"
            time.sleep(0.02)
        job = submit(alice, "Count from one to twenty in words.", 32)
        seen = timeline({"alice": job}, 300)["alice"]
        for thread in threads:
            thread.join(timeout=300)
    gradio_ok = sum(1 for k, r in results.items() if k.startswith("gradio") and r["success"])
    api_ok = sum(1 for k, r in results.items() if k.startswith("api") and r.status_code == 200)
    refused_api = [r for k, r in results.items() if k.startswith("api") and r.status_code == 429]
    one_reply_s = bob_alone["done"] - bob_alone["submitted"]
    quiet_s, flood_s = quiet["first"] - quiet["submitted"], seen["first"] - seen["submitted"]
    return {"bob_requests": len(results), "bob_admitted_gradio": gradio_ok, "bob_admitted_api": api_ok,
            "bob_refused": len(results) - gradio_ok - api_ok,
            "api_429_with_retry_after": sum(1 for r in refused_api if r.headers.get("retry-after")),
            "api_429": len(refused_api), **order_facts(events, "user:alice"),
            "alice_quiet_to_first_output_s": round(quiet_s, 2), "one_reply_s": round(one_reply_s, 2),
            "alice_flood_to_first_output_s": round(flood_s, 2),
            "alice_flood_within_quiet_plus_one_reply": flood_s <= quiet_s + one_reply_s,
            "alice_reply_new_tokens": job.outputs()[-1][3]["new_tokens"], "events": events}


def run(cache_dir: str) -> dict[str, Any]:
    from gradio_client import Client

    import app

    port = free_port()
    url = f"http://127.0.0.1:{port}/"
    demo = app.start(["--env-file", "/nonexistent/.env", "--auth", "alice:pw1,bob:pw2", "--port", str(port),
                      "--cache-dir", cache_dir, "--decode-path", "plain"], quiet=True)
    rows: dict[str, Any] = {}
    try:
        # First, before the rows below lock bob's name out with 1,000 wrong keys.
        rows["flood"] = flood(url, USERS, next(i for i, fn in demo.fns.items() if fn.api_name == "chat"), MODEL)
        alice = Client(url, verbose=False, auth=("alice", USERS["alice"]))
        job = alice.submit(message="Count from one to forty in words.", history=[], system_prompt="",
                           max_new_tokens=40, history_turns=8, do_sample=False, api_name="/chat")
        while not job.outputs():
            time.sleep(0.05)
        bob = logged_in(url, "bob", "127.0.0.2")
        session = alice.session_hash
        for name in ("run/stop", "run/clear", "call/stop", "run/end_session", "run/show_history",
                     "run/export_csv_file", "run/export_json_file"):
            response = bob.post(f"gradio_api/{name}", json={"data": [], "session_hash": session})
            rows[f"POST /gradio_api/{name} with alice's session hash"] = response.status_code
        job.result(timeout=120)
        rows["alice's reply finish_reason after bob's attempts"] = job.outputs()[-1][3]["finish_reason"]

        guesser = httpx.Client(base_url=url, timeout=30, transport=httpx.HTTPTransport(local_address="127.0.0.3"))
        codes = [guesser.post("login", data={"username": "alice", "password": "guess"},
                              headers={"X-Forwarded-For": f"10.0.0.{i}"}).status_code for i in range(8)]
        rows["8 wrong logins for alice, a new X-Forwarded-For each"] = codes
        other = httpx.post(url + "login", data={"username": "alice", "password": USERS["alice"]})
        rows["then alice's right password from another address"] = other.status_code
        wait_s = float(other.headers.get("retry-after", 0))
        time.sleep(wait_s)
        rows[f"alice's right password after Retry-After ({wait_s:.0f} s)"] = httpx.post(
            url + "login", data={"username": "alice", "password": USERS["alice"]}).status_code

        keys = httpx.Client(base_url=url, timeout=30, transport=httpx.HTTPTransport(local_address="127.0.0.4"))
        start = time.perf_counter()
        codes = [keys.get("v1/models", headers={"Authorization": f"Bearer bob:guess{i}"}).status_code
                 for i in range(1000)]
        elapsed = time.perf_counter() - start
        rows["1,000 wrong /v1 API keys"] = {str(c): codes.count(c) for c in sorted(set(codes))} | {
            "first_429_at": codes.index(429) + 1 if 429 in codes else None, "seconds": round(elapsed, 2)}

        body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
        v1 = url + "v1/chat/completions"
        key = {"Authorization": f"Bearer alice:{USERS['alice']}"}
        rows["fetch() from another site, Content-Type text/plain"] = httpx.post(
            v1, content=body, headers={**key, "Content-Type": "text/plain", "Origin": "https://evil.example"}
        ).status_code
        rows["same body, text/plain, no Origin"] = httpx.post(
            v1, content=body, headers={**key, "Content-Type": "text/plain"}).status_code
        js = {**key, "Content-Type": "application/json"}
        for label, content in (("seed 2**64", json.dumps({"model": MODEL, "seed": 2**64, "max_tokens": 2,
                                                           "messages": [{"role": "user", "content": "Hi"}]})),
                               ("100,000 nested [", "[" * 100_000)):
            response = httpx.post(v1, content=content, headers=js)
            rows[label] = [response.status_code, response.json()]
        for path in (f"models/{MODEL}", "embeddings", "moderations"):
            response = httpx.request("GET" if path.startswith("models") else "POST", url + "v1/" + path, headers=js,
                                     content=b"{}" if not path.startswith("models") else None)
            rows[f"/v1/{path}"] = [response.status_code, response.json()]

        results: list[httpx.Response] = []

        def one(i: int) -> None:
            results.append(httpx.post(v1, headers=js, timeout=300, content=json.dumps(
                {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": f"Count to {i}."}]})))

        threads = [threading.Thread(target=one, args=(i,)) for i in range(20)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=300)
        refused = [r for r in results if r.status_code == 429]
        rows["20 requests from one key at once"] = {
            "200": sum(r.status_code == 200 for r in results), "429": len(refused),
            "429_with_retry_after": sum(1 for r in refused if r.headers.get("retry-after"))}
        for target in ("/v1", "/v1/", "//v1/models", "/v1;x", "/v1/../gradio_api/info"):  # raw, as sent
            response = httpx.Client(headers=js).get(url, extensions={"target": target.encode()})
            rows[f"GET raw target {target}"] = [response.status_code, response.json()]

        call = logged_in(url, "alice").post("gradio_api/call/chat", json={"data": chat_inputs("Say hi.", 4)})
        event = call.json()["event_id"]
        rows["bob: GET /gradio_api/call/chat/{alice's event id}"] = bob.get(f"gradio_api/call/chat/{event}").status_code
        rows["bob: POST /gradio_api/cancel with alice's event id"] = bob.post("gradio_api/cancel", json={
            "session_hash": uuid.uuid4().hex, "fn_index": 0, "event_id": event}).status_code
    finally:
        demo.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache-dir", required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    rows = run(args.cache_dir)
    args.out.write_text(json.dumps(rows, indent=2) + "\n")
    print(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
