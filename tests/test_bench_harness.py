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
