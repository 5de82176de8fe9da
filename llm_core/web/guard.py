"""Guards in front of Gradio's HTTP routes (an ASGI middleware; app.py installs it through `launch(app_kwargs=...)`).

- Browser requests from another site (an `Origin` that is neither this server's own nor listed in CORS_ORIGINS):
  refused (403) on every route, /v1 included, as Ollama refuses origins outside OLLAMA_ORIGINS.
- POST /login: failed attempts are throttled per user name and per client address (LOGIN_MAX_FAILURES per
  LOGIN_WINDOW_S); the /v1 API counts its failed keys in the same throttle.
- Any request that names a session hash, wherever it names it (a path parameter of the matched route, the
  `session_hash` query parameter, or a JSON or form body's `session_hash`): allowed only to the session's owner, the
  person that first used it (llm_core.security.person_of: the login with AUTH, else the address). With AUTH it also
  needs a login. This covers run/*, call/*, queue/*, cancel, heartbeat and any route Gradio adds later.
- Routes this app does not use (uploads, streaming inputs, run history, MCP, vibe editing, custom components):
  closed (404).
- A malformed API payload gets one readable sentence, not pydantic's validation dump.

The decisions themselves (throttle, ownership, who a request's person is) live in llm_core.security; this module only
reads requests.
"""

from __future__ import annotations

import json
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
NOT_YOURS = "No session with that id belongs to your login: open the demo in your own browser tab."


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
        openai = path == OPENAI or path.startswith(OPENAI + "/")
        if not self._same_site(scope):
            await _refuse(send, 403, "Requests from another web site are refused: the page's origin is not this "
                          "server's own and not listed in CORS_ORIGINS.", openai=openai, code="origin_not_allowed")
            return
        if openai and path == OPENAI:  # the bare prefix is no route of the /v1 app; Gradio's would redirect it
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
        sessions, receive = await _sessions_named(scope, receive)
        if sessions:
            user = _user(scope)
            if user is not None:
                scope.setdefault("state", {})["login"] = user
            try:
                owner = person_of(_Connection(scope, user), self.server)
            except AuthError:
                await _refuse(send, 401, "Not logged in.")
                return
            if not all([self.owners.claim(session, owner) for session in sessions]):
                await _refuse(send, 403, NOT_YOURS)
                return
        await self.app(scope, receive, send)

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


async def _sessions_named(scope: Scope, receive: Receive) -> tuple[list[str], Receive]:
    """Every session hash a request names: a path parameter `session_hash` of the route it matches, the
    `session_hash` query parameter, `session_hash` in its JSON or form body. All are checked, so naming one's own
    session in one place does not carry another's in the next. Returns the replaying `receive` too."""
    from starlette.routing import Match

    named: list[str] = []
    for route in getattr(scope.get("app"), "routes", ()):
        matched, child = _match(route, scope)
        if matched == Match.FULL:
            session = child.get("path_params", {}).get("session_hash")
            named += [session] if isinstance(session, str) else []
            break
    named += parse_qs(scope.get("query_string", b"").decode("latin-1")).get("session_hash", [])
    if scope.get("method") not in ("POST", "PUT", "PATCH", "DELETE"):
        return named, receive
    body, receive = await _read_body(receive)
    if _is_form(scope):
        return named + parse_qs(body.decode("latin-1")).get("session_hash", []), receive
    try:
        data = parse_json(body)
    except InputError:
        field = _form_field(body, b"session_hash")  # multipart (component_server) or not JSON
        return named + ([field] if field is not None else []), receive
    session = data.get("session_hash") if isinstance(data, dict) else None
    return named + ([session] if isinstance(session, str) else []), receive


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
