"""Re-laying the weights end to end after loading (llm_core.memory.compact): every value, view and alias survives
the move, the decode path's tokens do not change, and (GPU, marked) the holes packing leaves are given back."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from llm_core.fast import FastDecodeOptions, FastDecoder
from llm_core.loading import load_model
from llm_core.memory.compact import compact_storages, device_storages
from llm_core.memory.model import model_tensors
from tests.conftest import make_settings

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def prefill_scores(dec: FastDecoder, ids: torch.Tensor) -> torch.Tensor:
    with dec.outside_reply():
        return dec.prefill_scores(ids, penalties=False).clone()


@pytest.mark.parametrize("quantization", ["none", "nf4"])
def test_re_laid_weights_keep_every_value_alias_and_the_scores(quantization: str) -> None:
    """The embedded model with the fast path's packed (fused q/k/v, gate/up) weights: after every storage was freed
    and allocated again (on CPU the system allocator may hand back the same addresses), the modules' weights are
    still views of the packed copies (one set of bytes, not two),
    the tied embedding and lm_head still share theirs, and the prefill's scores are bit-identical."""
    settings = make_settings(QUANTIZATION=quantization, COMPUTE_DTYPE="float32" if quantization == "none" else "auto")
    loaded = load_model(settings.model)
    options = FastDecodeOptions(gemv="bnb") if quantization == "nf4" else None
    dec = FastDecoder(loaded, compile=False, max_cache_len=256, options=options)
    dec.warmup()
    ids = torch.arange(3, 40)
    before = prefill_scores(dec, ids)
    tensors = [*model_tensors(loaded.model), *dec.device_tensors()]
    storages = [s for s in device_storages(tensors, torch.device("cpu")) if s.resizable()]  # not: mapped files
    layer = loaded.model.model.layers[0]
    fused_before = layer.self_attn.k_proj.weight.data_ptr() - layer.self_attn.q_proj.weight.data_ptr()

    result = compact_storages(tensors, "cpu", host_available_bytes=1 << 40)

    assert result.storages == len(storages) > 10 and not result.skipped
    assert result.moved_bytes == sum(s.nbytes() for s in storages)
    # q and k are still rows of one fused tensor, at the same distance apart
    assert layer.self_attn.k_proj.weight.data_ptr() - layer.self_attn.q_proj.weight.data_ptr() == fused_before
    if loaded.model.config.tie_word_embeddings and quantization == "none":
        assert loaded.model.lm_head.weight.data_ptr() == loaded.model.get_input_embeddings().weight.data_ptr()
    assert torch.equal(prefill_scores(dec, ids), before)


def test_compaction_is_skipped_without_host_memory_for_the_copies() -> None:
    t = torch.randn(1000)
    ptr, ref = t.data_ptr(), t.clone()
    result = compact_storages([t], "cpu", host_available_bytes=1 << 20)
    assert result.skipped and "host memory" in result.describe() and result.storages == 0
    assert t.data_ptr() == ptr and torch.equal(t, ref)


def test_borrowed_storages_stay_where_they_are_and_views_follow_their_storage() -> None:
    """A tensor over memory torch did not allocate (frombuffer) cannot be resized: it is left in place. Views of a
    moved storage, listed or not, see the moved bytes."""
    borrowed = torch.frombuffer(bytearray(4096), dtype=torch.uint8)
    owned = torch.randn(64, 64)
    unlisted_view = owned[3:5]
    ref = owned.clone()
    ptr = borrowed.data_ptr()
    result = compact_storages([borrowed, owned], "cpu", host_available_bytes=1 << 40)
    assert result.storages == 1 and borrowed.data_ptr() == ptr
    assert torch.equal(owned, ref) and torch.equal(unlisted_view, ref[3:5])
    owned[3, 0] = 7.0
    assert unlisted_view[0, 0] == 7.0


@pytest.mark.gpu
@needs_cuda
def test_gpu_compaction_gives_back_the_holes_between_kept_tensors() -> None:
    """Tensors kept between freed ones (as packing leaves the o/down weights between the freed q/k/v and gate/up
    parts) hold their segment's free blocks: empty_cache cannot return them. Re-laid, the kept bytes move to fresh
    allocations and the holes go back to the device (within 2 MiB of what the kept tensors need)."""
    dev = torch.device("cuda")
    torch.cuda.empty_cache()
    block = 24 * 2**20
    base = torch.empty(8 * block, dtype=torch.uint8, device=dev)
    del base  # one cached segment the next allocations split
    parts = [torch.full((block,), i, dtype=torch.uint8, device=dev) for i in range(8)]
    kept = parts[::2]
    del parts
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    held_before = torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
    result = compact_storages(kept, dev, host_available_bytes=1 << 40)
    assert result.storages == 4 and result.held_free_before == held_before
    assert held_before >= 2 * block, held_before  # the holes were there, or this test measures nothing
    assert result.held_free_after <= 2 * 2**20, result.held_free_after
    assert [int(t[0]) for t in kept] == [0, 2, 4, 6] and all(bool((t == t[0]).all()) for t in kept)


def test_the_engine_re_lays_the_weights_on_cuda_and_says_what_it_gave_back(monkeypatch: Any) -> None:
    """Start-up compacts the model's tensors on CUDA and notes what came back; on CPU (the system's allocator:
    nothing to give back) it does not run."""
    from types import SimpleNamespace

    from llm_core.engine import startup
    from llm_core.memory.compact import Compaction

    calls: list[list[torch.Tensor]] = []

    def fake(tensors: Any, device: Any, **_: Any) -> Compaction:
        calls.append(list(tensors))
        return Compaction(3, 10 << 20, 300 << 20, 2 << 20, 0.5)

    monkeypatch.setattr("llm_core.memory.compact.compact_storages", fake)
    model = torch.nn.Linear(4, 4)
    builder = object.__new__(startup.PathBuilder)
    builder.backend, builder.fast_scheduler, builder.notes = None, None, []
    builder.loaded = SimpleNamespace(device=torch.device("cpu"), model=model)
    builder.compact_weights()
    assert calls == [] and builder.notes == []
    builder.loaded = SimpleNamespace(device=torch.device("cuda"), model=model)
    builder.compact_weights()
    assert len(calls) == 1 and {t.data_ptr() for t in calls[0]} == {model.weight.data_ptr(), model.bias.data_ptr()}
    assert builder.notes == ["Weights re-laid end to end (0.01 GiB in 3 storages, 0.5 s): reserved-but-free memory "
                             "0.29 -> 0.00 GiB."]
