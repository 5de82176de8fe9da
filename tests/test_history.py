"""History trimming: whole turns dropped oldest first, system prompt and newest message always kept."""

from __future__ import annotations

import unicodedata

import pytest

from llm_core.errors import ContextBudgetError, InputError
from llm_core.history import ERROR_TITLE, Turn, clean_text, fit_history, trim_start, turns_from_messages


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


def _kept_first(fitted) -> str:
    return fitted.messages[0]["content"].split()[1]


def test_beyond_the_turn_limit_turns_go_in_steps_so_the_oldest_kept_turn_holds_for_the_next_reply() -> None:
    chat = [Turn(f"q {i}", f"a {i}") for i in range(12)]
    firsts = [_kept_first(fit_history(None, chat[:n], "hi", max_turns=4, budget_tokens=10_000, count_tokens=words,
                                      turn_step=2)) for n in range(5, 12)]
    assert firsts == ["2", "2", "4", "4", "6", "6", "8"]  # n=5: 1 over, 2 go; n=6: 2 over, the same 2 go
    fitted = fit_history(None, chat[:5], "hi", max_turns=4, budget_tokens=10_000, count_tokens=words, turn_step=2)
    assert (fitted.dropped_for_turn_limit, fitted.dropped_in_steps, fitted.kept_turns) == (1, 1, 3)
    assert fitted.describe() == ("Left out the 2 oldest turns (1 beyond the history-length setting and 1 more so "
                                 "the next replies reuse the cached prompt).")


def test_for_the_token_budget_turns_go_up_to_a_step_boundary_that_does_not_move_as_the_chat_grows() -> None:
    budget = 4 + 24 * 3  # the newest message + three turns of 24 tokens
    starts = []
    for n in range(4, 7):  # each reply adds a turn; one more must go each time at the fewest
        fewest = fit_history(None, TURNS[:n], "hi", max_turns=10, budget_tokens=budget, count_tokens=words)
        stepped = fit_history(None, TURNS[:n], "hi", max_turns=10, budget_tokens=budget, count_tokens=words,
                              token_step=48)
        assert fewest.dropped_turns == n - 3 and stepped.dropped_turns >= fewest.dropped_turns
        assert stepped.prompt_tokens == words(stepped.messages) <= budget
        starts.append(stepped.dropped_turns)
    assert starts == [2, 2, 4]  # boundaries where the running count crosses 48, 96: after turns 2 and 4


def test_trim_start_rounds_up_to_the_first_boundary_at_or_after_the_fewest() -> None:
    assert trim_start([10, 10, 10, 10], 1, 25) == 3  # running 10, 20, 30 (crosses 25), 40
    assert trim_start([10, 10, 10, 10], 3, 25) == 3
    assert trim_start([10, 10, 10, 10], 4, 25) == 4  # past the last boundary: everything goes
    assert trim_start([10, 10, 10, 10], 2, 0) == 2 and trim_start([10], 0, 25) == 0


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
