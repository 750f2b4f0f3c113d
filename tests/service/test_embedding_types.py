"""Compact embeddings (int8, uint8, binary, ubinary) on every protocol, against sentence-transformers' own quantisation.

The default model is served from its exported repository, whose calibrated ranges are the
`ranges` argument of `quantize_embeddings`. Each served form must equal `quantize_embeddings` of
the server's own float embedding exactly (the convention), and agree with the quantisation of
`SentenceTransformer.encode` up to the float noise between the two (one code; a bit of a value
within 1e-5 of zero).
"""

from __future__ import annotations

import base64
import shutil
from pathlib import Path

import numpy as np
import openai
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from sentence_transformers import SentenceTransformer
from sentence_transformers.util.quantization import quantize_embeddings
from tritonclient.utils import InferenceServerException

from export.gate.cases import read_sentences
from service.core.repository import P_EMBEDDING_RANGES, config_text, parse_config, read_model
from service.errors import InvalidArgument
from service.pipeline.embedding_types import quantize
from service.pipeline.outputs import check_output, served_outputs
from tests.servers import RunningServer
from tests.servers import post_json as post

MODEL = "all-MiniLM-L6-v2"
WIDTH = 384
TEXTS = read_sentences()[:12]
"""Gate sentences: the calibration corpus, so every value is within its stored range."""
UNSEEN = ["A sentence the calibration corpus never held, about quantised vectors in a database."]
COMPACT = {"int8": "INT8", "uint8": "UINT8", "binary": "INT8", "ubinary": "UINT8"}
NUMPY = {"INT8": np.int8, "UINT8": np.uint8}


@pytest.fixture(scope="module")
def ranges(default_repository: Path) -> np.ndarray:
    """The stored [2, 384] ranges of the default model."""
    return read_model(default_repository / MODEL).embedding_ranges[WIDTH]


@pytest.fixture(scope="module")
def reference(default_folder: Path) -> np.ndarray:
    """SentenceTransformer.encode of the texts."""
    return SentenceTransformer(str(default_folder), device="cpu").encode(TEXTS, convert_to_numpy=True)


def grpc_outputs(server: RunningServer, texts: list[str], names: list[str]) -> grpcclient.InferResult:
    with grpcclient.InferenceServerClient(server.target) as client:
        tensor = grpcclient.InferInput("text", [len(texts)], "BYTES")
        tensor.set_data_from_numpy(np.array([text.encode() for text in texts], dtype=object))
        outputs = [grpcclient.InferRequestedOutput(name) for name in names]
        return client.infer(MODEL, [tensor], outputs=outputs)


@pytest.fixture(scope="module")
def served(default_server: RunningServer) -> dict[str, np.ndarray]:
    """Every form of the texts' embedding over gRPC (tritonclient), by embedding type."""
    names = ["embedding", *(f"embedding_{kind}" for kind in COMPACT)]
    result = grpc_outputs(default_server, TEXTS, names)
    forms = {"float": result.as_numpy("embedding")}
    for kind, datatype in COMPACT.items():
        output = result.get_output(f"embedding_{kind}")
        assert output.datatype == datatype
        forms[kind] = result.as_numpy(f"embedding_{kind}")
        assert forms[kind].dtype == NUMPY[datatype]
    return forms


def test_quantize_equals_sentence_transformers_inside_and_outside_the_range() -> None:
    rng = np.random.default_rng(0)
    calibration = rng.normal(size=(64, 20)).astype(np.float32)
    ranges = np.stack([calibration.min(axis=0), calibration.max(axis=0)])
    for kind in ("int8", "uint8", "binary", "ubinary"):
        ours = quantize(calibration, kind, ranges)
        np.testing.assert_array_equal(ours, quantize_embeddings(calibration, kind, ranges=ranges))
    # A value past its range is clipped to the range's end, by both.
    outside = np.stack([ranges[0] - 1, ranges[1] + 1])
    np.testing.assert_array_equal(quantize(outside, "int8", ranges), [[-128] * 20, [127] * 20])
    np.testing.assert_array_equal(quantize(outside, "uint8", ranges), [[0] * 20, [255] * 20])
    np.testing.assert_array_equal(
        quantize(outside, "int8", ranges), quantize_embeddings(outside, "int8", ranges=ranges)
    )
    # 20 dimensions pack into 3 bytes a row, the last padded with zero bits.
    assert quantize(calibration, "ubinary").shape == (64, 3)


def test_grpc_forms_are_quantize_embeddings_of_the_served_vectors(
    served: dict[str, np.ndarray], ranges: np.ndarray, reference: np.ndarray
) -> None:
    for kind in COMPACT:
        expected = quantize_embeddings(served["float"], kind, ranges=ranges if kind in ("int8", "uint8") else None)
        np.testing.assert_array_equal(served[kind], expected)
    assert served["binary"].shape == served["ubinary"].shape == (len(TEXTS), WIDTH // 8)
    for kind in ("int8", "uint8"):
        theirs = quantize_embeddings(reference, kind, ranges=ranges).astype(np.int16)
        assert np.abs(served[kind].astype(np.int16) - theirs).max() <= 1
    clear = np.abs(reference) > 1e-5
    served_bits = np.unpackbits(served["ubinary"], axis=1).astype(bool)
    np.testing.assert_array_equal(served_bits[clear], (reference > 0)[clear])


def test_values_outside_the_calibrated_range_are_clipped(default_server: RunningServer, ranges: np.ndarray) -> None:
    result = grpc_outputs(default_server, UNSEEN, ["embedding", "embedding_uint8"])
    vector, codes = result.as_numpy("embedding")[0], result.as_numpy("embedding_uint8")[0]
    np.testing.assert_array_equal(codes[vector <= ranges[0]], 0)
    np.testing.assert_array_equal(codes[vector >= ranges[1]], 255)
    np.testing.assert_array_equal(codes, quantize(result.as_numpy("embedding"), "uint8", ranges)[0])


def test_metadata_and_config_declare_the_forms(default_server: RunningServer) -> None:
    with grpcclient.InferenceServerClient(default_server.target) as client:
        metadata = client.get_model_metadata(MODEL, as_json=True)
        config = client.get_model_config(MODEL, as_json=True)["config"]
    outputs = {output["name"]: (output["datatype"], output["shape"]) for output in metadata["outputs"]}
    assert outputs["embedding_int8"] == ("INT8", ["-1", str(WIDTH)])
    assert outputs["embedding_uint8"] == ("UINT8", ["-1", str(WIDTH)])
    assert outputs["embedding_binary"] == ("INT8", ["-1", str(WIDTH // 8)])
    assert outputs["embedding_ubinary"] == ("UINT8", ["-1", str(WIDTH // 8)])
    declared = {output["name"]: output["data_type"] for output in config["output"]}
    assert declared["embedding_int8"] == "TYPE_INT8" and declared["embedding_ubinary"] == "TYPE_UINT8"
    assert config["parameters"]["embedding_calibration"]["string_value"] == "sentences.txt: 82 texts"


def test_a_request_naming_no_outputs_gets_the_graphs_own(default_server: RunningServer) -> None:
    with grpcclient.InferenceServerClient(default_server.target) as client:
        tensor = grpcclient.InferInput("text", [1], "BYTES")
        tensor.set_data_from_numpy(np.array([TEXTS[0].encode()], dtype=object))
        answer = client.infer(MODEL, [tensor]).get_response(as_json=True)
    assert [output["name"] for output in answer["outputs"]] == ["last_hidden_state", "embedding"]


@pytest.mark.parametrize("binary", [True, False], ids=["binary-data", "json"])
def test_kserve_rest_answers_the_forms(default_server: RunningServer, served: dict, binary: bool) -> None:
    client = httpclient.InferenceServerClient(default_server.http_url.removeprefix("http://"))
    tensor = httpclient.InferInput("text", [len(TEXTS)], "BYTES")
    tensor.set_data_from_numpy(np.array([text.encode() for text in TEXTS], dtype=object))
    outputs = [httpclient.InferRequestedOutput(f"embedding_{kind}", binary_data=binary) for kind in COMPACT]
    result = client.infer(MODEL, [tensor], outputs=outputs)
    for kind in COMPACT:
        np.testing.assert_array_equal(result.as_numpy(f"embedding_{kind}"), served[kind])
    client.close()


def test_openai_embedding_type_as_numbers_and_base64(default_server: RunningServer, served: dict) -> None:
    client = openai.OpenAI(base_url=default_server.http_url + "/v1", api_key="unused")
    for kind in COMPACT:
        numbers = client.embeddings.create(
            model=MODEL, input=TEXTS, encoding_format="float", extra_body={"embedding_type": kind}
        )
        np.testing.assert_array_equal(np.array([item.embedding for item in numbers.data]), served[kind])
        status, answer = post(
            default_server,
            "/v1/embeddings",
            {"model": MODEL, "input": TEXTS, "encoding_format": "base64", "embedding_type": kind},
        )
        assert status == 200
        rows = [np.frombuffer(base64.b64decode(item["embedding"]), dtype=served[kind].dtype) for item in answer["data"]]
        np.testing.assert_array_equal(np.stack(rows), served[kind])
    with pytest.raises(openai.BadRequestError, match="embedding_type must be one of"):
        client.embeddings.create(model=MODEL, input="x", encoding_format="float", extra_body={"embedding_type": "int4"})


def test_tei_embed_answers_each_type(default_server: RunningServer, served: dict) -> None:
    for kind in COMPACT:
        status, answer = post(default_server, "/embed", {"inputs": TEXTS, "embedding_type": kind})
        assert status == 200, answer
        np.testing.assert_array_equal(np.array(answer), served[kind])
    status, answer = post(default_server, "/embed", {"inputs": TEXTS[:1], "embedding_type": "float16"})
    assert status == 422
    assert "embedding_type must be one of float, int8, uint8, binary, ubinary" in answer["error"]


def test_cohere_v2_embed_answers_every_type(default_server: RunningServer, served: dict) -> None:
    kinds = ["float", "int8", "uint8", "binary", "ubinary", "base64"]
    status, answer = post(
        default_server,
        "/v2/embed",
        {"model": MODEL, "texts": TEXTS, "input_type": "search_document", "embedding_types": kinds},
    )
    assert status == 200, answer
    assert answer["response_type"] == "embeddings_by_type" and answer["texts"] == TEXTS
    assert answer["meta"]["billed_units"]["input_tokens"] > len(TEXTS)
    embeddings = answer["embeddings"]
    np.testing.assert_allclose(np.array(embeddings["float"]), served["float"], rtol=0, atol=1e-6)
    for kind in COMPACT:
        np.testing.assert_array_equal(np.array(embeddings[kind]), served[kind])
    decoded = np.stack([np.frombuffer(base64.b64decode(row), dtype="<f4") for row in embeddings["base64"]])
    np.testing.assert_array_equal(decoded, np.array(embeddings["float"], dtype=np.float32))


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"texts": ["a"], "embedding_types": ["int4"]}, "embedding_types: 'int4' is not one of"),
        ({"texts": ["a"], "embedding_types": []}, "embedding_types must be a non-empty list"),
        ({"texts": []}, "texts is required"),
        ({"texts": ["a"], "images": ["data:image/png;base64,"]}, "send texts or images, not both"),
        ({"images": ["data:image/png;base64,iVBO"]}, "input image: this model has no image tower"),
        ({"texts": ["a"], "truncate": "START"}, "truncate START is not supported"),
        ({"texts": ["a"], "input_type": "image"}, "input_type must be one of"),
        ({"texts": ["a"], "output_dimension": 128}, "not trained to be shortened"),
    ],
)
def test_cohere_v2_embed_refuses_precisely(default_server: RunningServer, body: dict, message: str) -> None:
    status, answer = post(default_server, "/v2/embed", {"model": MODEL, **body})
    assert status == 400
    assert message in answer["message"]


def test_grpc_refuses_an_unknown_form(default_server: RunningServer) -> None:
    with pytest.raises(InferenceServerException, match="unknown output 'embedding_int4'"):
        grpc_outputs(default_server, TEXTS[:1], ["embedding_int4"])


def test_a_repository_without_ranges_serves_binary_but_not_int8(default_repository: Path, tmp_path: Path) -> None:
    copy = tmp_path / MODEL
    shutil.copytree(default_repository / MODEL, copy)
    config_file = copy / "config.pbtxt"
    config = parse_config(config_file.read_text(), config_file)
    del config.parameters[P_EMBEDDING_RANGES]
    config_file.write_text(config_text(config))
    spec = read_model(copy)
    assert spec.embedding_ranges == {}
    assert check_output("embedding_binary", spec, served_outputs(spec, accepts_text=True)).datatype == "INT8"
    with pytest.raises(InvalidArgument, match="no calibrated embedding ranges"):
        check_output("embedding_int8", spec, served_outputs(spec, accepts_text=True))
