"""Shared fixtures: tests never see the developer's environment or .env, and load each real model once."""

from __future__ import annotations

import collections
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from llm_core.config import SPECS, Settings
from llm_core.engine.chat import ChatEngine, ReplyUpdate

REPO = Path(__file__).resolve().parent.parent
# Converted embedded model, reused across runs (the first conversion takes ~20 s).
MODEL_CACHE = Path(os.environ.get("LLM_CORE_TEST_CACHE", REPO / ".cache" / "test-models"))
ARTIFACTS = REPO / "artifacts"


@pytest.fixture(autouse=True)
def _isolated_settings_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No setting leaks in from the shell, and no .env from the repo is read (tests run in tmp_path)."""
    for spec in SPECS:
        monkeypatch.delenv(spec.name, raising=False)
    monkeypatch.chdir(tmp_path)


def make_settings(**values: str) -> Settings:
    """Settings for tests. DECODE_PATH defaults to plain: on CPU, auto serves replies from the CPU path (int4, compiled;
    tests/test_cpu_path.py passes DECODE_PATH=auto), while these tests are about bitsandbytes and generate."""
    return Settings.from_env(environ={"CACHE_DIR": str(MODEL_CACHE), "DECODE_PATH": "plain", **values}, env_file=None)


@pytest.fixture(scope="session")
def nf4_engine() -> Iterator[ChatEngine]:
    """The embedded model in nf4 + double quant through bitsandbytes, plain generate on CPU (make_settings)."""
    torch.manual_seed(0)
    yield ChatEngine.load(make_settings())


@pytest.fixture(scope="session")
def fp32_engine() -> Iterator[ChatEngine]:
    """The embedded model unquantized in float32: exact reference for the equality tests."""
    yield ChatEngine.load(make_settings(QUANTIZATION="none", COMPUTE_DTYPE="float32", DECODE_PATH="plain"))


@pytest.fixture(scope="session")
def artifacts_dir() -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    return ARTIFACTS


# --- helpers for tests that run replies on several threads ------------------------------------------------------


def drain(stream: Iterator[ReplyUpdate]) -> ReplyUpdate:
    """The last update of a streamed reply."""
    return collections.deque(stream, maxlen=1)[0]


def run_threads(targets: list[Callable[[], None]], timeout_s: float = 240.0) -> None:
    """Run each target on its own thread, wait for all (at most timeout_s in total), re-raise the first error."""
    errors: list[BaseException] = []

    def wrap(fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                fn()
            except BaseException as exc:
                errors.append(exc)
        return run

    threads = [threading.Thread(target=wrap(fn), daemon=True) for fn in targets]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + timeout_s
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), f"threads still running after {timeout_s:.0f} s"
    if errors:
        raise errors[0]
