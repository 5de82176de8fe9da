"""History trimming: whole turns dropped oldest first, system prompt and newest message always kept."""

from __future__ import annotations

import unicodedata

import pytest

from llm_core.errors import ContextBudgetError, InputError
from llm_core.history import ERROR_TITLE, Turn, clean_text, fit_history, turns_from_messages


def words(messages: list[dict[str, str]]) -> int:
    """A stand-in tokenizer: one token per word plus two per message (role markers)."""
    return sum(len(m["content"].split()) + 2 for m in messages)


TURNS = [Turn(f"question {i} " + "x " * 8, f"answer {i} " + "y " * 8) for i in range(6)]  # 24 tokens per turn


def test_trim_keeps_system_prompt_and_newest_message_and_drops_oldest_turns() -> None:
    fitted = fit_history("be brief", TURNS, "newest message", max_turns=10, budget_tokens=4 + 4 + 24 * 2,
                         count_tokens=words)
    assert fitted.messages[0] == {"role": "system", "content": "be brief"}
    assert fitted.messages[-1] == {"role": "user", "content": "newest message"}
    assert [m["content"].split()[1] for m in fitted.messages[1:-1]] == ["4", "4", "5", "5"]
    assert (fitted.kept_turns, fitted.dropped_for_token_budget, fitted.dropped_for_turn_limit) == (2, 4, 0)
    assert fitted.prompt_tokens == words(fitted.messages) <= fitted.budget_tokens
    assert fitted.describe() == "Left out the 4 oldest turns (4 to fit the 56-token budget)."


def test_history_length_limit_drops_turns_beyond_it_and_reports_them() -> None:
    fitted = fit_history(None, TURNS, "hi", max_turns=1, budget_tokens=10_000, count_tokens=words)
    assert fitted.kept_turns == 1 and fitted.dropped_for_turn_limit == 5
    assert fitted.messages[0]["content"].startswith("question 5")
    assert "5 beyond the history-length setting" in (fitted.describe() or "")


def test_nothing_dropped_when_everything_fits() -> None:
    fitted = fit_history("s", TURNS, "hi", max_turns=6, budget_tokens=10_000, count_tokens=words)
    assert fitted.dropped_turns == 0 and fitted.describe() is None and len(fitted.messages) == 14


def test_message_too_long_for_the_context_raises_context_budget_error() -> None:
    with pytest.raises(ContextBudgetError, match="only 10 fit"):
        fit_history("system", [], "a " * 50, max_turns=4, budget_tokens=10, count_tokens=words)


def test_gradio_content_parts_are_normalised_to_text() -> None:
    history = [
        {"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]},
        {"role": "assistant", "content": "Hi!", "metadata": None},
    ]
    assert turns_from_messages(history) == [Turn("Hello there", "Hi!")]


def test_error_notes_and_unanswered_messages_are_not_fed_back() -> None:
    history = [
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "failed one"},
        {"role": "assistant", "content": "Out of memory", "metadata": {"title": ERROR_TITLE}},
        {"role": "user", "content": "unanswered"},
    ]
    assert turns_from_messages(history) == [Turn("first", "ok")]


@pytest.mark.parametrize(
    "history",
    ["not a list", [{"content": "no role"}], [{"role": "wizard", "content": "x"}], [{"role": "user", "content": 5}],
     [["user", "hi"]], [{"role": "user", "content": [{"type": "image", "url": "x"}]}]],
)
def test_malformed_history_raises_input_error(history: object) -> None:
    with pytest.raises(InputError):
        turns_from_messages(history)


def test_clean_text_strips_control_characters_and_keeps_unicode() -> None:
    assert clean_text("  héllo 👋\x00\x07 wörld\n\tok ") == "héllo 👋 wörld\n\tok"


def test_clean_text_removes_exactly_the_control_and_surrogate_categories() -> None:
    """Every code point: removed iff its Unicode category is Cc or Cs, newline and tab excepted."""
    every = "".join(chr(cp) for cp in range(0x110000))
    kept = "".join(ch for ch in every if ch in "\n\t" or unicodedata.category(ch) not in ("Cc", "Cs"))
    assert clean_text("x" + every + "x") == "x" + kept + "x"


@pytest.mark.parametrize("bad", ["", "   \n\t ", "\x00\x01"])
def test_empty_messages_are_refused(bad: str) -> None:
    with pytest.raises(InputError, match="empty"):
        clean_text(bad)


def test_overlong_messages_are_refused_with_the_limit() -> None:
    with pytest.raises(InputError, match="limit is 10"):
        clean_text("x" * 11, max_chars=10)
