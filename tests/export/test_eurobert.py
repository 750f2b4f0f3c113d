"""EuroBERT (export.families.eurobert) against transformers, sentence-transformers, CrossEncoder and a real server.

Tiny random EuroBERT models (hidden 32, 2 layers, 4 query heads sharing 2 key/value heads, head_dim 16
so that heads x head_dim is not the hidden size, rotary base 1,000) with a byte-level BPE tokenizer in
EuroBERT's Llama-3 form (<|begin_of_text|> before and <|end_of_text|> after every text, <|end_of_text|>
as padding, <|mask|>): an embedder saved as sentence-transformers saves it (Transformer + mean Pooling
+ Normalize, with query and document prompts) and a reranker (EuroBertForSequenceClassification, one
label, its default "late" pooling) saved as a CrossEncoder folder, both exported once by
`python -m export --source` (the embedder in fp32 and fp16, the reranker in fp32: a classifier's only variant)
and served by one real server.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import openai
import pytest
import torch
import transformers
import tritonclient.grpc as grpcclient
from sentence_transformers import CrossEncoder, SentenceTransformer
from sentence_transformers.sentence_transformer import modules as st_models

from export.checkpoints.architecture_error import ArchitectureError
from export.checkpoints.checkpoint import load_checkpoint
from export.families import eurobert
from export.heads.classifier import HeadError, head_config
from service.core.fidelity import VARIANT_MIN_COSINE
from service.core.repository import read_model
from service.pipeline.tokenizer import TextTokenizer
from tests.export import tiny_models
from tests.export.family_tokenizers import LLAMA3_BOS as BOS
from tests.export.family_tokenizers import LLAMA3_EOS as EOS
from tests.export.family_tokenizers import save_llama3_tokenizer
from tests.servers import RunningServer, post_json, start_server
from tests.vectors import assert_same_vectors

ROOT = Path(__file__).resolve().parents[2]
MAX_LENGTH = 64
ROPE_THETA = 1_000.0
"""Not the 10,000 a reader falls back to, so that a rotary base read wrongly shows."""
PROMPTS = {"query": "query: ", "document": ""}
SENTENCES = [
    "Hi.",
    *tiny_models.training_sentences()[:6],
    "A much longer sentence that goes on and on, well past the others in the batch, " * 2,
]
QUERY = tiny_models.training_sentences()[7]
PAIRS = [(QUERY, text) for text in [*SENTENCES, "A long passage, " * 30]]
"""One query, so that the pairs are also a rerank request; the last is truncated."""
EMBEDDER, RERANKER = "eurobert-embed", "eurobert-reranker"


def _hf_config(tokenizer: transformers.PreTrainedTokenizerFast, **overrides: object) -> transformers.EuroBertConfig:
    config = transformers.EuroBertConfig(
        vocab_size=len(tokenizer),
        hidden_size=tiny_models.HIDDEN,
        intermediate_size=2 * tiny_models.HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=tiny_models.MAX_POSITIONS,
        rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        mask_token_id=tokenizer.mask_token_id,
    )
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def save_model(folder: Path, seed: int, task: str = "embed", **overrides: object) -> Path:
    """A tiny random EuroBertModel (or -ForSequenceClassification) with its tokenizer in folder."""
    tokenizer = save_llama3_tokenizer(folder, max_length=MAX_LENGTH)
    torch.manual_seed(seed)
    auto = transformers.AutoModelForSequenceClassification if task == "classify" else transformers.AutoModel
    model = auto.from_config(_hf_config(tokenizer, **overrides), attn_implementation="eager").eval()
    tiny_models._randomise(model, seed)
    model.save_pretrained(str(folder))
    return folder


@dataclass(frozen=True)
class Sources:
    """The tiny models' folders and the repository they were exported to."""

    base: Path
    """transformers' EuroBertModel folder, under the embedder."""
    embedder: Path
    """The sentence-transformers folder."""
    reranker: Path
    """The CrossEncoder folder."""
    repository: Path


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> Sources:
    """The embedder (fp32 and fp16) and the reranker (fp32), each exported by the command line, the two at once."""
    root = tmp_path_factory.mktemp("eurobert")
    base = save_model(root / "base", seed=41)
    transformer = st_models.Transformer(str(base), max_seq_length=MAX_LENGTH)
    pooling = st_models.Pooling(transformer.get_embedding_dimension(), pooling_mode="mean")
    SentenceTransformer(modules=[transformer, pooling, st_models.Normalize()], prompts=PROMPTS).save(
        str(root / "embedder")
    )
    classifier = save_model(root / "classifier", seed=42, task="classify", num_labels=1)
    CrossEncoder(str(classifier), device="cpu").save(str(root / "reranker"))
    repository = root / "repository"
    runs = []
    for name, folder, variants in ((EMBEDDER, root / "embedder", "fp32,fp16"), (RERANKER, root / "reranker", "fp32")):
        command = [sys.executable, "-m", "export", "--source", str(folder), "--repository", str(repository)]
        command += ["--name", name, "--variants", variants, "--threads", "1"]
        runs.append(subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for run in runs:
        _, stderr = run.communicate(timeout=600)
        assert run.returncode == 0, stderr[-3000:]
    return Sources(base, root / "embedder", root / "reranker", repository)


@pytest.fixture(scope="module")
def server(sources: Sources, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """A real server on the exported repository."""
    with start_server(sources.repository, tmp_path_factory.mktemp("eurobert-server") / "server.log") as running:
        yield running


def _masks(batch: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """The batch right-padded (as tokenised), left-padded (each row rolled), and holed (every third token masked)."""
    left = {name: tensor.clone() for name, tensor in batch.items()}
    for row, length in enumerate(batch["attention_mask"].sum(dim=1).tolist()):
        for tensor in left.values():
            tensor[row] = torch.roll(tensor[row], tensor.shape[1] - length)
    holed = dict(batch, attention_mask=batch["attention_mask"].clone())
    holed["attention_mask"][:, 2::3] = 0
    return {"right-padded": batch, "left-padded": left, "holed": holed}


def _pairs_batch(folder: Path) -> dict[str, torch.Tensor]:
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    firsts, seconds = zip(*PAIRS, strict=True)
    encoded = tokenizer(list(firsts), list(seconds), padding=True, truncation=True, return_tensors="pt")
    return {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]}


def test_the_tokenizer_puts_begin_and_end_of_text_around_each_text(sources: Sources) -> None:
    """transformers and the server's tokenizer agree on the ids, alone and paired."""
    hf = transformers.AutoTokenizer.from_pretrained(str(sources.embedder))
    ours = TextTokenizer(sources.embedder / "tokenizer.json", MAX_LENGTH)
    bos, eos = hf.convert_tokens_to_ids(BOS), hf.convert_tokens_to_ids(EOS)
    ids = hf(SENTENCES[1])["input_ids"]
    assert (ids[0], ids[-1]) == (bos, eos) and eos not in ids[1:-1]
    assert ours.encode_rows([SENTENCES[1]]).input_ids.tolist() == ids
    paired = hf(QUERY, SENTENCES[1], truncation=True, max_length=MAX_LENGTH)["input_ids"]
    assert ours.encode_pair_rows([(QUERY, SENTENCES[1])]).input_ids.tolist() == paired


def test_hidden_states_equal_transformers(sources: Sources) -> None:
    """Pairs through both under every mask shape; each kept token equal within 1e-5."""
    checkpoint = load_checkpoint(sources.embedder)
    assert checkpoint.model_type == "eurobert" and checkpoint.task == "embed"
    assert isinstance(checkpoint.config, eurobert.EuroBertConfig) and not checkpoint.config.uses_segments
    assert (checkpoint.config.num_kv_heads, checkpoint.config.rope_theta) == (2, ROPE_THETA)
    reference = transformers.AutoModel.from_pretrained(str(sources.base), attn_implementation="eager").eval()
    ours = checkpoint.build_model()
    for kind, feed in _masks(_pairs_batch(sources.base)).items():
        with torch.inference_mode():
            expected = reference(**feed).last_hidden_state
            hidden, _ = ours(**feed)
        difference = float((hidden - expected)[feed["attention_mask"].bool()].abs().max())
        assert difference <= 1e-5, f"{kind}: max abs diff {difference:.2e}"


@pytest.mark.parametrize("pooling", ["bos", "mean", "late"])
def test_classifier_logits_equal_transformers(sources: Sources, tmp_path: Path, pooling: str) -> None:
    """Each classifier_pooling, three labels (the exported reranker, one label, is "late"'s too)."""
    folder = save_model(tmp_path, seed=43, task="classify", num_labels=3, classifier_pooling=pooling)
    checkpoint = load_checkpoint(folder)
    assert checkpoint.task == "classify" and checkpoint.head.style == "eurobert"
    reference = transformers.AutoModelForSequenceClassification.from_pretrained(
        str(folder), attn_implementation="eager"
    ).eval()
    ours = checkpoint.build_model()
    for kind, feed in _masks(_pairs_batch(folder)).items():
        if pooling == "bos" and kind == "left-padded":
            continue  # "bos" reads the first column, padding in a left-padded row, in transformers as here
        with torch.inference_mode():
            difference = float((ours(**feed) - reference(**feed).logits).abs().max())
        assert difference <= 1e-5, f"{kind}: max abs diff {difference:.2e}"


def test_parity_report_has_the_unfused_forms_and_the_library_checks(sources: Sources) -> None:
    """fp32 (and the embedder's fp16) are the unfused graph (BERT's fusions do not apply), held to the library."""
    for name, model_class in ((EMBEDDER, "SentenceTransformer"), (RERANKER, "CrossEncoder")):
        report = json.loads((sources.repository / name / "parity.json").read_text())
        assert report["model_type"] == "eurobert" and report["encoder"]["num_kv_heads"] == 2
        assert set(report["cpu_graph_forms"]["fp32"]["gate"]) == {"unfused"}
        library = report["variants"]["fp32"]["reference_library"]
        assert library["class"] == model_class and library["passed"] and library["max_abs_diff"] <= 1e-4
    report = json.loads((sources.repository / EMBEDDER / "parity.json").read_text())
    assert set(report["variants"]) == {"fp32", "fp16"} and report["withdrawn"] == {}
    fp16 = report["variants"]["fp16"]
    assert fp16["passed"] and fp16["recipe"]["graph_form"] == "unfused"
    assert fp16["reference_library"]["passed"] and fp16["reference_library"]["min_cosine"] >= VARIANT_MIN_COSINE["fp16"]
    weights = onnx.load(str(read_model(sources.repository / EMBEDDER).variants["fp16"])).graph.initializer
    assert max(weights, key=lambda tensor: np.prod(tensor.dims)).data_type == onnx.TensorProto.FLOAT16


def _embedding_over_grpc(server: RunningServer, texts: list[str], **parameters: object) -> np.ndarray:
    with grpcclient.InferenceServerClient(server.target) as client:
        text = grpcclient.InferInput("text", [len(texts)], "BYTES")
        text.set_data_from_numpy(np.array([t.encode() for t in texts], dtype=object))
        answer = client.infer(
            EMBEDDER,
            [text],
            outputs=[grpcclient.InferRequestedOutput("embedding")],
            parameters=parameters or None,
        )
        return answer.as_numpy("embedding")


def test_served_embeddings_equal_sentence_transformers(sources: Sources, server: RunningServer) -> None:
    """tritonclient over gRPC and the openai SDK over HTTP, with and without the query prompt."""
    reference = SentenceTransformer(str(sources.embedder), device="cpu")
    plain = reference.encode(SENTENCES, convert_to_numpy=True)
    query = reference.encode(SENTENCES, prompt_name="query", convert_to_numpy=True)
    assert_same_vectors(_embedding_over_grpc(server, SENTENCES), plain, min_cosine=0.9999)
    assert_same_vectors(_embedding_over_grpc(server, SENTENCES, prompt_name="query"), query, min_cosine=0.9999)
    sdk = openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="unused", max_retries=0)
    for extra, expected in (({}, plain), ({"prompt_name": "query"}, query)):
        answer = sdk.embeddings.create(model=EMBEDDER, input=SENTENCES, extra_body=extra)
        served = np.array([item.embedding for item in answer.data], dtype=np.float32)
        assert_same_vectors(served, expected, min_cosine=0.9999)


def test_served_reranker_equals_cross_encoder(sources: Sources, server: RunningServer) -> None:
    """Raw HTTP /rerank and gRPC query + text -> logits against CrossEncoder.predict's raw logits."""
    expected = CrossEncoder(str(sources.reranker), device="cpu").predict(PAIRS, activation_fn=torch.nn.Identity())
    expected = np.asarray(expected, dtype=np.float32).reshape(-1)
    body = {"model": RERANKER, "query": QUERY, "texts": [text for _, text in PAIRS], "raw_scores": True}
    status, ranked = post_json(server, "/rerank", body)
    assert status == 200, ranked
    assert [item["index"] for item in ranked] == list(np.argsort(-expected, kind="stable"))
    assert [item["score"] for item in ranked] == pytest.approx(sorted(expected, reverse=True), abs=1e-4)
    with grpcclient.InferenceServerClient(server.target) as client:
        inputs = []
        for name, texts in (("query", [q for q, _ in PAIRS]), ("text", [t for _, t in PAIRS])):
            tensor = grpcclient.InferInput(name, [len(texts)], "BYTES")
            tensor.set_data_from_numpy(np.array([t.encode() for t in texts], dtype=object))
            inputs.append(tensor)
        logits = client.infer(RERANKER, inputs).as_numpy("logits")
    assert logits.shape == (len(PAIRS), 1)
    np.testing.assert_allclose(logits[:, 0], expected, atol=1e-4)


def test_unimplemented_settings_are_refused_in_one_line(tmp_path: Path) -> None:
    hf = json.loads(_hf_config(save_llama3_tokenizer(tmp_path, max_length=MAX_LENGTH)).to_json_string())
    refusals = {
        "rope_parameters": (
            {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0},
            "unsupported rope_parameters rope_type 'yarn'",
        ),
        "rope_scaling": ({"type": "dynamic", "factor": 2.0}, "unsupported rope_scaling rope_type 'dynamic'"),
        "hidden_act": ("gelu", "unsupported hidden_act 'gelu'"),
        "mlp_bias": (True, "unsupported mlp_bias true"),
        "pad_token_id": (10_000, "pad_token_id 10000 is outside the vocabulary"),
    }
    for key, (value, message) in refusals.items():
        with pytest.raises(ArchitectureError, match=message):
            eurobert.config_from_hf(hf | {key: value}, pooling="mean", normalize=True)
    legacy = {key: value for key, value in hf.items() if key != "rope_parameters"} | {"rope_theta": 250_000.0}
    assert eurobert.config_from_hf(legacy, pooling="mean", normalize=True).rope_theta == 250_000.0
    with pytest.raises(HeadError, match="unsupported classifier_pooling 'max'"):
        head_config(hf | {"classifier_pooling": "max"}, "eurobert")
    with pytest.raises(HeadError, match=r"clf_pooling 'bos' .* disagrees with classifier_pooling 'late'"):
        head_config(hf | {"clf_pooling": "bos"}, "eurobert")
    assert head_config(hf | {"clf_pooling": "mean", "classifier_pooling": "mean"}, "eurobert").pooling == "mean"


def test_rename_sets_heads_apart() -> None:
    tensor = torch.zeros(1)
    weights, heads = eurobert.rename_weights(
        {
            "model.embed_tokens.weight": tensor,
            "model.layers.0.self_attn.q_proj.weight": tensor,
            "model.norm.weight": tensor,
            "dense.weight": tensor,
            "classifier.bias": tensor,
            "lm_head.weight": tensor,
        }
    )
    assert set(weights) == {"embed_tokens.weight", "layers.0.self_attn.q_proj.weight", "norm.weight"}
    assert set(heads) == {"dense.weight", "classifier.bias", "lm_head.weight"}
    with pytest.raises(ArchitectureError, match=r"unexpected weight 'model\.rotary_emb\.inv_freq'"):
        eurobert.rename_weights({"model.rotary_emb.inv_freq": tensor})
