"""What one /v1 request asks the engine for, as a list of replies (`Job`s: one per choice and prompt), and how each
finished reply becomes an OpenAI choice. Structured output, tools, logprobs and penalties become one
llm_core.constraints.RowControl per reply; `n` choices are replies of their own with seeds seed, seed+1, ...
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from ..config import GenerationSettings
from ..constraints import OutputSpec, RowControl
from ..engine.backend import ChatBackend
from ..engine.chat import RenderPrompt, ReplyUpdate
from ..errors import InputError
from ..history import Turn
from .openai_calls import FORMATS, HERMES_PROMPT, CallFormat, parse_tool_calls, template_family
from .openai_tools import (
    chat_logprobs,
    check_tools,
    completion_logprobs,
    forced_call_schema,
    supports_tool_prompt,
    tool_system_prompt,
)

MAX_COMPLETION_LOGPROBS = 5  # the legacy completions API's limit
MAX_PROMPTS = 8  # prompts in one /v1/completions list
MAX_CHOICES = 4  # n: each choice is a reply of its own (rows of one batch where the engine batches)


class SamplingRequest(BaseModel):
    """The fields both request bodies share: the model, sampling, stops, streaming, n. Fields outside OpenAI's API
    (and the two extensions) are refused."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)  # a 64-bit seed, as OpenAI's API
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    n: int | None = None
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # Extensions, as vLLM and llama.cpp's server accept them.
    top_k: int | None = None
    repetition_penalty: float | None = None

    def shared_unsupported(self) -> str | None:
        if self.n is not None and not 1 <= self.n <= MAX_CHOICES:
            return f"n must be 1 to {MAX_CHOICES}: each choice is a reply of its own."
        if self.logit_bias:
            return "logit_bias is not supported by this server."
        return None


class CompletionRequest(SamplingRequest):
    """The request body of POST /v1/completions (the legacy text endpoint)."""

    prompt: str | list[str]
    max_tokens: int | None = 16  # OpenAI's default for this endpoint
    best_of: int | None = None
    logprobs: int | None = None
    echo: bool | None = None
    suffix: str | None = None

    def unsupported(self) -> str | None:
        if self.suffix:
            return "suffix (text insertion) is not supported by this server."
        if self.echo:
            return "echo must be false: this server returns the completion only."
        shared = self.shared_unsupported()
        if shared:
            return shared
        if self.best_of not in (None, 1, self.n or 1):
            return "best_of must equal n: this server does not rank extra replies."
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_COMPLETION_LOGPROBS:
            return f"logprobs must be 0 to {MAX_COMPLETION_LOGPROBS}."
        prompts = self.prompt if isinstance(self.prompt, list) else [self.prompt]
        if not prompts or len(prompts) > MAX_PROMPTS:
            return f"prompt must be a string or a list of 1 to {MAX_PROMPTS} strings."
        return None


@dataclass
class Job:
    """One reply to run: choice `index` of the response."""

    index: int
    message: str
    turns: list[Turn]
    system_prompt: str | None
    gen: GenerationSettings
    raw: bool = False  # a text completion: no chat template
    control: RowControl | None = None
    render: RenderPrompt | None = None  # the prompt's own rendering (tools), else the chat template


@dataclass
class Plan:
    """A request's replies and how to read them back."""

    jobs: list[Job]
    tool_names: list[str] = field(default_factory=list)
    forced_call: bool = False
    logprobs: bool = False
    tokenizer: Any = None
    eos_ids: frozenset[int] = frozenset()
    call_format: CallFormat = HERMES_PROMPT  # how the tool calls are written


def base_options(req: Any, max_tokens: int | None) -> dict[str, Any]:
    options: dict[str, Any] = {"max_new_tokens": max_tokens, "top_p": req.top_p, "top_k": req.top_k,
                               "repetition_penalty": req.repetition_penalty}
    if req.temperature is not None:  # 0 = greedy, as OpenAI's API; unset = the server's DO_SAMPLE/TEMPERATURE
        options.update(do_sample=req.temperature > 0, temperature=req.temperature or None)
    return options


def _loaded(engine: ChatBackend, what: str) -> Any:
    loaded = getattr(engine, "loaded", None)
    if loaded is None:
        raise InputError(f"{what} runs on a local engine only, not on a remote one.")
    return loaded


Prompt = tuple[str, list[Turn], str | None, RenderPrompt | None]  # message, turns, system prompt, rendering


def make_jobs(engine: ChatBackend, req: Any, spec: OutputSpec, options: dict[str, Any], prompts: list[Prompt],
              raw: bool) -> list[Job]:
    """n jobs per prompt, each with its own seed (seed + choice) and its own control."""
    n = req.n or 1
    loaded = _loaded(engine, "Structured output, logprobs and presence/frequency penalties") if (
        spec.active or raw) else None
    jobs = []
    for p, (message, turns, system, render) in enumerate(prompts):
        for j in range(n):
            control = RowControl.for_model(spec, loaded) if spec.active else None
            seed = None if req.seed is None else req.seed + j
            gen = engine.request_options(**options, seed=seed, control=control)
            jobs.append(Job(p * n + j, message, turns, system, gen, raw, control, render))
    return jobs


def chat_spec(req: Any, forced_schema: dict[str, Any] | None) -> OutputSpec:
    fmt = req.response_format or {}
    schema = forced_schema or (fmt.get("json_schema", {}).get("schema") if fmt.get("type") == "json_schema" else None)
    return OutputSpec(json=forced_schema is not None or fmt.get("type") in ("json_object", "json_schema"),
                      json_schema=schema, presence_penalty=req.presence_penalty or 0.0,
                      frequency_penalty=req.frequency_penalty or 0.0,
                      top_logprobs=(req.top_logprobs or 0) if req.logprobs else None)


@dataclass(frozen=True)
class ToolUse:
    """How a chat request's tools reach the model: through its own template (`native`) or the Hermes prompt."""

    functions: list[dict[str, Any]]  # the function tools in play (none with tool_choice "none")
    forced_schema: dict[str, Any] | None  # "required" / a named function: the call's JSON schema
    format: CallFormat
    native: bool

    @property
    def tools(self) -> list[dict[str, Any]] | None:
        """The functions as OpenAI tool objects, as apply_chat_template takes them."""
        return [{"type": "function", "function": f} for f in self.functions] or None

    @property
    def opener(self) -> str:
        return self.format.opener if self.forced_schema is not None else ""


def tool_use(engine: ChatBackend, req: Any) -> ToolUse | None:
    """The request's tools and tool turns against the model's chat template; None when it has neither."""
    has_tool_turns = any(isinstance(m, dict) and (m.get("role") == "tool" or m.get("tool_calls"))
                         for m in req.messages)
    functions = check_tools(req.tools, req.tool_choice) if req.tool_choice != "none" else []
    if not functions and not has_tool_turns:
        return None
    template = getattr(getattr(getattr(engine, "loaded", None), "tokenizer", None), "chat_template", None)
    family = template_family(template)
    if family is None and not supports_tool_prompt(template):
        raise InputError("Tool calls need a chat template that renders tools itself (its source uses `tools`) or a "
                         "ChatML one (for the Hermes tool prompt); this model's template is neither, so tools are not "
                         "supported for it.")
    fmt = FORMATS[family] if family is not None else HERMES_PROMPT
    return ToolUse(functions, forced_call_schema(functions, req.tool_choice, fmt), fmt, family is not None)


def with_tool_prompt(system_prompt: str, default: str, functions: list[dict[str, Any]], forced: bool) -> str:
    return "\n\n".join(p for p in ((system_prompt or default).strip(), tool_system_prompt(functions, forced)) if p)


def chat_choice(plan: Plan, job: Job, text: str, reason: str) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if plan.tool_names:
        content, calls = parse_tool_calls(text, plan.tool_names, plan.forced_call, plan.call_format)
        if calls:
            message, reason = {"role": "assistant", "content": content, "tool_calls": calls}, "tool_calls"
    logprobs = chat_logprobs(job.control.logprobs, plan.tokenizer, plan.eos_ids) if (
        plan.logprobs and job.control is not None) else None
    return {"index": job.index, "message": message, "finish_reason": reason, "logprobs": logprobs}


def text_choice(plan: Plan, job: Job, text: str, reason: str) -> dict[str, Any]:
    logprobs = completion_logprobs(job.control.logprobs, plan.tokenizer, plan.eos_ids) if (
        plan.logprobs and job.control is not None) else None
    return {"index": job.index, "text": text, "finish_reason": reason, "logprobs": logprobs}


def usage(finals: list[ReplyUpdate]) -> dict[str, Any]:
    """Summed over the replies: prompt tokens as fed, generated token ids (EOS included)."""
    prompt = sum(f.stats.prompt_tokens for f in finals)
    completion = sum(f.stats.new_tokens for f in finals)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(f.stats.cached_prompt_tokens for f in finals)}}
