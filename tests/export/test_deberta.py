"""DeBERTa-v2/v3 (export.families.deberta) against transformers, its own ONNX graph, CrossEncoder and a real server.

Two tiny random `DebertaV2ForSequenceClassification` models in DeBERTa-v3's settings (relative
attention with log buckets, shared attention keys, LayerNorm'd position embeddings, no absolute
positions), a reranker (one label) and a classifier (three), with transformers' own DebertaV2Tokenizer
around trained Unigram pieces, saved as CrossEncoder folders and exported once by `python -m export`.
Other DeBERTa-v2 settings (the convolution, unshared keys, one attention term, no buckets, segments,
no relative attention) are compared with transformers' hidden states on right-padded, left-padded
and holed masks.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch
import transformers
from sentence_transformers import CrossEncoder
from transformers.models.deberta_v2 import modeling_deberta_v2

from export.checkpoints.architecture_error import ArchitectureError
from export.checkpoints.checkpoint import CheckpointError, load_checkpoint
from export.families import deberta
from service.core.fidelity import LOGITS_MAX_ABS_DIFF
from service.core.repository import read_model
from service.pipeline.tokenizer import TextTokenizer
from tests.export import tiny_models
from tests.servers import RunningServer, post_json, start_server

SENTENCES = tiny_models.training_sentences()
PAIRS = [(SENTENCES[0], text) for text in [*SENTENCES[1:10], "A long passage, " * 30]]
"""One query, so that the pairs are also a rerank request; the last is truncated."""
SOURCES = {"deberta-reranker": 1, "deberta-classifier": 3}
"""Name -> number of labels."""
LABELS = {0: "negative", 1: "neutral", 2: "positive"}
VARIANTS = {
    "v3": {},
    "v2-conv-unshared": {
        "conv_kernel_size": 3,
        "conv_act": "gelu",
        "share_att_key": False,
        "position_buckets": -1,
        "max_relative_positions": 24,  # longer distances clamp to the last row
        "norm_rel_ebd": "none",
        "type_vocab_size": 2,
    },
    "c2p-only": {"pos_att_type": "c2p", "share_att_key": False, "position_buckets": 8, "max_relative_positions": 40},
    "no-relative": {"relative_attention": False},
}
"""Config overrides of the tiny DeBERTa-v3 (tests.export.tiny_models.hf_config)."""


@dataclass(frozen=True)
class Exported:
    """The repository the sources were exported to, and each source's CrossEncoder folder."""

    repository: Path
    folders: dict[str, Path]


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Exported:
    """The reranker and the classifier as CrossEncoder folders, each exported by the command line (the reranker in
    fp32 and fp16, the classifier in fp32)."""
    root = tmp_path_factory.mktemp("deberta")
    repository, folders, commands = root / "repository", {}, []
    for seed, (name, labels) in enumerate(SOURCES.items()):
        config = {"num_labels": labels} | ({"id2label": LABELS} if labels == 3 else {})
        source = tiny_models.save_model("deberta-v2", root / "hf" / name, task="classify", seed=seed, **config)
        folders[name] = root / "cross-encoder" / name
        CrossEncoder(str(source), device="cpu").save(str(folders[name]))
        command = [sys.executable, "-m", "export", "--source", str(folders[name]), "--repository", str(repository)]
        variants = "fp32,fp16" if name == "deberta-reranker" else "fp32"
        commands.append([*command, "--name", name, "--variants", variants, "--threads", "1"])

    def export(command: list[str]) -> subprocess.CompletedProcess[str]:
        return subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)

    with ThreadPoolExecutor(max_workers=2) as pool:
        for done in pool.map(export, commands):
            assert done.returncode == 0, done.stderr[-3000:]
    return Exported(repository, folders)


def _cross_encoder_logits(folder: Path, pairs: list[tuple[str, str]]) -> np.ndarray:
    """CrossEncoder.predict's raw logits, [pairs, labels]."""
    predicted = CrossEncoder(str(folder), device="cpu").predict(pairs, activation_fn=torch.nn.Identity())
    return np.asarray(predicted, dtype=np.float32).reshape(len(pairs), -1)


def _left_padded(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same rows with their padding moved to the front."""
    moved = {name: tensor.clone() for name, tensor in batch.items()}
    for row in range(batch["input_ids"].shape[0]):
        shift = batch["input_ids"].shape[1] - int(batch["attention_mask"][row].sum())
        for name, tensor in moved.items():
            tensor[row] = torch.roll(batch[name][row], shift)
    return moved


def _holed(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same rows with every third token masked out (the first kept)."""
    mask = batch["attention_mask"].clone()
    mask[:, 2::3] = 0
    return {**batch, "attention_mask": mask}


MASKS = {"right-padded": lambda batch: batch, "left-padded": _left_padded, "holed": _holed}


@pytest.mark.parametrize("variant", VARIANTS)
def test_hidden_states_equal_transformers(tmp_path: Path, variant: str) -> None:
    folder = tiny_models.save_model("deberta-v2", tmp_path / variant, seed=3, **VARIANTS[variant])
    reference = transformers.AutoModel.from_pretrained(str(folder)).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    encoded = tokenizer([SENTENCES[0], *[text for pair in PAIRS[1:6] for text in pair]], padding=True)
    batch = {name: torch.tensor(values) for name, values in encoded.items()}
    checkpoint = load_checkpoint(folder)
    ours = checkpoint.build_model()
    assert checkpoint.model_type == "deberta-v2" and checkpoint.config.uses_segments == (
        "type_vocab_size" in VARIANTS[variant]
    )
    for kind, transform in MASKS.items():
        feed = transform(batch)
        if not checkpoint.config.uses_segments:
            feed = {name: tensor for name, tensor in feed.items() if name != "token_type_ids"}
        with torch.inference_mode():
            expected = reference(**feed).last_hidden_state
            hidden, _ = ours(**feed)
        attended = feed["attention_mask"].bool()
        difference = float((hidden - expected)[attended].abs().max())
        assert difference <= 1e-5, f"{variant}, {kind}: max abs diff {difference:.2e}"


def test_position_rows_equal_transformers_at_deberta_v3_size() -> None:
    """DeBERTa-v3's 256 buckets over 512 positions: the rows every (query, key) reads, as transformers picks them."""
    config = deberta.DebertaConfig(vocab_size=8, d_model=8, num_heads=2, num_layers=1, ffn_dim=8)
    assert (config.position_buckets, config.max_relative_positions, config.max_positions) == (256, 512, 512)
    relative = deberta.DebertaEncoder(config)._relative(torch.zeros(1, 512, dtype=torch.int64))
    span = torch.zeros(1, 512, 1)
    buckets = modeling_deberta_v2.build_relative_position(span, span, bucket_size=256, max_position=512)[0]
    assert torch.equal(relative.c2p_rows, torch.clamp(buckets + 256, 0, 511))
    assert torch.equal(relative.p2c_rows, torch.clamp(-buckets + 256, 0, 511))
    assert int(buckets.max()) == 255 and int(buckets[100, 37]) == 63  # the longest distance; an exact one


@pytest.mark.parametrize("name", SOURCES)
def test_classifier_logits_equal_transformers(exported: Exported, name: str) -> None:
    folder = exported.folders[name]
    reference = transformers.AutoModelForSequenceClassification.from_pretrained(str(folder)).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    batch = tokenizer([a for a, _ in PAIRS], [b for _, b in PAIRS], padding=True, truncation=True, return_tensors="pt")
    checkpoint = load_checkpoint(folder)
    assert checkpoint.task == "classify" and checkpoint.head.style == "deberta"
    with torch.inference_mode():
        expected = reference(**batch).logits
        logits = checkpoint.build_model()(batch["input_ids"], batch["attention_mask"])
    assert logits.shape == (len(PAIRS), SOURCES[name])
    assert float((logits - expected).abs().max()) <= 1e-5


@pytest.mark.parametrize("name", SOURCES)
def test_published_logits_equal_cross_encoder(exported: Exported, name: str) -> None:
    spec = read_model(exported.repository / name)
    assert (
        spec.task == "classify"
        and spec.model_type == "deberta-v2"
        and list(spec.input_names) == ["input_ids", "attention_mask"]
    )
    tokenizer = TextTokenizer(spec.tokenizer_file, spec.max_sequence_length, spec.pad_token_id)
    session = ort.InferenceSession(str(spec.variants["fp32"]), providers=["CPUExecutionProvider"])
    (logits,) = session.run(["logits"], tokenizer.encode_pairs(PAIRS).feed(spec.input_names))
    expected = _cross_encoder_logits(exported.folders[name], PAIRS)
    assert logits.shape == expected.shape == (len(PAIRS), SOURCES[name])
    np.testing.assert_allclose(logits, expected, atol=1e-4)
    assert (np.argsort(logits[:, 0]) == np.argsort(expected[:, 0])).all()


@pytest.mark.parametrize("name", SOURCES)
def test_parity_report_gates_every_form_and_the_cross_encoder(exported: Exported, name: str) -> None:
    report = json.loads((exported.repository / name / "parity.json").read_text())
    assert report["model_type"] == "deberta-v2" and report["encoder"]["position_buckets"] == tiny_models.DEBERTA_BUCKETS
    fp32 = report["variants"]["fp32"]
    assert fp32["passed"] and set(fp32["cases"]) == {"tokens", "sentences", "sentence_masks"}
    assert all(figures["max_abs_diff_logits"] <= 1e-4 for figures in fp32["cases"].values())
    assert all(form["passed"] for form in report["cpu_graph_forms"]["fp32"]["gate"].values())
    library = fp32["reference_library"]
    assert library["class"] == "CrossEncoder" and library["passed"] and library["max_abs_diff"] <= 1e-4
    if name == "deberta-reranker":  # fp16: the fully fused graph, disentangled attention included
        fp16 = report["variants"]["fp16"]
        assert fp16["passed"] and fp16["recipe"]["graph_form"] == "fully_fused"
        assert fp16["reference_library"]["passed"]
        assert fp16["reference_library"]["max_abs_diff"] <= LOGITS_MAX_ABS_DIFF["fp16"]


@pytest.fixture(scope="module")
def server(exported: Exported, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """A real server on the exported repository."""
    with start_server(exported.repository, tmp_path_factory.mktemp("deberta-server") / "server.log") as running:
        yield running


def test_served_rerank_is_the_cross_encoder_order(server: RunningServer, exported: Exported) -> None:
    query, texts = PAIRS[0][0], [text for _, text in PAIRS]
    expected = _cross_encoder_logits(exported.folders["deberta-reranker"], PAIRS)[:, 0]
    body = {"model": "deberta-reranker", "query": query, "texts": texts, "raw_scores": True}
    status, ranked = post_json(server, "/rerank", body)
    assert status == 200
    assert [item["index"] for item in ranked] == list(np.argsort(-expected, kind="stable"))
    assert [item["score"] for item in ranked] == pytest.approx(sorted(expected, reverse=True), abs=1e-4)


def test_unimplemented_settings_are_refused_in_one_line(tmp_path: Path) -> None:
    folder = tiny_models.save_model("deberta-v2", tmp_path / "absolute", position_biased_input=True)
    with pytest.raises(CheckpointError, match="unsupported position_biased_input true"):
        load_checkpoint(folder)
    hf = json.loads((folder / "config.json").read_text()) | {"position_biased_input": False}
    refusals = {
        "pos_att_type": ("p2c|p2p", "unsupported pos_att_type"),
        "norm_rel_ebd": ("batch_norm", "unsupported norm_rel_ebd"),
        "conv_kernel_size": (2, "an odd kernel"),
        "embedding_size": (16, "unsupported embedding_size 16"),
        "hidden_act": ("swish", "unsupported hidden_act 'swish'"),
    }
    for key, (value, message) in refusals.items():
        with pytest.raises(ArchitectureError, match=message):
            deberta.config_from_hf(hf | {key: value}, pooling="mean", normalize=True)


def test_rename_sets_heads_apart_and_drops_the_unread_position_table() -> None:
    tensor = torch.zeros(1)
    weights, heads = deberta.rename_weights(
        {
            "deberta.embeddings.word_embeddings.weight": tensor,
            "deberta.embeddings.position_embeddings.weight": tensor,  # DeBERTa-v3 checkpoints may carry it, unread
            "deberta.encoder.layer.0.attention.self.query_proj.weight": tensor,
            "deberta.encoder.rel_embeddings.weight": tensor,
            "lm_predictions.lm_head.dense.weight": tensor,
            "mask_predictions.classifier.weight": tensor,
            "pooler.dense.weight": tensor,
        }
    )
    assert set(weights) == {"embeddings.token.weight", "layers.0.attention.query.weight", "relative_embeddings.weight"}
    assert set(heads) == {
        "lm_predictions.lm_head.dense.weight",
        "mask_predictions.classifier.weight",
        "pooler.dense.weight",
    }
    with pytest.raises(ArchitectureError, match=r"unexpected weight '[\w.]+attention\.self\.gate\.weight'"):
        deberta.rename_weights({"deberta.encoder.layer.0.attention.self.gate.weight": tensor})
