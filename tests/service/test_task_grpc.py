"""Tasks over gRPC on tiny torch-free repositories: classifier pairs, prompts, truncate, dimensions, metadata, refusals.

The classifiers' logits are a fixed linear function of the token ids and segment ids that went in
(tests/task_models.py), checked against the graph run in onnxruntime on the tokenizer's own
encoding; the embedder is the default model with prompts and Matryoshka widths.
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnxruntime
import pytest
import tritonclient.grpc as grpcclient
from tokenizers import Tokenizer
from tritonclient.utils import InferenceServerException

from service.core.repository import RepositoryError, config_text, parse_config, read_model
from tests.conftest import DEFAULT_MODEL
from tests.servers import RunningServer, start_server
from tests.task_models import (
    BERT_CLASSIFIER,
    EMBEDDER,
    LABELS,
    MATRYOSHKA_DIMENSIONS,
    MAX_SEQUENCE_LENGTH,
    PROMPTS,
    ROBERTA_RERANKER,
    SENTENCES,
    copy_repository,
    expected_logits,
    task_repository,
)

QUERY = SENTENCES[0]
TEXTS = list(SENTENCES[1:5])
LONG_TEXT = " ".join(SENTENCES)


@pytest.fixture(scope="module")
def repository(default_repository: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Both classifiers and the prompted embedder."""
    return task_repository(tmp_path_factory.mktemp("task-grpc") / "repository", default_repository / DEFAULT_MODEL)


@pytest.fixture(scope="module")
def server(repository: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """One server for the whole repository."""
    with start_server(repository, tmp_path_factory.mktemp("task-grpc-server") / "server.log") as running:
        yield running


@pytest.fixture(scope="module")
def client(server: RunningServer) -> grpcclient.InferenceServerClient:
    """A tritonclient gRPC client of the server."""
    return grpcclient.InferenceServerClient(server.target)


def bytes_input(name: str, texts: list[str]) -> grpcclient.InferInput:
    """A BYTES [len(texts)] input."""
    tensor = grpcclient.InferInput(name, [len(texts)], "BYTES")
    tensor.set_data_from_numpy(np.array([text.encode() for text in texts], dtype=object))
    return tensor


def logits(
    client: grpcclient.InferenceServerClient, model: str, texts: list[str], queries: list[str] | None
) -> np.ndarray:
    """The model's logits for texts (paired with queries when given)."""
    inputs = [bytes_input("text", texts)] + ([bytes_input("query", queries)] if queries is not None else [])
    return client.infer(model, inputs).as_numpy("logits")


def embedding(client: grpcclient.InferenceServerClient, texts: list[str], **parameters: object) -> np.ndarray:
    """The embedder's embeddings of texts under the given request parameters."""
    outputs = [grpcclient.InferRequestedOutput("embedding")]
    answer = client.infer(EMBEDDER, [bytes_input("text", texts)], outputs=outputs, parameters=parameters or None)
    return answer.as_numpy("embedding")


def refusal(client: grpcclient.InferenceServerClient, model: str, inputs: list, **parameters: object) -> str:
    """The INVALID_ARGUMENT message the server answers a malformed request with."""
    with pytest.raises(InferenceServerException) as refused:
        client.infer(model, inputs, parameters=parameters or None)
    assert refused.value.status() == "StatusCode.INVALID_ARGUMENT", refused.value.message()
    return refused.value.message()


def reference_embedding(repository: Path, texts: list[str]) -> np.ndarray:
    """The embedder's graph run on the default tokenizer's encoding of texts (already prefixed)."""
    folder = repository / EMBEDDER
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.enable_padding()
    encodings = tokenizer.encode_batch(texts)
    session = onnxruntime.InferenceSession(str(folder / "1" / "model.onnx"), providers=["CPUExecutionProvider"])
    feeds = {
        "input_ids": np.array([e.ids for e in encodings], dtype=np.int64),
        "attention_mask": np.array([e.attention_mask for e in encodings], dtype=np.int64),
        "token_type_ids": np.array([e.type_ids for e in encodings], dtype=np.int64),
    }
    return session.run(["embedding"], feeds)[0]


@pytest.mark.parametrize("model", [BERT_CLASSIFIER, ROBERTA_RERANKER])
def test_pairs_and_single_texts_answer_the_graph_on_the_tokenizer_encoding(
    client: grpcclient.InferenceServerClient, repository: Path, model: str
) -> None:
    """Row i is (query[i], text[i]) encoded as the tokenizer pairs them; without query, the text alone."""
    paired = logits(client, model, TEXTS, [QUERY] * len(TEXTS))
    single = logits(client, model, TEXTS, None)
    assert paired.shape == single.shape == (len(TEXTS), len(LABELS[model]))
    np.testing.assert_allclose(paired, expected_logits(repository / model, [(QUERY, t) for t in TEXTS]), atol=1e-5)
    np.testing.assert_allclose(single, expected_logits(repository / model, [(t,) for t in TEXTS]), atol=1e-5)
    assert not np.allclose(paired, single)


def test_segment_ids_reach_the_graph(client: grpcclient.InferenceServerClient, repository: Path) -> None:
    """The BERT-form pair differs from the same tokens as segment 0 (the graph weighs segment 1 double)."""
    paired = logits(client, BERT_CLASSIFIER, [TEXTS[0]], [QUERY])
    tokenizer = Tokenizer.from_file(str(repository / BERT_CLASSIFIER / "tokenizer.json"))
    assert tokenizer.encode(QUERY, TEXTS[0]).type_ids[-1] == 1
    session = onnxruntime.InferenceSession(str(repository / BERT_CLASSIFIER / "1" / "model.onnx"))
    encoding = tokenizer.encode(QUERY, TEXTS[0])
    flat = {
        "input_ids": np.array([encoding.ids], dtype=np.int64),
        "attention_mask": np.array([encoding.attention_mask], dtype=np.int64),
        "token_type_ids": np.zeros((1, len(encoding.ids)), dtype=np.int64),
    }
    assert not np.allclose(paired, session.run(["logits"], flat)[0], atol=1e-3)


def test_long_pairs_truncate_longest_first(client: grpcclient.InferenceServerClient, repository: Path) -> None:
    """A pair over max_sequence_length is cut as the tokenizer's longest_first cuts it, unless truncate is false."""
    pair = (QUERY, LONG_TEXT)
    answer = logits(client, BERT_CLASSIFIER, [LONG_TEXT], [QUERY])
    np.testing.assert_allclose(answer, expected_logits(repository / BERT_CLASSIFIER, [pair]), atol=1e-5)
    message = refusal(
        client, BERT_CLASSIFIER, [bytes_input("text", [TEXTS[0], LONG_TEXT]), bytes_input("query", [QUERY] * 2)],
        truncate=False,
    )  # fmt: skip
    untruncated = Tokenizer.from_file(str(repository / BERT_CLASSIFIER / "tokenizer.json"))
    untruncated.no_truncation()
    count = len(untruncated.encode(*pair).ids)
    assert f"pair 1 has {count} tokens, more than the model's {MAX_SEQUENCE_LENGTH}" in message, message


def test_truncate_false_embeds_long_texts_in_windows(client: grpcclient.InferenceServerClient) -> None:
    """truncate=false: a text over the limit is embedded whole, in windows; a short text as with truncate."""
    long_text = "bread " * 150 + "stocks " * 150
    whole = embedding(client, ["short", long_text], truncate=False)
    cut = embedding(client, ["short", long_text])
    assert whole.shape == cut.shape == (2, 384)
    np.testing.assert_allclose(whole[0], cut[0], atol=1e-6)
    assert float(np.dot(whole[1], cut[1])) < 0.99


def test_prompt_name_prefixes_the_text_and_the_default_applies(
    client: grpcclient.InferenceServerClient, repository: Path
) -> None:
    """prompt_name puts its prefix before each text; with none named, the default prompt (passage) applies."""
    named = embedding(client, TEXTS[:2], prompt_name="query")
    default = embedding(client, TEXTS[:2])
    reference = reference_embedding(repository, [PROMPTS["query"] + t for t in TEXTS[:2]])
    np.testing.assert_allclose(named, reference, atol=1e-4)
    np.testing.assert_allclose(default, embedding(client, TEXTS[:2], prompt_name="passage"), atol=1e-6)
    np.testing.assert_allclose(
        default, reference_embedding(repository, ["passage: " + t for t in TEXTS[:2]]), atol=1e-4
    )


def test_dimensions_shorten_and_renormalise(client: grpcclient.InferenceServerClient) -> None:
    """dimensions d (a Matryoshka width) gives the first d values, renormalised; other widths are refused."""
    full = embedding(client, TEXTS[:2])
    for width in (*MATRYOSHKA_DIMENSIONS, 384):
        short = embedding(client, TEXTS[:2], dimensions=width)
        head = full[:, :width]
        np.testing.assert_allclose(short, head / np.linalg.norm(head, axis=1, keepdims=True), atol=1e-6)
    message = refusal(client, EMBEDDER, [bytes_input("text", TEXTS[:1])], dimensions=100)
    assert "384, 128, 64" in message and "100" in message


def test_metadata_and_config_say_what_each_task_takes(client: grpcclient.InferenceServerClient) -> None:
    """A classifier lists text, query, the token inputs and logits [-1, labels]; config reports task and labels."""
    metadata = client.get_model_metadata(BERT_CLASSIFIER, as_json=True)
    inputs = {tensor["name"]: tensor for tensor in metadata["inputs"]}
    assert {"text", "query", "input_ids", "attention_mask", "token_type_ids"} <= set(inputs)
    assert [(o["name"], o["shape"]) for o in metadata["outputs"]] == [("logits", ["-1", "3"])]
    reranker = client.get_model_metadata(ROBERTA_RERANKER, as_json=True)
    assert "token_type_ids" not in {tensor["name"] for tensor in reranker["inputs"]}
    parameters = client.get_model_config(BERT_CLASSIFIER, as_json=True)["config"]["parameters"]
    assert parameters["task"]["string_value"] == "classify"
    assert json.loads(parameters["labels"]["string_value"]) == list(LABELS[BERT_CLASSIFIER])
    embedder = client.get_model_metadata(EMBEDDER, as_json=True)
    assert "query" not in {tensor["name"] for tensor in embedder["inputs"]}
    config = client.get_model_config(EMBEDDER, as_json=True)["config"]["parameters"]
    assert json.loads(config["prompts"]["string_value"]) == PROMPTS
    assert config["default_prompt_name"]["string_value"] == "passage"
    assert json.loads(config["matryoshka_dimensions"]["string_value"]) == list(MATRYOSHKA_DIMENSIONS)


def test_malformed_task_requests_get_precise_refusals(client: grpcclient.InferenceServerClient) -> None:
    """Each malformed request is refused INVALID_ARGUMENT with what was wrong; the server keeps serving."""
    text, query = bytes_input("text", TEXTS[:2]), bytes_input("query", [QUERY])
    assert "query holds 1 elements and text 2" in refusal(client, BERT_CLASSIFIER, [text, query])
    assert "query" in refusal(client, EMBEDDER, [bytes_input("text", [QUERY]), bytes_input("query", [QUERY])])
    message = refusal(client, EMBEDDER, [bytes_input("text", [QUERY])], prompt_name="nope")
    assert "'nope'" in message and "query, passage" in message
    assert "no prompts" in refusal(client, BERT_CLASSIFIER, [bytes_input("text", [QUERY])], prompt_name="query")
    assert "answers no embedding" in refusal(client, BERT_CLASSIFIER, [bytes_input("text", [QUERY])], dimensions=2)
    assert "true or false" in refusal(client, EMBEDDER, [bytes_input("text", [QUERY])], truncate="no")
    huge = bytes_input("query", [QUERY, "x" * (64 * 1024 + 1)])  # over --max-text-bytes: named as the query it is
    assert "input query[1] is 65537 bytes" in refusal(client, BERT_CLASSIFIER, [bytes_input("text", TEXTS[:2]), huge])
    assert logits(client, BERT_CLASSIFIER, TEXTS[:1], [QUERY]).shape == (1, 3)


def test_pairs_through_two_front_ends(repository: Path, tmp_path: Path) -> None:
    """With --frontends 2, pairs and their segment ids cross to the engine process intact."""
    with start_server(repository, tmp_path / "server.log", "--frontends", "2") as running:
        client = grpcclient.InferenceServerClient(running.target)
        for model in (BERT_CLASSIFIER, ROBERTA_RERANKER):
            expected = expected_logits(repository / model, [(QUERY, t) for t in TEXTS])
            for _ in range(2):  # new connections may land on either front end
                answer = logits(grpcclient.InferenceServerClient(running.target), model, TEXTS, [QUERY] * len(TEXTS))
                np.testing.assert_allclose(answer, expected, atol=1e-5)
        assert "query holds" in refusal(
            client, BERT_CLASSIFIER, [bytes_input("text", TEXTS[:2]), bytes_input("query", [QUERY])]
        )


@pytest.mark.parametrize(
    ("model", "key", "value", "message"),
    [
        (BERT_CLASSIFIER, "task", "summarize", "task 'summarize' is not one of embed, classify"),
        (BERT_CLASSIFIER, "labels", '["a", "b"]', "labels must name the 3 labels of output logits"),
        (BERT_CLASSIFIER, "labels", "[a", "parameter 'labels' is not JSON"),
        (EMBEDDER, "task", "classify", "a classify model's outputs must be logits"),
        (EMBEDDER, "pooling", "sum", "pooling 'sum' is not one of mean, cls, max, lasttoken"),
        (EMBEDDER, "prompts", '["query: "]', "parameter 'prompts' must be a JSON dict"),
        (EMBEDDER, "default_prompt_name", "document", "default_prompt_name 'document' is not one of the prompts"),
        (EMBEDDER, "matryoshka_dimensions", "[512]", "matryoshka_dimensions must be widths within 1..384"),
    ],
)
def test_repository_refuses_bad_task_parameters(
    repository: Path, tmp_path: Path, *, model: str, key: str, value: str, message: str
) -> None:
    """Each bad task parameter is a RepositoryError naming the config file and the fault."""
    folder = copy_repository(repository, tmp_path / "copy") / model
    config = parse_config((folder / "config.pbtxt").read_text(), folder)
    config.parameters[key].string_value = value
    (folder / "config.pbtxt").write_text(config_text(config))
    with pytest.raises(RepositoryError, match=re.escape(message)) as refused:
        read_model(folder)
    assert str(folder / "config.pbtxt") in str(refused.value)


def rest_infer(server: RunningServer, model: str, body: dict[str, object]) -> tuple[int, dict[str, object]]:
    """POST a KServe v2 REST infer request; the status and the JSON answer."""
    request = urllib.request.Request(
        f"{server.http_url}/v2/models/{model}/infer",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_rest_takes_the_same_pairs_and_parameters(
    server: RunningServer, client: grpcclient.InferenceServerClient
) -> None:
    """KServe v2 REST: query/text pairs and the prompt_name/dimensions parameters answer as over gRPC."""
    status, answer = rest_infer(
        server,
        BERT_CLASSIFIER,
        {
            "inputs": [
                {"name": "text", "shape": [2], "datatype": "BYTES", "data": TEXTS[:2]},
                {"name": "query", "shape": [2], "datatype": "BYTES", "data": [QUERY, QUERY]},
            ]
        },
    )
    assert status == 200, answer
    (output,) = answer["outputs"]
    assert output["name"] == "logits" and output["shape"] == [2, 3]
    np.testing.assert_allclose(
        np.array(output["data"]).reshape(2, 3), logits(client, BERT_CLASSIFIER, TEXTS[:2], [QUERY] * 2), atol=1e-6
    )
    text = {"name": "text", "shape": [1], "datatype": "BYTES", "data": TEXTS[:1]}
    parameters = {"prompt_name": "query", "dimensions": 64}
    status, answer = rest_infer(
        server, EMBEDDER, {"inputs": [text], "outputs": [{"name": "embedding"}], "parameters": parameters}
    )
    assert status == 200, answer
    np.testing.assert_allclose(
        np.array(answer["outputs"][0]["data"]).reshape(1, 64),
        embedding(client, TEXTS[:1], prompt_name="query", dimensions=64),
        atol=1e-6,
    )
    status, answer = rest_infer(server, EMBEDDER, {"inputs": [text], "parameters": {"prompt_name": "nope"}})
    assert status == 400 and "query, passage" in answer["error"], answer


TOKEN_OUTPUTS = ("token_ids", "token_offsets", "token_counts")


def token_outputs(
    client: grpcclient.InferenceServerClient, model: str, texts: list[str], **parameters: object
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The texts' token ids, offsets and counts as the server's tokenizer reads them."""
    outputs = [grpcclient.InferRequestedOutput(name) for name in TOKEN_OUTPUTS]
    answer = client.infer(model, [bytes_input("text", texts)], outputs=outputs, parameters=parameters or None)
    return tuple(answer.as_numpy(name) for name in TOKEN_OUTPUTS)


def executions(client: grpcclient.InferenceServerClient, model: str) -> int:
    """Batches the model has run (Triton's execution_count)."""
    (figures,) = client.get_inference_statistics(model, as_json=True)["model_stats"]
    return int(figures.get("execution_count", 0))


def expected_tokens(repository: Path, model: str, texts: list[str], special: bool = True, length: int | None = 0):
    """Ids, offsets ((-1, -1) for special tokens) and counts from the model's tokenizer.json: truncation at
    `length` (0: the model's max_sequence_length; None: none), padded with -1."""
    tokenizer = Tokenizer.from_file(str(repository / model / "tokenizer.json"))
    tokenizer.no_padding()
    if length is None:
        tokenizer.no_truncation()
    else:
        config = repository / model / "config.pbtxt"
        served = parse_config(config.read_text(), config).parameters
        tokenizer.enable_truncation(length or int(served["max_sequence_length"].string_value))
    encodings = tokenizer.encode_batch(texts, add_special_tokens=special)
    width = max(len(e.ids) for e in encodings)
    ids = np.full((len(texts), width), -1, dtype=np.int64)
    offsets = np.full((len(texts), width, 2), -1, dtype=np.int64)
    for row, encoding in enumerate(encodings):
        ids[row, : len(encoding.ids)] = encoding.ids
        for place, (span, special_token) in enumerate(zip(encoding.offsets, encoding.special_tokens_mask, strict=True)):
            if not special_token:
                offsets[row, place] = span
    return ids, offsets, np.array([[len(e.ids)] for e in encodings], dtype=np.int64)


def test_token_outputs_are_the_tokenizers_reading_without_running_the_model(
    client: grpcclient.InferenceServerClient, repository: Path
) -> None:
    """token_ids, token_offsets and token_counts: the prompted texts as the model's tokenizer reads them, truncated
    at its maximum (or not, with truncate false), special tokens or not; no batch runs for them."""
    texts = ["A.", QUERY, LONG_TEXT * 20]
    embedding(client, texts[:1])
    before = executions(client, EMBEDDER)
    assert before > 0
    ids, offsets, counts = token_outputs(client, EMBEDDER, texts)
    reference = expected_tokens(repository, EMBEDDER, ["passage: " + text for text in texts])  # the default prompt
    for served, expected in zip((ids, offsets, counts), reference, strict=True):
        np.testing.assert_array_equal(served, expected)
    assert ids[1][0] == 101 and offsets[1][0].tolist() == [-1, -1]  # [CLS], a special token, has no place
    start, stop = offsets[1][1]
    assert ("passage: " + QUERY)[start:stop] == "passage"
    named = token_outputs(client, EMBEDDER, [QUERY], prompt_name="query", add_special_tokens=False)
    for served, expected in zip(named, expected_tokens(repository, EMBEDDER, ["query: " + QUERY], False), strict=True):
        np.testing.assert_array_equal(served, expected)
    whole = token_outputs(client, EMBEDDER, texts[2:], truncate=False)
    untruncated = expected_tokens(repository, EMBEDDER, ["passage: " + texts[2]], length=None)
    for served, expected in zip(whole, untruncated, strict=True):
        np.testing.assert_array_equal(served, expected)
    assert whole[2][0, 0] > counts[2, 0]
    pairs_model = token_outputs(client, BERT_CLASSIFIER, TEXTS[:2])
    np.testing.assert_array_equal(pairs_model[0], expected_tokens(repository, BERT_CLASSIFIER, TEXTS[:2])[0])
    assert executions(client, EMBEDDER) == before


def test_token_outputs_over_rest(server: RunningServer, client: grpcclient.InferenceServerClient) -> None:
    """KServe v2 REST answers the token outputs as gRPC does (the same pipeline)."""
    text = {"name": "text", "shape": [2], "datatype": "BYTES", "data": TEXTS[:2]}
    outputs = [{"name": "token_counts"}, {"name": "token_ids"}]
    status, answer = rest_infer(server, EMBEDDER, {"inputs": [text], "outputs": outputs})
    assert status == 200, answer
    counts, ids = answer["outputs"]
    expected_ids, _, expected_counts = token_outputs(client, EMBEDDER, TEXTS[:2])
    assert counts["shape"] == [2, 1] and counts["data"] == expected_counts.ravel().tolist()
    assert ids["shape"] == list(expected_ids.shape) and ids["data"] == expected_ids.ravel().tolist()


def test_token_outputs_are_not_declared_and_their_misuse_refused(client: grpcclient.InferenceServerClient) -> None:
    """The token outputs are answered but not declared (perf_analyzer asks for every declared output, and these are
    answered alone); mixing them with the model's outputs, token inputs, pairs and a stray add_special_tokens are
    refused with what was wrong."""
    declared = {o["name"] for o in client.get_model_metadata(EMBEDDER, as_json=True)["outputs"]}
    configured = {o["name"] for o in client.get_model_config(EMBEDDER, as_json=True)["config"]["output"]}
    assert "embedding" in declared and "embedding" in configured
    assert not (declared | configured) & set(TOKEN_OUTPUTS)
    text = [bytes_input("text", TEXTS[:1])]
    mixed = [grpcclient.InferRequestedOutput(name) for name in ("embedding", "token_ids")]
    with pytest.raises(InferenceServerException, match="request them apart from the model's other outputs"):
        client.infer(EMBEDDER, text, outputs=mixed)
    ids = grpcclient.InferInput("input_ids", [1, 2], "INT64")
    ids.set_data_from_numpy(np.array([[101, 102]], dtype=np.int64))
    mask = grpcclient.InferInput("attention_mask", [1, 2], "INT64")
    mask.set_data_from_numpy(np.ones((1, 2), dtype=np.int64))
    with pytest.raises(InferenceServerException, match="send input text, not token ids"):
        client.infer(EMBEDDER, [ids, mask], outputs=[grpcclient.InferRequestedOutput("token_ids")])
    pair = [bytes_input("text", TEXTS[:1]), bytes_input("query", [QUERY])]
    with pytest.raises(InferenceServerException, match="tokens of single texts: send no input query"):
        client.infer(BERT_CLASSIFIER, pair, outputs=[grpcclient.InferRequestedOutput("token_counts")])
    assert "applies to the outputs token_ids" in refusal(client, EMBEDDER, text, add_special_tokens=False)
    with pytest.raises(InferenceServerException, match="add_special_tokens must be true or false"):
        client.infer(
            EMBEDDER, text, outputs=[grpcclient.InferRequestedOutput("token_ids")], parameters={"add_special_tokens": 1}
        )
    assert token_outputs(client, EMBEDDER, TEXTS[:1])[2].shape == (1, 1)
