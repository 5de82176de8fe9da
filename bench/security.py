"""Issue 25's attacks, re-run against the served app: `app.start` with AUTH=alice:pw1,bob:pw2 on 127.0.0.1 (CPU,
embedded model), bob attacking as the issue's table did. Each row records what the server answered.

    python -m bench.security --cache-dir .cache/test-models --out bench/results/2026-12-01-cpu-security.json

Only HTTP from this process (httpx, gradio_client); no wall-clock threshold is judged here: the times are recorded.
"""

from __future__ import annotations

import argparse
import json
import socket
import threading
import time
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


def run(cache_dir: str) -> dict[str, Any]:
    from gradio_client import Client

    import app

    port = free_port()
    url = f"http://127.0.0.1:{port}/"
    demo = app.start(["--env-file", "/nonexistent/.env", "--auth", "alice:pw1,bob:pw2", "--port", str(port),
                      "--cache-dir", cache_dir, "--decode-path", "plain"], quiet=True)
    rows: dict[str, Any] = {}
    try:
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
        for path in (f"models/{MODEL}", "completions", "embeddings"):
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
