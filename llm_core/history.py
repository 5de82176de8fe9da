"""Conversation history: pure functions that validate a chat and fit it to turn and token budgets; no torch here.

Trimming never slices token ids (that would cut the system prompt or the chat template): it drops whole old
turns, oldest first, always keeps the system prompt and the newest user message, and reports what it dropped.
Token counts come from a `count_tokens(messages) -> int` callable supplied by the caller.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .config import ChatSettings
from .errors import ContextBudgetError, InputError

Message = dict[str, str]
CountTokens = Callable[[list[Message]], int]

ERROR_TITLE = "⚠️ Reply failed"  # assistant messages carrying this metadata title are notes, not model output


@dataclass(frozen=True)
class Turn:
    """One past exchange: what the user said and what the assistant answered."""

    user: str
    assistant: str


@dataclass(frozen=True)
class FittedHistory:
    messages: list[Message]  # system prompt (if any) + kept turns + newest user message, ready for the template
    prompt_tokens: int
    kept_turns: int
    dropped_for_turn_limit: int  # turns beyond the history-length setting
    dropped_for_token_budget: int  # further turns dropped so the prompt fits budget_tokens
    budget_tokens: int
    dropped_in_steps: int = 0  # further old turns dropped so that the next replies keep the same prompt prefix

    @property
    def dropped_turns(self) -> int:
        return self.dropped_for_turn_limit + self.dropped_for_token_budget + self.dropped_in_steps

    def describe(self) -> str | None:
        """One sentence for the user about what was left out of the prompt, or None if nothing was."""
        parts = []
        if self.dropped_for_turn_limit:
            parts.append(f"{self.dropped_for_turn_limit} beyond the history-length setting")
        if self.dropped_for_token_budget:
            parts.append(f"{self.dropped_for_token_budget} to fit the {self.budget_tokens:,}-token budget")
        if self.dropped_in_steps:
            parts.append(f"{self.dropped_in_steps} more so the next replies reuse the cached prompt")
        if not parts:
            return None
        n = self.dropped_turns
        return f"Left out the {n} oldest turn{'s' if n != 1 else ''} ({' and '.join(parts)})."


# Unicode categories Cc (C0 and C1 controls, DEL) and Cs (surrogates), newline and tab excepted: one regex pass
# (a per-character unicodedata loop cost 0.44 ms of every reply's TTFT at a 3,000-character message).
_CONTROL_CHARS = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\ud800-\udfff]")


def scrub(text: str) -> str:
    """`text` without control characters and lone surrogates (newline and tab kept); nothing else changes. A lone
    surrogate cannot be encoded as UTF-8: echoed back to a client it breaks that client's stream."""
    return _CONTROL_CHARS.sub("", text)


def clean_text(text: Any, *, field: str = "message", max_chars: int | None = None, allow_empty: bool = False) -> str:
    """Validate user-supplied text: a str, control characters and lone surrogates removed (newline and tab kept),
    not blank (unless `allow_empty`), at most `max_chars` characters. Runs before anything is tokenized."""
    if not isinstance(text, str):
        raise InputError(f"The {field} must be text, got {type(text).__name__}.")
    cleaned = scrub(text).strip()
    if not cleaned and not allow_empty:
        raise InputError(f"The {field} is empty. Type something first.")
    if max_chars is not None and len(cleaned) > max_chars:
        raise InputError(f"The {field} has {len(cleaned):,} characters; the limit is {max_chars:,}. Shorten it.")
    return cleaned


def check_history_size(history: Any, *, max_messages: int, max_chars: int) -> None:
    """Refuse a history (as it arrives through the API: a list of {"role", "content"} messages) that is longer than
    `max_messages` messages or holds more than `max_chars` characters of text. Malformed entries are left to the
    history parser, which names them; this only bounds the work a request can ask for."""
    if not isinstance(history, (list, tuple)):
        return
    if len(history) > max_messages:
        raise InputError(f"The history has {len(history):,} messages; the limit is {max_messages:,}. "
                         "Clear the chat or start a new one.")
    chars = 0
    for message in history:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            chars += len(content)
        elif isinstance(content, (list, tuple)):
            chars += sum(len(p) if isinstance(p, str) else len(p.get("text") or "") if isinstance(p, dict)
                         and isinstance(p.get("text"), str) else 0 for p in content)
        elif isinstance(content, dict) and isinstance(content.get("text"), str):
            chars += len(content["text"])
    if chars > max_chars:
        raise InputError(f"The history holds {chars:,} characters; the limit is {max_chars:,}. "
                         "Clear the chat or start a new one.")


def _scrub_value(value: Any, depth: int = 0) -> Any:
    """Every string inside a message (content, parts, metadata) scrubbed; other values kept as they are."""
    if isinstance(value, str):
        return scrub(value)
    if depth > 4:
        return value
    if isinstance(value, dict):
        return {k: _scrub_value(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_scrub_value(v, depth + 1) for v in value]
    return value


@dataclass(frozen=True)
class ChatInput:
    """One chat request's text, cleaned and size-checked: what the model is given and what is echoed back."""

    message: str
    system_prompt: str
    history: list[Any]  # the history as it arrived, every string scrubbed (safe to send back to the client)
    turns: list[Turn]


def clean_chat_input(message: Any, history: Any, system_prompt: Any, settings: ChatSettings) -> ChatInput:
    """The one cleaning and size check of a chat request's text (message, system prompt, history), before any
    tokenization: sizes first (cheap), then control characters and lone surrogates out, then the history parsed."""
    check_history_size(history, max_messages=settings.max_history_messages, max_chars=settings.max_history_chars)
    text = clean_text(message, max_chars=settings.max_message_chars)
    system = clean_text("" if system_prompt is None else system_prompt, field="system prompt",
                        max_chars=settings.max_system_prompt_chars, allow_empty=True)
    cleaned = _scrub_value(list(history)) if isinstance(history, (list, tuple)) else history
    return ChatInput(text, system, cleaned if isinstance(cleaned, list) else [], turns_from_messages(cleaned))


def clean_turns(turns: Sequence[Turn], *, max_chars: int) -> list[Turn]:
    """Turns given to the engine directly (library callers): scrubbed, and their text bounded like an API history."""
    if not isinstance(turns, (list, tuple)) or not all(isinstance(t, Turn) for t in turns):
        raise InputError("The history must be a list of turns (user message, assistant reply).")
    chars = sum(len(t.user) + len(t.assistant) for t in turns if isinstance(t.user, str) and
                isinstance(t.assistant, str))
    if chars > max_chars:
        raise InputError(f"The history holds {chars:,} characters; the limit is {max_chars:,}. "
                         "Clear the chat or start a new one.")
    return [Turn(scrub(str(t.user)), scrub(str(t.assistant))) for t in turns]


def content_to_text(content: Any) -> str:
    """Chat message content as plain text: a str, or a list of parts ({"type": "text", "text": ...} or str)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, dict):
        content = [content]
    if isinstance(content, (list, tuple)):
        texts = []
        for part in content:
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, dict) and isinstance(part.get("text"), str):
                texts.append(part["text"])
            elif isinstance(part, dict) and part.get("type") in ("file", "image", "audio", "video"):
                raise InputError("Files and images are not supported by this text-only demo.")
            else:
                raise InputError("The history holds a message part that is not text.")
        return "".join(texts)
    raise InputError(f"The history holds message content of type {type(content).__name__}; expected text.")


def turns_from_messages(history: Any) -> list[Turn]:
    """Parse an OpenAI/Gradio-style message list into turns. Malformed input raises InputError.

    Assistant error notes (metadata title ERROR_TITLE) and user messages that never got an answer are skipped:
    they stay visible in the chat but are not fed back to the model.
    """
    if history is None:
        return []
    if not isinstance(history, (list, tuple)):
        raise InputError("The history must be a list of messages with 'role' and 'content'.")
    turns: list[Turn] = []
    pending_user: str | None = None
    for i, msg in enumerate(history):
        if not isinstance(msg, dict) or "role" not in msg or "content" not in msg:
            raise InputError(f"History message {i + 1} is malformed: each needs 'role' and 'content'.")
        role = msg["role"]
        if role not in ("user", "assistant", "system"):
            raise InputError(f"History message {i + 1} has role {role!r}; use 'user' or 'assistant'.")
        if role == "system":
            continue  # the system prompt is a separate setting
        text = scrub(content_to_text(msg["content"]))
        metadata = msg.get("metadata") or {}
        if role == "user":
            pending_user = text  # a previous unanswered user message is superseded
        elif isinstance(metadata, dict) and metadata.get("title") == ERROR_TITLE:
            pending_user = None
        elif pending_user is not None:
            turns.append(Turn(pending_user, text))
            pending_user = None
        elif turns:  # consecutive assistant messages (e.g. streamed in parts): join them
            turns[-1] = Turn(turns[-1].user, turns[-1].assistant + text)
    return turns


def build_messages(system_prompt: str | None, turns: Sequence[Turn], message: str) -> list[Message]:
    messages: list[Message] = []
    if system_prompt and system_prompt.strip():
        messages.append({"role": "system", "content": system_prompt.strip()})
    for turn in turns:
        messages.append({"role": "user", "content": turn.user})
        messages.append({"role": "assistant", "content": turn.assistant})
    messages.append({"role": "user", "content": message})
    return messages


def trim_start(turn_tokens: Sequence[int], minimal_start: int, step_tokens: int) -> int:
    """The first turn to keep when at least `minimal_start` oldest turns must go: the first step boundary at or after
    it. Boundaries are where the running token count of the conversation (from its first turn) crosses a multiple
    of `step_tokens`; they never move as turns are added, so the next replies keep the same oldest turn, hence the
    same prompt prefix, and reuse its cached KV. `step_tokens` 0: exactly `minimal_start`."""
    if minimal_start <= 0 or step_tokens <= 0:
        return max(minimal_start, 0)
    total = 0
    for index, tokens in enumerate(turn_tokens, start=1):
        before, total = total, total + tokens
        if index >= minimal_start and total // step_tokens > before // step_tokens:
            return index
    return len(turn_tokens)


def fit_history(
    system_prompt: str | None,
    turns: Sequence[Turn],
    message: str,
    *,
    max_turns: int,
    budget_tokens: int,
    count_tokens: CountTokens,
    turn_step: int = 1,
    token_step: int = 0,
) -> FittedHistory:
    """Keep the newest `max_turns` turns, then drop oldest whole turns until the prompt fits `budget_tokens`.

    Turns are dropped in steps so that a long chat's next replies start from the same oldest turn and reuse the
    cached prompt: beyond the turn limit, the count of dropped turns is rounded up to a multiple of `turn_step`;
    for the token budget, up to a boundary of `token_step` tokens (trim_start). Steps of 1 and 0 drop the fewest.

    Raises ContextBudgetError when the system prompt plus the newest message alone exceed the budget.
    """
    if max_turns < 0:
        raise InputError("The history length must be 0 or more turns.")
    over = max(0, len(turns) - max_turns) if max_turns else len(turns)
    first = min(len(turns), -(-over // max(1, turn_step)) * max(1, turn_step)) if max_turns else len(turns)
    kept = list(turns[first:])
    # Token counts only grow as turns are added, so binary-search the most recent suffix that fits.
    lo, hi = 0, len(kept)  # number of newest turns to keep
    base_tokens = count_tokens(build_messages(system_prompt, [], message))
    if base_tokens > budget_tokens:
        raise ContextBudgetError(
            f"Your message needs {base_tokens:,} tokens with the system prompt, but only {budget_tokens:,} fit "
            "(context length minus max new tokens). Shorten the message or the system prompt, or lower max new tokens."
        )
    best_tokens = base_tokens
    while lo < hi:
        mid = (lo + hi + 1) // 2
        tokens = count_tokens(build_messages(system_prompt, kept[len(kept) - mid:], message))
        if tokens <= budget_tokens:
            lo, best_tokens = mid, tokens
        else:
            hi = mid - 1
    for_budget = len(kept) - lo
    if for_budget and token_step > 0:
        per_turn = [count_tokens([{"role": "user", "content": t.user}, {"role": "assistant", "content": t.assistant}])
                    for t in turns]
        start = trim_start(per_turn, first + for_budget, token_step)
        if start > first + for_budget:
            lo = len(turns) - start
            best_tokens = count_tokens(build_messages(system_prompt, kept[len(kept) - lo:] if lo else [], message))
    final = kept[len(kept) - lo:] if lo else []
    return FittedHistory(
        messages=build_messages(system_prompt, final, message),
        prompt_tokens=best_tokens,
        kept_turns=len(final),
        dropped_for_turn_limit=over,
        dropped_for_token_budget=for_budget,
        budget_tokens=budget_tokens,
        dropped_in_steps=len(turns) - len(final) - over - for_budget,
    )
