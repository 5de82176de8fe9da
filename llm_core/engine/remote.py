"""Remote engines: chat through a running OpenAI-compatible server with the ChatEngine's interface, so the same UI,
/v1 API and Compare view drive it (ENGINE=openai, or one side of a comparison). Knows nothing about Gradio.

The server may be vLLM or SGLang (tensor/pipeline parallel over many GPUs), Ray Serve LLM replicas, llama.cpp's
server, or another instance of this demo. Numbers are measured on our side of the wire: the clock starts when the
request is received (as ChatEngine's), TTFT ends when the first content chunk arrives, decode tokens/s is
(completion tokens - 1) / (last content chunk - first content chunk). Token counts are the engine's own (`usage`,
requested with stream_options.include_usage). Peak memory and KV-cache bytes are what the engine reports (this
demo's /v1 sends its numbers in a `stats` field); engines that report none leave them None, said in the notes.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from importlib.metadata import version
from typing import Any, cast

from ..config import GenerationSettings, Settings
from ..errors import BusyError, ContextBudgetError, GenerationError, InputError, LLMCoreError, ModelLoadError
from ..history import Turn, build_messages, clean_text
from ..metrics import ReplyStats
from .admission import SessionSlots
from .chat import ChatEngine, ReplyUpdate

NOT_REPORTED = "Peak memory and KV cache: not reported by the engine."
REPORTED = "Peak memory and KV cache as reported by the engine (its own process)."
_CONNECT_TIMEOUT_S = 10.0
# Fields of a reporting engine's `stats` (this demo's /v1) copied into ours: what only that process can measure.
_REPORTED_FIELDS = ("peak_vram_allocated_bytes", "peak_vram_reserved_bytes", "peak_rss_bytes", "kv_cache_bytes",
                    "weights_bytes")


@dataclass(frozen=True)
class RemoteReport:
    """The model panel's facts for a remote engine (LoadReport's shape where the UI reads it)."""

    model: str
    base_url: str
    models_served: tuple[str, ...]
    connect_s: float
    versions: dict[str, str] = field(default_factory=dict)
    quantization: str = "remote"
    double_quant: bool = False
    compute_dtype: str = ""
    attention: str = ""
    revision: str | None = None
    weights_bytes: int | None = None
    decode_path: str = "remote"

    @property
    def device_name(self) -> str:
        return f"remote engine at {self.base_url}"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def as_markdown(self) -> str:
        rows = [
            ("Engine", f"OpenAI-compatible server at {self.base_url}"),
            ("Model", self.model),
            ("Models it serves", ", ".join(self.models_served)),
            ("Connected in", f"{self.connect_s:.2f} s"),
            ("Numbers", "TTFT and tokens/s measured here, across the network; token counts from the engine; "
                        "peak memory only where the engine reports it"),
            ("Versions", ", ".join(f"{k} {v}" for k, v in self.versions.items())),
        ]
        return "| | |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in rows)


class RemoteEngine:
    """Serves chat replies from an OpenAI-compatible server. Stop closes the stream (the server stops generating
    when its client goes away); one running reply per session, as the local engine."""

    def __init__(self, settings: Settings, client: Any, report: RemoteReport) -> None:
        self.settings = settings
        self.model = report.model
        self._client = client
        self._report = report
        self._sessions = SessionSlots()
        self._stops: dict[str, threading.Event] = {}
        self._stops_lock = threading.Lock()

    @classmethod
    def connect(cls, settings: Settings, progress: Any = None) -> RemoteEngine:
        """Reach the server, list its models and pick OPENAI_MODEL (or the first it lists). ModelLoadError if the
        server cannot be reached or does not serve that model."""
        import openai

        remote = settings.remote
        if remote.base_url is None:
            raise ModelLoadError("No remote engine is configured: set OPENAI_BASE_URL, e.g. "
                                 "OPENAI_BASE_URL=http://127.0.0.1:8000/v1.")
        say = progress or (lambda _m: None)
        say(f"Connecting to the OpenAI-compatible server at {remote.base_url}…")
        t0 = time.perf_counter()
        client = openai.OpenAI(base_url=remote.base_url, api_key=remote.api_key or "EMPTY", max_retries=0,
                               timeout=openai.Timeout(settings.generation.stream_timeout_s,
                                                      connect=_CONNECT_TIMEOUT_S))
        try:
            served = tuple(m.id for m in client.models.list())
        except openai.APIError as exc:
            raise ModelLoadError(f"The OpenAI-compatible server at {remote.base_url} could not list its models: "
                                 f"{_describe(exc).rstrip('.')}. Check OPENAI_BASE_URL (it ends in /v1) and "
                                 "OPENAI_API_KEY.") from None
        if not served:
            raise ModelLoadError(f"The server at {remote.base_url} serves no model.")
        model = remote.model or served[0]
        if model not in served:
            raise ModelLoadError(f"OPENAI_MODEL={model!r} is not served at {remote.base_url}; it serves: "
                                 f"{', '.join(served)}.")
        report = RemoteReport(model, remote.base_url, served, round(time.perf_counter() - t0, 3),
                              {"openai": version("openai")})
        say(f"Ready: {model} at {remote.base_url}.")
        return cls(settings, client, report)

    # --- the ChatBackend interface ----------------------------------------------------------------
    @property
    def report(self) -> RemoteReport:
        return self._report

    @property
    def max_concurrent_replies(self) -> int:
        """The engine batches on its side: the UI lets MAX_BATCH_SIZE (default 8) replies run at once."""
        return self.settings.server.max_batch_size or 8

    def wait_estimate_s(self, ahead: int) -> float | None:
        """The remote engine queues on its side: no estimate here."""
        return None

    def request_options(self, **options: Any) -> GenerationSettings:
        # The same checks as the local engine's (that method reads only .settings).
        return ChatEngine.request_options(cast(Any, self), **options)

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        yield  # nothing held here to unload

    def stop(self, request_id: str | None) -> bool:
        if request_id is None:
            return False
        with self._stops_lock:
            event = self._stops.get(request_id)
        if event is None:
            return False
        event.set()
        return True

    def stream_chat(self, message: Any, history: list[Turn], *, gen: GenerationSettings | None = None,
                    history_turns: int | None = None, system_prompt: str | None = "",
                    request_id: str | None = None, person: str | None = None,
                    on_wait: Callable[[int], None] | None = None, raw_prompt: bool = False,
                    render_prompt: Callable[[list[dict[str, str]]], Any] | None = None,
                    group: str | None = None, hold: Callable[[], float] | None = None) -> Iterator[ReplyUpdate]:
        """Stream a reply from the server. History is cut to `history_turns` whole turns here; the token budget is
        the engine's (a prompt it cannot fit comes back as ContextBudgetError with its message). One reply per
        person at a time, `group` or not. `hold` is accepted and unused: the server's chunks are read as they
        come (its connection has no per-token thread hop to save)."""
        if raw_prompt or render_prompt is not None or (gen is not None and gen.control is not None):
            raise InputError("Text completions, structured output, logprobs and presence/frequency penalties run on "
                             "a local engine only, not on a remote one.")
        start_s = time.perf_counter()  # request received: the clock TTFT and end-to-end are measured from
        gen = gen or self.settings.generation
        history_turns = self.settings.chat.history_turns if history_turns is None else history_turns
        if system_prompt == "":
            system_prompt = self.settings.chat.system_prompt
        text = clean_text(message, max_chars=self.settings.chat.max_message_chars)
        if isinstance(history_turns, bool) or not isinstance(history_turns, int) or history_turns < 0:
            raise InputError(f"history_turns must be a whole number of 0 or more, got {history_turns!r}.")
        kept = list(history[len(history) - history_turns:]) if history_turns else []
        messages = build_messages(system_prompt, kept, text)
        request_id = request_id or uuid.uuid4().hex
        with self._sessions.hold(person or request_id):  # one running reply per person
            stop_event = threading.Event()
            with self._stops_lock:
                self._stops[request_id] = stop_event
            try:
                yield from self._stream(messages, gen, stop_event, start_s, len(history) - len(kept), request_id)
            finally:
                with self._stops_lock:
                    if self._stops.get(request_id) is stop_event:
                        del self._stops[request_id]

    # --- one reply ------------------------------------------------------------------------------------
    def _request(self, messages: list[dict[str, str]], gen: GenerationSettings, request_id: str) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "messages": messages, "max_tokens": gen.max_new_tokens,
                                "stream": True, "stream_options": {"include_usage": True},
                                "user": request_id}  # the end user: a reporting engine's per-session limit
        extra: dict[str, Any] = {}
        if gen.do_sample:
            body.update(temperature=gen.temperature, top_p=gen.top_p)
            if gen.seed is not None:
                body["seed"] = gen.seed
            if gen.top_k:
                extra["top_k"] = gen.top_k
        else:
            body["temperature"] = 0.0  # greedy
        if gen.repetition_penalty != 1.0:
            extra["repetition_penalty"] = gen.repetition_penalty  # vLLM's and this demo's name for it
        if extra:
            body["extra_body"] = extra
        return body

    def _stream(self, messages: list[dict[str, str]], gen: GenerationSettings, stop_event: threading.Event,
                start_s: float, dropped_turns: int, request_id: str) -> Iterator[ReplyUpdate]:
        import openai

        report = self._report
        stats = ReplyStats(model=report.model, quantization=report.quantization, decode_path="remote",
                           device=report.device_name, versions=dict(report.versions), dropped_turns=dropped_turns,
                           notes=[f"Left out the {dropped_turns} oldest turn{'s' if dropped_turns != 1 else ''} "
                                  "(beyond the history-length setting)."] if dropped_turns else [])
        text, chunks = "", 0
        first_s: float | None = None
        last_s: float | None = None
        usage: Any = None
        reported: dict[str, Any] = {}
        finish: str | None = None

        def timing(new_tokens: int) -> dict[str, Any]:
            decode_s = None if first_s is None or last_s is None else last_s - first_s
            rate = (new_tokens - 1) / decode_s if decode_s and new_tokens > 1 else None
            return {"new_tokens": new_tokens, "ttft_s": None if first_s is None else first_s - start_s,
                    "decode_s": decode_s, "decode_tokens_per_s": rate}

        try:
            stream = self._client.chat.completions.create(**self._request(messages, gen, request_id))
            with contextlib.closing(stream):
                for chunk in stream:
                    if stop_event.is_set():
                        finish = "stopped"  # closing the stream tells the server to stop generating
                        break
                    if chunk.usage is not None:
                        usage = chunk.usage
                    extra = chunk.model_extra or {}
                    if isinstance(extra.get("stats"), dict):
                        reported = extra["stats"]
                    if not chunk.choices:
                        continue
                    choice = chunk.choices[0]
                    if choice.finish_reason:
                        finish = {"stop": "eos", "length": "length"}.get(choice.finish_reason, choice.finish_reason)
                    if choice.delta and choice.delta.content:
                        last_s = time.perf_counter()
                        first_s = first_s or last_s
                        chunks += 1
                        text += choice.delta.content
                        yield ReplyUpdate(text, replace(stats, **timing(chunks)))
        except openai.APIError as exc:
            raise self._translate(exc, gen) from None
        notes = list(stats.notes)
        if usage is not None:
            prompt_tokens, new_tokens = int(usage.prompt_tokens), int(usage.completion_tokens)
        else:
            prompt_tokens, new_tokens = 0, chunks
            notes.append("Token counts: the engine reported no usage; 'out' counts streamed chunks.")
        measured: dict[str, Any] = {k: reported.get(k) for k in _REPORTED_FIELDS}
        notes.append(REPORTED if any(v is not None for k, v in measured.items() if k != "weights_bytes")
                     else NOT_REPORTED)
        final = replace(stats, **timing(new_tokens), prompt_tokens=prompt_tokens,
                        end_to_end_s=time.perf_counter() - start_s, finish_reason=finish or "eos", notes=notes,
                        **measured)
        yield ReplyUpdate(text, final, done=True)

    def _translate(self, exc: Any, gen: GenerationSettings) -> LLMCoreError:
        import openai

        where = f"the remote engine at {self._report.base_url}"
        if isinstance(exc, openai.APITimeoutError):
            return GenerationError(f"No new token from {where} for {gen.stream_timeout_s:.0f} s; the reply was "
                                   "stopped. Try again, or lower max new tokens.")
        if isinstance(exc, openai.APIConnectionError):
            return GenerationError(f"Cannot reach {where}: {_describe(exc).rstrip('.')}. Is the server running?")
        status = getattr(exc, "status_code", None)
        message = _describe(exc)
        if status == 429:
            return BusyError(f"{where[0].upper()}{where[1:]} is busy: {message}")
        if status in (400, 413, 422):
            if "context" in message.lower() or getattr(exc, "code", None) == "context_length_exceeded":
                return ContextBudgetError(f"The prompt does not fit {where}: {message}")
            return InputError(f"{where[0].upper()}{where[1:]} refused the request: {message}")
        if status in (401, 403):
            return GenerationError(f"{where[0].upper()}{where[1:]} refused OPENAI_API_KEY (HTTP {status}).")
        return GenerationError(f"{where[0].upper()}{where[1:]} failed" + (f" (HTTP {status})" if status else "")
                               + f": {message}")


def _describe(exc: Any) -> str:
    """The server's own error message where it sent one, else the exception's."""
    body = getattr(exc, "body", None)
    if isinstance(body, dict):
        inner = body.get("error", body)
        if isinstance(inner, dict) and isinstance(inner.get("message"), str):
            return str(inner["message"])[:500]
    return str(getattr(exc, "message", None) or exc)[:500]
