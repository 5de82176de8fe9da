"""Tools and logprobs for the /v1 API, in OpenAI's shapes. No FastAPI here: plain data in, plain data out.

Two ways to the model. A chat template that renders tools itself (its Jinja source uses `tools`: Qwen, Hermes, Llama
3.1, Mistral) gets them through `apply_chat_template(messages, tools=...)`, with assistant `tool_calls` and `tool`
results in the shape transformers' templates take (`NativePrompt`). A ChatML template without a tools section (the
embedded model's) gets a Hermes-style system prompt (`<tools>...</tools>`; replies `<tool_call>{"name": ...,
"arguments": ...}</tool_call>`), and `tool` messages go back as `<tool_response>` user turns. Any other template
without tools is refused. Calls are read from replies by llm_core.web.openai_calls.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import InputError
from ..history import Turn, content_to_text, scrub
from .openai_calls import CallFormat

MAX_TOOLS = 64


def check_tools(tools: list[Any] | None, tool_choice: Any) -> list[dict[str, Any]]:
    """The request's function tools, validated: each {"type": "function", "function": {"name", "parameters"?}}."""
    functions: list[dict[str, Any]] = []
    for i, tool in enumerate(tools or []):
        fn = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise InputError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                             "\"parameters\": {...}}}.")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise InputError(f"tools[{i}].function.parameters must be a JSON schema object.")
        functions.append({"name": fn["name"], "description": str(fn.get("description") or ""), "parameters": params})
    if len(functions) > MAX_TOOLS:
        raise InputError(f"At most {MAX_TOOLS} tools per request.")
    if tool_choice not in (None, "auto", "none", "required"):
        fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not any(f["name"] == name for f in functions):
            raise InputError("tool_choice must be \"auto\", \"none\", \"required\" or {\"type\": \"function\", "
                             "\"function\": {\"name\": ...}} naming one of the tools.")
    if tool_choice in ("required",) or isinstance(tool_choice, dict):
        if not functions:
            raise InputError("tool_choice asks for a tool call, but the request has no tools.")
    return functions


def forced_call_schema(functions: list[dict[str, Any]], tool_choice: Any, fmt: CallFormat
                       ) -> dict[str, Any] | None:
    """With tool_choice "required" or a named function: the JSON schema of the one call the reply must be, in the
    format's shape (its arguments key; Mistral: an array of one call)."""
    if tool_choice == "required":
        chosen = functions
    elif isinstance(tool_choice, dict):
        chosen = [f for f in functions if f["name"] == tool_choice["function"]["name"]]
    else:
        return None
    options = [{"type": "object", "properties": {"name": {"const": f["name"]}, fmt.args_key: f["parameters"]},
                "required": ["name", fmt.args_key], "additionalProperties": False} for f in chosen]
    call = options[0] if len(options) == 1 else {"anyOf": options}
    return {"type": "array", "items": call, "minItems": 1, "maxItems": 1} if fmt.array else call


def tool_system_prompt(functions: list[dict[str, Any]], forced: bool) -> str:
    """The Hermes function-calling system prompt."""
    listed = "\n".join(json.dumps({"type": "function", "function": f}, ensure_ascii=False) for f in functions)
    ask = "You must call one of the functions." if forced else (
        "Call a function only when it helps answer; otherwise answer directly.")
    return ("You are a function calling AI model. You are provided with function signatures within <tools></tools> "
            f"XML tags. {ask} Don't make assumptions about what values to plug into functions.\n<tools>\n{listed}\n"
            "</tools>\nFor each function call return a JSON object with the function name and arguments within "
            "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
            "<args-dict>}\n</tool_call>")


def supports_tool_prompt(chat_template: Any) -> bool:
    """Whether the Hermes-style prompt fits this template: a ChatML one (`<|im_start|>` turns)."""
    return isinstance(chat_template, str) and "<|im_start|>" in chat_template


def _assistant_calls(i: int, msg: dict[str, Any]) -> list[tuple[Any, Any, dict[str, Any]]]:
    """(id, name, arguments as a dict) of each call of assistant message `i`."""
    if not isinstance(msg["tool_calls"], list):
        raise InputError(f"messages[{i}].tool_calls must be a list of tool calls.")
    calls = []
    for call in msg["tool_calls"]:
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict):
            raise InputError(f"messages[{i}].tool_calls: each call needs a function with name and arguments.")
        try:
            args = json.loads(fn.get("arguments") or "{}")
        except (TypeError, ValueError):
            args = None
        if not isinstance(args, dict):
            raise InputError(f"messages[{i}].tool_calls: arguments must be a JSON object as a string.")
        calls.append((call.get("id"), fn.get("name"), args))
    return calls


def flatten_tool_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Assistant tool calls -> `<tool_call>` text; `tool` results -> one `<tool_response>` user turn per run of them."""
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(messages):
        role = msg.get("role") if isinstance(msg, dict) else None
        if role == "assistant" and msg.get("tool_calls"):
            parts = [content_to_text(msg.get("content"))] if msg.get("content") else []
            parts += ["<tool_call>\n" + json.dumps({"name": name, "arguments": args}, ensure_ascii=False) +
                      "\n</tool_call>" for _id, name, args in _assistant_calls(i, msg)]
            out.append({"role": "assistant", "content": "\n".join(parts)})
        elif role == "tool":
            text = f"<tool_response>\n{content_to_text(msg.get('content'))}\n</tool_response>"
            if out and out[-1]["role"] == "user" and out[-1].get("tool_results"):
                out[-1] = {**out[-1], "content": out[-1]["content"] + "\n" + text}
            else:
                out.append({"role": "user", "content": text, "tool_results": True})
        else:
            out.append(msg)
    return [{k: v for k, v in m.items() if k != "tool_results"} if isinstance(m, dict) else m for m in out]


def native_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI messages in the shape transformers' chat templates take: developer -> system, text content, assistant
    `tool_calls` as [{"id", "type": "function", "function": {"name", "arguments": dict}}], `tool` results with
    `tool_call_id` and the called function's `name` (Llama's and Mistral's templates use them)."""
    out: list[dict[str, Any]] = []
    called: dict[Any, Any] = {}  # call id -> function name
    for i, msg in enumerate(messages):
        role = msg.get("role") if isinstance(msg, dict) else None
        if role not in ("system", "developer", "user", "assistant", "tool"):
            raise InputError(f"messages[{i}] has role {role!r}; this server takes system, developer, user, "
                             "assistant and tool messages.")
        entry: dict[str, Any] = {"role": "system" if role == "developer" else role,
                                 "content": scrub(content_to_text(msg.get("content")))}
        if role == "assistant" and msg.get("tool_calls"):
            entry["tool_calls"] = []
            for call_id, name, args in _assistant_calls(i, msg):
                called[call_id] = name
                entry["tool_calls"].append({"id": call_id, "type": "function",
                                            "function": {"name": name, "arguments": args}})
        elif role == "tool":
            call_id = msg.get("tool_call_id")
            entry.update(tool_call_id=call_id, name=called.get(call_id) or msg.get("name") or "")
        out.append(entry)
    return out


@dataclass(frozen=True)
class NativePrompt:
    """A conversation for a template that renders tools itself, split the way the engine trims: the system prompt,
    whole exchanges (a user message and all that answered it: calls, results, replies) as `turns`, and the newest
    user message with what followed it (calls and results still being answered). As a RenderPrompt for the engine,
    it renders the exchanges the engine kept, natively."""

    tokenizer: Any
    tools: list[dict[str, Any]] | None  # OpenAI tool objects, as apply_chat_template takes them
    system_prompt: str
    exchanges: tuple[tuple[dict[str, Any], ...], ...]
    tail: tuple[dict[str, Any], ...]  # starts with the newest user message
    opener: str = ""  # put after the generation prompt (a forced call's opening)

    @property
    def turns(self) -> list[Turn]:
        """One Turn per exchange (its user text, the rest as text): what the engine counts and trims."""
        return [Turn(ex[0]["content"] if ex[0]["role"] == "user" else "",
                     "\n".join(_message_text(m) for m in ex[1:] if m["role"] != "user")) for ex in self.exchanges]

    @property
    def message(self) -> str:
        return str(self.tail[0]["content"])

    def __call__(self, messages: list[dict[str, str]]) -> Any:
        """The engine's message list (system prompt, one user/assistant pair per kept turn, newest message) ->
        the encoded prompt: the same system prompt and the newest exchanges, rendered by the model's template."""
        kept = sum(1 for m in messages if m["role"] == "assistant")
        system = [{"role": "system", "content": messages[0]["content"]}] if messages[0]["role"] == "system" else []
        exchanges = self.exchanges[len(self.exchanges) - kept:] if kept else ()
        return encode_prompt(self.tokenizer, system + [m for ex in exchanges for m in ex] + list(self.tail),
                             self.tools, self.opener)


@dataclass(frozen=True)
class OpenedPrompt:
    """A RenderPrompt for the Hermes tool prompt's forced call: the engine's messages through the chat template,
    then the call's opening, so that the grammar constrains only the JSON after it."""

    tokenizer: Any
    opener: str

    def __call__(self, messages: list[dict[str, str]]) -> Any:
        return encode_prompt(self.tokenizer, list(messages), None, self.opener)


def _message_text(msg: dict[str, Any]) -> str:
    calls = [json.dumps(c["function"], ensure_ascii=False) for c in msg.get("tool_calls") or []]
    return "\n".join([msg["content"], *calls]).strip()


def encode_prompt(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                  opener: str = "") -> Any:
    """The chat template applied with the generation prompt, `opener` after it, tokenized as apply_chat_template
    tokenizes (no special tokens added). A template that refuses the messages (its own `raise_exception`, e.g.
    roles out of order) is the request's fault, said as InputError."""
    from jinja2 import TemplateError

    try:
        text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    except TemplateError as exc:
        raise InputError(f"The model's chat template refused these messages: {exc}") from None
    return tokenizer(str(text) + opener, add_special_tokens=False, return_tensors="pt")


def native_prompt(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                  opener: str = "") -> NativePrompt:
    """Split an OpenAI conversation for NativePrompt. The newest user message may be followed by assistant calls
    and tool results only; the conversation must end with a user message or a tool result."""
    native = native_messages(messages)
    system = "\n\n".join(m["content"] for m in native if m["role"] == "system" and m["content"].strip())
    rest = [m for m in native if m["role"] != "system"]
    users = [i for i, m in enumerate(rest) if m["role"] == "user"]
    if not users or rest[-1]["role"] not in ("user", "tool"):
        raise InputError("The last message must come from the user or be a tool result.")
    if any(m["role"] == "assistant" and not m.get("tool_calls") for m in rest[users[-1]:]):
        raise InputError("After the newest user message only tool calls and their results may follow.")
    bounds = sorted({0, *users})  # messages before the first user message open the first exchange
    exchanges = tuple(tuple(rest[a:b]) for a, b in zip(bounds, bounds[1:], strict=False))
    return NativePrompt(tokenizer, tools, system, exchanges, tuple(rest[users[-1]:]), opener)


def chat_logprobs(entries: Sequence[Any], tokenizer: Any, eos_ids: Any) -> dict[str, Any]:
    """OpenAI's chat `logprobs`: {"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}, ...]}."""
    def item(token_id: int, logprob: float) -> dict[str, Any]:
        piece = tokenizer.decode([token_id])
        return {"token": piece, "logprob": logprob, "bytes": list(piece.encode("utf-8"))}

    return {"content": [item(e.token_id, e.logprob) | {"top_logprobs": [item(t, lp) for t, lp in e.top]}
                        for e in entries if e.token_id not in eos_ids]}


def completion_logprobs(entries: Sequence[Any], tokenizer: Any, eos_ids: Any) -> dict[str, Any]:
    """The legacy completions `logprobs`: parallel lists of tokens, their logprobs, top alternatives, offsets."""
    kept = [e for e in entries if e.token_id not in eos_ids]
    tokens = [tokenizer.decode([e.token_id]) for e in kept]
    offsets, at = [], 0
    for piece in tokens:
        offsets.append(at)
        at += len(piece)
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in kept],
            "top_logprobs": [{tokenizer.decode([t]): lp for t, lp in e.top} for e in kept], "text_offset": offsets}
