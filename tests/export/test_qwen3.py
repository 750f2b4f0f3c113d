"""Qwen3-Embedding (export.families.qwen3) against transformers, sentence-transformers and its published graph.

One tiny random Qwen3Model (hidden 32, 2 layers, 4 query heads sharing 2 key/value heads, head_dim 16
so that heads x head_dim is not the hidden size) with a byte-level BPE tokenizer in Qwen3-Embedding's
form (<|endoftext|> appended by a TemplateProcessing post-processor, padding on the left), saved as
sentence-transformers saves Qwen3-Embedding: Transformer + Pooling(lasttoken) + Normalize, with a
query prompt. Exported once (fp32) for the module.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import transformers
from sentence_transformers import SentenceTransformer
from sentence_transformers.sentence_transformer import modules as st_models

from export.build import ExportOptions, export_model
from export.checkpoints.architecture_error import ArchitectureError
from export.checkpoints.checkpoint import CheckpointError, load_checkpoint
from export.families import qwen3
from export.gate.served import served_feeds
from service.core.fidelity import VARIANT_MIN_COSINE
from service.core.repository import read_model
from service.pipeline.tokenizer import TextTokenizer
from tests.export import tiny_models
from tests.export.family_tokenizers import QWEN_EOS as EOS
from tests.export.family_tokenizers import save_qwen_tokenizer
from tests.vectors import FP32_RELATIVE_DIFF, assert_same_vectors

QUERY_PROMPT = "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery:"
MAX_LENGTH = 64
FP16_RELATIVE_DIFF = 5e-3
"""The fp16 graph's embedding values against fp32: each within this fraction of its row's norm (one rounding to
fp16's 11 significant bits moves a value by up to 4.9e-4 of it; measured here: 9e-4)."""
ROPE_THETA = 1_000.0
"""Not the 10,000 a reader falls back to, so that a rotary base read wrongly shows."""
SENTENCES = [
    "Hi.",
    *tiny_models.training_sentences()[:6],
    "A much longer sentence that goes on and on, well past the others in the batch, " * 2,
]


def _hf_config(tokenizer: transformers.PreTrainedTokenizerFast, **overrides: object) -> transformers.Qwen3Config:
    config = transformers.Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=tiny_models.HIDDEN,
        intermediate_size=2 * tiny_models.HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=tiny_models.MAX_POSITIONS,
        rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},
        rms_norm_eps=1e-6,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


@dataclass(frozen=True)
class Source:
    """The tiny model's folders and where it was published."""

    base: Path
    """transformers' folder (Qwen3Model + tokenizer)."""
    model: Path
    """The sentence-transformers folder."""
    repository: Path


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Source:
    """The tiny Qwen3-Embedding as sentence-transformers saves it, exported (fp32 and fp16) once."""
    root = tmp_path_factory.mktemp("qwen3")
    base = root / "base"
    tokenizer = save_qwen_tokenizer(base, max_length=MAX_LENGTH)
    torch.manual_seed(32)
    model = transformers.AutoModel.from_config(_hf_config(tokenizer), attn_implementation="eager").eval()
    tiny_models._randomise(model, seed=32)
    model.save_pretrained(str(base))
    transformer = st_models.Transformer(str(base), max_seq_length=MAX_LENGTH)
    pooling = st_models.Pooling(transformer.get_embedding_dimension(), pooling_mode="lasttoken")
    embedder = SentenceTransformer(
        modules=[transformer, pooling, st_models.Normalize()], prompts={"query": QUERY_PROMPT, "document": ""}
    )
    embedder.save(str(root / "model"))
    options = ExportOptions(variants=("fp32", "fp16"), threads=1)
    export_model(load_checkpoint(root / "model"), root / "repository", options)
    return Source(base, root / "model", root / "repository")


@pytest.fixture(scope="module")
def reference(source: Source) -> transformers.Qwen3Model:
    """transformers' own Qwen3Model on the saved weights."""
    return transformers.AutoModel.from_pretrained(str(source.base), attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def ours(source: Source) -> qwen3.Qwen3Encoder:
    """Our encoder as the exporter loads it from the sentence-transformers folder."""
    checkpoint = load_checkpoint(source.model)
    assert checkpoint.model_type == "qwen3" and checkpoint.task == "embed"
    assert (checkpoint.config.pooling, checkpoint.config.normalize) == ("lasttoken", True)
    assert checkpoint.serving.prompts["query"] == QUERY_PROMPT
    return checkpoint.build_model()


def _batch(source: Source, side: str) -> dict[str, torch.Tensor]:
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(source.base))
    tokenizer.padding_side = side
    encoded = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    return {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]}


def test_the_tokenizer_appends_endoftext(source: Source) -> None:
    """transformers and the server's tokenizer both end every text with <|endoftext|>, and agree on the ids."""
    hf = transformers.AutoTokenizer.from_pretrained(str(source.model))
    ours = TextTokenizer(source.model / "tokenizer.json", MAX_LENGTH)
    eos = hf.convert_tokens_to_ids(EOS)
    for text in (SENTENCES[0], QUERY_PROMPT + SENTENCES[1]):
        ids = hf(text, truncation=True, max_length=MAX_LENGTH)["input_ids"]  # the prompted text is longer
        assert ids[-1] == eos and eos not in ids[:-1]
        assert ours.encode_rows([text]).input_ids.tolist() == ids


def test_hidden_states_equal_transformers(
    reference: transformers.Qwen3Model, ours: qwen3.Qwen3Encoder, source: Source
) -> None:
    """Right-padded rows through both; each real token equal within 1e-5."""
    batch = _batch(source, "right")
    with torch.inference_mode():
        expected = reference(**batch).last_hidden_state
        hidden, _ = ours(**batch)
    attended = batch["attention_mask"].bool()
    assert float((hidden - expected)[attended].abs().max()) <= 1e-5


def test_right_padded_rows_equal_transformers_left_padded(
    reference: transformers.Qwen3Model, ours: qwen3.Qwen3Encoder, source: Source
) -> None:
    """The server's right padding against sentence-transformers' left padding: same real-token and last-token states."""
    right, left = _batch(source, "right"), _batch(source, "left")
    assert not torch.equal(right["attention_mask"], left["attention_mask"])
    with torch.inference_mode():
        expected = reference(**left).last_hidden_state
        hidden, embedding = ours(**right)
    for row in range(len(SENTENCES)):
        ours_tokens = hidden[row][right["attention_mask"][row].bool()]
        their_tokens = expected[row][left["attention_mask"][row].bool()]
        assert float((ours_tokens - their_tokens).abs().max()) <= 1e-5, f"row {row}"
    last = torch.nn.functional.normalize(expected[:, -1], dim=-1)  # left padding: the last position is the last token
    assert float((embedding - last).abs().max()) <= 1e-5


def _published(source: Source, variant: str) -> tuple[ort.InferenceSession, TextTokenizer, list[str], int]:
    spec = read_model(source.repository / "model")
    assert spec.model_type == "qwen3" and list(spec.input_names) == ["input_ids", "attention_mask"]
    tokenizer = TextTokenizer(spec.tokenizer_file, spec.max_sequence_length, spec.pad_token_id)
    session = ort.InferenceSession(str(spec.variants[variant]), providers=["CPUExecutionProvider"])
    return session, tokenizer, list(spec.input_names), spec.pad_token_id


@pytest.mark.parametrize(
    ("variant", "min_cosine", "relative_diff"),
    [("fp32", 0.9999, FP32_RELATIVE_DIFF), ("fp16", VARIANT_MIN_COSINE["fp16"], FP16_RELATIVE_DIFF)],
)
@pytest.mark.parametrize("prompt_name", [None, "query"])
def test_published_embeddings_equal_sentence_transformers(
    source: Source, prompt_name: str | None, variant: str, min_cosine: float, relative_diff: float
) -> None:
    """Each published graph fed as the server feeds it (right-padded, alone and batched) against encode.

    fp16 runs on the CPU here, at its own bar; the server checks it again on CUDA when it loads it.
    """
    expected = SentenceTransformer(str(source.model), device="cpu").encode(
        SENTENCES, prompt_name=prompt_name, convert_to_numpy=True
    )
    session, tokenizer, names, pad_token_id = _published(source, variant)
    texts = [(QUERY_PROMPT if prompt_name else "") + text for text in SENTENCES]
    for way in served_feeds(tokenizer, texts, names, max_length=MAX_LENGTH, pad_token_id=pad_token_id):
        got = np.concatenate([session.run(["embedding"], feed)[0] for feed in way])
        assert_same_vectors(got, expected, min_cosine=min_cosine, relative_diff=relative_diff)


def test_parity_report_has_the_unfused_forms_and_the_library_check(source: Source) -> None:
    """fp32 and fp16 are the unfused graph (BERT's fusions do not apply), each gated and held to the library."""
    report = json.loads((source.repository / "model" / "parity.json").read_text())
    assert report["model_type"] == "qwen3" and report["encoder"]["num_kv_heads"] == 2
    assert set(report["cpu_graph_forms"]["fp32"]["gate"]) == {"unfused"}
    assert set(report["variants"]) == {"fp32", "fp16"} and report["withdrawn"] == {}
    library = report["variants"]["fp32"]["reference_library"]
    assert library["passed"] and library["max_abs_diff"] <= 1e-4
    fp16 = report["variants"]["fp16"]
    assert fp16["passed"] and fp16["recipe"]["graph_form"] == "unfused" and fp16["reference_library"]["passed"]
    graph = onnx.load(str(read_model(source.repository / "model").variants["fp16"])).graph
    assert max(graph.initializer, key=lambda tensor: np.prod(tensor.dims)).data_type == onnx.TensorProto.FLOAT16
    # Rotary cos and sin are tables made in fp32 (export.layers.rotary): fp16 angles lose positions past 2048.
    assert not {"Cos", "Sin"} & {node.op_type for node in graph.node}


def test_unimplemented_settings_are_refused_in_one_line(tmp_path: Path) -> None:
    hf = json.loads(_hf_config(save_qwen_tokenizer(tmp_path, max_length=MAX_LENGTH)).to_json_string())
    refusals = {
        "rope_parameters": (
            {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0},
            "unsupported rope_parameters rope_type 'yarn'",
        ),
        "rope_scaling": ({"type": "linear", "factor": 2.0}, "unsupported rope_scaling rope_type 'linear'"),
        "use_sliding_window": (True, "unsupported use_sliding_window true"),
        "layer_types": (["full_attention", "sliding_attention"], "unsupported layer_types 'sliding_attention'"),
        "hidden_act": ("gelu", "unsupported hidden_act 'gelu'"),
    }
    for key, (value, message) in refusals.items():
        with pytest.raises(ArchitectureError, match=message):
            qwen3.config_from_hf(hf | {key: value}, pooling="lasttoken", normalize=True)
    config = qwen3.config_from_hf(hf, pooling="lasttoken", normalize=True)
    assert (config.head_dim, config.num_kv_heads, config.rope_theta) == (16, 2, ROPE_THETA)
    legacy = {key: value for key, value in hf.items() if key != "rope_parameters"}  # transformers 4.x's keys
    legacy |= {"rope_theta": 1e6, "rope_scaling": None}
    assert qwen3.config_from_hf(legacy, pooling="lasttoken", normalize=True).rope_theta == 1e6


def test_a_sliding_window_checkpoint_is_refused(tmp_path: Path) -> None:
    tokenizer = save_qwen_tokenizer(tmp_path, max_length=MAX_LENGTH)
    config = _hf_config(tokenizer, use_sliding_window=True, sliding_window=8, max_window_layers=1)
    transformers.AutoModel.from_config(config).save_pretrained(str(tmp_path))
    with pytest.raises(CheckpointError, match="sliding"):
        load_checkpoint(tmp_path)


def test_rename_sets_heads_apart() -> None:
    tensor = torch.zeros(1)
    weights, heads = qwen3.rename_weights(
        {
            "model.embed_tokens.weight": tensor,
            "model.layers.0.self_attn.q_norm.weight": tensor,
            "lm_head.weight": tensor,
        }
    )
    assert set(weights) == {"embed_tokens.weight", "layers.0.self_attn.q_norm.weight"}
    assert set(heads) == {"lm_head.weight"}
    with pytest.raises(ArchitectureError, match=r"unexpected weight 'model\.rotary_emb\.inv_freq'"):
        qwen3.rename_weights({"model.rotary_emb.inv_freq": tensor})
