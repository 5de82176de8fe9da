"""Tool calls and logprobs for the /v1 API, in OpenAI's shapes. No FastAPI here: plain data in, plain data out.

Tools reach the model as a Hermes-style system prompt (`<tools>...</tools>`; replies `<tool_call>{"name": ...,
"arguments": ...}</tool_call>`) on ChatML templates, the format Hermes and Qwen models are trained on; `tool` messages
go back as `<tool_response>` user turns, so history trimming sees ordinary turns. Replies are parsed for the call
formats of the three template families that define one: Hermes/Qwen `<tool_call>` JSON, Llama 3.1 JSON
(`{"name": ..., "parameters": ...}`), Mistral `[TOOL_CALLS] [...]`.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from typing import Any

from ..errors import InputError
from ..history import content_to_text

MAX_TOOLS = 64
_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


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


def forced_call_schema(functions: list[dict[str, Any]], tool_choice: Any) -> dict[str, Any] | None:
    """With tool_choice "required" or a named function: the JSON schema of the one call the reply must be."""
    if tool_choice == "required":
        chosen = functions
    elif isinstance(tool_choice, dict):
        chosen = [f for f in functions if f["name"] == tool_choice["function"]["name"]]
    else:
        return None
    options = [{"type": "object", "properties": {"name": {"const": f["name"]}, "arguments": f["parameters"]},
                "required": ["name", "arguments"], "additionalProperties": False} for f in chosen]
    return options[0] if len(options) == 1 else {"anyOf": options}


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


def flatten_tool_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Assistant tool calls -> `<tool_call>` text; `tool` results -> one `<tool_response>` user turn per run of them."""
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(messages):
        role = msg.get("role") if isinstance(msg, dict) else None
        if role == "assistant" and msg.get("tool_calls"):
            if not isinstance(msg["tool_calls"], list):
                raise InputError(f"messages[{i}].tool_calls must be a list of tool calls.")
            parts = [content_to_text(msg.get("content"))] if msg.get("content") else []
            for call in msg["tool_calls"]:
                fn = call.get("function") if isinstance(call, dict) else None
                if not isinstance(fn, dict):
                    raise InputError(f"messages[{i}].tool_calls: each call needs a function with name and arguments.")
                try:
                    args = json.loads(fn.get("arguments") or "{}")
                except (TypeError, ValueError):
                    raise InputError(f"messages[{i}].tool_calls: arguments must be a JSON string.") from None
                parts.append("<tool_call>\n" + json.dumps({"name": fn.get("name"), "arguments": args},
                                                          ensure_ascii=False) + "\n</tool_call>")
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


def parse_tool_calls(text: str, names: Sequence[str], forced: bool = False) -> tuple[str | None, list[dict[str, Any]]]:
    """(content left, OpenAI tool_calls) from a reply; no calls: (text, []). `forced`: the reply is the call's JSON."""
    calls: list[tuple[str, Any]] = []
    content: str | None = text
    stripped = text.strip()
    if forced:
        calls = _calls_from_json(stripped)
        content = None
    elif "<tool_call>" in text:  # Hermes / Qwen
        for body in _HERMES_CALL.findall(text):
            calls += _calls_from_json(body)
        content = text[:text.index("<tool_call>")].strip() or None
    elif stripped.startswith("[TOOL_CALLS]"):  # Mistral
        calls = _calls_from_json(stripped[len("[TOOL_CALLS]"):])
        content = None
    elif stripped.startswith(("{", "<|python_tag|>")):  # Llama 3.1: the whole reply is the call
        calls = _calls_from_json(stripped.removeprefix("<|python_tag|>"))
        content = None if calls else text
    known = [(n, a) for n, a in calls if n in names]
    if not known:
        return text, []
    return content, [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}}
                     for name, args in known]


def _calls_from_json(text: str) -> list[tuple[str, Any]]:
    try:
        value = json.loads(text)
    except ValueError:
        return []
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if isinstance(item, dict) and isinstance(item.get("name"), str):
            args = item.get("arguments", item.get("parameters", {}))
            if isinstance(args, str):
                try:
                    args = json.loads(args)
                except ValueError:
                    continue
            calls.append((item["name"], args))
    return calls


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
