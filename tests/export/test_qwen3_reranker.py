"""Qwen3-Reranker (export.heads.yes_no) against its model card's transformers code, exported and served.

One tiny random Qwen3ForCausalLM (tied embeddings, as Qwen3-Reranker-0.6B) with a byte-level BPE
tokenizer in Qwen2's form whose vocabulary holds "yes", "no" and the chat tokens, saved as Qwen
publishes the reranker (no sentence-transformers files), exported once (fp32) by the command line
and served. The reference is the model card's code, written out here: its prefix, suffix and
format_instruction, the middle truncated to what they leave, left padding, and
softmax([no, yes])[yes] of the last position's logits.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from client import EmbeddingClient
from export.checkpoints.checkpoint import load_checkpoint
from export.heads.yes_no import YesNoError, read_head
from service.core.fidelity import LOGITS_MAX_ABS_DIFF
from service.core.repository import RepositoryError, read_model
from service.errors import InvalidArgument
from service.pipeline.tokenizer import TextTokenizer
from service.pipeline.validation import instruction_choice
from tests.export import tiny_models
from tests.export.family_tokenizers import QWEN3_RERANKER_PREFIX as PREFIX
from tests.export.family_tokenizers import QWEN3_RERANKER_SUFFIX as SUFFIX
from tests.export.family_tokenizers import save_qwen_reranker_tokenizer
from tests.servers import RunningServer, start_server
from tests.servers import post_json as post

MODEL = "qwen3-reranker"
MAX_LENGTH = 256
"""The folder's model_max_length: this tokenizer makes the template's prefix, suffix and default instruction
about 190 tokens; the documents fit in what they leave, the long one does not."""
# The model card's code, as it is written there (its PREFIX and SUFFIX: family_tokenizers, trained on PREFIX).
DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
CUSTOM_INSTRUCTION = "Given a question, find the sentence that answers it"
QUERY = "Which animal is playing in the field?"
DOCUMENTS = [*tiny_models.training_sentences()[:5], "no", "A dog runs through the grass of the field."]
LONG_DOCUMENT = " ".join(tiny_models.training_sentences()[5:40])


def format_instruction(instruction: str | None, query: str, document: str) -> str:
    """The model card's format_instruction."""
    if instruction is None:
        instruction = DEFAULT_INSTRUCTION
    return f"<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}"


def _save_reranker(folder: Path) -> None:
    tokenizer = save_qwen_reranker_tokenizer(folder, max_length=MAX_LENGTH)
    config = transformers.Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=tiny_models.HIDDEN,
        intermediate_size=2 * tiny_models.HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=2 * MAX_LENGTH,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000.0},
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        architectures=["Qwen3ForCausalLM"],
    )
    torch.manual_seed(33)
    model = transformers.Qwen3ForCausalLM(config).eval()
    tiny_models._randomise(model, seed=33)
    model.save_pretrained(str(folder))


@dataclass(frozen=True)
class Reference:
    """The model card's scoring on the folder."""

    tokenizer: transformers.PreTrainedTokenizerFast
    model: transformers.Qwen3ForCausalLM

    def inputs(self, pairs: list[tuple[str, str]], instruction: str | None = None) -> dict[str, torch.Tensor]:
        """The model card's process_inputs."""
        prefix_tokens = self.tokenizer.encode(PREFIX, add_special_tokens=False)
        suffix_tokens = self.tokenizer.encode(SUFFIX, add_special_tokens=False)
        texts = [format_instruction(instruction, query, document) for query, document in pairs]
        inputs = self.tokenizer(
            texts,
            padding=False,
            truncation="longest_first",
            return_attention_mask=False,
            max_length=MAX_LENGTH - len(prefix_tokens) - len(suffix_tokens),
        )
        inputs["input_ids"] = [prefix_tokens + ids + suffix_tokens for ids in inputs["input_ids"]]
        return dict(self.tokenizer.pad(inputs, padding=True, return_tensors="pt", max_length=MAX_LENGTH))

    def logits(self, pairs: list[tuple[str, str]], instruction: str | None = None) -> np.ndarray:
        """logit(yes) - logit(no) at the last position, per pair."""
        with torch.inference_mode():
            last = self.model(**self.inputs(pairs, instruction)).logits[:, -1, :]
        yes, no = self.tokenizer.convert_tokens_to_ids("yes"), self.tokenizer.convert_tokens_to_ids("no")
        return (last[:, yes] - last[:, no]).numpy().astype(np.float64)

    def scores(self, pairs: list[tuple[str, str]], instruction: str | None = None) -> np.ndarray:
        """The model card's compute_logits: softmax over [no, yes], the probability of yes."""
        with torch.inference_mode():
            last = self.model(**self.inputs(pairs, instruction)).logits[:, -1, :]
        yes, no = self.tokenizer.convert_tokens_to_ids("yes"), self.tokenizer.convert_tokens_to_ids("no")
        pair_logits = torch.nn.functional.log_softmax(torch.stack([last[:, no], last[:, yes]], dim=1), dim=1)
        return pair_logits[:, 1].exp().numpy().astype(np.float64)


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The tiny reranker's folder, and the repository `python -m export --source` published it in (fp32, fp16)."""
    root = tmp_path_factory.mktemp("qwen3-reranker")
    _save_reranker(root / "source")
    command = [sys.executable, "-m", "export", "--source", str(root / "source"), "--repository", str(root / "repo")]
    done = subprocess.run(
        [*command, "--name", MODEL, "--threads", "1", "--variants", "fp32,fp16"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return root / "source", root / "repo"


@pytest.fixture(scope="module")
def reference(folders: tuple[Path, Path]) -> Reference:
    source, _ = folders
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(source), padding_side="left")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(source), attn_implementation="eager").eval()
    return Reference(tokenizer, model)


@pytest.fixture(scope="module")
def server(folders: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    with start_server(folders[1], tmp_path_factory.mktemp("qwen3-reranker-server") / "server.log") as running:
        yield running


def grpc_logits(server: RunningServer, pairs: list[tuple[str, str]], **parameters: object) -> np.ndarray:
    with grpcclient.InferenceServerClient(server.target) as client:
        inputs = []
        for name, texts in (("query", [q for q, _ in pairs]), ("text", [d for _, d in pairs])):
            tensor = grpcclient.InferInput(name, [len(texts)], "BYTES")
            tensor.set_data_from_numpy(np.array([text.encode() for text in texts], dtype=object))
            inputs.append(tensor)
        outputs = [grpcclient.InferRequestedOutput("logits")]
        result = client.infer(MODEL, inputs, outputs=outputs, parameters=parameters or None)
    return result.as_numpy("logits")[:, 0].astype(np.float64)


def sigmoid(values: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-values))


def by_index(items: list[dict], key: str) -> np.ndarray:
    """A rerank answer's scores in the documents' order."""
    return np.array([item[key] for item in sorted(items, key=lambda item: item["index"])])


def assert_same_ranking(served: np.ndarray, expected: np.ndarray) -> None:
    np.testing.assert_allclose(served, expected, rtol=0, atol=1e-4)
    assert list(np.argsort(-served, kind="stable")) == list(np.argsort(-expected, kind="stable"))


def test_our_model_equals_transformers(folders: tuple[Path, Path], reference: Reference) -> None:
    """Our PyTorch reading of the folder on the model card's left-padded batch: logit(yes) - logit(no) within 1e-5."""
    checkpoint = load_checkpoint(folders[0])
    assert checkpoint.task == "classify" and checkpoint.pair_template is not None
    pairs = [(QUERY, document) for document in [*DOCUMENTS, LONG_DOCUMENT]]
    with torch.inference_mode():
        ours = checkpoint.build_model()(**reference.inputs(pairs))[:, 0].numpy()
    assert np.abs(ours - reference.logits(pairs)).max() <= 1e-5


def test_server_tokens_are_the_model_cards(folders: tuple[Path, Path], reference: Reference) -> None:
    """The published template through the server's tokenizer gives the model card's ids; a long document is cut
    in the middle only, the prefix and the suffix whole."""
    spec = read_model(folders[1] / MODEL)
    tokenizer = TextTokenizer(spec.tokenizer_file, spec.max_sequence_length, spec.pad_token_id, spec.pair_template)
    pairs = [(QUERY, DOCUMENTS[0]), (QUERY, LONG_DOCUMENT)]
    for instruction in (None, CUSTOM_INSTRUCTION):
        expected = reference.inputs(pairs, instruction)
        rows = tokenizer.encode_pair_rows(pairs, instruction=instruction)
        served = np.split(rows.input_ids, np.cumsum(rows.lengths)[:-1])
        for row, ids in enumerate(served):
            kept = expected["input_ids"][row][expected["attention_mask"][row].bool()]
            assert ids.tolist() == kept.tolist()
    prefix = reference.tokenizer.encode(PREFIX, add_special_tokens=False)
    suffix = reference.tokenizer.encode(SUFFIX, add_special_tokens=False)
    long_row = served[1].tolist()
    assert len(long_row) == MAX_LENGTH and long_row[: len(prefix)] == prefix and long_row[-len(suffix) :] == suffix


def test_grpc_scores_equal_the_model_card(server: RunningServer, reference: Reference) -> None:
    """tritonclient: logits (yes - no) and their sigmoid against the card's probability of yes, one long pair cut."""
    pairs = [(QUERY, document) for document in [*DOCUMENTS, LONG_DOCUMENT]]
    logits = grpc_logits(server, pairs)
    np.testing.assert_allclose(logits, reference.logits(pairs), rtol=0, atol=1e-4)
    assert_same_ranking(sigmoid(logits), reference.scores(pairs))


def test_rerank_routes_equal_the_model_card(server: RunningServer, reference: Reference) -> None:
    """TEI's /rerank and Cohere's /v1/rerank: the card's scores, best first."""
    documents = [*DOCUMENTS, LONG_DOCUMENT]
    expected = reference.scores([(QUERY, document) for document in documents])
    status, answer = post(server, "/rerank", {"query": QUERY, "texts": documents})
    assert status == 200
    assert [item["index"] for item in answer] == list(np.argsort(-expected, kind="stable"))
    assert_same_ranking(by_index(answer, "score"), expected)
    status, answer = post(server, "/v1/rerank", {"model": MODEL, "query": QUERY, "documents": documents, "top_n": 3})
    assert status == 200 and len(answer["results"]) == 3
    best = np.argsort(-expected, kind="stable")[:3]
    assert [item["index"] for item in answer["results"]] == list(best)
    np.testing.assert_allclose(
        [item["relevance_score"] for item in answer["results"]], expected[best], rtol=0, atol=1e-4
    )


def test_an_instruction_replaces_the_default(server: RunningServer, reference: Reference) -> None:
    """gRPC's instruction parameter and the routes' instruction field: the card's scores with that instruction."""
    pairs = [(QUERY, document) for document in DOCUMENTS]
    expected = reference.scores(pairs, CUSTOM_INSTRUCTION)
    assert np.abs(expected - reference.scores(pairs)).max() > 1e-3  # the instruction changes the scores
    assert_same_ranking(sigmoid(grpc_logits(server, pairs, instruction=CUSTOM_INSTRUCTION)), expected)
    body = {"query": QUERY, "texts": DOCUMENTS, "instruction": CUSTOM_INSTRUCTION}
    status, answer = post(server, "/rerank", body)
    assert status == 200
    np.testing.assert_allclose(by_index(answer, "score"), expected, rtol=0, atol=1e-4)
    body = {"query": QUERY, "documents": DOCUMENTS, "instruction": CUSTOM_INSTRUCTION}
    status, answer = post(server, "/v1/rerank", body)
    assert status == 200
    np.testing.assert_allclose(by_index(answer["results"], "relevance_score"), expected, rtol=0, atol=1e-4)
    with EmbeddingClient(server.target, model=MODEL) as sdk:  # the project's own client
        ranking = sdk.rerank(QUERY, DOCUMENTS, instruction=CUSTOM_INSTRUCTION)
    assert list(ranking.indices) == list(np.argsort(-expected, kind="stable"))
    np.testing.assert_allclose(ranking.scores, expected[ranking.indices], rtol=0, atol=1e-4)
    status, answer = post(server, "/rerank", {"query": QUERY, "texts": DOCUMENTS, "instruction": 3})
    assert status == 422 and "instruction must be a non-empty string" in answer["error"]


def test_fp16_served_scores_keep_the_model_cards_order(
    folders: tuple[Path, Path], reference: Reference, tmp_path: Path
) -> None:
    """--variant fp16 on /rerank: logits within fp16's bar of the card's, so documents further apart than twice
    the bar keep their order."""
    documents = [*DOCUMENTS, LONG_DOCUMENT]
    pairs = [(QUERY, document) for document in documents]
    expected = reference.logits(pairs)
    with start_server(folders[1], tmp_path / "server.log", "--variant", "fp16") as fp16:
        status, answer = post(fp16, "/rerank", {"query": QUERY, "texts": documents, "raw_scores": True})
        assert "fidelity check passed: fp16 on CPUExecutionProvider: max logit difference" in fp16.log()
    assert status == 200
    served = by_index(answer, "score")
    bar = LOGITS_MAX_ABS_DIFF["fp16"]
    assert 0 < np.abs(served - expected).max() <= bar
    apart = np.abs(expected[:, None] - expected[None, :]) > 2 * bar
    same_order = np.sign(served[:, None] - served[None, :]) == np.sign(expected[:, None] - expected[None, :])
    assert apart.sum() > len(documents) and same_order[apart].all()


def test_truncate_false_refuses_a_pair_the_template_would_cut(server: RunningServer) -> None:
    with pytest.raises(InferenceServerException, match=r"pair 1 has \d+ tokens with its template"):
        grpc_logits(server, [(QUERY, DOCUMENTS[0]), (QUERY, LONG_DOCUMENT)], truncate=False)
    grpc_logits(server, [(QUERY, DOCUMENTS[0])], truncate=False)


def test_the_repository_declares_and_checks_the_template(folders: tuple[Path, Path]) -> None:
    folder = folders[1] / MODEL
    spec = read_model(folder)
    assert spec.labels == ("yes",) and spec.pair_template.prefix == PREFIX and spec.pair_template.suffix == SUFFIX
    assert spec.pair_template.default_instruction == DEFAULT_INSTRUCTION
    report = json.loads((folder / "parity.json").read_text())
    assert report["head"]["style"] == "yes_no" and set(report["variants"]) == {"fp32", "fp16"}
    library = report["variants"]["fp32"]["reference_library"]
    assert library["passed"] and library["class"] == "AutoModelForCausalLM" and library["max_abs_diff"] <= 1e-4
    fp16 = report["variants"]["fp16"]
    assert fp16["recipe"]["graph_form"] == "unfused" and fp16["reference_library"]["passed"]
    assert fp16["reference_library"]["max_abs_diff"] <= LOGITS_MAX_ABS_DIFF["fp16"]
    broken = shutil.copytree(folder, folders[1].parent / "broken" / MODEL)
    (broken / "config.pbtxt").write_text((folder / "config.pbtxt").read_text().replace("{query}", "{question}"))
    with pytest.raises(RepositoryError, match=r"middle must hold \{instruction\}, \{query\}, \{document\} once each"):
        read_model(broken)


def test_other_causal_lms_are_refused_in_one_line(folders: tuple[Path, Path]) -> None:
    with pytest.raises(YesNoError, match="only with Qwen3-Reranker's template"):
        read_head(folders[0], "llama")


def test_placeholders_are_filled_in_one_pass(folders: tuple[Path, Path]) -> None:
    """A query or document holding a placeholder's name stays as it is."""
    template = read_model(folders[1] / MODEL).pair_template
    filled = template.filled("what is {document}?", "{instruction} {query}")
    assert filled == format_instruction(None, "what is {document}?", "{instruction} {query}")


def test_an_instruction_needs_a_template_and_pairs(folders: tuple[Path, Path]) -> None:
    spec = read_model(folders[1] / MODEL)
    assert instruction_choice({"instruction": CUSTOM_INSTRUCTION}, spec, pairs=True) == CUSTOM_INSTRUCTION
    assert instruction_choice({}, spec, pairs=True) is None
    with pytest.raises(InvalidArgument, match="goes with"):
        instruction_choice({"instruction": CUSTOM_INSTRUCTION}, spec, pairs=False)
    with pytest.raises(InvalidArgument, match="has no pair template"):
        instruction_choice({"instruction": CUSTOM_INSTRUCTION}, dataclasses.replace(spec, pair_template=None), True)
