"""What a sentence-transformers folder declares: the one chain the exporter implements passes, anything else is refused.

Folders are saved by sentence-transformers itself (tests.export.tiny_models), then one file or field is
changed per case. Each refusal is one line naming the file and what it declares.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import transformers
from sentence_transformers import CrossEncoder, SentenceTransformer
from sentence_transformers.util.misc import import_from_string

from export.checkpoints.checkpoint import CheckpointError, load_checkpoint
from export.checkpoints.sentence_transformers_folder import MODULE_KINDS
from tests.export import tiny_models
from tests.vectors import assert_same_vectors

SENTENCES = tiny_models.training_sentences()[:8]


@pytest.fixture(scope="module")
def saved_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny BERT embedder as SentenceTransformer.save writes it: Transformer, Pooling (mean), Normalize."""
    return tiny_models.save_sentence_transformer("bert", tmp_path_factory.mktemp("saved"))


@pytest.fixture
def folder(tmp_path: Path, saved_folder: Path) -> Path:
    """A private copy of the saved folder that a test may change."""
    return Path(shutil.copytree(saved_folder, tmp_path / "model"))


def _edit(path: Path, change: Callable[[object], object]) -> None:
    path.write_text(json.dumps(change(json.loads(path.read_text()))))


def _set(**fields: object) -> Callable[[dict], dict]:
    return lambda content: content | fields


def test_every_accepted_module_type_is_what_sentence_transformers_resolves_it_to(saved_folder: Path) -> None:
    for name, kind in MODULE_KINDS.items():
        assert import_from_string(name).__name__ == kind, name
    written = [module["type"] for module in tiny_models.read_json(saved_folder / "modules.json")]
    assert [MODULE_KINDS[name] for name in written] == ["Transformer", "Pooling", "Normalize"]


def test_a_dense_module_with_an_activation_not_implemented_is_refused_naming_it(tmp_path: Path) -> None:
    """sentence-transformers' Dense is read (export.heads.dense: the identity activation only), its tanh is not."""
    source = tiny_models.save_sentence_transformer("bert", tmp_path, dense_width=16)
    with pytest.raises(CheckpointError) as refusal:
        load_checkpoint(source)
    message = str(refusal.value)
    assert message.startswith(f"{source / '2_Dense' / 'config.json'}: Dense activation_function")
    assert "'torch.nn.modules.activation.Tanh' is not supported" in message
    assert "\n" not in message


REFUSED_FIELDS = {
    # case: (file, change, what the one-line refusal says after the file's path)
    "sparse model_type": (
        "config_sentence_transformers.json",
        _set(model_type="SparseEncoder"),
        "model_type 'SparseEncoder' is not supported with modules.json's modules: a SparseEncoder is exported only"
        " as an MLMTransformer then SpladePooling",
    ),
    "cross encoder model_type on an embedder": (
        "config_sentence_transformers.json",
        _set(model_type="CrossEncoder"),
        "model_type 'CrossEncoder', but config.json's architectures make it an embedder",
    ),
    "truncate_dim": (
        "config_sentence_transformers.json",
        _set(truncate_dim=16),
        "truncate_dim 16 is not supported",
    ),
    "unknown model field": (
        "config_sentence_transformers.json",
        _set(max_active_dims=8),
        "field 'max_active_dims' is not implemented here",
    ),
    "do_lower_case": (
        "sentence_bert_config.json",
        _set(do_lower_case=True),
        "do_lower_case true (lower-casing outside the tokenizer) is not supported",
    ),
    "fill-mask task": (
        "sentence_bert_config.json",
        _set(transformer_task="fill-mask"),
        "transformer_task 'fill-mask' is not supported for an embedder (only 'feature-extraction')",
    ),
    "another output": (
        "sentence_bert_config.json",
        _set(modality_config={"text": {"method": "forward", "method_output_name": "pooler_output"}}),
        "modality_config {'text': {'method': 'forward', 'method_output_name': 'pooler_output'}} is not supported",
    ),
    "processing arguments": (
        "sentence_bert_config.json",
        _set(processing_kwargs={"text": {"max_length": 16}}),
        "processing_kwargs {'text': {'max_length': 16}} changes how the model is loaded or called",
    ),
    "model arguments": (
        "sentence_bert_config.json",
        _set(model_args={"torch_dtype": "float16"}),
        "model_args {'torch_dtype': 'float16'} changes how the model is loaded or called",
    ),
    "query expansion": (
        "sentence_bert_config.json",
        _set(query_length=32),
        "query_length 32 (a multi-vector setting) is not supported",
    ),
    "unknown transformer field": (
        "sentence_bert_config.json",
        _set(strip_accents=True),
        "field 'strip_accents' is not implemented here",
    ),
    "pooling width": (
        "1_Pooling/config.json",
        _set(embedding_dimension=64),
        "embedding dimension 64 is not the model's hidden size 32",
    ),
    "weighted mean pooling": (
        "1_Pooling/config.json",
        _set(pooling_mode="weightedmean"),
        "exactly one of mean, cls, max, lasttoken pooling is supported, got weightedmean",
    ),
    "two pooling modes": (
        "1_Pooling/config.json",
        _set(pooling_mode=["mean", "max"]),
        "exactly one of mean, cls, max, lasttoken pooling is supported, got mean, max",
    ),
    "prompt left out": (
        "1_Pooling/config.json",
        _set(include_prompt=False),
        "pooling that leaves out the prompt (include_prompt false) is not supported",
    ),
    "unknown pooling field": (
        "1_Pooling/config.json",
        _set(pooling_output_scale=2.0),
        "Pooling field 'pooling_output_scale' is not implemented here",
    ),
    "normalize elsewhere": (
        "2_Normalize/config.json",
        _set(module_output_name="token_embeddings"),
        "Normalize field 'module_output_name' = 'token_embeddings' is not implemented here",
    ),
    "normalize before pooling": (
        "modules.json",
        lambda modules: [modules[0], modules[2], modules[1]],
        "modules Transformer -> Normalize -> Pooling: an embedder must have exactly one Pooling after the"
        " Transformer, then only Dense modules, and Normalize only as the last module",
    ),
    "no pooling": (
        "modules.json",
        lambda modules: [modules[0], modules[2]],
        "modules Transformer -> Normalize: an embedder must have exactly one Pooling",
    ),
    "transformer in a subfolder": (
        "modules.json",
        lambda modules: [modules[0] | {"path": "0_Transformer"}, *modules[1:]],
        "the Transformer module is at path '0_Transformer', not the folder root",
    ),
    "a module of another package": (
        "modules.json",
        lambda modules: [*modules[:2], {"idx": 2, "name": "2", "path": "2_Scale", "type": "my_package.Scale"}],
        "module type not implemented here: 'my_package.Scale' at path '2_Scale'",
    ),
    "a pooling module outside the folder": (
        "modules.json",
        lambda modules: [modules[0], modules[1] | {"path": "../elsewhere"}, modules[2]],
        "module path '../elsewhere' is outside",
    ),
}


@pytest.mark.parametrize("case", REFUSED_FIELDS)
def test_each_declaration_not_implemented_is_refused_in_one_line_naming_its_file(folder: Path, case: str) -> None:
    file, change, message = REFUSED_FIELDS[case]
    _edit(folder / file, change)
    with pytest.raises(CheckpointError) as refusal:
        load_checkpoint(folder)
    assert str(refusal.value).startswith(f"{folder / file}: "), str(refusal.value)
    assert message in str(refusal.value) and "\n" not in str(refusal.value)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"position_embedding_type": "relative_key"}, "unsupported position_embedding_type 'relative_key'"),
        ({"is_decoder": True}, "unsupported is_decoder true (causal attention)"),
    ],
)
def test_config_fields_that_change_attention_are_refused(folder: Path, change: dict, message: str) -> None:
    _edit(folder / "config.json", _set(**change))
    with pytest.raises(CheckpointError) as refusal:
        load_checkpoint(folder)
    assert str(refusal.value).startswith(f"{folder}: ") and message in str(refusal.value)


def test_pooling_is_read_from_the_path_modules_json_gives(folder: Path) -> None:
    """A Pooling folder of another name (CLS here) is the one read: sentence-transformers agrees on the vectors."""
    (folder / "1_Pooling").rename(folder / "pooling_here")
    _edit(folder / "pooling_here" / "config.json", _set(pooling_mode="cls"))
    _edit(folder / "modules.json", lambda modules: [modules[0], modules[1] | {"path": "pooling_here"}, modules[2]])
    checkpoint = load_checkpoint(folder)
    assert (checkpoint.config.pooling, checkpoint.config.normalize) == ("cls", True)
    expected = SentenceTransformer(str(folder), device="cpu").encode(SENTENCES, convert_to_numpy=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    batch = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    with torch.inference_mode():
        _, embedding = checkpoint.build_model()(**batch)
    assert_same_vectors(embedding.numpy(), expected, min_cosine=0.9999)


def test_without_normalize_the_embedding_is_not_normalised(folder: Path) -> None:
    _edit(folder / "modules.json", lambda modules: modules[:2])
    assert load_checkpoint(folder).config.normalize is False


def _cross_encoder(tmp_path: Path) -> Path:
    source = tiny_models.save_model("bert", tmp_path / "source", task="classify", num_labels=1)
    CrossEncoder(str(source), device="cpu").save(str(tmp_path / "saved"))
    return tmp_path / "saved"


@pytest.mark.parametrize(
    ("file", "change", "message"),
    [
        (
            "config_sentence_transformers.json",
            _set(prompts={"query": "query: "}, default_prompt_name="query"),
            "default_prompt_name 'query' on a CrossEncoder is not supported",
        ),
        (
            "modules.json",
            lambda modules: [*modules, {"path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}],
            "Pooling after a sequence-classification Transformer (config.json's architectures) is not implemented",
        ),
        (
            "sentence_bert_config.json",
            _set(transformer_task="feature-extraction"),
            "transformer_task 'feature-extraction' is not supported for a reranker or classifier",
        ),
        (
            "config_sentence_transformers.json",
            _set(model_type="SentenceTransformer"),
            "model_type 'SentenceTransformer', but config.json's architectures make it a reranker or classifier",
        ),
    ],
)
def test_a_cross_encoder_folder_declaring_more_than_its_classifier_is_refused(
    tmp_path: Path, file: str, change: Callable[[object], object], message: str
) -> None:
    folder = _cross_encoder(tmp_path)
    load_checkpoint(folder)  # as saved: accepted
    _edit(folder / file, change)
    with pytest.raises(CheckpointError) as refusal:
        load_checkpoint(folder)
    assert str(refusal.value).startswith(f"{folder / file}: ") and message in str(refusal.value)
