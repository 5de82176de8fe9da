"""Guards in front of Gradio's HTTP routes (an ASGI middleware; app.py installs it through `launch(app_kwargs=...)`).

- Browser requests from another site (an `Origin` that is neither this server's own nor listed in CORS_ORIGINS):
  refused (403) on every route, /v1 included, as Ollama refuses origins outside OLLAMA_ORIGINS.
- POST /login: failed attempts are throttled per user name and per client address (LOGIN_MAX_FAILURES per
  LOGIN_WINDOW_S); the /v1 API counts its failed keys in the same throttle.
- Any request that names a session hash or an event id, wherever it names it (a path parameter of the matched
  route, a query parameter, or a JSON or form body's field `session_hash` / `event_id`): allowed only to its owner
  (llm_core.security.person_of: the login with AUTH, else the address). A session hash belongs to the person that
  first used it; an event id to the person whose answer handed it out (queue/join, call/NAME: claimed before the
  answer leaves), and one no answer handed out is nobody's. With AUTH it also needs a login. This covers run/*,
  call/* (the result stream GET call/NAME/EVENT_ID too), queue/*, cancel, reset, heartbeat and any route Gradio adds
  later under those parameter names.
- Any spelling of a /v1 path that the /v1 mount would not receive (`/v1` itself, `//v1/...`, `/v1;x`, `/v1\\...`,
  an absolute-form target): OpenAI's 404, never one of Gradio's answers.
- Routes this app does not use (uploads, streaming inputs, run history, MCP, vibe editing, custom components):
  closed (404).
- A malformed API payload gets one readable sentence, not pydantic's validation dump.

The decisions themselves (throttle, ownership, who a request's person is) live in llm_core.security; this module only
reads requests.
"""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable, MutableMapping
from http.cookies import SimpleCookie
from types import SimpleNamespace
from typing import Any
from urllib.parse import parse_qs

from ..config import ServerSettings
from ..errors import AuthError, InputError
from ..security import LoginThrottle, SessionOwners, parse_json, person_of

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

API = "/gradio_api"
OPENAI = "/v1"
CLOSED_PREFIXES = tuple(API + p for p in ("/upload", "/stream/", "/runs", "/run-history", "/mcp", "/vibe-",
                                          "/undo-vibe-edit", "/custom_component", "/process_recording",
                                          "/dev/reload"))
MAX_BODY_BYTES = 64 * 2**20  # a queue/join or cancel body read here; far above the largest accepted request
NOT_YOURS = ("No session or event with that id belongs to your login: open the demo in your own browser tab.")
ID_FIELDS = ("session_hash", "event_id")  # the names Gradio's routes give a session's and a queued job's id
MAX_WATCHED_ANSWER_BYTES = 64 * 2**10  # JSON answers held back until their event id is claimed (a join's is tiny)


class GuardMiddleware:
    def __init__(self, app: ASGIApp, *, throttle: LoginThrottle, owners: SessionOwners,
                 server: ServerSettings) -> None:
        self.app, self.throttle, self.owners, self.server = app, throttle, owners, server

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = str(scope.get("path", "")).rstrip("/") or "/"
        method = scope.get("method", "GET")
        mounted = path.startswith(OPENAI + "/")  # what the /v1 mount itself answers
        openai = mounted or _reads_as_openai(path)
        if not self._same_site(scope):
            await _refuse(send, 403, "Requests from another web site are refused: the page's origin is not this "
                          "server's own and not listed in CORS_ORIGINS.", openai=openai, code="origin_not_allowed")
            return
        if openai and not mounted:  # /v1 itself, or a spelling of a /v1 path that Gradio's routes would answer
            await _refuse(send, 404, "Unknown route: this server answers GET /v1/models, GET /v1/models/{id} and "
                          "POST /v1/chat/completions.", openai=True, code="unknown_url")
            return
        if openai:
            await self.app(scope, receive, send)  # the /v1 app checks its own keys, body and throttle
            return
        if path == "/login" and method == "POST":
            await self._login(scope, receive, send)
            return
        if path.startswith(CLOSED_PREFIXES):
            await _refuse(send, 404, "Not found: this demo does not use that route.")
            return
        named, receive = await _ids_named(scope, receive)
        user = _user(scope)
        if user is not None:
            scope.setdefault("state", {})["login"] = user
        try:
            owner: str | None = person_of(_Connection(scope, user), self.server)
        except AuthError:
            owner = None  # Gradio refuses it its routes (no event id is handed out without a login)
        if named:
            if owner is None:
                await _refuse(send, 401, "Not logged in.")
                return
            if not all([self.owners.claim(item, owner, new=field == "session_hash") for field, item in named]):
                await _refuse(send, 403, NOT_YOURS)
                return
        await self.app(scope, receive, send if owner is None else _ClaimingSend(send, self.owners, owner))

    def _same_site(self, scope: Scope) -> bool:
        """No Origin (not a browser's cross-site request), this server's own host, or an origin the operator lists.
        Own hosts: Host and X-Forwarded-Host (a browser page on another site cannot send the latter without a
        preflight, which carries its foreign Origin and is refused here); with SHARE, the gradio.live link, whose
        tunnel may not pass the public host on."""
        origin = next((v for k, v in scope.get("headers", []) if k == b"origin"), None)
        if origin is None:
            return True
        text = origin.decode("latin-1")
        if text in self.server.cors_origins or "*" in self.server.cors_origins:
            return True
        netloc = text.partition("://")[2]
        own = {v.decode("latin-1").strip() for k, v in scope.get("headers", []) if k == b"host"}
        own |= {h.strip() for k, v in scope.get("headers", []) if k == b"x-forwarded-host"
                for h in v.decode("latin-1").split(",")}
        return netloc in own or (self.server.share and text.startswith("https://")
                                 and netloc.endswith(".gradio.live"))

    async def _login(self, scope: Scope, receive: Receive, send: Send) -> None:
        address = _address(scope)
        body, receive = await _read_body(receive)
        name = _form_field(body, b"username") if not _is_form(scope) else next(
            iter(parse_qs(body.decode("latin-1")).get("username", [])), None)
        wait_s = self.throttle.retry_after_s(address, name)
        if wait_s > 0:
            await _refuse(send, 429, f"Too many failed logins for this user or from your address; try again in "
                          f"{wait_s:.0f} s.", headers=[(b"retry-after", str(int(wait_s) + 1).encode())])
            return
        status: list[int] = []

        async def watch(message: Message) -> None:
            if message["type"] == "http.response.start":
                status.append(int(message["status"]))
            await send(message)

        await self.app(scope, receive, watch)
        if status and status[0] == 200:
            self.throttle.succeeded(address, name)
        elif status and 400 <= status[0] < 500:
            self.throttle.failed(address, name)


def _reads_as_openai(path: str) -> bool:
    """Whether a path is /v1 or under it as a lenient client or proxy might read it: an absolute-form target's
    scheme and host dropped, backslashes as slashes, repeated slashes as one, segment parameters (`;x`) cut."""
    if "://" in path:
        path = "/" + path.partition("://")[2].partition("/")[2]
    path = re.sub(r"/+", "/", path.replace("\\", "/"))
    first = path.lstrip("/").partition("/")[0].partition(";")[0]
    return first == OPENAI.lstrip("/")


class _ClaimingSend:
    """A `send` that claims for `owner` the event id a JSON answer hands out (queue/join, call/NAME, any route that
    starts a job) before the answer leaves, so nobody else can have learnt the id first. Other answers, and JSON past
    MAX_WATCHED_ANSWER_BYTES, pass as they come."""

    def __init__(self, send: Send, owners: SessionOwners, owner: str) -> None:
        self.send, self.owners, self.owner = send, owners, owner
        self.held: list[Message] | None = None  # None: not holding (yet, or any more)
        self.body = b""

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start" and _is_json(message.get("headers", [])):
            self.held = [message]
            return
        if self.held is None or message["type"] != "http.response.body":
            await self._release()
            await self.send(message)
            return
        self.held.append(message)
        self.body += message.get("body", b"")
        if not message.get("more_body", False):
            event = _event_id(self.body)
            if event is not None:
                self.owners.claim(event, self.owner)
            await self._release()
        elif len(self.body) > MAX_WATCHED_ANSWER_BYTES:
            await self._release()

    async def _release(self) -> None:
        held, self.held = self.held or [], None
        for message in held:
            await self.send(message)


class _Connection:
    """What person_of reads of a request, from an ASGI scope: its login (from the cookie) and client address."""

    def __init__(self, scope: Scope, user: str | None) -> None:
        self.username = user
        self.client = SimpleNamespace(host=_address(scope))


def _address(scope: Scope) -> str:
    return str((scope.get("client") or ("unknown", 0))[0])


def _is_form(scope: Scope) -> bool:
    headers = dict(scope.get("headers", []))
    return headers.get(b"content-type", b"").split(b";")[0].strip() == b"application/x-www-form-urlencoded"


async def _ids_named(scope: Scope, receive: Receive) -> tuple[list[tuple[str, str]], Receive]:
    """Every session hash and event id a request names, as (field, id): a path parameter (`session_hash`,
    `event_id`) of the route it matches, the query parameters, the JSON or form body's fields of those names. All
    are checked, so naming one's own session in one place does not carry another's in the next. Returns the
    replaying `receive` too."""
    from starlette.routing import Match

    def of(values: Any) -> list[tuple[str, str]]:  # values: a mapping of field -> id, or of field -> [ids]
        found = []
        for field in ID_FIELDS:
            value = values.get(field)
            found += [(field, v) for v in (value if isinstance(value, list) else [value]) if isinstance(v, str)]
        return found

    named: list[tuple[str, str]] = []
    for route in getattr(scope.get("app"), "routes", ()):
        matched, child = _match(route, scope)
        if matched == Match.FULL:
            named += of(child.get("path_params", {}))
            break
    named += of(parse_qs(scope.get("query_string", b"").decode("latin-1")))
    if scope.get("method") not in ("POST", "PUT", "PATCH", "DELETE"):
        return named, receive
    body, receive = await _read_body(receive)
    if _is_form(scope):
        return named + of(parse_qs(body.decode("latin-1"))), receive
    try:
        data = parse_json(body)
    except InputError:  # multipart (component_server) or not JSON
        return named + of({field: _form_field(body, field.encode()) for field in ID_FIELDS}), receive
    return named + (of(data) if isinstance(data, dict) else []), receive


def _is_json(headers: Any) -> bool:
    return any(k.lower() == b"content-type" and v.split(b";")[0].strip() == b"application/json" for k, v in headers)


def _event_id(body: bytes) -> str | None:
    """The event id a JSON answer hands out (`{"event_id": ...}`), or None."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    event = data.get("event_id") if isinstance(data, dict) else None
    return event if isinstance(event, str) else None


def _match(route: Any, scope: Scope) -> tuple[Any, dict[str, Any]]:
    """A route's match of the request; an included router (Gradio's /gradio_api routes) is searched inside."""
    from starlette.routing import Match

    inner = getattr(getattr(route, "include_context", None), "included_router", None)
    if inner is not None:
        for child_route in inner.routes:
            matched, child = child_route.matches(scope)
            if matched == Match.FULL:
                return matched, child
        return Match.NONE, {}
    try:
        return route.matches(scope)
    except Exception:  # noqa: BLE001 - a route that cannot judge this request does not match it
        return Match.NONE, {}


def _form_field(body: bytes, name: bytes) -> str | None:
    """A multipart form's text field (`name="session_hash"`), without parsing the rest of the body."""
    marker = b'name="' + name + b'"'
    at = body.find(marker)
    if at < 0:
        return None
    start = body.find(b"\r\n\r\n", at)
    end = body.find(b"\r\n", start + 4) if start >= 0 else -1
    return body[start + 4:end].decode("utf-8", "replace") if end >= 0 else None


def _user(scope: Scope) -> str | None:
    """The logged-in user of this request, from Gradio's login cookie (None without a valid one)."""
    app = scope.get("app")
    tokens, cookie_id = getattr(app, "tokens", None), getattr(app, "cookie_id", None)
    if not isinstance(tokens, dict) or cookie_id is None:
        return None
    raw = b"; ".join(v for k, v in scope.get("headers", []) if k == b"cookie").decode("latin-1")
    cookies = SimpleCookie()
    try:
        cookies.load(raw)
    except Exception:  # noqa: BLE001 - a malformed cookie header is simply no login
        return None
    for name in (f"access-token-{cookie_id}", f"access-token-unsecure-{cookie_id}"):
        if name in cookies and cookies[name].value in tokens:
            return str(tokens[cookies[name].value])
    return None


async def _read_body(receive: Receive) -> tuple[bytes, Receive]:
    """The whole request body, and a `receive` that replays it to the app."""
    messages: list[Message] = []
    body = b""
    while True:
        message = await receive()
        messages.append(message)
        if message["type"] != "http.request":
            break
        body += message.get("body", b"")
        if not message.get("more_body", False) or len(body) > MAX_BODY_BYTES:
            break

    async def replay() -> Message:
        return messages.pop(0) if messages else await receive()

    return body, replay


async def _refuse(send: Send, status: int, detail: str, headers: list[tuple[bytes, bytes]] | None = None, *,
                  openai: bool = False, code: str | None = None) -> None:
    """A refusal: OpenAI's error shape on /v1, Gradio's `detail` elsewhere (with `error` for older clients)."""
    if openai:
        kind = "permission_error" if status == 403 else "invalid_request_error"  # OpenAI's names
        payload: dict[str, Any] = {"error": {"message": detail, "type": kind, "param": None, "code": code}}
    else:
        payload = {"detail": detail, "error": detail}
    body = json.dumps(payload).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


def validation_error_handler(request: Any, exc: Any) -> Any:
    """FastAPI's RequestValidationError as one sentence naming the fields, instead of pydantic's dump."""
    from fastapi.responses import JSONResponse

    problems = []
    for error in list(getattr(exc, "errors", lambda: [])())[:5]:
        where = ".".join(str(p) for p in error.get("loc", ()) if p != "body") or "the body"
        problems.append(f"{where}: {str(error.get('msg', 'invalid')).lower()}")
    detail = "Malformed request (" + "; ".join(problems) + "). See /gradio_api/info for the expected payload."
    return JSONResponse({"detail": detail, "error": detail}, status_code=422)
