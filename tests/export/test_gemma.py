"""EmbeddingGemma (export.families.gemma, export.heads.dense) against transformers, sentence-transformers, a server.

One tiny random Gemma3 text model in EmbeddingGemma's form (bidirectional attention; sliding,
full and sliding layers with their own rotary bases; a sliding window of 8, so a token sees 4
either side, shorter than most sentences here; grouped-query heads whose width times their count
is not the hidden size; a query_pre_attn_scalar that is not head_dim) with a tokenizer of Gemma's
kind (SentencePiece-style BPE: spaces as ▁, byte fallback, <bos> ... <eos> added), saved as
sentence-transformers saves EmbeddingGemma: Transformer, mean Pooling, two Dense modules (hidden ->
4 x hidden -> hidden, identity activation, no bias), Normalize, with EmbeddingGemma's prompts.
Exported once (fp32) by `python -m export --source` with its Matryoshka widths, and served.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort
import openai
import pytest
import torch
import transformers
from openai import OpenAI
from sentence_transformers import SentenceTransformer
from sentence_transformers.base.modules import Dense
from sentence_transformers.sentence_transformer import modules as st_models
from torch import nn
from tritonclient import grpc as triton_grpc

from export.checkpoints.architecture_error import ArchitectureError
from export.checkpoints.checkpoint import CheckpointError, load_checkpoint
from export.families import gemma
from service.core.repository import read_model
from service.pipeline.tokenizer import TextTokenizer
from tests.export import tiny_models
from tests.export.family_tokenizers import save_gemma_tokenizer
from tests.servers import start_server
from tests.vectors import assert_same_vectors

ROOT = Path(__file__).resolve().parents[2]
MAX_LENGTH = tiny_models.MAX_POSITIONS - 2
SLIDING_WINDOW = 8
"""config.json's sliding_window: a sliding layer's token sees 4 tokens either side."""
PROMPTS = {
    "query": "task: search result | query: ",
    "document": "title: none | text: ",
    "BitextMining": "task: search result | query: ",
    "Clustering": "task: clustering | query: ",
    "Classification": "task: classification | query: ",
    "InstructionRetrieval": "task: code retrieval | query: ",
    "MultilabelClassification": "task: classification | query: ",
    "PairClassification": "task: sentence similarity | query: ",
    "Reranking": "task: search result | query: ",
    "Retrieval": "task: search result | query: ",
    "Retrieval-query": "task: search result | query: ",
    "Retrieval-document": "title: none | text: ",
    "STS": "task: sentence similarity | query: ",
    "Summarization": "task: summarization | query: ",
}
"""EmbeddingGemma's prompts (its config_sentence_transformers.json)."""
MATRYOSHKA_DIMENSIONS = (16, 8)
"""A tiny model's stand-ins for EmbeddingGemma's 512, 256 and 128."""
SENTENCES = [
    "Hi.",
    *tiny_models.training_sentences()[:5],
    "A naïve café ☕ sentence with bytes the vocabulary lacks.",
    "A much longer sentence that goes on and on, well past the others in the batch, " * 2,
]


def _hf_config(tokenizer: transformers.PreTrainedTokenizerFast, **overrides: object) -> transformers.Gemma3TextConfig:
    config = transformers.Gemma3TextConfig(
        vocab_size=len(tokenizer),
        hidden_size=tiny_models.HIDDEN,
        intermediate_size=48,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=24,
        sliding_window=SLIDING_WINDOW,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
            "full_attention": {"rope_type": "default", "rope_theta": 5_000.0},
        },
        use_bidirectional_attention=True,
        max_position_embeddings=tiny_models.MAX_POSITIONS,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **overrides,
    )
    return config


@dataclass(frozen=True)
class Source:
    """The tiny model's folders and where it was published."""

    base: Path
    """transformers' folder (Gemma3TextModel + tokenizer)."""
    model: Path
    """The sentence-transformers folder."""
    repository: Path


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Source:
    """The tiny EmbeddingGemma as sentence-transformers saves it, exported (fp32) once by the command line."""
    root = tmp_path_factory.mktemp("gemma")
    base = root / "base"
    tokenizer = save_gemma_tokenizer(base, max_length=MAX_LENGTH)
    torch.manual_seed(33)
    model = transformers.AutoModel.from_config(_hf_config(tokenizer), attn_implementation="eager").eval()
    tiny_models._randomise(model, seed=33)
    model.save_pretrained(str(base))
    transformer = st_models.Transformer(str(base), max_seq_length=MAX_LENGTH)
    width = transformer.get_embedding_dimension()
    modules: list[nn.Module] = [transformer, st_models.Pooling(width, pooling_mode="mean")]
    generator = torch.Generator().manual_seed(34)
    for in_features, out_features in ((width, 4 * width), (4 * width, width)):
        weight = torch.randn(out_features, in_features, generator=generator) / in_features**0.5
        modules.append(Dense(in_features, out_features, bias=False, activation_function=None, init_weight=weight))
    modules.append(st_models.Normalize())
    SentenceTransformer(modules=modules, prompts=PROMPTS, similarity_fn_name="cosine").save(str(root / "model"))
    repository = root / "repository"
    command = [sys.executable, "-m", "export", "--source", str(root / "model"), "--repository", str(repository)]
    command += ["--name", "gemma", "--variants", "fp32", "--threads", "1"]
    command += ["--matryoshka-dimensions", ",".join(map(str, MATRYOSHKA_DIMENSIONS))]
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    return Source(base, root / "model", repository)


@pytest.fixture(scope="module")
def embedder(source: Source) -> SentenceTransformer:
    """sentence-transformers' own reading of the folder."""
    return SentenceTransformer(str(source.model), device="cpu")


def _batch(source: Source, texts: list[str]) -> dict[str, torch.Tensor]:
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(source.base))
    encoded = tokenizer(texts, padding=True, return_tensors="pt")
    return {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]}


def test_hidden_states_equal_transformers_and_the_window_matters(source: Source) -> None:
    """Every real token within 1e-5 of Gemma3TextModel, right- and left-padded; without the window they differ."""
    reference = transformers.AutoModel.from_pretrained(str(source.base), attn_implementation="eager").eval()
    checkpoint = load_checkpoint(source.base)
    assert checkpoint.model_type == "gemma3_text" and checkpoint.config.window_radius == SLIDING_WINDOW // 2
    ours = checkpoint.build_model()
    batch = _batch(source, SENTENCES)
    lengths = batch["attention_mask"].sum(dim=1)
    assert int(lengths.max()) > 2 * SLIDING_WINDOW
    left = {name: tensor.clone() for name, tensor in batch.items()}
    for row, length in enumerate(lengths.tolist()):
        for tensor in left.values():
            tensor[row] = torch.roll(tensor[row], tensor.shape[1] - length)
    with torch.inference_mode():
        for feed in (batch, left):
            expected = reference(**feed).last_hidden_state
            hidden, _ = ours(**feed)
            attended = feed["attention_mask"].bool()
            assert float((hidden - expected)[attended].abs().max()) <= 1e-5
        unwindowed = gemma.GemmaEncoder(dataclasses.replace(checkpoint.config, sliding_window=4 * MAX_LENGTH))
        unwindowed.load_state_dict(ours.state_dict())
        wide, _ = unwindowed(**batch)
        hidden, _ = ours(**batch)
    assert float((wide - hidden)[batch["attention_mask"].bool()].abs().max()) > 1e-2


def test_the_tokenizer_adds_bos_and_eos_and_falls_back_to_bytes(source: Source) -> None:
    """transformers and the server's tokenizer agree on the ids: <bos> first, <eos> last, unknown bytes as pieces."""
    hf = transformers.AutoTokenizer.from_pretrained(str(source.model))
    ours = TextTokenizer(source.model / "tokenizer.json", MAX_LENGTH)
    for text in SENTENCES[:2] + SENTENCES[-2:-1]:
        ids = hf(PROMPTS["query"] + text, truncation=True, max_length=MAX_LENGTH)["input_ids"]
        assert ids[0] == hf.bos_token_id and ids[-1] == hf.eos_token_id
        assert ours.encode_rows([PROMPTS["query"] + text]).input_ids.tolist() == ids
    assert hf.convert_tokens_to_ids("<0xE2>") in hf("☕")["input_ids"]


def test_the_folder_reads_as_embeddinggemma(source: Source) -> None:
    """Mean pooling, the two Dense modules between it and Normalize, the prompts, the Matryoshka widths, fp32 only."""
    checkpoint = load_checkpoint(source.model)
    assert (checkpoint.model_type, checkpoint.task) == ("gemma3_text", "embed")
    assert (checkpoint.config.pooling, checkpoint.config.normalize) == ("mean", True)
    assert [(layer.in_features, layer.out_features, layer.bias) for layer in checkpoint.head.layers] == [
        (tiny_models.HIDDEN, 4 * tiny_models.HIDDEN, False),
        (4 * tiny_models.HIDDEN, tiny_models.HIDDEN, False),
    ]
    spec = read_model(source.repository / "gemma")
    assert spec.model_type == "gemma3_text" and list(spec.input_names) == ["input_ids", "attention_mask"]
    assert spec.prompts == PROMPTS and spec.default_prompt_name == ""
    assert tuple(spec.matryoshka_dimensions) == MATRYOSHKA_DIMENSIONS and spec.pooled_projection == "dense"
    report = json.loads((source.repository / "gemma" / "parity.json").read_text())
    assert report["head"]["style"] == "dense" and len(report["head"]["layers"]) == 2
    assert set(report["cpu_graph_forms"]["fp32"]["gate"]) == {"unfused"}  # BERT's fusions do not apply
    library = report["variants"]["fp32"]["reference_library"]
    assert library["passed"] and library["max_abs_diff"] <= 1e-4


@pytest.mark.parametrize("prompt_name", ["query", "document"])
def test_published_graph_equals_sentence_transformers(
    source: Source, embedder: SentenceTransformer, prompt_name: str
) -> None:
    """The published fp32 graph on the prompted texts as the server tokenises them, against encode(prompt_name)."""
    spec = read_model(source.repository / "gemma")
    tokenizer = TextTokenizer(spec.tokenizer_file, spec.max_sequence_length, spec.pad_token_id)
    session = ort.InferenceSession(str(spec.variants["fp32"]), providers=["CPUExecutionProvider"])
    feed = tokenizer.encode([PROMPTS[prompt_name] + text for text in SENTENCES]).feed(spec.input_names)
    (embedding,) = session.run(["embedding"], feed)
    expected = embedder.encode(SENTENCES, prompt_name=prompt_name, convert_to_numpy=True)
    assert_same_vectors(embedding, expected, min_cosine=0.9999)


def _grpc_embeddings(client: triton_grpc.InferenceServerClient, texts: list[str], prompt_name: str) -> np.ndarray:
    text = triton_grpc.InferInput("text", [len(texts)], "BYTES")
    text.set_data_from_numpy(np.array([t.encode() for t in texts], dtype=np.object_))
    answer = client.infer(
        "gemma",
        [text],
        outputs=[triton_grpc.InferRequestedOutput("embedding")],
        parameters={"prompt_name": prompt_name},
    )
    return answer.as_numpy("embedding")


def test_served_embeddings_equal_sentence_transformers(
    source: Source, embedder: SentenceTransformer, tmp_path: Path
) -> None:
    """A real server over gRPC (tritonclient) and the OpenAI SDK, each prompt, and a Matryoshka width."""
    width = MATRYOSHKA_DIMENSIONS[-1]
    with start_server(source.repository, tmp_path / "server.log") as server:
        grpc = triton_grpc.InferenceServerClient(server.target)
        sdk = OpenAI(base_url=f"{server.http_url}/v1", api_key="unused", max_retries=0)
        try:
            for prompt_name in ("query", "document"):
                expected = embedder.encode(SENTENCES, prompt_name=prompt_name, convert_to_numpy=True)
                assert_same_vectors(_grpc_embeddings(grpc, SENTENCES, prompt_name), expected, min_cosine=0.9999)
                answer = sdk.embeddings.create(model="gemma", input=SENTENCES, extra_body={"prompt_name": prompt_name})
                served = np.array([item.embedding for item in answer.data], dtype=np.float32)
                assert_same_vectors(served, expected, min_cosine=0.9999)
            shortened = embedder.encode(SENTENCES, prompt_name="query", truncate_dim=width, convert_to_numpy=True)
            answer = sdk.embeddings.create(
                model="gemma", input=SENTENCES, dimensions=width, extra_body={"prompt_name": "query"}
            )
            served = np.array([item.embedding for item in answer.data], dtype=np.float32)
            expected = shortened / np.linalg.norm(shortened, axis=1, keepdims=True)  # the server renormalises
            assert_same_vectors(served, expected, min_cosine=0.9999)
            with pytest.raises(openai.BadRequestError, match="late_chunking: model gemma maps its pooled vector"):
                sdk.embeddings.create(model="gemma", input=SENTENCES[:2], extra_body={"late_chunking": True})
        finally:
            grpc.close()


def test_unimplemented_settings_are_refused_in_one_line(tmp_path: Path) -> None:
    hf = json.loads(_hf_config(save_gemma_tokenizer(tmp_path, max_length=MAX_LENGTH)).to_json_string())
    refusals = {
        "use_bidirectional_attention": (False, "unsupported use_bidirectional_attention false"),
        "attn_logit_softcapping": (50.0, "unsupported attn_logit_softcapping 50.0"),
        "rope_parameters": (
            {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}},
            "unsupported rope_parameters full_attention rope_type 'linear'",
        ),
        "rope_scaling": ({"rope_type": "yarn", "factor": 4.0}, "unsupported rope_scaling rope_type 'yarn'"),
        "hidden_activation": ("silu", "unsupported hidden_activation 'silu'"),
        "layer_types": (["sliding_attention", "chunked_attention", "full_attention"], "'chunked_attention'"),
    }
    for key, (value, message) in refusals.items():
        with pytest.raises(ArchitectureError, match=message):
            gemma.config_from_hf(hf | {key: value}, pooling="mean", normalize=True)
    config = gemma.config_from_hf(hf, pooling="mean", normalize=True)
    assert (config.rope_theta, config.rope_local_theta, config.query_pre_attn_scalar) == (5_000.0, 100.0, 24.0)
    # transformers 4.x's keys (EmbeddingGemma's config.json): rope_theta, rope_local_base_freq, a layer pattern
    legacy = {key: value for key, value in hf.items() if key not in ("rope_parameters", "layer_types")}
    legacy |= {"rope_theta": 1e6, "rope_local_base_freq": 1e4, "rope_scaling": None, "sliding_window_pattern": 2}
    config = gemma.config_from_hf(legacy, pooling="mean", normalize=True)
    assert (config.rope_theta, config.rope_local_theta) == (1e6, 1e4)
    assert config.layer_types == ("sliding_attention", "full_attention", "sliding_attention")


@pytest.mark.parametrize(
    ("model_type", "message"),
    [
        ("gemma3", "Gemma3's image-and-text model"),
        ("embedding_gemma2", "EmbeddingGemma 2, a Gemma4-based model"),
    ],
)
def test_other_gemma_models_are_refused_naming_the_one_supported(
    source: Source, tmp_path: Path, model_type: str, message: str
) -> None:
    folder = shutil.copytree(source.base, tmp_path / "changed")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"model_type": model_type}))
    with pytest.raises(CheckpointError, match=f"unsupported architecture '{model_type}': {message}"):
        load_checkpoint(folder)


def test_a_dense_chain_ending_at_another_width_is_refused(source: Source, tmp_path: Path) -> None:
    """The server answers the embedding and the token states at one width: a projection to another is refused."""
    folder = shutil.copytree(source.model, tmp_path / "changed")
    embedder = SentenceTransformer(str(folder), device="cpu")
    dense = embedder[3]
    narrower = Dense(dense.in_features, 8, bias=False, activation_function=None)
    SentenceTransformer(modules=[*list(embedder)[:3], narrower, embedder[4]]).save(str(folder))
    with pytest.raises(CheckpointError, match="Dense out_features 8 ends the chain at a width other than the hidden"):
        load_checkpoint(folder)


EMBEDDINGGEMMA_300M = {
    "model_type": "gemma3_text",
    "architectures": ["Gemma3TextModel"],
    "attention_bias": False,
    "attn_logit_softcapping": None,
    "final_logit_softcapping": None,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 768,
    "intermediate_size": 1152,
    "max_position_embeddings": 2048,
    "num_attention_heads": 3,
    "num_hidden_layers": 24,
    "num_key_value_heads": 1,
    "pad_token_id": 0,
    "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-6,
    "rope_local_base_freq": 10_000.0,
    "rope_scaling": None,
    "rope_theta": 1_000_000.0,
    "sliding_window": 512,
    "use_bidirectional_attention": True,
    "vocab_size": 262_144,
}
"""google/embeddinggemma-300m's config.json as transformers 4.x wrote it (layer_types left to the default pattern)."""


def test_embeddinggemma_config_reads_as_transformers_reads_it() -> None:
    config = gemma.config_from_hf(EMBEDDINGGEMMA_300M, pooling="mean", normalize=True)
    reference = transformers.Gemma3TextConfig(**{k: v for k, v in EMBEDDINGGEMMA_300M.items() if k != "model_type"})
    assert config.layer_types == tuple(reference.layer_types)
    assert config.window_radius == reference.sliding_window - 1  # transformers' bound is exclusive
    assert (config.rope_theta, config.rope_local_theta) == (
        reference.rope_parameters["full_attention"]["rope_theta"],
        reference.rope_parameters["sliding_attention"]["rope_theta"],
    )
    assert (config.num_heads, config.num_kv_heads, config.head_dim, config.ffn_dim) == (3, 1, 256, 1152)
    assert config.max_sequence_positions == 2048
