"""GPU: structured output (llguidance's mask) and n choices on the CUDA fast paths, at the engine's level.

The /v1 layer over these (tests/test_openai_features.py, tests/test_openai_native.py) runs on CPU; the GPU machine has
no gradio, uvicorn or openai, so what only CUDA can show is tested here without a server: a random llama with the
byte-level ChatML tokenizer (bench.harness), whose replies are valid JSON by the mask alone.
"""

from __future__ import annotations

import functools
import json
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from llm_core.constraints import OutputSpec, RowControl
from llm_core.engine.chat import ChatEngine
from tests.conftest import drain, make_settings, run_threads

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
jsonschema = pytest.importorskip("jsonschema")

SHAPE = dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=8,
             num_key_value_heads=4, vocab_size=1024, rope_theta=10000.0, rms_norm_eps=1e-5)
# Bounded by enums: random weights never choose to end a free string, so a free-text field could outlast any budget.
COLOR = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                          "shades": {"type": "array", "items": {"enum": ["light", "dark"]},
                                                     "maxItems": 2}},
         "required": ["color", "shades"], "additionalProperties": False}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from bench.harness import make_random_checkpoint

    return make_random_checkpoint(SHAPE, tmp_path_factory.mktemp("constrained") / "ckpt", torch.device("cuda"), 2048,
                                  tokenizer="chatml")


def _engine(checkpoint: Path, batch: str) -> ChatEngine:
    return ChatEngine.load(make_settings(MODEL_ID=str(checkpoint), DEVICE="cuda", DECODE_PATH="fast",
                                         MAX_BATCH_SIZE=batch))


def _constrained(engine: ChatEngine, prompt: str, request_id: str | None = None) -> tuple[Any, RowControl]:
    control = RowControl.for_model(OutputSpec(json=True, json_schema=COLOR, top_logprobs=0), engine.loaded)
    gen = engine.request_options(max_new_tokens=96, do_sample=False, control=control)  # ~50 byte tokens
    return drain(engine.stream_chat(prompt, [], gen=gen, request_id=request_id)), control


@pytest.mark.parametrize("batch", ["1", "8"])
def test_fast_paths_mask_rows_and_keep_unmasked_greedy_rows_as_they_were(checkpoint: Path, batch: str) -> None:
    """On the single-reply fast path (batch 1) and the batched one (8), a schema-constrained reply is valid for the
    schema, the mask ran on its steps, and asking for logprobs does not change a greedy reply's tokens (the host's pick
    from the processed logits = the graph's argmax)."""
    engine = _engine(checkpoint, batch)
    assert engine.backend.name == ("fast" if batch == "1" else "fast-batched")
    final, control = _constrained(engine, "Describe the sky.")
    jsonschema.validate(json.loads(final.text), COLOR)
    assert control.masked_steps > 0 and final.stats.grammar_mask_ms_per_token > 0
    gen = engine.request_options(max_new_tokens=16, do_sample=False)
    plain = drain(engine.stream_chat("Name a fruit.", [], gen=gen))
    logged = RowControl.for_model(OutputSpec(top_logprobs=1), engine.loaded)
    with_logprobs = drain(engine.stream_chat("Name a fruit.", [], gen=engine.request_options(
        max_new_tokens=16, do_sample=False, control=logged)))
    assert with_logprobs.token_ids == plain.token_ids
    assert [e.token_id for e in logged.logprobs] == list(plain.token_ids)


def test_masked_and_unmasked_rows_share_a_batch_and_each_keeps_its_own(checkpoint: Path) -> None:
    """Four constrained rows and two free rows at once on the batched fast path: every constrained reply is valid,
    the free rows equal the same request served alone (a mask is per row, not per batch), and rows did share steps."""
    engine = _engine(checkpoint, "8")
    gen = engine.request_options(max_new_tokens=16, do_sample=False)
    alone = [drain(engine.stream_chat(p, [], gen=gen)) for p in ("Name a fruit.", "Name a tree.")]
    results: dict[str, Any] = {}

    def masked(i: int) -> None:
        results[f"m{i}"] = _constrained(engine, f"Describe sky number {i}.", request_id=f"m{i}")[0]

    def free(i: int, prompt: str) -> None:
        results[f"f{i}"] = drain(engine.stream_chat(prompt, [], gen=gen, request_id=f"f{i}"))

    run_threads([functools.partial(masked, i) for i in range(4)]
                + [functools.partial(free, i, p) for i, p in enumerate(("Name a fruit.", "Name a tree."))])
    for i in range(4):
        jsonschema.validate(json.loads(results[f"m{i}"].text), COLOR)
    for i, reference in enumerate(alone):  # the first tokens: bf16 rows kernels may round a tie unlike a row alone
        assert results[f"f{i}"].token_ids[:8] == reference.token_ids[:8]
    assert max(r.stats.peak_batch_rows or 1 for r in results.values()) >= 2


def test_n_choices_are_rows_of_the_batched_fast_path(checkpoint: Path) -> None:
    """The n choices of one /v1 request (one admission group, seeds seed+i) share decode steps on the batched fast
    path, each with its own seed stream: three different texts, and at least two rows decoded together."""
    engine = _engine(checkpoint, "4")
    assert engine.backend.name == "fast-batched"
    finals: dict[int, Any] = {}
    started = threading.Barrier(3)

    def choice(i: int) -> None:
        started.wait(30)
        gen = engine.request_options(max_new_tokens=24, do_sample=True, temperature=0.9, seed=7 + i)
        finals[i] = drain(engine.stream_chat("Hi there.", [], gen=gen, request_id=f"req/{i}", person="alice",
                                             group="req"))

    run_threads([functools.partial(choice, i) for i in range(3)])
    assert max(f.stats.peak_batch_rows or 1 for f in finals.values()) >= 2
    assert len({f.text for f in finals.values()}) == 3
