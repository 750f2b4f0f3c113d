"""Tenants: the token bucket and the key file (pure), then limits, usage and reload on real servers.

Servers run the tiny model on loopback; clients are grpc's own stubs, the openai SDK and urllib.
Limits in the servers' files refill so slowly (one request or token in ~1000 s) that what a test
sees depends on the requests it sent, never on how fast the machine sends them.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import struct
import urllib.error
import urllib.request
from collections.abc import Iterator
from email.message import Message
from pathlib import Path

import grpc
import openai
import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from protocol import grpc_service_pb2 as pb
from protocol import grpc_service_pb2_grpc as pb_grpc
from service.errors import OverLimit
from service.ops.security import KEY_CHECK_INTERVAL_S, ApiKeys, SecurityError
from service.ops.tenants import DEFAULT_TENANT, Tenant, TenantLimits, TokenBucket, parse_key_file
from tests.conftest import TINY_MODEL
from tests.servers import (
    MetricSamples,
    RunningServer,
    failed_start,
    metric_samples,
    metric_value,
    post_json,
    start_server,
    wait_for_metric,
    wait_until,
)

TENANTS = """
# Slow refills: what passes is decided by the burst alone within a test.
[tenants.capped]
keys = ["k-capped"]
requests_per_second = 0.001
requests_burst = 3

[tenants.capped-http]
keys = ["k-capped-http"]
requests_per_second = 0.001
requests_burst = 2

[tenants.streamer]
keys = ["k-streamer"]
requests_per_second = 0.001
requests_burst = 2

[tenants.metered]
keys = ["k-metered"]
tokens_per_minute = 0.06
tokens_burst = 1

[tenants.usage]
keys = ["k-usage-1", "k-usage-2"]

[tenants.tokenizing]
keys = ["k-tokenizing"]
tokens_per_minute = 0.06
tokens_burst = 1

[tenants.free]
keys = ["k-free"]
"""
USAGE_TEXTS = (
    "The quick brown fox jumps over the lazy dog.",
    "Tokenizers split unbelievably long words into pieces",
    "a",
    "Embeddings: 384 floats per sentence, mean-pooled.",
    "héllo wörld",
)


class Clock:
    """A clock the test moves."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# --- the token bucket and the tenant, with an injected clock -------------------------------------------------


def test_a_bucket_starts_full_and_refills_at_its_rate_up_to_its_burst() -> None:
    clock = Clock()
    bucket = TokenBucket(rate_per_s=2.0, burst=3.0, clock=clock)
    assert [bucket.take(1) for _ in range(4)] == [True, True, True, False]
    assert bucket.seconds_until(1) == pytest.approx(0.5)
    clock.now += 0.25
    assert not bucket.take(1)
    clock.now += 0.25
    assert bucket.take(1)
    clock.now += 100  # a long quiet spell fills it to its burst, no more
    assert bucket.level() == 3.0
    assert bucket.seconds_until(4) == float("inf")


def test_a_charge_may_put_a_bucket_in_debt_that_the_refill_pays_back() -> None:
    clock = Clock()
    bucket = TokenBucket(rate_per_s=10.0, burst=5.0, clock=clock)
    bucket.charge(25)
    assert bucket.level() == -20.0
    assert not bucket.take(1)
    assert bucket.seconds_until(0) == pytest.approx(2.0)
    clock.now += 2.0
    assert bucket.level() == pytest.approx(0.0)
    clock.now += 0.5
    assert bucket.take(5)


def test_a_bucket_needs_a_positive_rate_and_burst() -> None:
    for rate, burst in ((0.0, 1.0), (1.0, 0.0), (-1.0, 1.0)):
        with pytest.raises(ValueError, match="positive"):
            TokenBucket(rate, burst)


def test_a_tenant_is_refused_over_its_requests_limit_with_the_wait_until_it_may_retry() -> None:
    clock = Clock()
    tenant = Tenant("search", TenantLimits(requests_per_second=0.5, requests_burst=2), clock=clock)
    tenant.admit()
    tenant.admit()
    with pytest.raises(OverLimit) as refused:
        tenant.admit()
    assert str(refused.value) == "tenant 'search' is over its 0.5 requests/s limit; retry in 2 s"
    assert (refused.value.reason, refused.value.retry_after_s) == ("tenant_requests", 2)
    clock.now += 2
    tenant.admit()


def test_a_tenant_is_refused_while_its_tokens_are_spent_and_charged_what_it_used() -> None:
    clock = Clock()
    tenant = Tenant("batch", TenantLimits(tokens_per_minute=600, tokens_burst=100), clock=clock)  # 10 tokens/s
    tenant.admit()
    tenant.charge(130)  # more than the burst: allowed once, then owed
    with pytest.raises(OverLimit) as refused:
        tenant.admit()
    assert str(refused.value) == "tenant 'batch' is over its 600 tokens/minute limit; retry in 3 s"
    assert (refused.value.reason, refused.value.retry_after_s) == ("tenant_tokens", 3)
    clock.now += 3.01
    tenant.admit()


def test_each_of_several_front_ends_holds_a_tenant_to_its_share() -> None:
    clock = Clock()
    tenant = Tenant("search", TenantLimits(requests_per_second=10, requests_burst=8), share=1 / 4, clock=clock)
    admitted = 0
    for _ in range(8):
        try:
            tenant.admit()
            admitted += 1
        except OverLimit:
            pass
    assert admitted == 2
    clock.now += 0.4  # 10/4 = 2.5 requests/s here: one more
    tenant.admit()
    with pytest.raises(OverLimit):
        tenant.admit()


def test_a_tenant_without_limits_is_never_refused() -> None:
    tenant = Tenant("free", TenantLimits())
    for _ in range(1000):
        tenant.admit()
        tenant.charge(10_000)


# --- the key file ---------------------------------------------------------------------------------------------


def test_a_key_per_line_file_is_one_unlimited_default_tenant() -> None:
    described = parse_key_file("keys", "# ops\nkey-one\n\n  key-two  \n")
    assert described.keys == ((b"key-one", DEFAULT_TENANT), (b"key-two", DEFAULT_TENANT))
    assert described.tenants == {DEFAULT_TENANT: TenantLimits()}


def test_a_tenants_file_names_each_keys_tenant_and_its_limits() -> None:
    described = parse_key_file("keys", TENANTS)
    assert dict((key.decode(), tenant) for key, tenant in described.keys) == {
        "k-capped": "capped",
        "k-capped-http": "capped-http",
        "k-streamer": "streamer",
        "k-metered": "metered",
        "k-usage-1": "usage",
        "k-usage-2": "usage",
        "k-tokenizing": "tokenizing",
        "k-free": "free",
    }
    assert described.tenants["capped"] == TenantLimits(requests_per_second=0.001, requests_burst=3)
    assert described.tenants["metered"] == TenantLimits(tokens_per_minute=0.06, tokens_burst=1)
    assert described.tenants["free"] == TenantLimits()
    # Named *.toml, a file may begin with anything TOML allows.
    assert parse_key_file("keys.toml", 'tenants.a.keys = ["x"]').tenants == {"a": TenantLimits()}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[tenants.a]\nkeys = ['s3cret-1']\nrequests_per_secnd = 5\n", "unknown requests_per_secnd"),
        ("[tenants.a]\nkeys = ['s3cret-1']\nrequests_burst = 5\n", "requests_burst without requests_per_second"),
        ("[tenants.a]\nkeys = ['s3cret-1']\ntokens_per_minute = 0\n", "tokens_per_minute must be a positive number"),
        ("[tenants.a]\nkeys = ['s3cret-1']\ntokens_per_minute = '5'\n", "tokens_per_minute must be a positive number"),
        ("[tenants.a]\nkeys = ['s3cret-1']\n[tenants.b]\nkeys = ['s3cret-1']\n", "one key to two tenants"),
        ("[tenants.a]\nkeys = []\n", "tenant 'a' has no keys"),
        ("[tenants.a]\nkeys = ['s3cret 1']\n", "key 1 is not a string without spaces"),
        ('[tenants."a b"]\nkeys = ["s3cret-1"]\n', "tenant name 'a b'"),
        ("[tenants.a]\nkeys = ['s3cret-1'\n", "is not valid TOML"),
        ("[tenant.a]\nkeys = ['s3cret-1']\n", "only [tenants.<name>] tables"),
        ("[tenants]\n", "names no tenant"),
        ("[tenants.a]\nkeys = ['s3cret-1']\nweight = 'high'\n", "weight must be a positive number"),
        ("[tenants.a]\nkeys = ['s3cret-1']\nweight = 0\n", "weight must be a positive number"),
        ("[tenants.a]\nkeys = ['s3cret-1']\npriority = 1.5\n", "priority must be a whole number"),
        ("[tenants.a]\nkeys = ['s3cret-1']\npriority = 0\n", "priority must be a positive number"),
        ("# nothing\n", "holds no key"),
    ],
)
def test_a_key_file_that_cannot_be_used_says_why_without_quoting_a_key(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=None) as refused:
        parse_key_file("keys", text)
    assert message in str(refused.value)
    assert "s3cret" not in str(refused.value)


def test_a_reloaded_file_changes_limits_adds_keys_and_a_broken_one_keeps_the_last_good(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    clock = Clock()
    path = tmp_path / "keys.toml"
    path.write_text('[tenants.a]\nkeys = ["k-a"]\nrequests_per_second = 1\n[tenants.b]\nkeys = ["k-b"]\n')
    keys = ApiKeys(path, clock=clock)
    a, b = keys.tenant("Bearer k-a"), keys.tenant("Bearer k-b")
    assert (a.name, b.name) == ("a", "b")
    assert keys.tenant("Bearer k-c") is None and keys.tenant("k-a") is None and keys.tenant(None) is None
    path.write_text('[tenants.a]\nkeys = ["k-a"]\nrequests_per_second = 2\n[tenants.b]\nkeys = ["k-b", "k-c"]\n')
    assert keys.tenant("Bearer k-c") is None  # not looked at again within KEY_CHECK_INTERVAL_S
    clock.now += KEY_CHECK_INTERVAL_S
    assert keys.tenant("Bearer k-c") is b  # limits unchanged: the same tenant, its buckets as they were
    assert keys.tenant("Bearer k-a") is not a and keys.tenant("Bearer k-a").limits.requests_per_second == 2
    path.write_text('[tenants.a]\nkeys = ["k-a"]\nrequests_per_second = -1\n')
    clock.now += KEY_CHECK_INTERVAL_S
    with caplog.at_level(logging.ERROR, logger="service.ops.security"):
        assert keys.tenant("Bearer k-c") is b
    assert "API keys not reloaded, keeping the previous ones" in caplog.text
    assert "requests_per_second must be a positive number" in caplog.text


def test_a_key_file_that_cannot_be_used_at_start_is_a_security_error(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text("[tenants.a]\nkeys = 'k-a'\n")
    with pytest.raises(SecurityError, match=rf"API key file {path} tenant 'a' has no keys"):
        ApiKeys(path)


# --- real servers ---------------------------------------------------------------------------------------------


def text_request(*texts: str) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=TINY_MODEL)
    request.inputs.add(name="text", datatype="BYTES", shape=[len(texts)])
    request.raw_input_contents.append(b"".join(struct.pack("<I", len(t.encode())) + t.encode() for t in texts))
    request.outputs.add(name="embedding")
    return request


def infer(server: RunningServer, key: str, *texts: str) -> grpc.StatusCode:
    """One ModelInfer on its own connection: its status."""
    with grpc.insecure_channel(server.target, [("grpc.use_local_subchannel_pool", 1)]) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        try:
            stub.ModelInfer(text_request(*(texts or ("a sentence",))), metadata=(("authorization", f"Bearer {key}"),))
        except grpc.RpcError as error:
            return error.code()
    return grpc.StatusCode.OK


def refusal(server: RunningServer, key: str) -> grpc.RpcError:
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            stub.ModelInfer(text_request("a sentence"), timeout=10, metadata=(("authorization", f"Bearer {key}"),))
    return refused.value


def sdk(server: RunningServer, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.http_url}/v1", api_key=key, max_retries=0)


def kserve_infer(server: RunningServer, key: str) -> tuple[int, Message, dict]:
    """One KServe REST inference: status, headers (names in any case), body."""
    body = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": ["a sentence"]}]}
    request = urllib.request.Request(
        f"{server.http_url}/v2/models/{TINY_MODEL}/infer",
        json.dumps(body).encode(),
        {"content-type": "application/json", "authorization": f"Bearer {key}"},
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.headers, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, error.headers, json.loads(error.read())


def model_tokens(model_folder: Path, text: str) -> int:
    """The text's tokens by the model's own tokenizer (transformers', not the server's): [CLS] ... [SEP], no padding."""
    return len(_tokenizer(model_folder)(text)["input_ids"])


@functools.cache
def _tokenizer(model_folder: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(model_folder)


def tenant_labels(samples: MetricSamples) -> set[str]:
    return {dict(labels)["tenant"] for name, labels in samples if name.startswith("encoder_tenant_")}


@pytest.fixture(scope="module")
def tenants_server(tiny_repository: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    folder = tmp_path_factory.mktemp("tenants")
    keys = folder / "keys.toml"
    keys.write_text(TENANTS)
    with start_server(tiny_repository, folder / "server.log", "--api-key-file", str(keys)) as server:
        yield server


def test_a_tenant_over_its_requests_limit_is_refused_over_grpc_and_others_are_not(
    tenants_server: RunningServer,
) -> None:
    server = tenants_server
    before = metric_value(metric_samples(server), "encoder_requests_rejected_total", reason="tenant_requests")
    assert [infer(server, "k-capped") for _ in range(3)] == [grpc.StatusCode.OK] * 3
    refused = refusal(server, "k-capped")
    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert refused.details().startswith("tenant 'capped' is over its 0.001 requests/s limit; retry in ")
    assert infer(server, "k-free") == grpc.StatusCode.OK  # another tenant is not held back
    samples = metric_samples(server)
    assert metric_value(samples, "encoder_tenant_requests_total", tenant="capped", code="OK") == 3
    assert metric_value(samples, "encoder_tenant_requests_total", tenant="capped", code="RESOURCE_EXHAUSTED") == 1
    assert metric_value(samples, "encoder_tenant_requests_rejected_total", tenant="capped", limit="requests_per_second")
    assert metric_value(samples, "encoder_requests_rejected_total", reason="tenant_requests") == before + 1
    assert metric_value(samples, "encoder_tenant_requests_total", tenant="free", code="RESOURCE_EXHAUSTED") == 0


def test_a_tenant_over_its_requests_limit_gets_429_with_retry_after_over_http(tenants_server: RunningServer) -> None:
    server = tenants_server
    with sdk(server, "k-capped-http") as client:
        for _ in range(2):
            assert len(client.embeddings.create(model=TINY_MODEL, input="a sentence").data) == 1
        with pytest.raises(openai.RateLimitError) as refused:
            client.embeddings.create(model=TINY_MODEL, input="a sentence")
    assert refused.value.status_code == 429
    assert "tenant 'capped-http' is over its 0.001 requests/s limit" in refused.value.message
    assert refused.value.code == "tenant_requests"
    retry_after = int(refused.value.response.headers["retry-after"])
    assert 900 <= retry_after <= 1000  # one request at 0.001/s: ~1000 s, less what refilled meanwhile
    status, headers, body = kserve_infer(server, "k-capped-http")  # KServe REST: the same limit, the same answer
    assert status == 429 and int(headers["Retry-After"]) >= 900
    assert body["error"].startswith("tenant 'capped-http' is over its 0.001 requests/s limit")
    with sdk(server, "k-free") as client:  # another tenant is not held back
        assert len(client.embeddings.create(model=TINY_MODEL, input="a sentence").data) == 1
    samples = metric_samples(server)
    assert metric_value(samples, "encoder_tenant_requests_total", tenant="capped-http", code="OK") == 2
    assert metric_value(samples, "encoder_tenant_requests_total", tenant="capped-http", code="RESOURCE_EXHAUSTED") == 2
    rejected = metric_value(
        samples, "encoder_tenant_requests_rejected_total", tenant="capped-http", limit="requests_per_second"
    )
    assert rejected == 2


def test_each_request_of_a_stream_counts_against_the_limit(tenants_server: RunningServer) -> None:
    requests = []
    for number in range(4):
        request = text_request(f"message {number}")
        request.id = f"m{number}"
        requests.append(request)
    with grpc.insecure_channel(tenants_server.target) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        metadata = (("authorization", "Bearer k-streamer"),)
        responses = list(stub.ModelStreamInfer(iter(requests), timeout=30, metadata=metadata))
    assert [response.infer_response.id for response in responses] == ["m0", "m1", "m2", "m3"]
    assert [response.error_message for response in responses[:2]] == ["", ""]
    for response in responses[2:]:
        assert response.error_message.startswith("tenant 'streamer' is over its 0.001 requests/s limit")
    samples = metric_samples(tenants_server)
    assert metric_value(samples, "encoder_tenant_requests_total", tenant="streamer", code="OK") == 2
    assert metric_value(samples, "encoder_tenant_requests_total", tenant="streamer", code="RESOURCE_EXHAUSTED") == 2


def test_a_tenant_whose_tokens_are_spent_is_refused_until_they_refill(tenants_server: RunningServer) -> None:
    server = tenants_server
    # One token of burst: the first request passes (the bucket is not empty) and is charged its tokens.
    assert infer(server, "k-metered", "a first sentence, charged after it is answered") == grpc.StatusCode.OK
    refused = refusal(server, "k-metered")
    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert refused.details().startswith("tenant 'metered' is over its 0.06 tokens/minute limit; retry in ")
    with sdk(server, "k-metered") as client, pytest.raises(openai.RateLimitError) as over_http:
        client.embeddings.create(model=TINY_MODEL, input="a sentence")
    assert over_http.value.code == "tenant_tokens" and int(over_http.value.response.headers["retry-after"]) > 60
    samples = metric_samples(server)
    assert metric_value(samples, "encoder_tenant_requests_rejected_total", tenant="metered", limit="tokens_per_minute")
    assert metric_value(samples, "encoder_tenant_requests_total", tenant="metered", code="RESOURCE_EXHAUSTED") == 2


def test_usage_is_counted_per_tenant_exactly_in_the_models_tokens(
    tenants_server: RunningServer, default_folder: Path
) -> None:
    server = tenants_server
    expected = sum(model_tokens(default_folder, text) for text in USAGE_TEXTS)
    assert infer(server, "k-usage-1", *USAGE_TEXTS[:3]) == grpc.StatusCode.OK
    assert infer(server, "k-usage-2", USAGE_TEXTS[3]) == grpc.StatusCode.OK
    with sdk(server, "k-usage-2") as client:
        answer = client.embeddings.create(model=TINY_MODEL, input=[USAGE_TEXTS[4]])
    status, _, _ = kserve_infer(server, "k-usage-1")
    assert status == 200
    expected += model_tokens(default_folder, "a sentence")
    assert answer.usage.prompt_tokens == model_tokens(default_folder, USAGE_TEXTS[4])
    assert infer(server, "k-unknown") == grpc.StatusCode.UNAUTHENTICATED  # refused, and never a label
    samples = metric_samples(server)
    assert metric_value(samples, "encoder_tenant_prompt_tokens_total", tenant="usage") == expected
    assert metric_value(samples, "encoder_tenant_requests_total", tenant="usage", code="OK") == 4
    assert tenant_labels(samples) <= set(parse_key_file("keys", TENANTS).tenants)


def tei_post(server: RunningServer, route: str, body: dict, key: str | None) -> tuple[int, object]:
    """One POST to a TEI route, with the key as a Bearer token if given: status and body."""
    return post_json(server, route, body, None if key is None else {"authorization": f"Bearer {key}"})


def test_tokenize_and_decode_are_authenticated_admitted_and_charged_as_inferences(
    tenants_server: RunningServer, default_folder: Path
) -> None:
    server = tenants_server
    text = USAGE_TEXTS[1]
    for key in (None, "k-unknown"):
        status, answer = tei_post(server, "/tokenize", {"inputs": text}, key)
        assert status == 401 and answer["error_type"] == "Unauthorized" and "API key" in answer["error"]
    status, answer = tei_post(server, "/tokenize", {"inputs": text}, "k-tokenizing")
    assert status == 200 and len(answer[0]) == model_tokens(default_folder, text)
    samples = metric_samples(server)
    assert metric_value(samples, "encoder_tenant_prompt_tokens_total", tenant="tokenizing") == len(answer[0])
    assert metric_value(samples, "encoder_tenant_requests_total", tenant="tokenizing", code="OK") == 1
    # One token of burst, spent on the tokens above: a /decode is refused as an inference would be.
    status, answer = tei_post(server, "/decode", {"ids": [token["id"] for token in answer[0]]}, "k-tokenizing")
    assert status == 429 and answer["error_type"] == "Overloaded"
    assert answer["error"].startswith("tenant 'tokenizing' is over its 0.06 tokens/minute limit")
    samples = metric_samples(server)
    assert metric_value(samples, "encoder_tenant_requests_total", tenant="tokenizing", code="RESOURCE_EXHAUSTED") == 1


def test_a_changed_file_takes_effect_without_a_restart(tiny_repository: Path, tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text('[tenants.a]\nkeys = ["k-a"]\nrequests_per_second = 0.001\nrequests_burst = 1\n')
    with start_server(tiny_repository, tmp_path / "server.log", "--api-key-file", str(keys)) as server:
        assert infer(server, "k-a") == grpc.StatusCode.OK
        assert infer(server, "k-a") == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert infer(server, "k-b") == grpc.StatusCode.UNAUTHENTICATED
        staging = keys.with_suffix(".new")
        staging.write_text(
            '[tenants.a]\nkeys = ["k-a"]\nrequests_per_second = 0.001\nrequests_burst = 3\n'
            '[tenants.b]\nkeys = ["k-b"]\n'
        )
        os.replace(staging, keys)  # as a Kubernetes Secret update swaps the file
        # A new key, once the file is re-read.
        wait_until(lambda: infer(server, "k-b") != grpc.StatusCode.UNAUTHENTICATED, "the new key accepted", 10)
        # a's limits changed: a fresh bucket with the new burst of 3.
        assert [infer(server, "k-a") for _ in range(4)] == [grpc.StatusCode.OK] * 3 + [
            grpc.StatusCode.RESOURCE_EXHAUSTED
        ]
        keys.write_text("[tenants.a]\nkeys = 'k-a'\n")  # broken: the last good file stays in force

        def broken_file_read_and_b_still_served() -> bool:
            assert infer(server, "k-b") == grpc.StatusCode.OK
            return "API keys not reloaded, keeping the previous ones" in server.log()

        wait_until(broken_file_read_and_b_still_served, "the broken file read", 10)
        # Logged as an error by the process that read it (a front end names its role: "ERROR [frontend 1] ...").
        assert re.search(r"ERROR (\[[^]]+\] )?service\.ops\.security: API keys not reloaded", server.log())
        assert "tenant 'a' has no keys" in server.log() and "k-a" not in server.log()
        assert infer(server, "k-b") == grpc.StatusCode.OK


def test_a_key_per_line_file_still_works_as_one_default_tenant(
    tiny_repository: Path, tmp_path: Path, default_folder: Path
) -> None:
    keys = tmp_path / "keys"
    keys.write_text("# one key per line, as before tenants\nk-old-1\nk-old-2\n")
    with start_server(tiny_repository, tmp_path / "server.log", "--api-key-file", str(keys)) as server:
        assert infer(server, "k-old-1") == grpc.StatusCode.OK
        with sdk(server, "k-old-2") as client:
            answer = client.embeddings.create(model=TINY_MODEL, input="one two three")
        assert infer(server, "k-new") == grpc.StatusCode.UNAUTHENTICATED
        samples = metric_samples(server)
        assert metric_value(samples, "encoder_tenant_requests_total", tenant=DEFAULT_TENANT, code="OK") == 2
        tokens = metric_value(samples, "encoder_tenant_prompt_tokens_total", tenant=DEFAULT_TENANT)
        assert tokens == answer.usage.prompt_tokens + model_tokens(default_folder, "a sentence")
        assert tenant_labels(samples) == {DEFAULT_TENANT}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[tenants.search]\nkeys = ['s3cret-key']\nrequests_per_second = 'fast'\n", "must be a positive number"),
        ("[tenants.search]\nkeys = ['s3cret-key'\n", "is not valid TOML"),
    ],
)
def test_a_malformed_tenants_file_stops_the_server_with_one_line_and_exit_2(
    tiny_repository: Path, tmp_path: Path, text: str, message: str
) -> None:
    keys = tmp_path / "keys.toml"
    keys.write_text(text)
    finished = failed_start(tiny_repository, "--api-key-file", str(keys))
    assert finished.returncode == 2, finished.stderr
    assert "Traceback" not in finished.stderr and "s3cret" not in finished.stderr, finished.stderr
    errors = [line for line in finished.stderr.splitlines() if line.startswith("service: error:")]
    assert len(errors) == 1 and message in errors[0] and str(keys) in errors[0], finished.stderr


def test_several_front_ends_each_enforce_their_share_and_their_metrics_add_up(
    tiny_repository: Path, tmp_path: Path, default_folder: Path
) -> None:
    keys = tmp_path / "keys"
    keys.write_text('[tenants.shared]\nkeys = ["k-shared"]\nrequests_per_second = 0.001\nrequests_burst = 4\n')
    calls = 16
    with start_server(
        tiny_repository, tmp_path / "server.log", "--frontends", "2", "--api-key-file", str(keys)
    ) as server:
        statuses = [infer(server, "k-shared") for _ in range(calls)]  # each on its own connection
        answered = statuses.count(grpc.StatusCode.OK)
        assert statuses.count(grpc.StatusCode.RESOURCE_EXHAUSTED) == calls - answered
        # Each front end admits its share, 2: 4 in all once the kernel gave each at least two connections
        # (the chance it did not, over 16: ~3e-4), and never more.
        assert answered == 4, statuses
        wait_for_metric(server, "encoder_tenant_requests_total", answered, tenant="shared", code="OK")
        samples = metric_samples(server)
        refused = metric_value(samples, "encoder_tenant_requests_total", tenant="shared", code="RESOURCE_EXHAUSTED")
        assert refused == calls - answered
        assert metric_value(samples, "encoder_tenant_prompt_tokens_total", tenant="shared") == answered * model_tokens(
            default_folder, "a sentence"
        )
