"""Make the Triton interpreter's bf16 arithmetic match the GPU's, for the CPU tests of Triton kernels.

Triton's interpreter (3.9) holds bf16 as raw uint16: its `tl.dot` multiplies those raw bits as integers, and its
fp32 -> bf16 cast truncates where the GPU rounds to nearest even, and an integer -> bf16 cast keeps the integer's
value as the result's bits. `exact_bf16(monkeypatch)` patches these, for one
test: dot operands in bf16 are widened to fp32 (exact), the cast rounds as torch does (nearest even)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch


def _bf16_bits_to_f32(a: np.ndarray) -> np.ndarray:
    return (a.astype(np.uint32) << 16).view(np.float32)


def _f32_to_bf16_bits(a: np.ndarray) -> np.ndarray:
    t = torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32)).to(torch.bfloat16)
    return t.view(torch.int16).numpy().view(np.uint16)


def exact_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    import triton.language as tl
    from triton.runtime import interpreter as ti

    builder = ti.InterpreterBuilder
    cast, dot = builder.cast_impl, builder.create_dot

    def cast_impl(self: Any, src: Any, dst_type: Any) -> Any:
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return ti.TensorHandle(_f32_to_bf16_bits(src.data), dst_type.scalar)
        if src.dtype.scalar.is_int() and dst_type.scalar == tl.bfloat16:  # the interpreter keeps the integer as bits
            return ti.TensorHandle(_f32_to_bf16_bits(src.data.astype(np.float32)), dst_type.scalar)
        return cast(self, src, dst_type)

    def create_dot(self: Any, a: Any, b: Any, d: Any, input_precision: Any, max_num_imprecise_acc: Any) -> Any:
        if a.dtype.scalar == tl.bfloat16 and b.dtype.scalar == tl.bfloat16:
            out = np.matmul(_bf16_bits_to_f32(a.data), _bf16_bits_to_f32(b.data), dtype=np.float32) + d.data
            return ti.TensorHandle(out.astype(d.data.dtype), d.dtype.scalar)
        return dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    monkeypatch.setattr(builder, "cast_impl", cast_impl)
    monkeypatch.setattr(builder, "create_fp_trunc", cast_impl)
    monkeypatch.setattr(builder, "create_dot", create_dot)


def run_interpreted_tests(test_file: str) -> subprocess.CompletedProcess[str]:
    """The tests of `test_file` whose names contain "interpreted", in a child pytest with TRITON_INTERPRET=1 (read
    when Triton is imported, so the suite's own process cannot switch it on)."""
    repo = Path(__file__).resolve().parent.parent
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(repo), os.environ.get("PYTHONPATH", "")) if p)}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-k", "interpreted",
                           str(Path(test_file))], cwd=repo, env=env, capture_output=True, text=True, timeout=600)


def check_interpreted_tests(test_file: str, triton_module: Any) -> None:
    """The body of each test file's "the interpreter tests pass in their own process": skips without Triton or inside
    the child itself, else runs run_interpreted_tests and asserts that they ran (none skipped) and passed."""
    if triton_module is None:
        pytest.skip("Triton is not installed")
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("already the interpreter's process")
    run = run_interpreted_tests(test_file)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "skipped" not in run.stdout.splitlines()[-1], run.stdout[-500:]
