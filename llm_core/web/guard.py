"""Guards in front of Gradio's HTTP routes (an ASGI middleware; app.py installs it through `launch(app_kwargs=...)`).

- POST /login: failed attempts are throttled per client address (LOGIN_MAX_FAILURES per LOGIN_WINDOW_S).
- Routes that act on a session by its id and that Gradio answers without checking who asks (/gradio_api/cancel,
  /gradio_api/heartbeat/{session}, /gradio_api/queue/data): allowed only to the session's owner, the client that
  first used it (its login with AUTH, else its address). With AUTH they also need a login.
- Routes this app does not use (uploads, streaming inputs, run history, MCP, vibe editing, custom components):
  closed (404).
- A malformed API payload gets one readable sentence, not pydantic's validation dump.

The decisions themselves (throttle, ownership) live in llm_core.security; this module only reads requests.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from http.cookies import SimpleCookie
from typing import Any
from urllib.parse import parse_qs

from ..security import LoginThrottle, SessionOwners

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

API = "/gradio_api"
CLOSED_PREFIXES = tuple(API + p for p in ("/upload", "/stream/", "/runs", "/run-history", "/mcp", "/vibe-",
                                          "/undo-vibe-edit", "/custom_component", "/process_recording",
                                          "/dev/reload"))
MAX_BODY_BYTES = 64 * 2**20  # a queue/join or cancel body read here; far above the largest accepted request


class GuardMiddleware:
    def __init__(self, app: ASGIApp, *, throttle: LoginThrottle, owners: SessionOwners, auth: bool) -> None:
        self.app, self.throttle, self.owners, self.auth = app, throttle, owners, auth

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = str(scope.get("path", "")).rstrip("/") or "/"
        method = scope.get("method", "GET")
        address = (scope.get("client") or ("unknown", 0))[0]
        if path == "/login" and method == "POST":
            await self._login(scope, receive, send, address)
            return
        if path.startswith(CLOSED_PREFIXES):
            await _json(send, 404, "Not found: this demo does not use that route.")
            return
        session: str | None = None
        if path == API + "/cancel" and method == "POST" or path == API + "/queue/join" and method == "POST":
            body, receive = await _read_body(receive)
            session = _session_in(body)
        elif path.startswith(API + "/heartbeat/"):
            session = path.rsplit("/", 1)[-1]
        elif path == API + "/queue/data":
            session = (parse_qs(scope.get("query_string", b"").decode("latin-1")).get("session_hash") or [None])[0]
        if session is not None:
            user = _user(scope)
            if self.auth and user is None:
                await _json(send, 401, "Not logged in.")
                return
            if not self.owners.claim(session, f"user:{user}" if self.auth else f"address:{address}"):
                await _json(send, 403, "That session belongs to another client.")
                return
        await self.app(scope, receive, send)

    async def _login(self, scope: Scope, receive: Receive, send: Send, address: str) -> None:
        wait_s = self.throttle.retry_after_s(address)
        if wait_s > 0:
            await _json(send, 429, f"Too many failed logins from your address; try again in {wait_s:.0f} s.",
                        headers=[(b"retry-after", str(int(wait_s) + 1).encode())])
            return
        status: list[int] = []

        async def watch(message: Message) -> None:
            if message["type"] == "http.response.start":
                status.append(int(message["status"]))
            await send(message)

        await self.app(scope, receive, watch)
        if status and status[0] == 200:
            self.throttle.succeeded(address)
        elif status and 400 <= status[0] < 500:
            self.throttle.failed(address)


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


def _session_in(body: bytes) -> str | None:
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    session = data.get("session_hash") if isinstance(data, dict) else None
    return session if isinstance(session, str) else None


async def _json(send: Send, status: int, detail: str, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    body = json.dumps({"detail": detail, "error": detail}).encode()
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
