"""Issue 18 through the served app: the demo as `app.start` (main's path) serves it with AUTH, attacked the way a
hostile teammate would (CPU, embedded model, 127.0.0.1 only, every wait bounded)."""

from __future__ import annotations

import json
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

import app
from llm_core.config import Settings
from llm_core.engine.chat import ChatEngine
from llm_core.errors import SettingsError
from llm_core.metrics import ReplyStats, export_csv
from llm_core.security import ExportFiles, LoginThrottle, check_exposure
from llm_core.web.guard import NOT_YOURS
from tests.conftest import MODEL_CACHE
from tests.test_app import free_port

SYSTEM = "You are a helpful assistant."
USERS = {"alice": "alice-pw-1", "bob": "bob-pw-2"}
LOGIN_MAX_FAILURES = 3
LOGIN_WINDOW_S = 4


@pytest.fixture(scope="module")
def served(nf4_engine: ChatEngine) -> Iterator[tuple[Any, str]]:
    """The app started by `app.start` from command-line flags, as `python app.py --auth ...` starts it. Only the
    model load is short-cut: the engine is built on the session's already loaded embedded model."""
    port = free_port()
    argv = ["--env-file", "/nonexistent/.env", "--auth", ",".join(f"{u}:{p}" for u, p in USERS.items()),
            "--port", str(port), "--cache-dir", str(MODEL_CACHE), "--login-max-failures", str(LOGIN_MAX_FAILURES),
            "--login-window-s", str(LOGIN_WINDOW_S)]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ChatEngine, "load", classmethod(lambda cls, settings, progress=None: cls(nf4_engine.loaded,
                                                                                               settings)))
        demo = app.start(argv, quiet=True)
    try:
        yield demo, f"http://127.0.0.1:{port}/"
    finally:
        demo.close()


def client(url: str, user: str) -> Any:
    from gradio_client import Client

    return Client(url, verbose=False, auth=(user, USERS[user]))


def submit_chat(c: Any, message: str, max_new_tokens: int) -> Any:
    return c.submit(message=message, history=[], system_prompt=SYSTEM, max_new_tokens=max_new_tokens,
                    history_turns=8, do_sample=False, api_name="/chat")


def fn_index(demo: Any, name: str) -> int:
    return next(i for i, fn in demo.fns.items() if fn.name == name or fn.api_name == name)


def wait_until(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout_s:.0f} s waiting for {what}"
        time.sleep(0.02)


class Raw:
    """A browser's calls by hand: login, then queue/join + queue/data with a session hash of our choosing."""

    def __init__(self, url: str, user: str | None = None) -> None:
        self.http = httpx.Client(base_url=url, timeout=60)
        if user is not None:
            assert self.http.post("login", data={"username": user, "password": USERS[user]}).status_code == 200

    def join(self, session: str, fn: int, data: list[Any]) -> httpx.Response:
        body = json.dumps({"data": data, "fn_index": fn, "session_hash": session, "event_data": None,
                           "trigger_id": None}, ensure_ascii=True)  # lone surrogates travel as JSON escapes
        return self.http.post("gradio_api/queue/join", content=body, headers={"content-type": "application/json"})

    def event(self, session: str, fn: int, data: list[Any]) -> dict[str, Any]:
        """Run one event; returns its process_completed message."""
        joined = self.join(session, fn, data)
        assert joined.status_code == 200, joined.text
        event_id = joined.json()["event_id"]
        with self.http.stream("GET", "gradio_api/queue/data", params={"session_hash": session}) as stream:
            for line in stream.iter_lines():
                if line.startswith("data:"):
                    message = json.loads(line[5:])
                    if message.get("event_id") == event_id and message.get("msg") == "process_completed":
                        return dict(message)
        raise AssertionError("the event stream ended without completing the event")


def chat_data(message: str, history: list[Any], max_new_tokens: int = 4) -> list[Any]:
    return [message, history, SYSTEM, max_new_tokens, 8, False, 0.7, 0.95, 50, 1.05, "bf16", None]


# --- 7 and 8: the open host, auth through main's path, login throttling, sessions' owners ---------------------------

def test_open_host_without_auth_refuses_to_start_before_loading(monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    def never(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the model must not be loaded")

    monkeypatch.setattr(ChatEngine, "load", never)
    assert app.main(["--env-file", "/nonexistent/.env", "--host", "0.0.0.0"]) == 2
    assert "Refusing to serve on HOST=0.0.0.0 (beyond this machine) without a login" in capsys.readouterr().err
    opted_in = Settings.from_env(environ={"HOST": "0.0.0.0", "ALLOW_OPEN_HOST": "true"}, env_file=None)
    assert "no login (ALLOW_OPEN_HOST=true)" in str(check_exposure(opted_in.server))
    with pytest.raises(SettingsError, match="SHARE link"):
        check_exposure(Settings.from_env(environ={"SHARE": "true"}, env_file=None).server)
    assert check_exposure(Settings.from_env(environ={"HOST": "0.0.0.0", "AUTH": "a:b"}, env_file=None).server) is None


def test_auth_from_the_settings_guards_the_app_that_main_starts(served: tuple[Any, str]) -> None:
    _, url = served
    assert httpx.get(url + "config").status_code == 401
    assert httpx.post(url + "login", data={"username": "alice", "password": USERS["bob"]}).status_code == 400
    assert httpx.post(url + "login", data={"username": "alice", "password": USERS["alice"]}).status_code == 200
    outputs = list(submit_chat(client(url, "bob"), "Hi", 2))
    assert outputs[-1][3]["new_tokens"] > 0


def from_address(address: str, url: str) -> httpx.Client:
    """A client whose connection comes from another loopback address (Linux routes all of 127.0.0.0/8 locally)."""
    return httpx.Client(base_url=url, timeout=60, transport=httpx.HTTPTransport(local_address=address))


def login(http: httpx.Client, user: str, password: str, forged: str | None = None) -> httpx.Response:
    headers = {"X-Forwarded-For": forged} if forged else {}
    return http.post("login", data={"username": user, "password": password}, headers=headers)


def test_failed_logins_are_throttled_per_user_and_per_address_whatever_x_forwarded_for_says(
        served: tuple[Any, str]) -> None:
    _, url = served
    guesser = from_address("127.0.0.2", url)
    codes = [login(guesser, "alice", "guess", forged=f"10.9.8.{i}").status_code
             for i in range(LOGIN_MAX_FAILURES + 1)]  # a new forged address each try: not believed
    assert codes == [400] * LOGIN_MAX_FAILURES + [429], codes
    elsewhere = login(from_address("127.0.0.3", url), "alice", USERS["alice"])  # alice herself, another address
    assert elsewhere.status_code == 429  # the user waits, whatever address she comes from, even with her password
    assert "Too many failed logins for this user or from your address; try again in" in elsewhere.json()["detail"]
    bob = login(from_address("127.0.0.3", url), "bob", USERS["bob"])
    assert bob.status_code == 200  # another user from that address is not locked out
    walker = from_address("127.0.0.4", url)  # one address trying many names: throttled by its address
    codes = [login(walker, name, "guess").status_code for name in ("carol", "dave", "erin", "bob")]
    assert codes == [400, 400, 400, 429], codes
    time.sleep(float(elsewhere.headers["retry-after"]))
    assert login(from_address("127.0.0.3", url), "alice", USERS["alice"]).status_code == 200  # after the wait


def test_v1_api_keys_are_throttled_per_user_and_address_like_logins(served: tuple[Any, str]) -> None:
    _, url = served
    guesser = from_address("127.0.0.5", url)
    codes = [guesser.get("v1/models", headers={"Authorization": f"Bearer bob:guess{i}",
                                                "X-Forwarded-For": f"10.1.1.{i}"}).status_code
             for i in range(LOGIN_MAX_FAILURES + 1)]
    assert codes == [401] * LOGIN_MAX_FAILURES + [429], codes
    right = from_address("127.0.0.6", url).get("v1/models", headers={"Authorization": f"Bearer bob:{USERS['bob']}"})
    assert right.status_code == 429 and int(right.headers["retry-after"]) >= 1
    assert set(right.json()["error"]) == {"message", "type", "param", "code"}
    assert right.json()["error"]["code"] == "too_many_failed_keys"
    time.sleep(float(right.headers["retry-after"]))
    again = from_address("127.0.0.6", url).get("v1/models", headers={"Authorization": f"Bearer bob:{USERS['bob']}"})
    assert again.status_code == 200


def test_another_user_cannot_cancel_or_read_a_session(served: tuple[Any, str]) -> None:
    demo, url = served
    alice = client(url, "alice")
    job = submit_chat(alice, "Count from one to forty in words.", 40)
    wait_until(lambda: len(job.outputs()) >= 1, 120, "alice's reply to stream")
    target = {"session_hash": alice.session_hash, "fn_index": fn_index(demo, "chat"), "event_id": "any"}
    bob = Raw(url, "bob")
    assert bob.http.post("gradio_api/cancel", json=target).status_code == 403
    assert httpx.post(url + "gradio_api/cancel", json=target).status_code == 401  # no login at all
    assert bob.http.get("gradio_api/queue/data", params={"session_hash": alice.session_hash}).status_code == 403
    assert bob.http.get(f"gradio_api/heartbeat/{alice.session_hash}").status_code == 403
    job.result(timeout=120)
    stats = job.outputs()[-1][3]
    assert stats["finish_reason"] in ("length", "eos") and stats["new_tokens"] > 1  # alice's reply ran to its end


def app_routes(app: Any) -> list[tuple[str, str]]:
    """(method, path template) of every route the served app answers, Gradio's included routers walked into, the
    mounted /v1 app left out (it has no sessions)."""
    found: list[tuple[str, str]] = []
    for route in app.routes:
        inner = getattr(getattr(route, "include_context", None), "included_router", None)
        for leaf in (inner.routes if inner is not None else [route]):
            path = getattr(leaf, "path", "")
            if not path or path.startswith("/v1"):
                continue
            found += [(method, path) for method in sorted(getattr(leaf, "methods", None) or {"GET"})]
    return found


def test_no_route_lets_another_login_use_a_session_by_its_hash(served: tuple[Any, str]) -> None:
    """Every route of the app's own route table, and every API name of the built demo (run/*, call/*, api/*),
    with alice's session hash in the path, the query and the body, as bob: refused (403, or 404 where the route is
    closed), and alice's reply runs to its end."""
    import re

    demo, url = served
    alice = client(url, "alice")
    job = submit_chat(alice, "Count from one to forty in words.", 40)
    wait_until(lambda: len(job.outputs()) >= 1, 120, "alice's reply to stream")
    session = alice.session_hash
    api_names = sorted({fn.api_name for fn in demo.fns.values() if fn.api_name})
    assert {"chat", "stop", "clear", "show_history", "export_csv_file", "export_json_file"} <= set(api_names)
    bob = Raw(url, "bob")
    checked: list[str] = []
    bobs_own = uuid.uuid4().hex
    for method, template in app_routes(demo.app):
        if template.rstrip("/") in ("/login", "/logout"):
            continue  # no session: the login is throttled instead; logout only ends bob's own login
        for api_name in (api_names if "{api_name}" in template else ["x"]):
            # Alice's hash in one place at a time (bob's own elsewhere): each place is checked on its own.
            for where in ("path", "query", "body"):
                if where == "path" and "{session_hash" not in template or where == "body" and method != "POST":
                    continue
                values = {"session_hash": session if where == "path" else bobs_own, "api_name": api_name}
                path = re.sub(r"{(\w+)(:\w+)?}", lambda m, v=values: v.get(m.group(1), "x"), template)
                body = {"data": [], "session_hash": session if where == "body" else bobs_own, "fn_index": 0,
                        "event_data": None, "trigger_id": None, "event_id": "x"}
                response = bob.http.request(method, path.lstrip("/"), json=body if method == "POST" else None,
                                            params={"session_hash": session if where == "query" else bobs_own})
                assert response.status_code in (403, 404), (where, method, path, response.status_code,
                                                             response.text[:200])
                if response.status_code == 403 and method != "HEAD":
                    assert NOT_YOURS in response.text, (method, path, response.text[:200])
                checked.append(f"{method} {path} ({where})")
    assert len(checked) > 200 and "POST /gradio_api/run/stop (body)" in checked
    assert "POST /gradio_api/call/clear (body)" in checked and "GET /gradio_api/queue/data (query)" in checked
    assert f"GET /gradio_api/heartbeat/{session} (path)" in checked
    job.result(timeout=120)
    stats = job.outputs()[-1][3]
    assert stats["finish_reason"] in ("length", "eos") and stats["new_tokens"] > 1  # not stopped by bob


def test_routes_the_app_does_not_use_are_closed(served: tuple[Any, str]) -> None:
    _, url = served
    raw = Raw(url, "alice")
    for path in ("gradio_api/upload", "gradio_api/stream/x", "gradio_api/run-history/buckets", "gradio_api/runs"):
        response = raw.http.post(path) if path.endswith("upload") else raw.http.get(path)
        assert response.status_code == 404 and "does not use" in response.json()["detail"], path


# --- 3 and 4 through the app: a flooding session, Stop of a queued request --------------------------------------

def timeline(jobs: dict[str, Any], timeout_s: float) -> dict[str, dict[str, float]]:
    """When each job streamed its first output and when it finished (monotonic seconds)."""
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


def test_a_flooding_session_cannot_make_another_user_wait_more_than_one_reply(served: tuple[Any, str]) -> None:
    from gradio_client.exceptions import AppError

    _, url = served
    hog, other = client(url, "alice"), client(url, "bob")
    flood = {f"hog{i}": submit_chat(hog, f"Count from {i} to {i + 40} in words.", 24) for i in range(6)}
    wait_until(lambda: sum(job.done() for job in flood.values()) >= 4, 60, "the hog's extra requests to be refused")
    jobs = {**flood, "other": submit_chat(other, "Say hello.", 4)}
    seen = timeline(jobs, 180)
    refused = []
    for name, job in flood.items():
        try:
            job.result(timeout=1)
        except AppError as exc:
            refused.append((name, str(exc)))
    assert len(refused) == 4, refused
    assert all("already has a reply being written and 1 waiting" in message for _, message in refused)
    accepted = [name for name in flood if name not in dict(refused)]
    second = max(accepted, key=lambda name: seen[name]["first"])  # the hog's waiting request
    assert seen["other"]["done"] <= seen[second]["first"]  # the other user went before it (10 ms polls)
    assert jobs["other"].outputs()[-1][3]["new_tokens"] > 0


def test_a_flood_from_one_login_by_every_route_costs_another_user_at_most_one_reply(
        served: tuple[Any, str], monkeypatch: pytest.MonkeyPatch, artifacts_dir: Path) -> None:
    """Bob sends 30 chats through Gradio (each its own session hash) and 30 through /v1 (each its own `user`
    field), every one from its own forged X-Forwarded-For. Admission counts bob once: alice's reply is the next to
    take the (single) slot after the reply running when she arrives, before any of bob's. Asserted on the order the
    scheduler gives; the wall times go to the record (artifacts/flood.json)."""
    from llm_core.engine.serving import ReplySlots

    demo, url = served
    events: list[tuple[str, str, int]] = []  # (what, person, requests ahead) in the order the scheduler saw them
    original = ReplySlots._wait_turn

    def recording(self: ReplySlots, ticket: Any, on_wait: Callable[[int], None] | None = None) -> None:
        def told(ahead: int) -> None:
            events.append(("waits", ticket.session_id, ahead))
            if on_wait is not None:
                on_wait(ahead)

        events.append(("ready", ticket.session_id, -1))
        original(self, ticket, told)
        events.append(("starts", ticket.session_id, -1))

    monkeypatch.setattr(ReplySlots, "_wait_turn", recording)
    alice = client(url, "alice")
    quiet = timeline({"alice": submit_chat(alice, "Count from one to twenty in words.", 32)}, 120)["alice"]
    bob_alone = timeline({"bob": submit_chat(client(url, "bob"), "Count from one to forty in words.", 48)}, 120)["bob"]
    events.clear()

    bob = Raw(url, "bob")
    chat = fn_index(demo, "chat")
    results: dict[str, Any] = {}

    def gradio_flood(i: int) -> None:
        bob.http.headers["X-Forwarded-For"] = f"10.0.0.{i}"  # not believed: the connection is not a listed proxy
        results[f"gradio{i}"] = bob.event(uuid.uuid4().hex, chat, chat_data(f"Count from {i} to {i + 40}.", [], 48))

    def api_flood(i: int) -> None:
        results[f"api{i}"] = httpx.post(url + "v1/chat/completions", timeout=300, json={
            "model": "SmolLM2-135M-Instruct", "max_tokens": 48, "user": f"end-user-{i}",
            "messages": [{"role": "user", "content": f"Count from {i} to {i + 40}."}]}, headers={
            "Authorization": f"Bearer bob:{USERS['bob']}", "X-Forwarded-For": f"10.0.1.{i}"})

    flood = [threading.Thread(target=f, args=(i,), daemon=True) for i in range(30) for f in (gradio_flood, api_flood)]
    for thread in flood:
        thread.start()
    wait_until(lambda: any(what == "starts" and who == "user:bob" for what, who, _ in events), 120,
               "one of bob's requests to run")
    job = submit_chat(alice, "Count from one to twenty in words.", 32)
    seen = timeline({"alice": job}, 300)["alice"]
    for thread in flood:
        thread.join(timeout=300)

    assert job.outputs()[-1][3]["new_tokens"] > 0
    assert {who for _, who, _ in events} == {"user:alice", "user:bob"}  # 60 hashes, user fields and addresses: 1 bob
    mine = [i for i, (_, who, _) in enumerate(events) if who == "user:alice"]
    ready, start = mine[0], next(i for i in mine if events[i][0] == "starts")
    waited = [ahead for what, who, ahead in events[ready:start] if what == "waits" and who == "user:alice"]
    assert max(waited, default=0) <= 1, waited  # only the reply running when she arrived went first
    assert not [e for e in events[ready:start] if e[0] == "starts"], events[ready:start]  # none of bob's jumped her
    gradio_ok = sum(1 for k, r in results.items() if k.startswith("gradio") and r["success"])
    api_ok = sum(1 for k, r in results.items() if k.startswith("api") and r.status_code == 200)
    refused_api = [r for k, r in results.items() if k.startswith("api") and r.status_code == 429]
    assert all(r.headers.get("retry-after") for r in refused_api)
    record = {"bob_alone_reply_s": bob_alone["done"] - bob_alone["submitted"],
              "flood_requests": len(results), "bob_admitted_gradio": gradio_ok, "bob_admitted_api": api_ok,
              "bob_refused": len(results) - gradio_ok - api_ok, "alice_ahead_when_ready": max(waited, default=0),
              "alice_wait_to_first_output_s": seen["first"] - seen["submitted"],
              "alice_quiet_to_first_output_s": quiet["first"] - quiet["submitted"],
              "alice_reply_s": seen["done"] - seen["first"]}
    (artifacts_dir / "flood.json").write_text(json.dumps(record, indent=2))


def test_stop_removes_a_queued_request_through_the_api(served: tuple[Any, str]) -> None:
    from gradio_client.exceptions import AppError

    _, url = served
    busy_client, waiting_client = client(url, "alice"), client(url, "bob")
    busy = submit_chat(busy_client, "Count from one to sixty in words.", 60)
    wait_until(lambda: len(busy.outputs()) >= 1, 120, "the first reply to stream")
    queued = submit_chat(waiting_client, "Write a long story about a lighthouse.", 256)
    time.sleep(0.5)  # reaches the engine and waits for the single slot
    assert not queued.outputs()
    t0 = time.monotonic()
    waiting_client.predict(api_name="/stop")
    with pytest.raises(AppError, match="Stopped before it started"):
        queued.result(timeout=30)
    assert time.monotonic() - t0 < 5 and not queued.outputs()  # ended at once, nothing generated
    busy.result(timeout=120)
    assert busy.outputs()[-1][3]["finish_reason"] in ("length", "eos")


# --- 6, 9, 10: clean text everywhere, internal events, exports, payload errors --------------------------------------

def test_a_lone_surrogate_neither_breaks_the_stream_nor_the_next_request(served: tuple[Any, str]) -> None:
    demo, url = served
    raw, session, chat = Raw(url, "alice"), uuid.uuid4().hex, fn_index(demo, "chat")
    history = [{"role": "user", "content": [{"type": "text", "text": "My name is \udc00Ada\x07."}]},
               {"role": "assistant", "content": [{"type": "text", "text": "Hello\ud800 Ada."}]}]
    first = raw.event(session, chat, chat_data("What is my \ud83dname?", history))
    assert first["success"], first
    echoed = json.dumps(first["output"]["data"][1], ensure_ascii=False)
    echoed.encode("utf-8")  # valid UTF-8 all the way
    assert "My name is Ada." in echoed and "What is my name?" in echoed and "\\u0007" not in echoed
    second = raw.event(session, chat, chat_data("And again?", []))
    assert second["success"] and second["output"]["data"][3]["new_tokens"] > 0


def test_internal_events_cannot_write_the_session_stats_and_csv_cells_are_escaped(served: tuple[Any, str]) -> None:
    demo, url = served
    raw, session = Raw(url, "alice"), uuid.uuid4().hex
    hostile = {"reply_id": "x", "model": "=HYPERLINK(\"http://evil\")", "versions": "not a dict", "notes": 5}
    skip = {"respond", "regenerate", "compare", "stop", "clear", "export_csv_file", "export_json_file"}
    for index, fn in demo.fns.items():
        if fn.fn is None or fn.name in skip:
            continue
        raw.event(session, index, [hostile if i else [hostile] for i in range(len(fn.inputs))])
    export = raw.event(session, fn_index(demo, "export_csv_file"), [None])
    assert not export["success"] and "No replies yet" in json.dumps(export["output"])  # nothing was recorded

    rows = [ReplyStats(model="=HYPERLINK(\"http://evil\")", notes=["@SUM(A1)", "+1"]).as_dict()]
    rows[0]["versions"] = "not a dict"  # a malformed row exports instead of breaking the export for good
    text = export_csv(rows, Path(tempfile.mkdtemp()) / "s.csv").read_text()
    assert "'=HYPERLINK" in text and "'@SUM(A1) +1" in text and ",=" not in text


def test_export_files_are_deleted_when_the_session_ends(served: tuple[Any, str]) -> None:
    demo, url = served
    raw, session = Raw(url, "alice"), uuid.uuid4().hex
    folders = lambda: set(Path(tempfile.gettempdir()).glob("llm-demo-stats-*"))  # noqa: E731
    before = folders()
    alive = threading.Event()

    def heartbeat() -> None:  # the open tab
        with raw.http.stream("GET", f"gradio_api/heartbeat/{session}") as stream:
            for _ in stream.iter_lines():
                alive.set()
                if closing.is_set():
                    break

    closing = threading.Event()
    tab = threading.Thread(target=heartbeat, daemon=True)
    tab.start()
    assert alive.wait(30)
    assert raw.event(session, fn_index(demo, "chat"), chat_data("Hi", []))["success"]
    export = raw.event(session, fn_index(demo, "export_csv_file"), [None])
    assert export["success"], export
    new = folders() - before
    assert len(new) == 1 and (next(iter(new)) / "reply-stats.csv").is_file()
    closing.set()  # the tab closes
    tab.join(30)
    wait_until(lambda: not (folders() & new), 30, "the session's export folder to be deleted")


def test_export_files_expire_after_their_ttl(tmp_path: Path) -> None:
    now = [0.0]
    exports = ExportFiles(60, root=tmp_path, clock=lambda: now[0])
    old = exports.new_folder("a")
    now[0] = 61
    fresh = exports.new_folder("b")  # every export sweeps first
    assert not old.exists() and fresh.exists() and exports.folders() == [fresh]


def test_malformed_payloads_get_one_sentence_not_a_validation_dump(served: tuple[Any, str]) -> None:
    demo, url = served
    raw = Raw(url, "alice")
    response = raw.http.post("gradio_api/call/chat", json={"data": "not a list"})
    assert response.status_code == 422
    assert response.json()["detail"] == ("Malformed request (data: input should be a valid list). See "
                                         "/gradio_api/info for the expected payload.")
    done = raw.event(uuid.uuid4().hex, fn_index(demo, "chat"), chat_data("hi", [{"role": "user"}]))
    error = json.dumps(done["output"])
    assert "History message 1 is malformed: each needs 'role' and 'content'." in error  # the library's words
    assert "validation error" not in error and "pydantic" not in error


def test_login_throttle_counts_each_known_user_and_each_address() -> None:
    now = [0.0]
    throttle = LoginThrottle(2, 10, users=["alice"], clock=lambda: now[0])
    throttle.failed("a", "alice")
    throttle.succeeded("a", "alice")  # the user's own success clears the user's count
    throttle.failed("b", "alice")
    assert throttle.retry_after_s("c", "alice") == 0  # one failure since the success
    throttle.failed("c", "alice")
    assert throttle.retry_after_s("d", "alice") == 10  # locked by name, from any address
    assert throttle.retry_after_s("d", "bob") == 0 and throttle.retry_after_s("d") == 0
    for name in ("x", "y"):  # invented names get no count of their own, but their address does
        throttle.failed("e", name)
    assert throttle.retry_after_s("e", "bob") == 10
    for i in range(20_000):  # flooding addresses cannot push alice's count out of memory
        throttle.failed(f"10.0.{i // 256}.{i % 256}", f"name{i}")
    assert throttle.retry_after_s("f", "alice") == 10
    now[0] = 10
    assert throttle.retry_after_s("d", "alice") == 0
