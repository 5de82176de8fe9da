"""OpenAI-compatible chat API over the served engine: `GET /v1/models`, `POST /v1/chat/completions`. No Gradio here.

`create_openai_app` returns a FastAPI app to mount at `/v1` on the demo's own server (app.py does the mounting), so
any OpenAI client works with `base_url="http://HOST:PORT/v1"`. Replies go through the same engine as the chat tab:
the same memory guard, batching, per-person limit (one running reply per AUTH user) and history trimming. `usage`
counts token ids (the prompt as fed after trimming, the generated ids), and every reply carries the engine's full
numbers in an extra `stats` field. Library errors become OpenAI-shaped errors through `describe_error`, which the
caller supplies (app.py: the one place where library errors are translated).
"""

from __future__ import annotations

import collections
import hmac
import math
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import Field, ValidationError
from starlette.exceptions import HTTPException

from ..config import Settings, parse_auth
from ..constraints import OutputSpec
from ..engine.backend import ChatBackend
from ..engine.chat import ReplyUpdate
from ..errors import BusyError, InputError, LLMCoreError
from ..history import check_history_size, content_to_text, turns_from_messages
from ..models import EMBEDDED_NAME
from ..security import LoginThrottle, parse_json, person_of
from .openai_jobs import (
    CompletionRequest,
    Job,
    Plan,
    Prompt,
    SamplingRequest,
    ToolUse,
    base_options,
    chat_spec,
    make_jobs,
    tool_use,
    usage,
    with_tool_prompt,
)
from .openai_reply import Reply, Rows, StopScanner, error_body, row_hold, row_width
from .openai_tools import OpenedPrompt, flatten_tool_messages, native_prompt

# (HTTP status, OpenAI error type, OpenAI error code) for a library error.
ErrorInfo = tuple[int, str, str | None]
DescribeError = Callable[[LLMCoreError], ErrorInfo]
GetEngine = Callable[[], ChatBackend]

MAX_STOP_SEQUENCES = 4  # as OpenAI's API


def served_model_id(settings: Settings, engine: ChatBackend | None = None) -> str:
    """The model name clients pass as `model`: MODEL_ID or the embedded model's name, or a remote engine's model
    (OPENAI_MODEL, or the one it picked). With `engine`, that engine's (the served model may have been switched)."""
    from ..engine.remote import RemoteEngine

    if isinstance(engine, RemoteEngine):
        return engine.model
    if engine is not None:
        settings = engine.settings
    if settings.remote.engine == "openai":
        return settings.remote.model or ""
    return settings.model.model_id or EMBEDDED_NAME


class ChatCompletionRequest(SamplingRequest):
    """The request body of POST /v1/chat/completions. OpenAI fields this server cannot honour are accepted only at
    their neutral values."""

    messages: list[dict[str, Any]] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None

    def unsupported(self) -> str | None:
        """What this server cannot do of what the request asks, in words; None if it can do all of it."""
        shared = self.shared_unsupported()
        if shared:
            return shared
        if self.top_logprobs is not None and not self.logprobs:
            return "top_logprobs needs logprobs: true."
        kind = (self.response_format or {}).get("type", "text")
        if kind not in ("text", "json_object", "json_schema"):
            return "response_format.type must be text, json_object or json_schema."
        wrapper = (self.response_format or {}).get("json_schema")
        if kind == "json_schema" and not (isinstance(wrapper, dict) and isinstance(wrapper.get("schema"), dict)):
            return "response_format json_schema needs {\"json_schema\": {\"name\": ..., \"schema\": {...}}}."
        return None


class ApiError(Exception):
    """An error of the HTTP layer itself (auth, model name, body), already in OpenAI's terms."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type_, code, param
        self.retry_after_s = retry_after_s

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.code, self.param)


@dataclass(frozen=True)
class Conversation:
    """An OpenAI message list split the way the engine takes it."""

    system_prompt: str  # "" = the configured SYSTEM_PROMPT
    history: list[dict[str, Any]]  # earlier user/assistant messages
    message: str  # the newest user message


def split_messages(messages: list[dict[str, Any]]) -> Conversation:
    """System/developer messages become the system prompt; the last message must come from the user."""
    system: list[str] = []
    rest: list[dict[str, Any]] = []
    for i, msg in enumerate(messages):
        role = msg.get("role") if isinstance(msg, dict) else None
        if role in ("system", "developer"):
            system.append(content_to_text(msg.get("content")))
        elif role in ("user", "assistant"):
            rest.append({"role": role, "content": msg.get("content")})
        else:
            raise InputError(f"messages[{i}] has role {role!r}; this server takes system, developer, user, "
                             "assistant and tool messages.")
    if not rest or rest[-1]["role"] != "user":
        raise InputError("The last message must come from the user.")
    return Conversation("\n\n".join(s for s in system if s.strip()), rest[:-1], content_to_text(rest[-1]["content"]))


class OpenAIServer:
    """The state of one mounted API: the engine getter, settings, keys and the count of requests in flight."""

    def __init__(self, get_engine: GetEngine, settings: Settings, describe_error: DescribeError,
                 throttle: LoginThrottle | None = None) -> None:
        self.get_engine = get_engine
        self.settings = settings
        self.describe_error = describe_error
        self._keys = [f"{user}:{password}" for user, password in parse_auth(settings.server.auth)] if (
            settings.server.auth) else []
        server = settings.server
        # Failed keys share the login throttle when app.py passes it: guesses on /login and /v1 count together.
        self.throttle = throttle or LoginThrottle(server.login_max_failures, server.login_window_s,
                                                  users=[key.partition(":")[0] for key in self._keys])
        self._in_flight = 0
        self._in_flight_by_person: collections.Counter[str] = collections.Counter()
        self._in_flight_lock = threading.Lock()
        chat = settings.chat
        # Largest body accepted: every allowed character as a 6-byte JSON escape, plus 64 KiB for the rest.
        self.max_body_bytes = 6 * (chat.max_message_chars + chat.max_history_chars) + 65_536

    @property
    def model_id(self) -> str:
        """The served model now (it can be switched in the page without a restart)."""
        return served_model_id(self.settings, self.get_engine())

    # --- access ------------------------------------------------------------------------------------
    def caller(self, request: Request) -> str:
        """Who is asking, as llm_core.security.person_of names people: the AUTH user whose `user:password` is the
        Bearer key (then `request.state.login`), else the client address. Failed keys are throttled per user name
        and per address, as failed logins are."""
        if not self._keys:
            return person_of(request, self.settings.server)
        header = request.headers.get("authorization", "")
        scheme, _, key = header.partition(" ")
        key = key.strip()
        address = request.client.host if request.client else None
        name = key.partition(":")[0] if ":" in key else None
        wait_s = self.throttle.retry_after_s(address, name)
        if wait_s > 0:
            raise ApiError(429, f"Too many failed API keys for this user or from your address; try again in "
                           f"{wait_s:.0f} s.", type_="rate_limit_error", code="too_many_failed_keys",
                           retry_after_s=wait_s)
        if scheme.lower() != "bearer" or not key:
            raise ApiError(401, "Missing API key: send `Authorization: Bearer USER:PASSWORD` with one of the "
                           "demo's AUTH logins (the openai client: api_key=\"USER:PASSWORD\").", code="invalid_api_key")
        for known in self._keys:
            if hmac.compare_digest(known.encode(), key.encode()):
                request.state.login = known.partition(":")[0]
                return person_of(request, self.settings.server)
        self.throttle.failed(address, name)
        raise ApiError(401, "Incorrect API key: use USER:PASSWORD of one of the demo's AUTH logins.",
                       code="invalid_api_key")

    def enter(self, person: str) -> None:
        """Count a request in flight: at most QUEUE_SIZE in all, and per person one running and
        SESSION_MAX_WAITING waiting (the engine's own limit; refused here before it takes a worker thread)."""
        server = self.settings.server
        with self._in_flight_lock:
            if self._in_flight >= server.queue_size:
                raise BusyError(f"The server is busy: {self._in_flight} API requests are running or waiting "
                                f"(QUEUE_SIZE={server.queue_size}). Try again shortly.", retry_after_s=1)
            held = self._in_flight_by_person[person]
            if held >= 1 + server.session_max_waiting:
                raise BusyError(f"This user already has a reply being written and {held - 1} waiting (the limit per "
                                f"user is {1 + server.session_max_waiting}). Wait for one to finish, then send again.",
                                retry_after_s=1)
            self._in_flight += 1
            self._in_flight_by_person[person] += 1

    def leave(self, person: str) -> None:
        with self._in_flight_lock:
            self._in_flight -= 1
            self._in_flight_by_person[person] -= 1
            if self._in_flight_by_person[person] <= 0:
                del self._in_flight_by_person[person]

    # --- requests ------------------------------------------------------------------------------------
    async def parse(self, request: Request, model: type[Any] = ChatCompletionRequest) -> Any:
        content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if content_type != "application/json":  # text/plain would let any web page post here without a preflight
            raise ApiError(415, f"The request body must be sent as Content-Type: application/json (got "
                           f"{content_type or 'none'!r}).", code="unsupported_media_type")
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            raise ApiError(413, f"The request body has {int(length):,} bytes; the limit is {self.max_body_bytes:,} "
                           "(MAX_MESSAGE_CHARS and MAX_HISTORY_CHARS).", code="request_too_large")
        body = await request.body()
        if len(body) > self.max_body_bytes:
            raise ApiError(413, f"The request body has {len(body):,} bytes; the limit is {self.max_body_bytes:,}.",
                           code="request_too_large")
        try:
            data = parse_json(body)  # nesting checked before parsing
        except InputError as exc:
            raise ApiError(400, str(exc), code="invalid_json") from None
        if not isinstance(data, dict):
            raise ApiError(400, "The request body must be a JSON object.")
        try:
            req = model.model_validate(data)
        except ValidationError as exc:
            first = exc.errors()[0]
            param = ".".join(str(p) for p in first.get("loc", ())) or None
            problem = "is not a field of this API" if first.get("type") == "extra_forbidden" else first.get("msg")
            raise ApiError(400, f"{param}: {problem}." if param else f"{problem}.", param=param) from None
        unsupported = req.unsupported()
        if unsupported:
            raise ApiError(400, unsupported, code="unsupported_parameter")
        stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if len(stops) > MAX_STOP_SEQUENCES or not all(stops):
            raise ApiError(400, f"stop takes up to {MAX_STOP_SEQUENCES} non-empty strings.", param="stop")
        return req

    def _engine_for(self, req: Any) -> tuple[ChatBackend, str]:
        engine = self.get_engine()
        model_id = served_model_id(self.settings, engine)
        if req.model != model_id:
            raise ApiError(404, f"The model {req.model!r} is not served here; this server serves {model_id!r} "
                           "(GET /v1/models).", code="model_not_found", param="model")
        return engine, model_id

    def plan_chat(self, req: ChatCompletionRequest) -> tuple[ChatBackend, str, Plan]:
        """The request's replies, validated against the engine (runs in a worker thread)."""
        engine, model_id = self._engine_for(req)
        tools = tool_use(engine, req)
        options = base_options(req, req.max_completion_tokens if req.max_completion_tokens is not None
                               else req.max_tokens)
        jobs = make_jobs(engine, req, chat_spec(req, tools.forced_schema if tools else None), options,
                         [self._chat_prompt(engine, req, tools)], raw=False)
        plan = self._plan(engine, jobs, [f["name"] for f in tools.functions] if tools else [],
                          tools is not None and tools.forced_schema is not None, bool(req.logprobs))
        if tools is not None:
            plan.call_format = tools.format
        return engine, model_id, plan

    def _chat_prompt(self, engine: ChatBackend, req: ChatCompletionRequest, tools: ToolUse | None) -> Prompt:
        """(newest message, earlier turns, system prompt, rendering) of a chat request."""
        chat = self.settings.chat
        tokenizer = getattr(getattr(engine, "loaded", None), "tokenizer", None)
        if tools is not None and tools.native:  # the model's own template renders tools and tool turns
            native = native_prompt(tokenizer, req.messages, tools.tools, tools.opener)
            check_history_size([m for ex in native.exchanges for m in ex] + list(native.tail[1:]),
                               max_messages=chat.max_history_messages, max_chars=chat.max_history_chars)
            return native.message, native.turns, native.system_prompt, native
        conversation = split_messages(flatten_tool_messages(req.messages) if tools else req.messages)
        check_history_size(conversation.history, max_messages=chat.max_history_messages,
                           max_chars=chat.max_history_chars)
        system = conversation.system_prompt
        if tools is not None and tools.functions:
            system = with_tool_prompt(system, chat.system_prompt, tools.functions, tools.forced_schema is not None)
        render = OpenedPrompt(tokenizer, tools.opener) if tools is not None and tools.opener else None
        return conversation.message, turns_from_messages(conversation.history), system, render

    def plan_completion(self, req: CompletionRequest) -> tuple[ChatBackend, str, Plan]:
        engine, model_id = self._engine_for(req)
        spec = OutputSpec(presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
                          top_logprobs=req.logprobs)
        prompts = req.prompt if isinstance(req.prompt, list) else [req.prompt]
        jobs = make_jobs(engine, req, spec, base_options(req, req.max_tokens),
                         [(p, [], None, None) for p in prompts], raw=True)
        return engine, model_id, self._plan(engine, jobs, [], False, req.logprobs is not None)

    @staticmethod
    def _plan(engine: ChatBackend, jobs: list[Job], names: list[str], forced: bool, logprobs: bool) -> Plan:
        loaded = getattr(engine, "loaded", None)
        return Plan(jobs, names, forced, logprobs, getattr(loaded, "tokenizer", None),
                    frozenset(getattr(loaded, "eos_token_ids", ()) or ()))


def _usage(update: ReplyUpdate) -> dict[str, Any]:
    return usage([update])


def create_openai_app(get_engine: GetEngine, settings: Settings, describe_error: DescribeError, *,
                      throttle: LoginThrottle | None = None) -> FastAPI:
    """The `/v1` app: mount it with `Mount("/v1", app=...)`. `get_engine` returns the engine that serves chat now;
    `throttle` is the login throttle, so failed keys and failed logins count together. Every answer that is not a
    success is in OpenAI's error shape, unknown routes included."""
    server = OpenAIServer(get_engine, settings, describe_error, throttle)
    # No slash redirects: every answer is either a result or an OpenAI error (a redirect is neither).
    api = FastAPI(title="Local LLM demo: OpenAI-compatible API", docs_url=None, redoc_url=None, openapi_url=None,
                  redirect_slashes=False)

    def error_response(exc: Exception) -> JSONResponse:
        if isinstance(exc, ApiError):
            status, body, retry_s = exc.status, exc.body(), exc.retry_after_s
        else:
            assert isinstance(exc, LLMCoreError)
            status, type_, code = describe_error(exc)
            body, retry_s = error_body(str(exc), type_, code), getattr(exc, "retry_after_s", None)
        headers = {"Retry-After": str(max(1, math.ceil(retry_s or 1)))} if status == 429 else None
        return JSONResponse(body, status_code=status, headers=headers)

    def http_error(_request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, HTTPException)
        if exc.status_code == 404:
            message = "Unknown route: this server answers GET /v1/models, GET /v1/models/{id}, POST " \
                      "/v1/chat/completions and POST /v1/completions."
        elif exc.status_code == 405:
            message = "This route does not take that method."
        else:
            message = str(exc.detail)
        return JSONResponse(error_body(message, "invalid_request_error", "unknown_url" if exc.status_code == 404
                                       else None), status_code=exc.status_code, headers=getattr(exc, "headers", None))

    def server_error(_request: Request, _exc: Exception) -> JSONResponse:
        # A bug, not the client's fault: still OpenAI's shape, and nothing of the exception (no paths or secrets).
        return JSONResponse(error_body("The server failed on this request; it keeps serving others.",
                                       "server_error"), status_code=500)

    api.add_exception_handler(ApiError, lambda _r, exc: error_response(exc))
    api.add_exception_handler(LLMCoreError, lambda _r, exc: error_response(exc))
    api.add_exception_handler(HTTPException, http_error)
    api.add_exception_handler(Exception, server_error)

    def model_card(model_id: str) -> dict[str, Any]:
        return {"id": model_id, "object": "model", "created": 0, "owned_by": "local"}

    @api.get("/models")
    async def list_models(request: Request) -> dict[str, Any]:
        server.caller(request)
        model_id = await run_in_threadpool(lambda: server.model_id)  # may wait for the served model to load
        return {"object": "list", "data": [model_card(model_id)]}

    @api.get("/models/{model_id:path}")
    async def retrieve_model(request: Request, model_id: str) -> dict[str, Any]:
        server.caller(request)
        served = await run_in_threadpool(lambda: server.model_id)
        if model_id != served:
            raise ApiError(404, f"The model {model_id!r} is not served here; this server serves {served!r}.",
                           type_="invalid_request_error", code="model_not_found", param="model")
        return model_card(served)

    async def serve(request: Request, text: bool) -> JSONResponse | StreamingResponse:
        person = server.caller(request)
        req = await server.parse(request, CompletionRequest if text else ChatCompletionRequest)
        server.enter(person)
        left = False
        try:
            # Stop reaches this request alone; admission counts the person (the key's user), never `user`.
            session = f"openai-api:{uuid.uuid4().hex}"
            engine, model_id, plan = await run_in_threadpool(server.plan_completion if text else server.plan_chat,
                                                             req)
            stops = StopScanner([req.stop] if isinstance(req.stop, str) else list(req.stop or []))
            rows = Rows(engine, plan.jobs, session, person, row_width(engine, len(plan.jobs)),
                        hold=row_hold(bool(req.stream), stops))
            try:
                first = await run_in_threadpool(rows.get)  # errors before the first token get their own status
            except BaseException:
                rows.cancel()
                raise
            reply = Reply(rows, plan, stops, describe_error, model_id, text,
                          f"{'cmpl' if text else 'chatcmpl'}-{first[1].stats.reply_id}", int(time.time()))
            if req.stream:
                include_usage = bool((req.stream_options or {}).get("include_usage"))
                left = True  # the stream leaves when it ends
                return StreamingResponse(reply.events(first, include_usage, lambda: server.leave(person)),
                                         media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
            return JSONResponse(await run_in_threadpool(reply.whole, first))
        finally:
            if not left:
                server.leave(person)

    @api.post("/chat/completions", response_model=None)
    async def chat_completions(request: Request) -> JSONResponse | StreamingResponse:
        return await serve(request, text=False)

    @api.post("/completions", response_model=None)
    async def completions(request: Request) -> JSONResponse | StreamingResponse:
        return await serve(request, text=True)

    return api
