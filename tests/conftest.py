"""Shared fixtures: tests never see the developer's environment or .env, and load each real model once."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from llm_core.config import SPECS, Settings
from llm_core.engine.chat import ChatEngine

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
