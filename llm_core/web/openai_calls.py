"""Tool calls read out of a reply, whole or as it grows, in the call formats of the chat-template families that define
one: Hermes/Qwen `<tool_call>{"name", "arguments"}</tool_call>`, Llama 3.1 `{"name", "parameters"}` (after an optional
`<|python_tag|>`), Mistral `[TOOL_CALLS] [{"name", "arguments"}, ...]`. No FastAPI here: text in, OpenAI deltas out.

One reader serves both: `ToolCallStream.feed(text)` gives the deltas since the last call (content pieces, a call's
name, pieces of its arguments as they are generated); `parse_tool_calls` is the same reader fed the whole reply, so a
streamed call adds up to the non-streamed one. A call's `arguments` is the model's own text of the arguments object.
"""

from __future__ import annotations

import json
import re
import secrets
import string
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

TAG_OPEN, TAG_CLOSE = "<tool_call>", "</tool_call>"
MISTRAL_MARKER, PYTHON_TAG = "[TOOL_CALLS]", "<|python_tag|>"
_SCALAR = re.compile(r"[^,}\]\s]+")  # a number, true, false or null (checked by whoever decodes it)


@dataclass(frozen=True)
class CallFormat:
    """How one template family writes a call. `opener`: what a forced call's reply starts with (put at the end of
    the prompt, so the grammar constrains only the JSON after it)."""

    family: str  # hermes | llama3 | mistral | json (a tools template of no known family)
    opener: str
    args_key: str  # the arguments' key in the call object
    array: bool  # calls as one JSON array (Mistral), else one object per call
    detectors: frozenset[str]  # where calls are looked for: "tag" (Hermes tags anywhere), "start" (the reply's start)

    def call_id(self) -> str:
        # Mistral's templates refuse any tool call id that is not 9 letters and digits
        if self.family == "mistral":
            return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))
        return f"call_{uuid.uuid4().hex[:24]}"


FORMATS = {
    "hermes": CallFormat("hermes", TAG_OPEN + "\n", "arguments", False, frozenset({"tag"})),
    "llama3": CallFormat("llama3", "", "parameters", False, frozenset({"start"})),
    "mistral": CallFormat("mistral", MISTRAL_MARKER, "arguments", True, frozenset({"start"})),
    "json": CallFormat("json", "", "arguments", False, frozenset({"tag", "start"})),
}
ANY_FORMAT = FORMATS["json"]  # every format looked for: what parse_tool_calls reads without a family
# The Hermes tool prompt on a ChatML model not trained on it: Hermes calls, and a bare JSON call read as one too.
HERMES_PROMPT = CallFormat("hermes", TAG_OPEN + "\n", "arguments", False, frozenset({"tag", "start"}))


def template_family(chat_template: Any) -> str | None:
    """The call format of a chat template that renders tools itself (its Jinja source uses `tools`), from the
    template's text; None when the template has no tools section."""
    if not isinstance(chat_template, str) or not re.search(r"\btools\b", chat_template):
        return None
    if TAG_OPEN in chat_template:
        return "hermes"
    if MISTRAL_MARKER in chat_template or "[AVAILABLE_TOOLS]" in chat_template:
        return "mistral"
    if PYTHON_TAG in chat_template or "ipython" in chat_template:
        return "llama3"
    return "json"


# --- a JSON scanner for text that is still being written ------------------------------------------------------


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


def _string_end(text: str, i: int) -> int | None:
    """End (exclusive) of the JSON string opening at text[i]; None while it is not closed yet."""
    j = i + 1
    while j < len(text):
        if text[j] == "\\":
            j += 2
        elif text[j] == '"':
            return j + 1
        else:
            j += 1
    return None


def _value_end(text: str, i: int) -> int | None:
    """End (exclusive) of the JSON value starting at text[i]; None while incomplete. ValueError: not JSON."""
    first = text[i]
    if first == '"':
        return _string_end(text, i)
    if first in "{[":
        depth, j = 0, i
        while j < len(text):
            ch = text[j]
            if ch == '"':
                end = _string_end(text, j)
                if end is None:
                    return None
                j = end
                continue
            depth += ch in "{["
            depth -= ch in "}]"
            if depth == 0:
                return j + 1
            j += 1
        return None
    match = _SCALAR.match(text, i)
    if match is None:
        raise ValueError("not a JSON value")
    return None if match.end() == len(text) else match.end()  # at the end of the text it may still grow


@dataclass
class _Call:
    """One call object as read so far."""

    name: str | None = None  # once its string is complete
    args: tuple[int, int | None] | None = None  # span of the arguments value (end None: still growing)
    end: int | None = None  # end of the object (None: still growing)


def _read_object(text: str, i: int, args_keys: tuple[str, ...]) -> _Call:
    """The call object opening at text[i] == '{', as far as it is written. ValueError: not a JSON object."""
    call, j = _Call(), i + 1
    while True:
        j = _skip_ws(text, j)
        if j >= len(text):
            return call
        if text[j] == "}":
            call.end = j + 1
            return call
        if text[j] == ",":
            j += 1
            continue
        if text[j] != '"':
            raise ValueError("a key must be a string")
        key_end = _string_end(text, j)
        if key_end is None:
            return call
        key = json.loads(text[j:key_end])
        j = _skip_ws(text, key_end)
        if j >= len(text):
            return call
        if text[j] != ":":
            raise ValueError("a key must be followed by ':'")
        j = _skip_ws(text, j + 1)
        if j >= len(text):
            return call
        end = _value_end(text, j)
        if key == "name" and end is not None and text[j] == '"':
            call.name = json.loads(text[j:end])
        elif key in args_keys and call.args is None:
            call.args = (j, end)
        if end is None:
            return call
        j = end


# --- the reader -----------------------------------------------------------------------------------------------


@dataclass
class _Reading:
    content: str  # the content that may be shown now
    calls: list[tuple[str, str, bool]] = field(default_factory=list)  # (name, arguments text so far, complete)


class ToolCallStream:
    """Reads tool calls out of one reply as it grows (the whole text so far each time) and says what is new."""

    def __init__(self, names: Sequence[str], fmt: CallFormat = ANY_FORMAT, forced: bool = False) -> None:
        self.names, self.format, self.forced = frozenset(names), fmt, forced
        self._args_keys = ("arguments", "parameters")
        self._content_sent = 0
        self._calls_sent: list[int] = []  # per call: characters of its arguments sent
        self.ids: list[str] = []

    def feed(self, text: str, done: bool = False) -> list[dict[str, Any]]:
        """The deltas since the last feed, in order: {"content": piece} or {"tool_call": {"index", "id"?, "type"?,
        "function": {"name"?, "arguments"}}} (id, type and name in a call's first delta only)."""
        reading = self._read(text, done)
        out: list[dict[str, Any]] = []
        if len(reading.content) > self._content_sent and not self._calls_sent:
            out.append({"content": reading.content[self._content_sent:]})
            self._content_sent = len(reading.content)
        for index, (name, args, _complete) in enumerate(reading.calls):
            if index == len(self._calls_sent):
                self.ids.append(self.format.call_id())
                self._calls_sent.append(0)
                out.append({"tool_call": {"index": index, "id": self.ids[index], "type": "function",
                                          "function": {"name": name, "arguments": ""}}})
            if len(args) > self._calls_sent[index]:
                out.append({"tool_call": {"index": index, "function": {"arguments": args[self._calls_sent[index]:]}}})
                self._calls_sent[index] = len(args)
        return out

    @property
    def calling(self) -> bool:
        """Whether a call has been read (the reply's finish_reason is then tool_calls)."""
        return bool(self._calls_sent)

    def _read(self, text: str, done: bool) -> _Reading:
        """What the reply so far says: the content safe to show, and the calls read (text only grows, so each
        reading extends the one before)."""
        lead = _skip_ws(text, 0)
        if self.forced:
            return self._body(text, lead) or _Reading("")
        if "start" in self.format.detectors:  # Llama 3.1 / Mistral: a reply that is a call starts with it
            rest = text[lead:]
            if not done and any(m.startswith(rest) for m in (MISTRAL_MARKER, PYTHON_TAG)):
                return _Reading("")  # may still become a marker
            marker = next((m for m in (MISTRAL_MARKER, PYTHON_TAG) if rest.startswith(m)), "")
            start = _skip_ws(text, lead + len(marker))
            if start >= len(text) and marker and not done:
                return _Reading("")
            if start < len(text) and text[start] in "{[":
                body = self._body(text, start)
                if body is not None:
                    return body
                if not done and self._undecided(text, start):
                    return _Reading("")
        if "tag" in self.format.detectors:  # Hermes: content, then tagged calls
            at = text.find(TAG_OPEN)
            if at >= 0:
                start = _skip_ws(text, at + len(TAG_OPEN))
                body = self._body(text, start)
                if body is not None:
                    return body
                if not done and self._undecided(text, start):
                    return _Reading(text[:at].strip())
            elif not done:  # hold back what may be the start of a tag
                hold = next((k for k in range(len(TAG_OPEN) - 1, 0, -1) if text.endswith(TAG_OPEN[:k])), 0)
                return _Reading(text[:len(text) - hold].strip())
        return _Reading(text.strip())

    def _objects(self, text: str, start: int) -> list[_Call]:
        """The call objects of a body at `start` (one object, an array of them, or tagged objects one after
        another), as far as written. ValueError when it is not JSON."""
        if start >= len(text):
            return []
        if text[start] == "[":
            calls: list[_Call] = []
            j = start + 1
            while True:
                j = _skip_ws(text, j)
                while j < len(text) and text[j] == ",":
                    j = _skip_ws(text, j + 1)
                if j >= len(text) or text[j] == "]":
                    return calls
                if text[j] != "{":
                    raise ValueError("a call must be an object")
                calls.append(_read_object(text, j, self._args_keys))
                if calls[-1].end is None:
                    return calls
                j = calls[-1].end  # type: ignore[assignment]
        if text[start] != "{":
            raise ValueError("a call must be an object")
        calls = [_read_object(text, start, self._args_keys)]
        while calls[-1].end is not None and "tag" in self.format.detectors:  # Hermes: more tagged calls after it
            at = text.find(TAG_OPEN, calls[-1].end)
            following = _skip_ws(text, at + len(TAG_OPEN)) if at >= 0 else len(text)
            if following >= len(text) or text[following] != "{":
                break
            calls.append(_read_object(text, following, self._args_keys))
        return calls

    def _body(self, text: str, start: int) -> _Reading | None:
        """The calls of a body starting at `start`, or None when its first call is not (yet) a call to a known
        function."""
        try:
            objects = self._objects(text, start)
        except ValueError:
            objects = []
        calls: list[tuple[str, str, bool]] = []
        for obj in objects:
            if obj.name is None:
                if obj.end is not None:  # a finished object with no name: not a call
                    continue
                break
            if obj.name not in self.names:
                continue
            if obj.args is None:
                if obj.end is None:
                    break  # its arguments may still come
                calls.append((obj.name, "{}", True))
                continue
            begin, end = obj.args
            if text[begin] == '"':  # arguments written as a JSON string: sent once it is complete
                if end is None:
                    break
                calls.append((obj.name, str(json.loads(text[begin:end])), True))
            else:
                calls.append((obj.name, text[begin:end if end is not None else len(text)], end is not None))
            if end is None:
                break
        if not calls:
            return None
        return _Reading(text[:self._content_end(text)].strip(), calls)

    def _content_end(self, text: str) -> int:
        at = text.find(TAG_OPEN) if "tag" in self.format.detectors else -1
        return at if at >= 0 else 0

    def _undecided(self, text: str, start: int) -> bool:
        """Whether the body at `start` may still turn out to be a call (its first object is unfinished)."""
        try:
            objects = self._objects(text, start)
        except ValueError:
            return False
        return not objects or objects[0].end is None


def parse_tool_calls(text: str, names: Sequence[str], forced: bool = False, fmt: CallFormat = ANY_FORMAT,
                     ids: Sequence[str] = ()) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, OpenAI tool_calls) of a whole reply: what ToolCallStream streams, added up. No calls: (the text
    stripped, []). `forced`: the reply is the call's JSON (after the format's opener)."""
    stream = ToolCallStream(names, fmt, forced)
    content: list[str] = []
    calls: list[dict[str, Any]] = []
    for delta in stream.feed(text, done=True):
        if "content" in delta:
            content.append(delta["content"])
            continue
        call = delta["tool_call"]
        if "id" in call:
            calls.append({"id": ids[call["index"]] if call["index"] < len(ids) else call["id"], "type": "function",
                          "function": {"name": call["function"]["name"], "arguments": ""}})
        calls[call["index"]]["function"]["arguments"] += call["function"]["arguments"]
    text_out = "".join(content)
    if not calls:
        return text_out, []
    return text_out or None, calls
