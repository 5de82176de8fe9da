"""bench.harness: random-weight checkpoints are whole or not there."""

from __future__ import annotations

from pathlib import Path

import torch

from bench.harness import checkpoint_ready, make_random_checkpoint


def test_a_half_written_checkpoint_is_not_trusted_and_is_rebuilt(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "config.json").write_text("{}")  # what a full disk left: a config and no weights
    assert not checkpoint_ready(folder)
    make_random_checkpoint("tiny", folder, torch.device("cpu"), 256, tokenizer="chatml")
    assert checkpoint_ready(folder)
    assert list(folder.glob("*.safetensors")) and (folder / "tokenizer.json").is_file()
    assert not folder.with_name("ckpt.partial").exists()


def test_a_random_chatml_reply_tokenizes_back_to_its_own_ids(tmp_path: Path) -> None:
    """A random model's reply (any ids past the byte alphabet) decoded to text, as the page keeps it in the history,
    encodes back to the same ids, as a real model's reply mostly does: the next turn's prompt holds it at its length
    and the prefix cache can reuse it."""
    from transformers import AutoTokenizer

    folder = make_random_checkpoint("tiny", tmp_path / "ckpt", torch.device("cpu"), 256, tokenizer="chatml")
    tok = AutoTokenizer.from_pretrained(folder)
    first_extra = tok.convert_tokens_to_ids("<extra_0>")
    ids = [first_extra + (37 * i) % (len(tok) - first_extra) for i in range(64)]
    text = tok.decode(ids, skip_special_tokens=True)
    assert tok(text, add_special_tokens=False)["input_ids"] == ids
    assert tok("hello", add_special_tokens=False)["input_ids"] == [tok.convert_tokens_to_ids(c) for c in "hello"]
