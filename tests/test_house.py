"""The house rules the code review keeps (issue 23's 'the house follows the design'), checked where a test can."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 800


def test_no_library_file_is_over_800_lines() -> None:
    """A file that grows past 800 lines is split by what its parts do (as fast/linear_pick.py left generate.py)."""
    files = sorted((ROOT / "llm_core").rglob("*.py"))
    assert len(files) > 20  # the library is there
    over = {str(f.relative_to(ROOT)): n for f in files if (n := len(f.read_text().splitlines())) > MAX_LINES}
    assert not over, f"split these files (lines): {over}"
