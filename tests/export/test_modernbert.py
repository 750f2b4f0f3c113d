"""ModernBERT (export.families.modernbert) against transformers, sentence-transformers and its own ONNX graph.

One tiny random ModernBERT (hidden 64, 3 layers: global, local, local; a local window of 8
tokens) with a byte-level BPE tokenizer in ModernBERT's form, wrapped as a sentence-transformers
model (Transformer + mean Pooling + Normalize). Sentences run shorter and longer than the window,
so the sliding-window mask and both rotary bases are exercised; masks are right-padded,
left-padded and holed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch
import transformers
from sentence_transformers import SentenceTransformer
from sentence_transformers.sentence_transformer import modules as st_models

from export.checkpoints.architecture_error import ArchitectureError
from export.families import modernbert
from export.graph.onnx_export import export_onnx
from tests.export import tiny_models

HIDDEN = 64
WINDOW = 8
SENTENCES = [
    "Hi.",
    *tiny_models.training_sentences()[:6],
    "A much longer sentence that goes on and on, well past the local attention window, " * 2,
]
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A sentence-transformers folder around a tiny random ModernBERT (eager attention)."""
    folder = tmp_path_factory.mktemp("modernbert")
    base = folder / "base"
    base.mkdir()
    tokenizer = tiny_models.save_tokenizer("modernbert", base)
    config = tiny_models.hf_config(
        "modernbert", tokenizer, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, local_attention=WINDOW
    )
    torch.manual_seed(18)
    model = transformers.AutoModel.from_config(config, attn_implementation="eager").eval()
    tiny_models._randomise(model, seed=18)
    model.save_pretrained(str(base))
    transformer = st_models.Transformer(str(base), max_seq_length=tiny_models.MAX_POSITIONS - 2)
    pooling = st_models.Pooling(transformer.get_embedding_dimension(), pooling_mode="mean")
    SentenceTransformer(modules=[transformer, pooling, st_models.Normalize()]).save(str(folder / "model"))
    return folder


@pytest.fixture(scope="module")
def reference(source: Path) -> transformers.ModernBertModel:
    """transformers' own ModernBERT on the saved weights."""
    return transformers.AutoModel.from_pretrained(str(source / "base"), attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def ours(source: Path) -> modernbert.ModernBertEncoder:
    """Our encoder, configured and loaded from the same folder."""
    hf_config = json.loads((source / "base" / "config.json").read_text())
    config = modernbert.config_from_hf(hf_config, pooling="mean", normalize=True)
    state = transformers.AutoModel.from_pretrained(str(source / "base")).state_dict()
    weights, heads = modernbert.rename_weights({f"model.{name}": tensor for name, tensor in state.items()})
    assert heads == {}
    model = modernbert.ModernBertEncoder(config).eval()
    model.load_state_dict(weights, strict=True)
    return model


@pytest.fixture(scope="module")
def batch(source: Path) -> dict[str, torch.Tensor]:
    """The sentences tokenised and right-padded (some shorter, some longer than the window)."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(source / "base"))
    encoded = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    lengths = encoded["attention_mask"].sum(dim=1)
    assert int(lengths.min()) < WINDOW < 3 * WINDOW < int(lengths.max())
    return {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]}


def _left_padded(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same rows with their padding moved to the front."""
    ids, mask = batch["input_ids"].clone(), batch["attention_mask"].clone()
    for row in range(ids.shape[0]):
        length = int(mask[row].sum())
        ids[row] = torch.roll(ids[row], ids.shape[1] - length)
        mask[row] = torch.roll(mask[row], ids.shape[1] - length)
    return {"input_ids": ids, "attention_mask": mask}


def _holed(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same rows with every third token masked out (the first kept)."""
    mask = batch["attention_mask"].clone()
    mask[:, 2::3] = 0
    return {"input_ids": batch["input_ids"], "attention_mask": mask}


MASKS = {"right-padded": lambda b: b, "left-padded": _left_padded, "holed": _holed}


@pytest.mark.parametrize("kind", list(MASKS))
def test_hidden_states_equal_transformers(
    reference: transformers.ModernBertModel,
    ours: modernbert.ModernBertEncoder,
    batch: dict[str, torch.Tensor],
    kind: str,
) -> None:
    feed = MASKS[kind](batch)
    attended = feed["attention_mask"].bool()
    for length in (WINDOW // 2, WINDOW + 3, feed["input_ids"].shape[1]):  # shorter and longer than the window
        part = {name: tensor[:, :length] for name, tensor in feed.items()}
        rows = part["attention_mask"].sum(dim=1) > 0
        part = {name: tensor[rows] for name, tensor in part.items()}
        with torch.inference_mode():
            expected = reference(**part).last_hidden_state
            hidden, _ = ours(**part)
        difference = (hidden - expected)[attended[rows, :length]].abs().max()
        assert float(difference) <= 1e-5, f"{kind}, {length} tokens: max abs diff {float(difference):.2e}"


def test_local_layers_see_only_the_window(ours: modernbert.ModernBertEncoder, batch: dict[str, torch.Tensor]) -> None:
    """A change beyond the window of a local-only model leaves a token's state alone; a global one does not."""
    config = ours.config
    local_only = modernbert.ModernBertEncoder(
        modernbert.ModernBertConfig(**{**config.to_dict(), "global_layers": (False,) * config.num_layers})
    ).eval()
    local_only.load_state_dict(ours.state_dict())
    ids, mask = batch["input_ids"][-1:], batch["attention_mask"][-1:]
    changed = ids.clone()
    changed[0, 1 + config.num_layers * WINDOW // 2 + 1] = ids[0, 1] + 1  # out of reach of position 1 after 3 layers
    with torch.inference_mode():
        before, after = local_only(ids, mask)[0], local_only(changed, mask)[0]
        assert torch.equal(before[0, 1], after[0, 1])
        assert not torch.equal(ours(ids, mask)[0][0, 1], ours(changed, mask)[0][0, 1])


def test_embeddings_equal_sentence_transformers(source: Path, ours: modernbert.ModernBertEncoder) -> None:
    expected = SentenceTransformer(str(source / "model"), device="cpu").encode(SENTENCES, convert_to_numpy=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(source / "model"))
    encoded = tokenizer(SENTENCES, padding=True, truncation=True, return_tensors="pt")
    with torch.inference_mode():
        _, embedding = ours(encoded["input_ids"], encoded["attention_mask"])
    ours_vectors = embedding.numpy()
    cosine = np.sum(ours_vectors * expected, axis=1) / (
        np.linalg.norm(ours_vectors, axis=1) * np.linalg.norm(expected, axis=1)
    )
    assert float(cosine.min()) >= 0.9999


def test_onnx_equals_module(tmp_path: Path, ours: modernbert.ModernBertEncoder, batch: dict[str, torch.Tensor]) -> None:
    path = tmp_path / "modernbert.onnx"
    export_onnx(ours, path)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == ["input_ids", "attention_mask"]
    for kind, transform in MASKS.items():
        feed = transform(batch)
        for length in (3, WINDOW + 5, feed["input_ids"].shape[1]):
            part = {name: tensor[:, :length] for name, tensor in feed.items()}
            hidden, embedding = session.run(None, {name: tensor.numpy() for name, tensor in part.items()})
            with torch.inference_mode():
                expected_hidden, expected_embedding = ours(**part)
            attended = part["attention_mask"].bool().numpy()
            difference = np.abs(hidden - expected_hidden.numpy())[attended].max()
            assert difference <= 1e-4, f"{kind}, {length} tokens: max abs diff {difference:.2e}"
            assert np.abs(embedding - expected_embedding.numpy()).max() <= 1e-4


def test_config_from_hf_reads_layer_kinds_and_rotary_bases() -> None:
    hf = {
        "vocab_size": 100,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_hidden_layers": 7,
        "intermediate_size": 96,
        "global_attn_every_n_layers": 3,
        "global_rope_theta": 160000.0,
        "local_rope_theta": 10000.0,
        "local_attention": 128,
        "hidden_activation": "gelu",
        "norm_eps": 1e-5,
    }
    config = modernbert.config_from_hf(hf, pooling="cls", normalize=False)
    assert config.global_layers == (True, False, False, True, False, False, True)
    assert (config.global_rope_theta, config.local_rope_theta) == (160000.0, 10000.0)
    assert config.uses_segments is False and config.head_dim == 16 and config.to_dict()["pooling"] == "cls"
    with pytest.raises(ArchitectureError, match="hidden_activation"):
        modernbert.config_from_hf({**hf, "hidden_activation": "relu6"}, pooling="mean", normalize=True)
    with pytest.raises(ArchitectureError, match="even head width"):
        modernbert.config_from_hf({**hf, "num_attention_heads": 3}, pooling="mean", normalize=True)


def test_rename_weights_sets_task_heads_apart() -> None:
    tensor = torch.zeros(1)
    weights, heads = modernbert.rename_weights(
        {
            "model.embeddings.tok_embeddings.weight": tensor,
            "model.layers.0.attn.Wqkv.weight": tensor,
            "model.final_norm.weight": tensor,
            "head.dense.weight": tensor,
            "classifier.weight": tensor,
        }
    )
    assert set(weights) == {"embeddings.tok_embeddings.weight", "layers.0.attn.Wqkv.weight", "final_norm.weight"}
    assert set(heads) == {"head.dense.weight", "classifier.weight"}
    with pytest.raises(ArchitectureError, match="unexpected weight"):
        modernbert.rename_weights({"model.pooler.weight": tensor})


def test_export_command_publishes_a_passing_model(source: Path, tmp_path: Path) -> None:
    """`python -m export` end to end: every CPU graph form either passes the gate or is left out, none crashes."""
    repository = tmp_path / "repository"
    command = [sys.executable, "-m", "export", "--source", str(source / "model"), "--repository", str(repository)]
    command += ["--name", "tiny-modernbert", "--variants", "fp32"]
    done = subprocess.run(
        command, check=False, cwd=ROOT, capture_output=True, text=True, timeout=300, env=os.environ.copy()
    )
    assert done.returncode == 0, done.stderr[-3000:]
    model = repository / "tiny-modernbert"
    config_text = (model / "config.pbtxt").read_text()
    assert "modernbert" in config_text and "token_type_ids" not in config_text
    assert list(model.glob("*/model.onnx"))
