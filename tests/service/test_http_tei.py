"""text-embeddings-inference's /embed, /tokenize and /info over raw HTTP, on the default model's real server.

/embed is checked against /v1/embeddings (one engine behind both), /tokenize against the `tokenizers`
library reading the model's own tokenizer.json, and every refusal for TEI's error body and status.
"""

from __future__ import annotations

import http.client
import json
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from tests.conftest import DEFAULT_MODEL
from tests.servers import RunningServer

TEXTS = ["A man is eating food.", "Ein Hund läuft über die Wiese 🐕.", "The new movie is awesome."]


def request(
    server: RunningServer, method: str, route: str, body: object = None, content_type: str = "application/json"
) -> tuple[int, dict[str, str], object]:
    """One request to the HTTP port: the status, the headers (lower-case names) and the decoded answer."""
    data = body if body is None or isinstance(body, bytes) else json.dumps(body).encode()
    connection = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=60)
    try:
        connection.request(method, route, data, {"Content-Type": content_type} if data is not None else {})
        response = connection.getresponse()
        headers = {name.lower(): value for name, value in response.getheaders()}
        return response.status, headers, json.loads(response.read())
    finally:
        connection.close()


def post(server: RunningServer, route: str, body: object) -> tuple[int, object]:
    """POST a JSON body: the status and the decoded answer."""
    status, _, answer = request(server, "POST", route, body)
    return status, answer


def test_embed_equals_openai_embeddings(default_server: RunningServer) -> None:
    status, embedded = post(default_server, "/embed", {"inputs": TEXTS})
    _, openai_answer = post(default_server, "/v1/embeddings", {"model": DEFAULT_MODEL, "input": TEXTS})
    assert status == 200 and len(embedded) == len(TEXTS)
    np.testing.assert_allclose(embedded, [item["embedding"] for item in openai_answer["data"]], atol=1e-6)
    np.testing.assert_allclose(np.linalg.norm(embedded, axis=1), 1.0, atol=1e-5)
    status, single = post(default_server, "/embed", {"inputs": TEXTS[0], "model": DEFAULT_MODEL, "truncate": True})
    assert status == 200
    np.testing.assert_allclose(single, embedded[:1], atol=1e-6)


def test_truncate_false_embeds_a_long_text_whole(default_server: RunningServer) -> None:
    long_text = "food " * 200 + "weather " * 200
    status, whole = post(default_server, "/embed", {"inputs": [TEXTS[0], long_text], "truncate": False})
    assert status == 200 and len(whole) == 2
    status, cut = post(default_server, "/embed", {"inputs": [TEXTS[0], long_text]})
    assert status == 200
    np.testing.assert_allclose(whole[0], cut[0], atol=1e-6)  # within the model's length: the same row
    assert float(np.dot(whole[1], cut[1])) < 0.99  # the cut one never saw the weather


@pytest.mark.parametrize("special", [True, False])
def test_tokenize_gives_the_tokenizer_ids_and_offsets(
    default_server: RunningServer, default_repository: Path, special: bool
) -> None:
    status, tokens = post(default_server, "/tokenize", {"inputs": TEXTS, "add_special_tokens": special})
    tokenizer = Tokenizer.from_file(str(default_repository / DEFAULT_MODEL / "tokenizer.json"))
    tokenizer.no_padding()
    assert status == 200 and len(tokens) == len(TEXTS)
    for text, answer in zip(TEXTS, tokens, strict=True):
        encoding = tokenizer.encode(text, add_special_tokens=special)
        assert [token["id"] for token in answer] == encoding.ids
        assert [token["special"] for token in answer] == [bool(flag) for flag in encoding.special_tokens_mask]
        for token, piece, (start, stop) in zip(answer, encoding.tokens, encoding.offsets, strict=True):
            if token["special"]:  # as TEI: a special token's own text, and no place in the text
                assert (token["text"], token["start"], token["stop"]) == (piece, None, None)
            else:  # the piece of the text it covers (not the vocabulary's lower-cased entry)
                assert (token["text"], token["start"], token["stop"]) == (text[start:stop], start, stop)
    assert tokens[0][0]["text"] == ("[CLS]" if special else "A")


def test_a_large_tokenize_request_gives_the_same_tokens(
    default_server: RunningServer, default_repository: Path
) -> None:
    texts = [f"{text} ({index})" for index in range(40) for text in TEXTS]  # ~3,600 characters: tokenised on a worker
    status, tokens = post(default_server, "/tokenize", {"inputs": texts})
    tokenizer = Tokenizer.from_file(str(default_repository / DEFAULT_MODEL / "tokenizer.json"))
    tokenizer.no_padding()
    assert status == 200
    assert [[token["id"] for token in answer] for answer in tokens] == [e.ids for e in tokenizer.encode_batch(texts)]


@pytest.mark.parametrize(
    ("inputs", "status", "message"),
    [
        (["a"] * 2049, 413, "2049 inputs, over the limit of 2048 per request (--max-embedding-inputs)"),
        ("a" * (64 * 1024 + 1), 413, "input inputs[0] is 65537 bytes, over the limit of 65536 bytes per text"),
        ("a\ud800b", 422, "input inputs[0] is not valid UTF-8"),
        ([TEXTS[0], " "], 422, "input inputs[1] is empty"),
    ],
)
def test_tokenize_is_held_to_the_limits_of_embed(
    default_server: RunningServer, inputs: object, status: int, message: str
) -> None:
    got, answer = post(default_server, "/tokenize", {"inputs": inputs})
    assert got == status and message in answer["error"], answer
    assert answer["error_type"] == "Validation"
    assert post(default_server, "/tokenize", {"inputs": TEXTS[0]})[0] == 200  # still serving


def test_info_describes_the_served_embedder(default_server: RunningServer) -> None:
    status, _, info = request(default_server, "GET", "/info")
    assert status == 200
    assert info["model_id"] == DEFAULT_MODEL and info["model_sha"] is None
    assert info["model_type"] == {"embedding": {"pooling": "mean"}}
    assert info["model_dtype"] == "fp32" and info["max_input_length"] == 256
    for key in ("max_concurrent_requests", "max_batch_tokens", "max_batch_requests", "max_client_batch_size"):
        assert isinstance(info[key], int) and info[key] > 0, key
    assert isinstance(info["version"], str) and info["models"] == [{"id": DEFAULT_MODEL, "task": "embed"}]


@pytest.mark.parametrize(
    ("route", "body", "status", "message"),
    [
        ("/embed", {"inputs": TEXTS[0], "normalize": False}, 422, "normalize false is not available"),
        ("/embed", {"inputs": TEXTS[0], "prompt_name": "query"}, 422, "prompt"),
        ("/embed", {"inputs": TEXTS[0], "dimensions": 64}, 422, "not trained to be shortened"),
        ("/embed", {"inputs": TEXTS[0], "truncation_direction": "Left"}, 422, "truncation_direction must be Right"),
        ("/embed", {"inputs": TEXTS[0], "truncate": "no"}, 422, "truncate must be true or false"),
        ("/embed", {"inputs": [TEXTS[0], 3]}, 422, "inputs must be a string or a non-empty list of strings"),
        ("/embed", {"input": TEXTS[0]}, 422, "unknown field 'input'"),
        ("/embed", {"normalize": True}, 422, "inputs is required"),
        ("/embed", {"inputs": TEXTS[0], "model": "elsewhere"}, 404, "elsewhere"),
        ("/embed", b'{"inputs": ', 422, "not valid JSON"),
        (
            "/rerank",
            {"query": "food", "texts": TEXTS},
            404,
            "no reranker (a classify model of one label, or a multi-vector model) is served here",
        ),
        ("/predict", {"inputs": TEXTS[0]}, 404, "no classify model is served here"),
        ("/tokenize", {"inputs": TEXTS[0], "prompt_name": "query"}, 422, "prompts: none"),
        ("/tokenize", {"inputs": TEXTS[0], "add_special_tokens": 1}, 422, "add_special_tokens must be true or false"),
    ],
)
def test_malformed_bodies_get_tei_errors(
    default_server: RunningServer, route: str, body: object, status: int, message: str
) -> None:
    got, answer = post(default_server, route, body)
    assert got == status and message in answer["error"], answer
    assert answer["error_type"] == "Validation"
    assert post(default_server, "/embed", {"inputs": TEXTS[0]})[0] == 200  # still serving


def test_wrong_method_and_content_type_are_refused_in_tei_form(default_server: RunningServer) -> None:
    status, headers, answer = request(default_server, "GET", "/embed")
    assert status == 405 and headers["allow"] == "POST" and answer["error_type"] == "Validation"
    status, _, answer = request(default_server, "POST", "/embed", b"inputs=x", "application/x-www-form-urlencoded")
    assert status == 415 and "application/json" in answer["error"]
    status, _, answer = request(default_server, "POST", "/info", {})
    assert status == 405 and answer["error"] == "/info answers GET, not POST"
