"""The public API: every name llm_core exports resolves, importing the package loads no model (not even torch),
and the one sampler that the fast and batched loops share behaves as transformers' processors do."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import llm_core
from llm_core.config import GenerationSettings
from llm_core.sampling import logits_processors, next_token

REPO = Path(__file__).resolve().parent.parent


def test_every_exported_name_resolves() -> None:
    assert sorted(llm_core.__all__) == sorted(llm_core._EXPORTS)
    for name in llm_core.__all__:
        assert getattr(llm_core, name) is not None
    with pytest.raises(AttributeError):
        llm_core.NoSuchThing  # noqa: B018


def test_importing_the_package_loads_neither_torch_nor_a_model() -> None:
    code = "import sys, llm_core, llm_core.config; print('torch' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_greedy_picks_the_argmax_after_the_repetition_penalty() -> None:
    scores = torch.tensor([[2.0, 1.9, -1.0, 0.5]])
    gen = GenerationSettings(do_sample=False, repetition_penalty=2.0)
    seen = torch.tensor([[0]])  # token 0 was generated: 2.0 / 2 = 1.0 < 1.9
    assert int(next_token(scores, False, logits_processors(gen), seen)) == 1
    assert int(next_token(scores, False, logits_processors(gen, penalty=False), seen)) == 0


def test_sampling_keeps_only_what_top_k_and_top_p_allow() -> None:
    scores = torch.tensor([[5.0, 4.0, 0.0, -1.0]])
    generator = torch.Generator().manual_seed(0)
    top1 = GenerationSettings(do_sample=True, top_k=1, top_p=1.0, temperature=1.0)
    assert {int(next_token(scores, True, logits_processors(top1), None, generator)) for _ in range(50)} == {0}
    # top_p 0.9: softmax of (5, 4, 0, -1) puts 0.727 on token 0 and 0.268 on token 1; tokens 2 and 3 are cut
    nucleus = GenerationSettings(do_sample=True, top_k=0, top_p=0.9, temperature=1.0)
    seen = {int(next_token(scores, True, logits_processors(nucleus), None, generator)) for _ in range(200)}
    assert seen == {0, 1}
