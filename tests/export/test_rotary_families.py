"""GTE and NomicBERT (export.families.rotary_bert) against transformers, sentence-transformers, the exporter's output.

Three tiny random models, each with a real tokenizer of its family, wrapped as sentence-transformers
saves them (transformers writes the original checkpoints' weight names, as the hub folders hold):
- GTE in gte-base-en-v1.5's form: WordPiece, no segment embeddings, linear rotary scaling (the
  native form of its NTK scaling), CLS pooling without normalisation;
- GTE in gte-multilingual-base's form: XLM-R's Unigram, one segment row, padding id 1;
- NomicBERT in nomic-embed-text-v1.5's form: WordPiece, two segments, SwiGLU without biases,
  mean pooling, its task prompts and Matryoshka widths.
GTE (en) and NomicBERT are exported once each by `python -m export --source` (the multilingual GTE
differs from the English one only in its reading, checked without an export); the published fp32
graph is run as the server feeds it, and served by a real server, and compared with
`SentenceTransformer.encode` on the source folder.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch
import transformers
from sentence_transformers import SentenceTransformer
from sentence_transformers.sentence_transformer import modules as st_models

from export.checkpoints.checkpoint import CheckpointError, load_checkpoint
from export.families import rotary_bert
from export.families.rotary_bert_encoder import RotaryBertConfig
from service.core.repository import read_model
from service.pipeline.tokenizer import TextTokenizer
from tests.export import tiny_models
from tests.servers import post_json, start_server
from tests.vectors import assert_same_vectors

ROOT = Path(__file__).resolve().parents[2]
SENTENCES = [
    "Hi.",
    *tiny_models.training_sentences()[:7],
    "A much longer sentence that goes on and on, " * 5,
]
NOMIC_PROMPTS = {
    "search_query": "search_query: ",
    "search_document": "search_document: ",
    "classification": "classification: ",
    "clustering": "clustering: ",
}
MATRYOSHKA_DIMENSIONS = (16, 8)


@dataclass(frozen=True)
class Family:
    """One tiny source: its tokenizer's kind, its transformers config and what its sentence-transformers folder says."""

    tokenizer: str
    """tests.export.tiny_models' tokenizer family: bert (WordPiece) or xlm-roberta (Unigram)."""
    config: type[transformers.PretrainedConfig]
    settings: dict[str, object]
    pooling: str
    normalize: bool
    prompts: dict[str, str] | None = None
    default_prompt_name: str | None = None


FAMILIES = {
    "gte-en": Family(
        "bert",
        transformers.GteConfig,
        {"type_vocab_size": 0, "rope_parameters": {"rope_type": "linear", "rope_theta": 1e6, "factor": 1.25}},
        pooling="cls",
        normalize=False,
    ),
    "gte-multilingual": Family("xlm-roberta", transformers.GteConfig, {"type_vocab_size": 1}, "cls", normalize=True),
    "nomic": Family(
        "bert",
        transformers.NomicBertConfig,
        {},
        pooling="mean",
        normalize=True,
        prompts=NOMIC_PROMPTS,
        default_prompt_name="search_document",
    ),
}
EXPORTED = ("gte-en", "nomic")


def save_source(name: str, folder: Path, seed: int) -> Path:
    """A sentence-transformers folder around a tiny random model of the family; returns it."""
    family = FAMILIES[name]
    base = folder / "base"
    base.mkdir(parents=True)
    tokenizer = tiny_models.save_tokenizer(family.tokenizer, base)
    config = family.config(
        vocab_size=len(tokenizer),
        hidden_size=tiny_models.HIDDEN,
        num_hidden_layers=tiny_models.LAYERS,
        num_attention_heads=tiny_models.HEADS,
        intermediate_size=2 * tiny_models.HIDDEN,
        max_position_embeddings=tiny_models.MAX_POSITIONS,
        pad_token_id=tokenizer.pad_token_id,
        **family.settings,
    )
    torch.manual_seed(seed)
    model = transformers.AutoModel.from_config(config, attn_implementation="eager").eval()
    tiny_models._randomise(model, seed)
    model.save_pretrained(str(base))
    transformer = st_models.Transformer(str(base), max_seq_length=tiny_models.MAX_POSITIONS - 2)
    modules = [transformer, st_models.Pooling(transformer.get_embedding_dimension(), pooling_mode=family.pooling)]
    modules += [st_models.Normalize()] if family.normalize else []
    target = folder / "model"
    SentenceTransformer(modules=modules, prompts=family.prompts, default_prompt_name=family.default_prompt_name).save(
        str(target)
    )
    return target


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each family's sentence-transformers folder."""
    root = tmp_path_factory.mktemp("rotary-sources")
    return {name: save_source(name, root / name, seed) for seed, name in enumerate(FAMILIES)}


@pytest.fixture(scope="module")
def repository(sources: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """GTE (en) and NomicBERT exported by the command line, fp32, the two at once."""
    repository = tmp_path_factory.mktemp("rotary-repository")
    runs = []
    for name in EXPORTED:
        command = [sys.executable, "-m", "export", "--source", str(sources[name]), "--repository", str(repository)]
        command += ["--name", name, "--variants", "fp32", "--threads", "1"]
        if name == "nomic":
            command += ["--matryoshka-dimensions", ",".join(map(str, MATRYOSHKA_DIMENSIONS))]
        runs.append(subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for run in runs:
        _, stderr = run.communicate(timeout=600)
        assert run.returncode == 0, stderr[-3000:]
    return repository


def _loaded_transformers(folder: Path) -> transformers.PreTrainedModel:
    return transformers.AutoModel.from_pretrained(str(folder), attn_implementation="eager").eval()


def _masks(batch: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """The batch right-padded (as tokenised), left-padded (each row rolled), and holed (every third token masked)."""
    left = {name: tensor.clone() for name, tensor in batch.items()}
    for row, length in enumerate(batch["attention_mask"].sum(dim=1).tolist()):
        for tensor in left.values():
            tensor[row] = torch.roll(tensor[row], tensor.shape[1] - length)
    holed = dict(batch, attention_mask=batch["attention_mask"].clone())
    holed["attention_mask"][:, 2::3] = 0
    return {"right-padded": batch, "left-padded": left, "holed": holed}


@pytest.mark.parametrize("name", FAMILIES)
def test_hidden_states_equal_transformers(sources: dict[str, Path], name: str) -> None:
    """Sentence pairs (segment ids 0 and 1 where the model has segments), under every mask shape."""
    folder = sources[name]
    checkpoint = load_checkpoint(folder)
    assert isinstance(checkpoint.config, RotaryBertConfig)
    assert checkpoint.config.uses_segments == (name == "nomic")
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    encoded = tokenizer(SENTENCES[:-1], SENTENCES[1:], padding=True, truncation=True, return_tensors="pt")
    names = ["input_ids", "attention_mask"] + (["token_type_ids"] if checkpoint.config.uses_segments else [])
    batch = {key: encoded[key] for key in names}
    assert "token_type_ids" not in batch or bool(batch["token_type_ids"].any())
    reference, ours = _loaded_transformers(folder), checkpoint.build_model()
    for kind, feed in _masks(batch).items():
        with torch.inference_mode():
            expected = reference(**feed).last_hidden_state
            hidden, _ = ours(**feed)
        difference = float((hidden - expected)[feed["attention_mask"].bool()].abs().max())
        assert difference <= 1e-5, f"{kind}: max abs diff {difference:.2e}"


@pytest.mark.parametrize("name", FAMILIES)
def test_embeddings_equal_sentence_transformers(sources: dict[str, Path], name: str) -> None:
    folder, family = sources[name], FAMILIES[name]
    checkpoint = load_checkpoint(folder)
    assert (checkpoint.config.pooling, checkpoint.config.normalize) == (family.pooling, family.normalize)
    expected = SentenceTransformer(str(folder), device="cpu").encode(SENTENCES, convert_to_numpy=True)
    prefix = (family.prompts or {}).get(family.default_prompt_name or "", "")
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    batch = tokenizer(
        [prefix + s for s in SENTENCES],
        padding=True,
        truncation=True,
        max_length=checkpoint.max_seq_length,
        return_tensors="pt",
    )
    segments = batch.get("token_type_ids") if checkpoint.config.uses_segments else None
    with torch.inference_mode():
        _, embedding = checkpoint.build_model()(batch["input_ids"], batch["attention_mask"], segments)
    assert_same_vectors(embedding.numpy(), expected, min_cosine=0.9999)


@pytest.mark.parametrize("name", EXPORTED)
def test_published_embeddings_equal_sentence_transformers(
    sources: dict[str, Path], repository: Path, name: str
) -> None:
    spec = read_model(repository / name)
    assert spec.model_type == ("nomic_bert" if name == "nomic" else "gte")
    assert spec.uses_segments == (name == "nomic")
    tokenizer = TextTokenizer(spec.tokenizer_file, spec.max_sequence_length, spec.pad_token_id)
    session = ort.InferenceSession(str(spec.variants["fp32"]), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == list(spec.input_names)
    prefix = spec.prompts.get(spec.default_prompt_name, "")
    (embedding,) = session.run(["embedding"], tokenizer.encode([prefix + s for s in SENTENCES]).feed(spec.input_names))
    expected = SentenceTransformer(str(sources[name]), device="cpu").encode(SENTENCES, convert_to_numpy=True)
    assert_same_vectors(embedding, expected, min_cosine=0.9999)
    parity = json.loads((repository / name / "parity.json").read_text())
    assert parity["encoder"]["rope_theta"] == (1e6 if name == "gte-en" else 1000.0)


def test_nomic_prompts_and_matryoshka_widths_are_published(sources: dict[str, Path], repository: Path) -> None:
    spec = read_model(repository / "nomic")
    declared = tiny_models.read_json(sources["nomic"] / "config_sentence_transformers.json")["prompts"]
    assert spec.prompts == declared and NOMIC_PROMPTS.items() <= declared.items()
    assert spec.default_prompt_name == "search_document"
    assert tuple(spec.matryoshka_dimensions) == MATRYOSHKA_DIMENSIONS


def test_served_embeddings_equal_sentence_transformers(
    sources: dict[str, Path], repository: Path, tmp_path: Path
) -> None:
    """Through a real server's OpenAI route: GTE as it is, NomicBERT with a named prompt and a Matryoshka width."""
    texts = SENTENCES[:4]
    gte = SentenceTransformer(str(sources["gte-en"]), device="cpu")
    nomic = SentenceTransformer(str(sources["nomic"]), device="cpu")
    shortened = nomic.encode(texts, prompt_name="search_query", truncate_dim=MATRYOSHKA_DIMENSIONS[-1])
    cases = [
        ({"model": "gte-en", "input": texts}, gte.encode(texts)),
        ({"model": "nomic", "input": texts}, nomic.encode(texts)),  # the default prompt, search_document
        (
            {"model": "nomic", "input": texts, "prompt_name": "search_query", "dimensions": MATRYOSHKA_DIMENSIONS[-1]},
            shortened / np.linalg.norm(shortened, axis=1, keepdims=True),  # the server normalises a shortened vector
        ),
    ]
    with start_server(repository, tmp_path / "server.log") as server:
        for body, expected in cases:
            status, answer = post_json(server, "/v1/embeddings", body)
            assert status == 200, answer
            served = np.array([item["embedding"] for item in answer["data"]], dtype=np.float32)
            assert_same_vectors(served, expected, min_cosine=0.9999)


NOMIC_EMBED_TEXT_V1_5 = {
    "model_type": "nomic_bert",
    "activation_function": "swiglu",
    "causal": False,
    "layer_norm_epsilon": 1e-12,
    "max_trained_positions": 2048,
    "mlp_fc1_bias": False,
    "mlp_fc2_bias": False,
    "n_embd": 768,
    "n_head": 12,
    "n_inner": 3072,
    "n_layer": 12,
    "n_positions": 8192,
    "pad_vocab_size_multiple": 64,
    "parallel_block": False,
    "prenorm": False,
    "qkv_proj_bias": False,
    "rotary_emb_base": 1000,
    "rotary_emb_fraction": 1.0,
    "rotary_emb_interleaved": False,
    "rotary_emb_scale_base": None,
    "rotary_scaling_factor": None,
    "scale_attn_by_inverse_layer_idx": False,
    "scale_attn_weights": True,
    "type_vocab_size": 2,
    "vocab_size": 30528,
}
"""nomic-embed-text-v1.5's config.json (its remote-code form; keys that do not change the model left out)."""


def test_nomic_embed_text_config_reads_as_transformers_reads_it() -> None:
    config = rotary_bert.nomic_bert_config(NOMIC_EMBED_TEXT_V1_5, pooling="mean", normalize=True)
    reference = transformers.NomicBertConfig(**NOMIC_EMBED_TEXT_V1_5)
    assert (config.d_model, config.num_heads, config.num_layers, config.ffn_dim, config.head_dim) == (
        reference.hidden_size,
        reference.num_attention_heads,
        reference.num_hidden_layers,
        reference.intermediate_size,
        reference.head_dim,
    )
    assert (config.rope_theta, config.rope_linear_factor) == (reference.rope_parameters["rope_theta"], 1.0)
    assert (config.activation, config.type_vocab_size, config.vocab_size) == ("silu", 2, 30528)
    assert not (config.attention_bias or config.up_gate_bias or config.down_bias)
    assert config.max_sequence_positions == 8192  # n_positions: the sentence-transformers folder's max_seq_length


@pytest.mark.parametrize("name", FAMILIES)
def test_transformers_module_names_load_the_same_weights(sources: dict[str, Path], name: str) -> None:
    """A state dict under transformers' module names (q_proj, gate_proj...) gives what the saved folder's names give."""
    checkpoint = load_checkpoint(sources[name])
    rename = rotary_bert.rename_nomic_bert_weights if name == "nomic" else rotary_bert.rename_gte_weights
    native = _loaded_transformers(sources[name]).state_dict()
    assert any(".self_attn.q_proj." in key for key in native)
    weights, heads = rename(native)
    assert heads == {} and weights.keys() == checkpoint.state_dict.keys()
    assert all(torch.equal(weights[key], checkpoint.state_dict[key]) for key in weights)


def _with_config(source: Path, folder: Path, **changes: object) -> Path:
    """A copy of a source folder with config.json changed."""
    shutil.copytree(source, folder)
    config = json.loads((source / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))
    return folder


@pytest.mark.parametrize(
    ("name", "changes", "message"),
    [
        ("gte-en", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "unsupported rope_type 'dynamic'"),
        ("gte-en", {"model_type": "new"}, "unsupported architecture 'new': GTE's remote-code form"),
        ("nomic", {"rotary_emb_interleaved": True}, "unsupported rotary_emb_interleaved true (only false)"),
        ("nomic", {"rotary_scaling_factor": 2.0}, "unsupported rotary_scaling_factor 2.0 (only null)"),
        ("nomic", {"n_embd": 48}, "n_embd 48 disagrees with hidden_size 32, which transformers reads"),
    ],
)
def test_what_is_not_implemented_is_refused_by_name(
    sources: dict[str, Path], tmp_path: Path, name: str, changes: dict[str, object], message: str
) -> None:
    folder = _with_config(sources[name], tmp_path / "changed", **changes)
    with pytest.raises(CheckpointError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_checkpoint(folder)
