"""What torch.compile needs of the functions both decode paths compile (CUDA fast path and CPU path)."""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any


def own_code(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    """fn with a code object of its own. Dynamo keeps compiled graphs on the code object, and these graphs run with
    their guards dropped: two decoders compiling the same function would otherwise share (and run) each other's
    graphs, whatever their model's shapes."""
    code = fn.__code__.replace(co_name=name)
    return types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)
