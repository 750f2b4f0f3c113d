"""bge-m3: one XLM-RoBERTa model, three outputs from one forward pass, equal to FlagEmbedding's BGEM3FlagModel.

One tiny random bge-m3 folder is exported once for every test (tests.multivector_models); the
published graph is then read as the server reads it and held to FlagEmbedding on the same folder.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch

from export.checkpoints.checkpoint import CheckpointError, load_checkpoint
from export.gate.references.bge_m3 import bge_m3_flag_model
from export.heads.bge_m3 import COLBERT_HEAD_FILE, SPARSE_HEAD_FILE
from service.core.fidelity import FidelityReference, compare, cosines
from service.core.repository import TOKEN_VECTORS, TOKEN_WEIGHTS, ModelSpec, read_model
from service.core.text_rules import MultiVectorSpec
from service.pipeline.tokenizer import TextTokenizer
from tests.multivector_models import BGE_M3_TEXTS, BGE_M3_WIDTH, ExportedBgeM3


def test_the_folder_is_published_as_an_embedder_with_token_vectors_and_weights(bge_m3: ExportedBgeM3) -> None:
    spec = read_model(bge_m3.published)
    assert (spec.task, spec.output_names) == ("embed", ("last_hidden_state", "embedding", TOKEN_VECTORS, TOKEN_WEIGHTS))
    assert spec.multivector == MultiVectorSpec(score="mean", skip_first_token=True)
    assert (spec.hidden_size, spec.multivector_width, spec.pooling, spec.normalize) == (32, BGE_M3_WIDTH, "cls", True)
    assert spec.output_shape(TOKEN_VECTORS, 3, 17) == (3, 17, BGE_M3_WIDTH)
    assert spec.output_shape(TOKEN_WEIGHTS, 3, 17) == (3, 17, 1)
    outputs = {output.name: list(output.dims) for output in spec.config.output}
    assert outputs[TOKEN_VECTORS] == [-1, BGE_M3_WIDTH] and outputs[TOKEN_WEIGHTS] == [-1, 1]
    assert set(spec.variants) == {"fp32"} and spec.preferred_variants == {"cpu": "fp32", "cuda": "fp32"}
    assert any("bge-m3: published in fp32 only" in message for message in bge_m3.warnings)
    assert set(spec.embedding_ranges) == {32}  # the dense output's calibration still runs


def test_parity_json_holds_every_output_to_the_model_and_to_flag_embedding(bge_m3: ExportedBgeM3) -> None:
    report = json.loads((bge_m3.published / "parity.json").read_text())
    assert report["head"]["style"] == "bge-m3" and report["head"]["colbert_width"] == BGE_M3_WIDTH
    assert report["head"]["unused_token_ids"] == [0, 1, 2, 3]  # <s>, <pad>, </s>, <unk>
    fp32 = report["variants"]["fp32"]
    for kind, figures in fp32["cases"].items():
        assert figures[TOKEN_VECTORS]["max_abs_diff"] <= 1e-4 and figures[TOKEN_VECTORS]["min_cosine"] >= 0.9999, kind
        assert figures[TOKEN_WEIGHTS]["max_abs_diff"] <= 1e-4, kind
    flag = fp32["flag_embedding"]
    assert flag["class"] == "BGEM3FlagModel" and flag["passed"] and flag["rows"] > 80
    assert flag["dense"]["min_cosine"] >= 0.9999 and flag["dense"]["max_abs_diff"] <= 1e-4
    # An id on one side only counts at its weight against 0: a weight at relu's edge may be 0 on one side.
    assert flag["lexical_weights"]["max_abs_diff"] <= 1e-4 and "ids_on_one_side_only" in flag["lexical_weights"]
    assert flag["colbert_vecs"]["max_abs_diff"] <= 1e-4 and flag["colbert_vecs"]["count_mismatches"] == []
    assert flag["colbert_score"]["max_abs_diff"] <= 1e-4
    library = fp32["reference_library"]  # sentence-transformers, on the dense output
    assert library["class"] == "SentenceTransformer" and library["passed"] and library["min_cosine"] >= 0.9999


def _served(spec: ModelSpec, session: ort.InferenceSession, feed: dict[str, np.ndarray]) -> list[tuple]:
    """Each row as the server reads it: embedding, each id's largest weight, the vectors the multivector rule keeps."""
    embedding, vectors, weights = session.run(["embedding", TOKEN_VECTORS, TOKEN_WEIGHTS], feed)
    weights = weights[..., 0]
    rows = []
    for row, mask in enumerate(feed["attention_mask"]):
        positions = np.nonzero(mask)[0][1 if spec.multivector.skip_first_token else 0 :]
        terms: dict[int, float] = {}
        for token, weight in zip(feed["input_ids"][row][mask == 1], weights[row][mask == 1], strict=True):
            if weight > 0:
                terms[int(token)] = max(terms.get(int(token), 0.0), float(weight))
        rows.append((embedding[row], terms, vectors[row, positions]))
    return rows


def test_the_published_graph_equals_flag_embedding(bge_m3: ExportedBgeM3) -> None:
    spec = read_model(bge_m3.published)
    session = ort.InferenceSession(str(spec.variants["fp32"]), providers=["CPUExecutionProvider"])
    tokenizer = TextTokenizer(spec.tokenizer_file, spec.max_sequence_length, spec.pad_token_id)
    alone = [
        row for text in BGE_M3_TEXTS for row in _served(spec, session, tokenizer.encode([text]).feed(spec.input_names))
    ]
    batched = _served(spec, session, tokenizer.encode(BGE_M3_TEXTS).feed(spec.input_names))
    flag_model = bge_m3_flag_model()(str(bge_m3.source), use_fp16=False, devices="cpu", colbert_dim=BGE_M3_WIDTH)
    expected = flag_model.encode(
        BGE_M3_TEXTS,
        max_length=spec.max_sequence_length,
        return_dense=True,
        return_sparse=True,
        return_colbert_vecs=True,
    )
    for served in (alone, batched):
        dense = np.stack([row[0] for row in served])
        assert cosines(dense, expected["dense_vecs"]).min() >= 0.9999
        assert np.abs(dense - expected["dense_vecs"]).max() <= 1e-4
        for (_, terms, vectors), lexical, colbert in zip(
            served, expected["lexical_weights"], expected["colbert_vecs"], strict=True
        ):
            theirs = {int(token): float(weight) for token, weight in lexical.items()}
            # Each id's weight on both sides, a missing id at 0: an id kept on one side only (a weight at relu's
            # edge, e.g. 2e-7 here and 0 there) must weigh nearly nothing, and every other id is on both sides.
            assert theirs and all(abs(terms.get(i, 0.0) - theirs.get(i, 0.0)) <= 1e-4 for i in set(terms) | set(theirs))
            assert vectors.shape == colbert.shape and np.abs(vectors - colbert).max(initial=0.0) <= 1e-4
        for query, passage in ((0, 1), (2, 3), (10, 11), (11, 0)):  # "ok" and the truncated text among them
            ours = float((served[query][2] @ served[passage][2].T).max(axis=1).mean())
            theirs = float(flag_model.colbert_score(expected["colbert_vecs"][query], expected["colbert_vecs"][passage]))
            assert abs(ours - theirs) <= 1e-4
    assert sum(len(row[1]) for row in batched) > 20  # the sparse head weighs terms, not nothing


def test_the_special_tokens_and_padding_weigh_nothing(bge_m3: ExportedBgeM3) -> None:
    """The sparse head's raw weight at <s> is often positive: the graph leaves it out, as FlagEmbedding does."""
    spec = read_model(bge_m3.published)
    session = ort.InferenceSession(str(spec.variants["fp32"]), providers=["CPUExecutionProvider"])
    tokenizer = TextTokenizer(spec.tokenizer_file, spec.max_sequence_length, spec.pad_token_id)
    feed = tokenizer.encode(BGE_M3_TEXTS).feed(spec.input_names)
    hidden, vectors, weights = session.run(["last_hidden_state", TOKEN_VECTORS, TOKEN_WEIGHTS], feed)
    weights = weights[..., 0]
    head = torch.load(bge_m3.source / SPARSE_HEAD_FILE, weights_only=True)
    raw = np.maximum(hidden @ head["weight"].numpy().T + head["bias"].numpy(), 0.0)[..., 0]
    special = np.isin(feed["input_ids"], [0, 1, 2, 3]) | (feed["attention_mask"] == 0)
    assert (raw[special] > 0).any() and (weights[special] == 0).all()
    assert np.abs(weights - raw)[~special].max() <= 1e-5 and (weights[~special] > 0).mean() > 0.2
    norms = np.linalg.norm(vectors, axis=2)
    assert (
        np.allclose(norms[feed["attention_mask"] == 1], 1.0, atol=1e-5)
        and (norms[feed["attention_mask"] == 0] == 0).all()
    )


def test_the_server_check_at_load_passes_on_the_dense_output(bge_m3: ExportedBgeM3) -> None:
    spec = read_model(bge_m3.published)
    fidelity = FidelityReference.load(spec.fidelity_file)
    assert fidelity.output == "embedding"
    session = ort.InferenceSession(str(spec.variants["fp32"]), providers=["CPUExecutionProvider"])
    (answer,) = session.run([fidelity.output], fidelity.feed)
    assert compare(fidelity, answer, "fp32", "CPUExecutionProvider", 0.99999).passed


@pytest.fixture
def folder(tmp_path: Path, bge_m3: ExportedBgeM3) -> Path:
    """A private copy of the bge-m3 source folder that a test may change."""
    return Path(shutil.copytree(bge_m3.source, tmp_path / "model"))


@pytest.mark.parametrize(
    ("missing", "kept"), [(SPARSE_HEAD_FILE, COLBERT_HEAD_FILE), (COLBERT_HEAD_FILE, SPARSE_HEAD_FILE)]
)
def test_one_head_file_without_the_other_is_refused(folder: Path, missing: str, kept: str) -> None:
    (folder / missing).unlink()
    with pytest.raises(CheckpointError) as refusal:
        load_checkpoint(folder)
    assert str(refusal.value) == (
        f"{folder}: {kept} without {missing}: a bge-m3 folder has both of FlagEmbedding's heads"
    )


@pytest.mark.parametrize(
    ("name", "head", "message"),
    [
        (
            COLBERT_HEAD_FILE,
            {"weight": torch.zeros(BGE_M3_WIDTH, 16), "bias": torch.zeros(BGE_M3_WIDTH)},
            "weight (24, 16) and bias (24,), the model needs weight [width, 32] and bias [width]",
        ),
        (
            SPARSE_HEAD_FILE,
            {"weight": torch.zeros(2, 32), "bias": torch.zeros(2)},
            "weight (2, 32) and bias (2,), the model needs weight [1, 32] and bias [1]",
        ),
        (SPARSE_HEAD_FILE, {"weight": torch.zeros(1, 32)}, "not a Linear layer's weight and bias (holds ['weight'])"),
    ],
)
def test_a_head_of_the_wrong_shape_is_refused_naming_it(folder: Path, name: str, head: dict, message: str) -> None:
    torch.save(head, folder / name)
    with pytest.raises(CheckpointError) as refusal:
        load_checkpoint(folder)
    assert str(refusal.value) == f"{folder / name}: {message}"


def test_pooling_other_than_flag_embedding_s_is_refused(folder: Path) -> None:
    pooling_file = folder / "1_Pooling" / "config.json"
    settings = json.loads(pooling_file.read_text())
    settings |= {"pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True, "pooling_mode": "mean"}
    pooling_file.write_text(json.dumps(settings))
    with pytest.raises(CheckpointError) as refusal:
        load_checkpoint(folder)
    assert str(refusal.value) == (
        f"{pooling_file}: declares mean pooling, but FlagEmbedding's BGEM3FlagModel makes bge-m3's dense embedding"
        " from the first position, normalised"
    )


def test_a_folder_without_sentence_transformers_files_is_read_as_flag_embedding_reads_it(folder: Path) -> None:
    """FlagEmbedding pools the first position and normalises whatever the folder says; so does the exporter."""
    for name in ("modules.json", "config_sentence_transformers.json", "sentence_bert_config.json"):
        (folder / name).unlink()
    for name in ("1_Pooling", "2_Normalize"):
        shutil.rmtree(folder / name)
    checkpoint = load_checkpoint(folder)
    assert (checkpoint.task, checkpoint.config.pooling, checkpoint.config.normalize) == ("embed", "cls", True)
    assert checkpoint.head.colbert_width == BGE_M3_WIDTH
    tokenizer = TextTokenizer(folder / "tokenizer.json", checkpoint.max_seq_length, checkpoint.config.pad_token_id)
    check = checkpoint.head_declaration.library_check(checkpoint, tokenizer, [], [])
    figures, failures = check("fp32", None)
    assert "FlagEmbedding is its reference" in figures["reason"] and not failures


def test_the_heads_on_another_architecture_are_refused(folder: Path) -> None:
    config_file = folder / "config.json"
    config_file.write_text(json.dumps(json.loads(config_file.read_text()) | {"model_type": "bert"}))
    with pytest.raises(CheckpointError) as refusal:
        load_checkpoint(folder)
    assert str(refusal.value) == (
        f"{folder}: bge-m3's heads (colbert_linear.pt, sparse_linear.pt) are implemented on an XLM-RoBERTa"
        " embedder only, this folder's task is embed and its model_type 'bert'"
    )
