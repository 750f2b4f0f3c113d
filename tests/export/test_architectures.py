"""Every supported architecture and task: our encoder against transformers and sentence-transformers, same weights.

The models are tiny and random (tests.export.tiny_models), with real tokenizers of their family;
what is compared is the computation, so a mistaken weight mapping, position rule or head shows.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch
import transformers
from sentence_transformers import CrossEncoder, SentenceTransformer

from export.checkpoints.checkpoint import CheckpointError, load_checkpoint
from service.core.repository import read_model
from service.pipeline.tokenizer import TextTokenizer
from tests.conftest import ExportedTasks
from tests.export import tiny_models
from tests.vectors import assert_same_vectors

SENTENCES = [
    *tiny_models.training_sentences()[:9],
    "A much longer sentence that goes on and on, " * 6,
]
PAIRS = [(SENTENCES[0], text) for text in SENTENCES[1:]]
EXPORTED = {name: source for name, source in tiny_models.TASK_SOURCES.items() if source.task == "embed"}
"""The shared task repository's embedders (tests/conftest.py exported_tasks): every architecture and pooling mode."""


def _feed(batch: dict, uses_segments: bool) -> dict[str, torch.Tensor]:
    names = ["input_ids", "attention_mask"] + (["token_type_ids"] if uses_segments else [])
    return {name: batch[name] for name in names}


@pytest.mark.parametrize("family", tiny_models.FAMILIES)
def test_encoder_equals_transformers(tmp_path: Path, family: str) -> None:
    folder = tiny_models.save_model(family, tmp_path / family)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    batch = tokenizer(SENTENCES, padding=True, truncation=True, return_tensors="pt")
    reference = transformers.AutoModel.from_pretrained(str(folder), attn_implementation="eager").eval()
    checkpoint = load_checkpoint(folder)
    assert checkpoint.model_type == family and checkpoint.task == "embed"
    with torch.inference_mode():
        expected = reference(**batch).last_hidden_state
        hidden, _ = checkpoint.build_model()(**_feed(batch, checkpoint.config.uses_segments))
    attended = batch["attention_mask"].bool()
    assert float((hidden - expected)[attended].abs().max()) <= 1e-5


@pytest.mark.parametrize(
    ("family", "pooling", "normalize"),
    [
        ("roberta", "mean", True),
        ("xlm-roberta", "cls", True),
        ("mpnet", "max", False),
        ("distilbert", "lasttoken", True),
        ("modernbert", "mean", True),
        ("deberta-v2", "mean", True),
    ],
)
def test_embeddings_equal_sentence_transformers(tmp_path: Path, family: str, pooling: str, normalize: bool) -> None:
    folder = tiny_models.save_sentence_transformer(family, tmp_path, pooling=pooling, normalize=normalize)
    expected = SentenceTransformer(str(folder), device="cpu").encode(SENTENCES, convert_to_numpy=True)
    checkpoint = load_checkpoint(folder)
    assert (checkpoint.config.pooling, checkpoint.config.normalize) == (pooling, normalize)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    batch = tokenizer(
        SENTENCES, padding=True, truncation=True, max_length=checkpoint.max_seq_length, return_tensors="pt"
    )
    with torch.inference_mode():
        _, embedding = checkpoint.build_model()(**_feed(batch, checkpoint.config.uses_segments))
    assert_same_vectors(embedding.numpy(), expected, min_cosine=0.9999)  # values too: max pooling is not normalised


def test_prompts_and_matryoshka_widths_are_read(tmp_path: Path) -> None:
    prompts = {"query": "query: ", "passage": "passage: "}
    folder = tiny_models.save_sentence_transformer(
        "xlm-roberta", tmp_path, prompts=prompts, default_prompt_name="query"
    )
    checkpoint = load_checkpoint(folder, matryoshka_dimensions=(16, 8, 16))
    assert checkpoint.serving.prompts["query"] == "query: " and checkpoint.serving.prompts["passage"] == "passage: "
    assert checkpoint.serving.default_prompt_name == "query"
    assert checkpoint.serving.similarity_fn_name == "cosine"
    assert checkpoint.serving.matryoshka_dimensions == (16, 8)
    with pytest.raises(CheckpointError, match=r"Matryoshka dimensions must be within 1\.\.32"):
        load_checkpoint(folder, matryoshka_dimensions=(64,))


def test_pooling_we_do_not_have_is_refused_in_one_line(tmp_path: Path) -> None:
    folder = tiny_models.save_sentence_transformer("bert", tmp_path)
    config = folder / "1_Pooling" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "pooling_mode": "weightedmean"}))
    with pytest.raises(CheckpointError, match="exactly one of mean, cls, max, lasttoken pooling is supported"):
        load_checkpoint(folder)


@pytest.mark.parametrize(
    ("family", "labels"),
    [("bert", 1), ("roberta", 1), ("xlm-roberta", 3), ("distilbert", 2), ("mpnet", 1), ("modernbert", 1)],
)
def test_classifier_logits_equal_transformers_and_cross_encoder(tmp_path: Path, family: str, labels: int) -> None:
    id2label = {i: f"class-{i}" for i in range(labels)}
    extra = {"classifier_pooling": "mean"} if family == "modernbert" else {}
    folder = tiny_models.save_model(
        family, tmp_path / family, task="classify", num_labels=labels, id2label=id2label, **extra
    )
    checkpoint = load_checkpoint(folder)
    assert checkpoint.task == "classify" and checkpoint.head.labels == tuple(id2label.values())
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    firsts, seconds = zip(*PAIRS, strict=True)
    batch = tokenizer(list(firsts), list(seconds), padding=True, truncation=True, return_tensors="pt")
    reference = transformers.AutoModelForSequenceClassification.from_pretrained(str(folder)).eval()
    with torch.inference_mode():
        expected = reference(**batch).logits
        logits = checkpoint.build_model()(**_feed(batch, checkpoint.config.uses_segments))
    assert float((logits - expected).abs().max()) <= 1e-5
    predicted = CrossEncoder(str(folder), device="cpu").predict(PAIRS, activation_fn=torch.nn.Identity())
    np.testing.assert_allclose(logits.numpy().reshape(predicted.shape), predicted, atol=1e-4)


def test_unsupported_architecture_names_the_supported_ones(tmp_path: Path) -> None:
    folder = tiny_models.save_model("bert", tmp_path / "model")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "t5"}))
    with pytest.raises(CheckpointError, match=r"unsupported architecture 't5' \(supported: bert, roberta"):
        load_checkpoint(folder)


@pytest.mark.parametrize("name", EXPORTED)
def test_published_embeddings_equal_sentence_transformers(exported_tasks: ExportedTasks, name: str) -> None:
    repository, sources = exported_tasks.repository, exported_tasks.sources
    spec = read_model(repository / name)
    tokenizer = TextTokenizer(spec.tokenizer_file, spec.max_sequence_length, spec.pad_token_id)
    session = ort.InferenceSession(str(spec.variants["fp32"]), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == list(spec.input_names)
    # The server puts the default prompt before each text, as SentenceTransformer.encode does.
    prefix = spec.prompts.get(spec.default_prompt_name, "")
    (embedding,) = session.run(["embedding"], tokenizer.encode([prefix + s for s in SENTENCES]).feed(spec.input_names))
    expected = SentenceTransformer(str(sources[name]), device="cpu").encode(SENTENCES, convert_to_numpy=True)
    # fp32 ONNX against fp32 PyTorch: the direction and the values (distilbert-embed's are not normalised).
    assert_same_vectors(embedding, expected, min_cosine=0.9999)


@pytest.mark.parametrize("name", EXPORTED)
def test_config_declares_what_the_source_declares(exported_tasks: ExportedTasks, name: str) -> None:
    repository, sources = exported_tasks.repository, exported_tasks.sources
    source = EXPORTED[name]
    family, pooling, normalize, prompts = source.family, source.pooling, source.normalize, source.prompts
    declared_prompts = tiny_models.read_json(sources[name] / "config_sentence_transformers.json")["prompts"]
    assert all(declared_prompts[key] == text for key, text in (prompts or {}).items())
    spec = read_model(repository / name)
    parameters = {key: value.string_value for key, value in spec.config.parameters.items()}
    assert spec.task == "embed" and spec.model_type == parameters["model_type"] == family
    assert parameters["pooling"] == pooling and parameters["normalize"] == str(normalize).lower()
    assert spec.uses_segments == (family == "bert")
    assert [(o.name, list(o.dims)) for o in spec.config.output] == [
        ("last_hidden_state", [-1, tiny_models.HIDDEN]),
        ("embedding", [tiny_models.HIDDEN]),
    ]
    assert json.loads(parameters.get("prompts", "{}")) == spec.prompts == declared_prompts
    assert parameters.get("default_prompt_name", "") == (source.default_prompt_name or "")
    assert parameters["similarity_fn_name"] == "cosine"
    assert json.loads(parameters.get("matryoshka_dimensions", "[]")) == list(source.matryoshka_dimensions)
