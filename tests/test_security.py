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
from bench.security import chat_inputs, flood, gradio_event, timeline
from llm_core.config import Settings
from llm_core.engine.chat import ChatEngine
from llm_core.errors import SettingsError
from llm_core.metrics import ReplyStats, export_csv
from llm_core.security import ExportFiles, LoginThrottle, SessionOwners, check_exposure
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

    def event(self, session: str, fn: int, data: list[Any]) -> dict[str, Any]:
        """Run one event; returns its process_completed message."""
        return gradio_event(self.http, session, fn, data)


def chat_data(message: str, history: list[Any], max_new_tokens: int = 4) -> list[Any]:
    return chat_inputs(message, max_new_tokens, history, SYSTEM)


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


# Path parameters of Gradio's routes that name no session and no job: files, pages, API names, closed routes' keys.
# A route keyed by anything else (a new kind of id) fails the walk below until it is added here or to ID_FIELDS.
NOT_AN_ID = {"api_name", "path", "path_or_url", "url_path", "file_name", "id", "environment", "type", "size", "key",
             "ext", "run", "component_id", "segment_id", "endpoint", "record_id", "asset_id"}


def test_no_route_lets_another_login_use_a_session_or_an_event_by_its_id(served: tuple[Any, str]) -> None:
    """Every route of the app's own route table, and every API name of the built demo (run/*, call/*, api/*),
    with alice's session hash, then alice's event id (a call/ job's), in the path, the query and the body, as bob:
    refused (403, or 404 where the route is closed); alice's reply runs to its end and her job's result is hers."""
    import re

    from llm_core.web.guard import ID_FIELDS

    demo, url = served
    alice = client(url, "alice")
    job = submit_chat(alice, "Count from one to forty in words.", 40)
    wait_until(lambda: len(job.outputs()) >= 1, 120, "alice's reply to stream")
    alice_raw = Raw(url, "alice")
    called = alice_raw.http.post("gradio_api/call/chat", json={"data": chat_data("Say hi.", [], 4)})
    assert called.status_code == 200, called.text
    mine = {"session_hash": alice.session_hash, "event_id": called.json()["event_id"]}
    api_names = sorted({fn.api_name for fn in demo.fns.values() if fn.api_name})
    assert {"chat", "stop", "clear", "show_history", "export_csv_file", "export_json_file"} <= set(api_names)
    bob = Raw(url, "bob")
    checked: list[str] = []
    bobs_call = bob.http.post("gradio_api/call/chat", json={"data": chat_data("Say hi.", [], 4)}).json()["event_id"]
    bobs_own = {"session_hash": uuid.uuid4().hex, "event_id": bobs_call}  # real ids of bob's: refusals are alice's
    routes = app_routes(demo.app)
    unclassified = {(m, t) for m, t in routes for name in re.findall(r"{(\w+)", t)
                    if name not in NOT_AN_ID and name not in ID_FIELDS}
    assert not unclassified, f"routes keyed by a parameter the guard does not check: {unclassified}"
    for method, template in routes:
        if template.rstrip("/") in ("/login", "/logout"):
            continue  # no session: the login is throttled instead; logout only ends bob's own login
        for api_name in (api_names if "{api_name}" in template else ["x"]):
            # Alice's id in one place at a time (bob's own elsewhere): each place is checked on its own.
            for field in ID_FIELDS:
                for where in ("path", "query", "body"):
                    if where == "path" and "{" + field not in template or where == "body" and method != "POST":
                        continue
                    values = {k: mine[k] if (k, where) == (field, "path") else bobs_own[k] for k in ID_FIELDS}
                    values["api_name"] = api_name
                    path = re.sub(r"{(\w+)(:\w+)?}", lambda m, v=values: v.get(m.group(1), "x"), template)
                    body = {"data": [], "fn_index": 0, "event_data": None, "trigger_id": None} | {
                        k: mine[k] if (k, where) == (field, "body") else bobs_own[k] for k in ID_FIELDS}
                    query = {k: mine[k] if (k, where) == (field, "query") else bobs_own[k] for k in ID_FIELDS}
                    response = bob.http.request(method, path.lstrip("/"), json=body if method == "POST" else None,
                                                params=query)
                    assert response.status_code in (403, 404), (field, where, method, path, response.status_code,
                                                                 response.text[:200])
                    if response.status_code == 403 and method != "HEAD":
                        assert NOT_YOURS in response.text, (method, path, response.text[:200])
                    checked.append(f"{method} {path} ({field} in {where})")
    assert len(checked) > 400 and "POST /gradio_api/run/stop (session_hash in body)" in checked
    assert "POST /gradio_api/call/clear (session_hash in body)" in checked
    assert "GET /gradio_api/queue/data (session_hash in query)" in checked
    assert f"GET /gradio_api/heartbeat/{mine['session_hash']} (session_hash in path)" in checked
    assert f"GET /gradio_api/call/chat/{mine['event_id']} (event_id in path)" in checked
    assert "POST /gradio_api/cancel (event_id in body)" in checked
    job.result(timeout=120)
    stats = job.outputs()[-1][3]
    assert stats["finish_reason"] in ("length", "eos") and stats["new_tokens"] > 1  # not stopped by bob
    result = alice_raw.http.get(f"gradio_api/call/chat/{mine['event_id']}", timeout=120)
    assert result.status_code == 200 and "event: complete" in result.text, result.text[:300]  # still alice's
    own = bob.http.get(f"gradio_api/call/chat/{bobs_call}", params={"session_hash": bobs_own["session_hash"]})
    assert own.status_code == 200 and "event: complete" in own.text, own.text[:300]  # bob's own ids pass


def test_a_call_job_result_is_read_only_by_its_login(served: tuple[Any, str]) -> None:
    """The event id a call/ job hands out belongs to the login that started it: another login that learns it gets
    the same 403 as for an id that does not exist, by the result route, as a session hash, or to cancel it."""
    demo, url = served
    alice, bob = Raw(url, "alice"), Raw(url, "bob")
    event = alice.http.post("gradio_api/call/chat", json={"data": chat_data("Say hi.", [], 4)}).json()["event_id"]
    unknown = uuid.uuid4().hex
    for who, status in ((bob, 403), (Raw(url), 401)):
        for path in (f"gradio_api/call/chat/{event}", f"gradio_api/call/v2/chat/{event}"):
            refused = who.http.get(path)
            assert refused.status_code == status and "event: complete" not in refused.text, refused.text[:200]
    refused_detail = bob.http.get(f"gradio_api/call/chat/{event}").json()["detail"]
    assert refused_detail == NOT_YOURS
    assert bob.http.get("gradio_api/queue/data", params={"session_hash": event}).status_code == 403
    cancel = {"session_hash": uuid.uuid4().hex, "fn_index": fn_index(demo, "chat"), "event_id": event}
    assert bob.http.post("gradio_api/cancel", json=cancel).status_code == 403
    missing = bob.http.get(f"gradio_api/call/chat/{unknown}")  # an id no answer handed out: the same refusal
    assert missing.status_code == 403 and missing.json()["detail"] == refused_detail
    mine = alice.http.get(f"gradio_api/call/chat/{event}", timeout=120)
    assert mine.status_code == 200 and "event: complete" in mine.text, mine.text[:300]


def test_routes_the_app_does_not_use_are_closed(served: tuple[Any, str]) -> None:
    _, url = served
    raw = Raw(url, "alice")
    for path in ("gradio_api/upload", "gradio_api/stream/x", "gradio_api/run-history/buckets", "gradio_api/runs"):
        response = raw.http.post(path) if path.endswith("upload") else raw.http.get(path)
        assert response.status_code == 404 and "does not use" in response.json()["detail"], path


# --- 3 and 4 through the app: a flooding session, Stop of a queued request --------------------------------------

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
        served: tuple[Any, str], artifacts_dir: Path) -> None:
    """Bob sends 30 chats through Gradio (each its own session hash) and 30 through /v1 (each its own `user`
    field), every one from its own forged X-Forwarded-For (bench.security.flood, the record's own run). Admission
    counts bob once: alice's reply is the next to take the (single) slot after the reply running when she arrives,
    before any of bob's. Asserted on the order the scheduler gives; the wall times go to artifacts/flood.json."""
    demo, url = served
    record = flood(url, USERS, fn_index(demo, "chat"), "SmolLM2-135M-Instruct", system_prompt=SYSTEM)
    assert record["persons"] == ["user:alice", "user:bob"]  # 60 hashes, user fields and addresses: one bob
    assert record["ahead_when_ready"] <= 1  # only the reply running when she arrived went first
    assert record["others_started_before_it"] == 0  # none of bob's jumped her
    assert record["bob_admitted_gradio"] + record["bob_admitted_api"] == 2  # one running, one waiting
    assert record["bob_refused"] == 58 and record["api_429_with_retry_after"] == record["api_429"]
    assert record["alice_reply_new_tokens"] > 0
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


def test_a_flood_of_new_ids_forgets_only_the_flooders_own() -> None:
    owners = SessionOwners(max_ids=100, max_per_owner=10)
    assert owners.claim("alice-tab", "user:alice")
    assert not owners.claim("alice-event", "user:alice", new=False)  # an event id no answer handed out: nobody's
    for i in range(10_000):
        assert owners.claim(f"bob-{i}", "user:bob")
    assert not owners.claim("alice-tab", "user:bob") and owners.claim("alice-tab", "user:alice")  # still hers
    assert owners.claim("bob-9999", "user:bob") and owners.claim("bob-0", "user:carol")  # bob's oldest went
    for i in range(200):  # more persons than max_ids / max_per_owner: the least recently used id goes
        owners.claim(f"tab-{i}", f"address:10.0.0.{i}")
    assert owners.claim("alice-tab", "user:bob")  # forgotten after 200 newer ids from 200 persons


def test_compare_runs_count_per_person_with_that_persons_chats(nf4_engine: ChatEngine) -> None:
    """A person gets one comparison in (running or waiting its turn); a second is refused at once, not queued,
    while another person's waits for its turn and runs next. A side on the chat engine counts in that engine's
    admission for the same person, so comparisons cannot add to a person's running and waiting chats."""
    from llm_core.engine.compare import CompareConfig, Comparison, EnginePool
    from llm_core.errors import BusyError

    pool = EnginePool(nf4_engine.settings, primary=nf4_engine)
    comparison = Comparison(pool, pool.settings)
    gen = nf4_engine.request_options(max_new_tokens=40)
    configs = [CompareConfig(None, "nf4"), CompareConfig(None, "none")]
    bobs = comparison.run(configs, "Count to ten.", gen, request_id="bob-tab-1", person="user:bob")
    step = next(bobs)
    while step.update is None:  # bob's first side is streaming on the chat engine
        step = next(bobs)
    with pytest.raises(BusyError, match="already has a reply being written"):
        next(comparison.run(configs, "Hi", gen, request_id="bob-tab-2", person="user:bob"))  # another tab: refused
    alices = comparison.run(configs, "Hi", gen, request_id="alice-tab", person="user:alice")
    alice_started = threading.Event()
    alice = threading.Thread(target=lambda: (next(alices), alice_started.set()), daemon=True)
    alice.start()
    wait_until(lambda: comparison._lock.waiting("user:alice") == 1, 30, "alice's comparison to wait for its turn")

    chats: list[Any] = []
    waiting_chat = threading.Thread(target=lambda: chats.append(list(nf4_engine.stream_chat(
        "Hi", [], gen=nf4_engine.request_options(max_new_tokens=2), request_id="bob-tab-3", person="user:bob"))),
        daemon=True)
    waiting_chat.start()  # bob's compare side runs, this chat waits: bob's limit of one running and one waiting
    wait_until(lambda: nf4_engine._lock.waiting("user:bob") == 1, 30, "bob's chat to wait")
    third: list[BaseException] = []

    def third_chat() -> None:
        try:
            next(nf4_engine.stream_chat("Hi", [], gen=gen, request_id="bob-tab-4", person="user:bob"))
        except BaseException as exc:  # noqa: BLE001 - what the engine answered is the result
            third.append(exc)

    asking = threading.Thread(target=third_chat, daemon=True)
    asking.start()
    asking.join(30)  # refused at once; were it admitted it would wait for its turn, so Stop ends it
    nf4_engine.stop("bob-tab-4")
    asking.join(30)
    assert third and isinstance(third[0], BusyError), third
    assert "already has a reply being written and 1 waiting" in str(third[0])
    bobs.close()  # bob's comparison ends: alice's is next, and bob's waiting chat gets the engine
    assert alice_started.wait(60)
    waiting_chat.join(120)
    assert chats and chats[0][-1].done
    alices.close()
    alice.join(10)
