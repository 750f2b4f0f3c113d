"""KServe v2 REST on the HTTP port, driven by `tritonclient.http` (JSON and binary tensors) and raw HTTP."""

from __future__ import annotations

import http.client
import json
import re
import socket
from collections.abc import Callable

import numpy as np
import pytest
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tritonclient.utils import InferenceServerException

from tests.conftest import TINY_MODEL
from tests.servers import RunningServer, metric_samples, metric_value

SENTENCES = ["A man is eating food.", "The new movie is awesome.", "Ein Hund läuft über die Wiese 🐕."]


@pytest.fixture(scope="module")
def client(tiny_server: RunningServer) -> triton.InferenceServerClient:
    client = triton.InferenceServerClient(f"127.0.0.1:{tiny_server.http_port}")
    yield client
    client.close()


def text_input(texts: list[str], binary: bool) -> triton.InferInput:
    tensor = triton.InferInput("text", [len(texts)], "BYTES")
    tensor.set_data_from_numpy(np.array([text.encode() for text in texts], dtype=object), binary_data=binary)
    return tensor


def grpc_outputs(server: RunningServer, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    client = triton_grpc.InferenceServerClient(server.target)
    tensor = triton_grpc.InferInput("text", [len(texts)], "BYTES")
    tensor.set_data_from_numpy(np.array([text.encode() for text in texts], dtype=object))
    result = client.infer(TINY_MODEL, [tensor])
    return result.as_numpy("embedding"), result.as_numpy("last_hidden_state")


def test_health_metadata_and_config(client: triton.InferenceServerClient) -> None:
    assert client.is_server_live()
    assert client.is_server_ready()
    assert client.is_model_ready(TINY_MODEL)
    assert client.is_model_ready(TINY_MODEL, "1")
    assert not client.is_model_ready(TINY_MODEL, "2")
    assert not client.is_model_ready("no-such-model")
    assert client.get_server_metadata()["name"] == "encoder-serve"
    metadata = client.get_model_metadata(TINY_MODEL)
    assert metadata["versions"] == ["1"]
    inputs = {tensor["name"]: (tensor["datatype"], tensor["shape"]) for tensor in metadata["inputs"]}
    assert inputs["input_ids"] == ("INT64", [-1, -1])
    outputs = {tensor["name"]: (tensor["datatype"], tensor["shape"]) for tensor in metadata["outputs"]}
    assert outputs == {
        "embedding": ("FP32", [-1, 32]),
        "last_hidden_state": ("FP32", [-1, -1, 32]),
        "embedding_int8": ("INT8", [-1, 32]),
        "embedding_uint8": ("UINT8", [-1, 32]),
        "embedding_binary": ("INT8", [-1, 4]),
        "embedding_ubinary": ("UINT8", [-1, 4]),
        "chunk_embeddings": ("FP32", [-1, 32]),
        "chunk_counts": ("INT64", [-1, 1]),
    }
    assert client.get_model_metadata(TINY_MODEL, "1")["name"] == TINY_MODEL
    config = client.get_model_config(TINY_MODEL)
    # As Triton writes it: proto field names, enum names, 64-bit integers as numbers.
    assert config["max_batch_size"] == 64
    embedding = next(tensor for tensor in config["output"] if tensor["name"] == "embedding")
    assert embedding["data_type"] == "TYPE_FP32" and embedding["dims"] == [32]


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_infer_text_answers_what_grpc_answers(
    tiny_server: RunningServer, client: triton.InferenceServerClient, binary: bool
) -> None:
    outputs = [
        triton.InferRequestedOutput("embedding", binary_data=binary),
        triton.InferRequestedOutput("last_hidden_state", binary_data=binary),
    ]
    result = client.infer(TINY_MODEL, [text_input(SENTENCES, binary)], outputs=outputs, request_id="r-7")
    answer = result.get_response()
    assert (answer["model_name"], answer["model_version"], answer["id"]) == (TINY_MODEL, "1", "r-7")
    embedding, hidden = grpc_outputs(tiny_server, SENTENCES)
    np.testing.assert_allclose(result.as_numpy("embedding"), embedding, atol=1e-6)
    np.testing.assert_allclose(result.as_numpy("last_hidden_state"), hidden, atol=1e-5)


def test_outputs_default_to_all_in_binary_when_none_are_named(client: triton.InferenceServerClient) -> None:
    result = client.infer(TINY_MODEL, [text_input(["two words"], binary=True)])
    assert result.as_numpy("embedding").shape == (1, 32)
    assert result.as_numpy("last_hidden_state").shape == (1, 4, 32)  # [CLS] two words [SEP]


def test_infer_token_inputs(tiny_server: RunningServer, client: triton.InferenceServerClient) -> None:
    ids = np.array([[101, 2048, 2616, 102]], dtype=np.int64)
    tensors = []
    for name, values in (("input_ids", ids), ("attention_mask", np.ones_like(ids))):
        tensor = triton.InferInput(name, list(values.shape), "INT64")
        tensor.set_data_from_numpy(values, binary_data=name == "input_ids")  # one binary, one JSON
        tensors.append(tensor)
    result = client.infer(TINY_MODEL, tensors, outputs=[triton.InferRequestedOutput("embedding")])
    np.testing.assert_allclose(result.as_numpy("embedding"), grpc_outputs(tiny_server, ["two words"])[0], atol=1e-6)


def test_errors_reach_tritonclient_with_their_status(client: triton.InferenceServerClient) -> None:
    with pytest.raises(InferenceServerException, match="unknown model 'no-such-model'") as unknown:
        client.get_model_metadata("no-such-model")
    assert unknown.value.status() == "404"
    with pytest.raises(InferenceServerException, match="has no version '2'") as version:
        client.infer(TINY_MODEL, [text_input(["x"], binary=True)], model_version="2")
    assert version.value.status() == "404"
    misnamed = triton.InferInput("txet", [1], "BYTES")
    misnamed.set_data_from_numpy(np.array([b"x"], dtype=object))
    with pytest.raises(InferenceServerException, match="unknown input 'txet'") as wrong:
        client.infer(TINY_MODEL, [misnamed])
    assert wrong.value.status() == "400"
    with pytest.raises(InferenceServerException, match="parameter timeout must be a non-negative integer"):
        client.infer(TINY_MODEL, [text_input(["x"], binary=True)], timeout=-1)


def request(server: RunningServer, method: str, path: str, body: bytes = b"", **headers: str) -> tuple[int, bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=30)
    try:
        connection.request(method, path, body, {key.replace("_", "-"): value for key, value in headers.items()})
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


INFER = f"/v2/models/{TINY_MODEL}/infer"
GOOD_INPUT = {"name": "text", "datatype": "BYTES", "shape": [1], "data": ["fine"]}


@pytest.mark.parametrize(
    ("body", "headers", "status", "message"),
    [
        (b"{", {}, 400, "not valid JSON"),
        (b"\xff\xfe\x00", {}, 400, "not valid JSON"),
        (b"[1, 2]", {}, 400, "the request must be a JSON object"),
        (json.dumps({"inputs": [GOOD_INPUT], "extra": 1}).encode(), {}, 400, "unknown field 'extra'"),
        (json.dumps({"inputs": []}).encode(), {}, 400, "inputs must be a non-empty list"),
        (json.dumps({"inputs": [{**GOOD_INPUT, "shape": [2]}]}).encode(), {}, 400, "data holds 1 elements"),
        (json.dumps({"inputs": [{**GOOD_INPUT, "shape": "1"}]}).encode(), {}, 400, "shape must be a list"),
        (json.dumps({"inputs": [{**GOOD_INPUT, "data": [7]}]}).encode(), {}, 400, "BYTES data must be strings"),
        (json.dumps({"inputs": [{**GOOD_INPUT, "datatype": "FP32"}]}).encode(), {}, 400, "datatype FP32"),
        (json.dumps({"inputs": [{**GOOD_INPUT, "data": [""]}]}).encode(), {}, 400, r"input text\[0\] is empty"),
        (json.dumps({"inputs": [GOOD_INPUT], "outputs": [{"name": "pooled"}]}).encode(), {}, 400, "unknown output"),
        (json.dumps({"inputs": [GOOD_INPUT], "id": 5}).encode(), {}, 400, "id must be a string"),
        (
            json.dumps({"inputs": [{**GOOD_INPUT, "parameters": {"binary_data_size": 10}}]}).encode(),
            {},
            400,
            "has both data and binary_data_size",
        ),
        (json.dumps({"inputs": [GOOD_INPUT]}).encode(), {"inference_header_content_length": "999"}, 400, "within"),
        (
            json.dumps({"inputs": [GOOD_INPUT]}).encode() + b"tail",
            {"inference_header_content_length": "0"},
            400,
            "JSON",
        ),
        (json.dumps({"inputs": [GOOD_INPUT]}).encode(), {"content_type": "text/plain"}, 415, "text/plain"),
        (json.dumps({"inputs": [GOOD_INPUT]}).encode(), {"content_encoding": "gzip"}, 415, "gzip"),
    ],
)
def test_malformed_infer_bodies_get_a_precise_4xx(
    tiny_server: RunningServer, body: bytes, headers: dict[str, str], status: int, message: str
) -> None:
    labels = {"route": "/v2/models/{name}/infer", "status": str(status)}
    before = metric_value(metric_samples(tiny_server), "encoder_http_requests_total", **labels)
    answered, content = request(tiny_server, "POST", INFER, body, **headers)
    assert answered == status, content
    error = json.loads(content)["error"]
    assert isinstance(error, str)
    assert re.search(message, error), error
    assert metric_value(metric_samples(tiny_server), "encoder_http_requests_total", **labels) == before + 1


def test_binary_data_must_match_what_the_inputs_claim(tiny_server: RunningServer) -> None:
    text = b"binary text"
    header = json.dumps(
        {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "parameters": {"binary_data_size": 15}}]}
    ).encode()
    element = len(text).to_bytes(4, "little") + text
    good = request(tiny_server, "POST", INFER, header + element, inference_header_content_length=str(len(header)))
    assert good[0] == 200, good[1]
    for extra, expected in ((element + b"!", "1 bytes of binary data follow"), (element[:-1], "does not fit")):
        status, content = request(
            tiny_server, "POST", INFER, header + extra, inference_header_content_length=str(len(header))
        )
        assert status == 400 and expected in json.loads(content)["error"], content


def test_unknown_routes_and_methods(tiny_server: RunningServer) -> None:
    status, content = request(tiny_server, "GET", "/v2/no-such-route")
    assert status == 404 and "no route /v2/no-such-route" in json.loads(content)["error"]
    for path in (INFER, "/v2/repository/index"):
        status, content = request(tiny_server, "GET", path)
        assert status == 405 and "answers POST" in json.loads(content)["error"]


def test_repository_index_as_grpc_answers_it(tiny_server: RunningServer, client: triton.InferenceServerClient) -> None:
    served = [{"name": TINY_MODEL, "version": "1", "state": "READY"}]
    assert client.get_model_repository_index() == served
    grpc_index = triton_grpc.InferenceServerClient(tiny_server.target).get_model_repository_index().models
    assert [(m.name, m.version, m.state) for m in grpc_index] == [(m["name"], m["version"], m["state"]) for m in served]
    status, content = request(tiny_server, "POST", "/v2/repository/index", b'{"ready": true}')
    assert (status, json.loads(content)) == (200, served)
    for body, message in ((b'{"ready": "yes"}', "'ready' must be true or false"), (b'{"x": 1}', "unknown field 'x'")):
        status, content = request(tiny_server, "POST", "/v2/repository/index", body)
        assert status == 400 and message in json.loads(content)["error"], content


@pytest.mark.parametrize(
    ("call", "reason"),
    [
        (lambda client: client.load_model(TINY_MODEL), "models are loaded at start"),
        (lambda client: client.unload_model(TINY_MODEL), "models are loaded at start"),
        (lambda client: client.get_system_shared_memory_status(), "tensors travel inside the messages"),
        (lambda client: client.register_system_shared_memory("region", "/key", 64), "tensors travel inside"),
        (lambda client: client.unregister_system_shared_memory(), "tensors travel inside the messages"),
        (lambda client: client.get_cuda_shared_memory_status("region"), "tensors travel inside the messages"),
        (lambda client: client.unregister_cuda_shared_memory(), "tensors travel inside the messages"),
        (lambda client: client.get_trace_settings(TINY_MODEL), "--log-level DEBUG"),
        (lambda client: client.update_log_settings({"log_info": True}), "logging is set at start with --log-level"),
    ],
)
def test_the_triton_routes_not_offered_answer_501_with_the_grpc_methods_reason(
    client: triton.InferenceServerClient, call: Callable[[triton.InferenceServerClient], object], reason: str
) -> None:
    with pytest.raises(InferenceServerException, match=re.escape(reason)) as refused:
        call(client)
    assert refused.value.status() == "501"
    assert "is not supported by this server" in str(refused.value)
    assert client.is_model_ready(TINY_MODEL)


def test_the_server_keeps_serving_and_logs_no_error_after_garbage(tiny_server: RunningServer) -> None:
    with socket.create_connection(("127.0.0.1", tiny_server.http_port), timeout=30) as connection:
        connection.sendall(b"\x16\x03\x01 not HTTP at all\r\n\r\n")
        assert connection.recv(4096).startswith(b"HTTP/1.1 400")
    status, _ = request(tiny_server, "GET", "/v2/health/ready")
    assert status == 200
    assert " ERROR " not in tiny_server.log()


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**64), 2**64) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)
tensors = st.fixed_dictionaries(
    {
        "name": st.sampled_from(["text", "input_ids", "attention_mask", "token_type_ids", "other"]),
        "datatype": st.sampled_from(["BYTES", "INT64", "FP32", "int64"]),
        "shape": st.lists(st.integers(-2, 4) | st.sampled_from([2**62, 2**63]), max_size=3),
    },
    optional={
        "data": json_values,
        "parameters": st.dictionaries(st.sampled_from(["binary_data_size", "x"]), json_values),
    },
)
infer_bodies = st.fixed_dictionaries(
    {"inputs": st.lists(tensors, max_size=3)},
    optional={
        "outputs": json_values,
        "parameters": st.dictionaries(st.text(max_size=8), json_values),
        "id": json_values,
    },
)
embedding_bodies = st.fixed_dictionaries(
    {"model": st.sampled_from([TINY_MODEL, "other"]) | json_values, "input": json_values},
    optional={"encoding_format": json_values, "dimensions": json_values, "user": json_values},
)


@settings(max_examples=80, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    target=st.sampled_from([INFER, "/v1/embeddings"]),
    body=infer_bodies | embedding_bodies | json_values,
    binary=st.none() | st.binary(max_size=16),
)
def test_fuzzed_bodies_get_a_precise_answer_and_log_no_error(
    tiny_server: RunningServer, target: str, body: object, binary
) -> None:
    logged_before = tiny_server.log_path.stat().st_size
    encoded = json.dumps(body).encode()
    headers = {"content_type": "application/json"}
    if binary is not None:
        headers["inference_header_content_length"] = str(len(encoded))
        encoded += binary
    status, content = request(tiny_server, "POST", target, encoded, **headers)
    assert status in (200, 400, 404, 413), content
    if status != 200:
        error = json.loads(content)["error"]
        message = error["message"] if target.startswith("/v1/") else error  # OpenAI's object, or KServe's string
        assert isinstance(message, str) and message
    # The server still answers, and wrote no error line for this body (what it logged since it came).
    assert request(tiny_server, "GET", "/v2/health/ready")[0] == 200
    with tiny_server.log_path.open("rb") as log:
        log.seek(logged_before)
        assert b" ERROR " not in log.read(), body
