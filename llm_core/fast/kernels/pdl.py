"""Programmatic dependent launch (PDL, CUDA sm_90+): the next kernel of the decode step is launched while the one
before it is still finishing, and waits on the device (`griddepcontrol.wait`) only where it reads what that one
wrote. The gap between two dependent kernels (about ten of them a layer in a decode step, inside one CUDA graph)
then overlaps the previous kernel's tail instead of following it (H100: 1.04-1.05x one chat's decode speed;
docs/fast_decode.md).

How it is used (FastDecodeOptions.launch_overlap, setting LAUNCH_OVERLAP):
- our Triton kernels take a `PDL` constexpr: with it they call `gdc_wait()` before their first load of anything an
  earlier kernel writes (and before any store), and `gdc_launch_dependents()` once their main loop has read all its
  inputs; they are launched with Triton's `launch_pdl`;
- inductor's own kernels of the compiled step get the same two calls (its `triton.enable_pdl` option);
- kernels launched without the attribute (cuBLAS, torch's own) serialize as before, so mixing is safe: a PDL kernel
  always waits before touching data, and no kernel finishes before its wait returned, so the order is transitive.

The wait is a no-op where the kernel was launched without the attribute; the instructions need sm_90.
"""

from __future__ import annotations

from typing import Any

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None
    tl = None


def triton_has_gdc() -> bool:
    """Whether this Triton exposes grid dependency control (Triton >= 3.4)."""
    if triton is None:
        return False
    try:
        from triton.language.extra import cuda
    except ImportError:  # pragma: no cover - depends on the install
        return False
    return hasattr(cuda, "gdc_wait") and hasattr(cuda, "gdc_launch_dependents")


def inductor_has_pdl() -> bool:
    """Whether this PyTorch's inductor can emit PDL code for its own kernels (config triton.enable_pdl)."""
    try:
        import torch._inductor.config as inductor_config
    except ImportError:  # pragma: no cover - depends on the install
        return False
    return hasattr(inductor_config.triton, "enable_pdl")


def pdl_support(device: torch.device) -> tuple[bool, str]:
    """(usable, why not): PDL needs CUDA sm_90+, a Triton with grid dependency control, and a driver that launches
    and captures such kernels (probed: a tiny kernel launched with the attribute, eagerly and in a CUDA graph)."""
    if device.type != "cuda":
        return False, "PDL is a CUDA feature"
    if not triton_has_gdc():
        return False, "this Triton has no grid dependency control (gdc_wait)"
    major, _ = torch.cuda.get_device_capability(device)
    if major < 9:
        return False, f"PDL needs sm_90 or newer (this GPU is sm_{major}x)"
    return _probe(device)


def _probe(device: torch.device) -> tuple[bool, str]:
    """Launch _probe_kernel (read, wait, add one) twice eagerly and twice inside a captured CUDA graph, then replay
    the graph: the counter must read 4. An old driver refuses the launch attribute or its capture: say so."""
    try:
        with torch.cuda.device(device):
            counter = torch.zeros(1, dtype=torch.int32, device=device)
            for _ in range(2):
                _probe_kernel[(1,)](counter, **pdl_meta(True))
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(2):
                    _probe_kernel[(1,)](counter, **pdl_meta(True))
            graph.replay()
            torch.cuda.synchronize(device)
            got = int(counter.item())
    except Exception as exc:  # noqa: BLE001 - any failure means: launch one kernel after the other
        return False, f"a programmatic dependent launch failed here ({type(exc).__name__}: {str(exc)[:120]})"
    if got != 4:
        return False, f"a programmatic dependent launch gave a wrong count here ({got}, not 4)"
    return True, ""


def pdl_meta(pdl: bool, early: bool = False) -> dict[str, Any]:
    """A kernel's launch keywords for a programmatic dependent launch: its PDL constexpr and Triton's launch_pdl,
    and with `early` its EARLY constexpr (the weight prefetch before the wait: prefetch_weight_rows); nothing
    otherwise, so the interpreter and an older Triton never see them. Raises where early comes without pdl."""
    if early and not pdl:
        raise ValueError("early prefetch only pays before a PDL wait: pass pdl=True with early=True")
    return {"PDL": True, "launch_pdl": True, **({"EARLY": True} if early else {})} if pdl else {}


def compile_options(pdl: bool) -> dict[str, Any]:
    """inductor options for the compiled decode functions: PDL code in its kernels where it can emit it."""
    return {"triton.enable_pdl": True} if pdl and inductor_has_pdl() else {}


if triton is not None and triton_has_gdc():
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    @triton.jit
    def wait_for_inputs(PDL: tl.constexpr):
        """griddepcontrol.wait where PDL is on: the kernels before this one have finished and their writes are
        visible. Call before the first load of an activation and before any store."""
        if PDL:
            gdc_wait()

    @triton.jit
    def release_dependents(PDL: tl.constexpr):
        """griddepcontrol.launch_dependents where PDL is on: the next kernel may start launching (it waits for
        this one's completion itself). Call once every input has been read."""
        if PDL:
            gdc_launch_dependents()

    @triton.jit
    def _probe_kernel(counter_ptr, PDL: tl.constexpr):
        """pdl_support's probe: counter += 1, waiting for the kernel before as every PDL kernel does."""
        wait_for_inputs(PDL)
        value = tl.load(counter_ptr)
        release_dependents(PDL)
        tl.store(counter_ptr, value + 1)

elif triton is None:  # no Triton: no kernel calls these
    wait_for_inputs = release_dependents = None

else:  # a Triton without gdc: the constexpr is never True there (pdl_support says no)

    @triton.jit
    def wait_for_inputs(PDL: tl.constexpr):
        pass

    @triton.jit
    def release_dependents(PDL: tl.constexpr):
        pass

if triton is not None:

    @triton.jit
    def prefetch_weight_rows(w_ptr, rows, rmask, KW, first_word, WORDS: tl.constexpr):
        """EARLY: prefetch.global.L2 of WORDS int32 words of each of `rows` (KW words a row) from first_word, one per
        128-byte line, clamped to the row. Weights are never written during a step, so a PDL kernel may issue this
        before its wait."""
        LINES: tl.constexpr = (WORDS + 31) // 32
        cols = tl.minimum(first_word + tl.arange(0, LINES) * 32, KW - 1)
        ptrs = w_ptr + tl.where(rmask, rows, 0)[:, None] * KW + cols[None, :]
        tl.inline_asm_elementwise("prefetch.global.L2 [$1];\nmov.b32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                                  is_pure=False, pack=1)

else:  # no Triton: no kernel calls it
    prefetch_weight_rows = None
