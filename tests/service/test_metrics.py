"""/metrics scraped and parsed with prometheus_client's parser while requests are served."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import grpc
import numpy as np
import pytest
import tritonclient.grpc as triton
from tritonclient.utils import InferenceServerException

from protocol import grpc_service_pb2 as pb
from protocol import grpc_service_pb2_grpc as pb_grpc
from tests.conftest import TINY_MODEL
from tests.servers import MetricSamples, RunningServer, metric_samples, metric_value

LABELS = {"model": TINY_MODEL, "version": "1"}


def value(samples: MetricSamples, name: str, **labels: str) -> float:
    return metric_value(samples, name, **{**LABELS, **labels})


def test_counters_move_as_requests_are_served(tiny_server: RunningServer) -> None:
    client = triton.InferenceServerClient(tiny_server.target)
    before = metric_samples(tiny_server)
    texts = [b"one two three", b"four five"]
    for _ in range(3):
        tensor = triton.InferInput("text", [2], "BYTES")
        tensor.set_data_from_numpy(np.array(texts, dtype=object))
        client.infer(TINY_MODEL, [tensor])
    bad = triton.InferInput("input_ids", [1, 1], "INT64")
    bad.set_data_from_numpy(np.array([[10**6]], dtype=np.int64))
    with pytest.raises(InferenceServerException) as refused:
        client.infer(TINY_MODEL, [bad])
    assert refused.value.status() == "StatusCode.INVALID_ARGUMENT"
    after = metric_samples(tiny_server)

    def moved(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert moved("encoder_requests_total", code="OK") == 3
    assert moved("encoder_requests_total", code="INVALID_ARGUMENT") == 1
    assert moved("encoder_request_duration_seconds_count", code="OK") == 3
    assert moved("encoder_request_duration_seconds_count", code="INVALID_ARGUMENT") == 1
    assert moved("encoder_tokenize_duration_seconds_count") == 3
    assert moved("encoder_sequences_total") == 6
    assert moved("encoder_tokens_total") == 3 * (5 + 4)  # [CLS] ... [SEP] per text
    assert moved("encoder_queue_duration_seconds_count") == 3
    assert 1 <= moved("encoder_compute_duration_seconds_count") <= 3
    assert moved("encoder_batch_size_sum") == 6
    assert moved("encoder_padding_ratio_count") == moved("encoder_batch_size_count")
    assert value(after, "encoder_model_ready") == 1
    assert value(after, "encoder_queue_depth") == 0
    assert value(after, "encoder_queue_capacity") == 1024
    assert value(after, "encoder_inflight_requests") == 0
    # The provider and variant the server reports in its ModelConfig (the CPU here, CUDA on a GPU machine).
    served = client.get_model_config(TINY_MODEL).config.parameters
    provider, variant = served["execution_provider"].string_value, served["variant"].string_value
    assert variant == "fp32"  # the only variant the tiny repository publishes
    assert value(after, "encoder_execution_provider_info", provider=provider, variant=variant) == 1


def test_unknown_model_names_do_not_create_label_values(tiny_server: RunningServer) -> None:
    with grpc.insecure_channel(tiny_server.target) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        for name in ("random-name-1", "random-name-2"):
            with pytest.raises(grpc.RpcError) as refused:
                stub.ModelInfer(pb.ModelInferRequest(model_name=name), timeout=5)
            assert refused.value.code() == grpc.StatusCode.NOT_FOUND
    samples = metric_samples(tiny_server)
    assert not [key for key in samples if "random-name" in str(key)]
    assert samples[("encoder_requests_total", (("code", "NOT_FOUND"), ("model", ""), ("version", "")))] >= 2


def _post(server: RunningServer, route: str, body: object) -> int:
    request = urllib.request.Request(
        f"{server.http_url}{route}", json.dumps(body).encode(), {"content-type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code


def test_tokenize_and_decode_are_counted_as_requests_of_their_model(tiny_server: RunningServer) -> None:
    """TEI's /tokenize and /decode run inside the envelope, as inferences: counted in encoder_requests_total."""
    before = metric_samples(tiny_server)
    assert _post(tiny_server, "/tokenize", {"inputs": ["one two three", "four"], "model": TINY_MODEL}) == 200
    assert _post(tiny_server, "/decode", {"ids": [[5, 6], [7]], "model": TINY_MODEL}) == 200
    assert _post(tiny_server, "/decode", {"ids": [10**6], "model": TINY_MODEL}) == 422  # not in the vocabulary
    after = metric_samples(tiny_server)

    def moved(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert moved("encoder_requests_total", code="OK") == 2
    assert moved("encoder_requests_total", code="INVALID_ARGUMENT") == 1
