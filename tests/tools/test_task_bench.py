"""The reranker-beside-embedder bench's own parts: its reranker and its texts are what it says."""

from __future__ import annotations

from pathlib import Path

from export.checkpoints.checkpoint import load_checkpoint
from service.pipeline.tokenizer import TextTokenizer
from tools import task_bench


def test_reranker_has_the_default_model_shape_and_one_label(tmp_path: Path) -> None:
    checkpoint = load_checkpoint(task_bench.reranker_folder(tmp_path / "reranker"), task_bench.RERANKER)
    assert checkpoint.task == "classify" and checkpoint.head.num_labels == 1
    assert (checkpoint.config.d_model, checkpoint.config.num_layers) == (384, 6)
    assert checkpoint.tokenizer_files  # it takes text, as the served reranker must


def test_texts_are_as_long_as_asked(default_folder: Path) -> None:
    tokenizer = TextTokenizer(default_folder / "tokenizer.json", 256, 0)
    for tokens in (16, 128):
        length = len(tokenizer.encode_rows([task_bench.text_of(tokenizer, tokens, offset=3)]).input_ids)
        assert tokens - 2 <= length < tokens
