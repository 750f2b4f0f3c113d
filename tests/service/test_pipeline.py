"""The pipeline: readiness, lookups and refusals before any model is served; a model's batching and instances."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from protocol import model_config_pb2 as mc
from service.core.policy import batching_policy, warm_up_shapes
from service.core.repository import RepositoryError, read_model
from service.core.runtime import ExecutionError
from service.errors import NotFound, Unavailable
from service.frontends import codec
from service.ops import metrics
from service.ops.settings import Settings
from service.pipeline.api import InferenceRequest, InputTensor, Pipeline
from tests.conftest import TINY_MODEL
from tests.servers import ROOT


def text_request(text: str) -> InferenceRequest:
    return InferenceRequest(TINY_MODEL, inputs=(InputTensor("text", "BYTES", (1,), [text.encode()], raw=False),))


async def test_a_loading_model_is_unavailable_then_ready(tiny_repository: Path) -> None:
    pipeline = Pipeline(Settings(model_repository=tiny_repository, device="cpu", intra_op_threads=1))
    assert pipeline.discover() == [TINY_MODEL]
    assert not pipeline.ready and not pipeline.model_ready(TINY_MODEL)
    with pytest.raises(Unavailable, match=f"model {TINY_MODEL} is loading"):
        await pipeline.infer(text_request("hello"), pipeline.reservation())
    with pytest.raises(NotFound, match="unknown model 'other'"):
        pipeline.model("other")
    model = await pipeline.load(TINY_MODEL)
    assert pipeline.ready and pipeline.model(TINY_MODEL, "1") == model and pipeline.model_ready(TINY_MODEL, "1")
    assert [(state.name, state.state) for state in pipeline.index()] == [(TINY_MODEL, "READY")]
    assert (await pipeline.infer(text_request("hello"), pipeline.reservation())).outputs["embedding"].shape == (1, 32)
    await pipeline.close(1)
    assert not pipeline.ready and not pipeline.model_ready(TINY_MODEL)
    with pytest.raises(Unavailable, match="shutting down"):
        await pipeline.infer(text_request("hello"), pipeline.reservation())


async def test_a_model_that_cannot_load_is_reported_with_its_reason(repository_copy: Path) -> None:
    (repository_copy / TINY_MODEL / "1" / "model.onnx").write_bytes(b"not an onnx graph")
    pipeline = Pipeline(Settings(model_repository=repository_copy, device="cpu", intra_op_threads=1))
    pipeline.discover()
    with pytest.raises(ExecutionError, match="cannot load"):
        await pipeline.load(TINY_MODEL)
    (state,) = pipeline.index()
    assert state.state == "UNAVAILABLE" and "cannot load" in state.reason
    assert pipeline.index(ready_only=True) == []
    with pytest.raises(Unavailable, match="failed to load"):
        pipeline.model(TINY_MODEL)


async def test_a_drain_answers_a_request_accepted_while_its_texts_were_still_being_tokenised(
    tiny_repository: Path,
) -> None:
    """Accepted before the drain, still on the tokenizer thread when it began: admitted to the queue and answered.

    A request arriving after the drain began is refused, and the drain ends only once the accepted one is answered.
    """
    settings = Settings(model_repository=tiny_repository, device="cpu", intra_op_threads=1, inline_tokenize_chars=0)
    pipeline = Pipeline(settings)
    pipeline.discover()
    await pipeline.load(TINY_MODEL)
    tokenizer_free = threading.Event()
    pipeline.tokenizer_pool().submit(tokenizer_free.wait)  # the one tokenizer thread is busy until the test says
    accepted = asyncio.ensure_future(pipeline.infer(text_request("accepted before the drain"), pipeline.reservation()))
    served = pipeline.served(TINY_MODEL)
    while not served.accepted:
        await asyncio.sleep(0)
    closing = asyncio.ensure_future(pipeline.close(30))
    await asyncio.sleep(0)
    with pytest.raises(Unavailable, match="shutting down"):
        await pipeline.infer(text_request("arrived during the drain"), pipeline.reservation())
    assert not closing.done() and not accepted.done()
    tokenizer_free.set()
    assert (await accepted).outputs["embedding"].shape == (1, 32)
    await closing


def _token_request(rows: int, length: int) -> InferenceRequest:
    ids = np.full((rows, length), 2023, dtype="<i8").tobytes()
    mask = np.ones((rows, length), dtype="<i8").tobytes()
    inputs = (
        InputTensor("input_ids", "INT64", (rows, length), ids, raw=True),
        InputTensor("attention_mask", "INT64", (rows, length), mask, raw=True),
    )
    return InferenceRequest(TINY_MODEL, inputs=inputs, outputs=("embedding",))


async def test_bucketed_lengths_never_pass_the_models_maximum(tiny_repository: Path) -> None:
    """A bucket of 48 rounds 100 tokens up to 144, past the tiny model's 128 positions: capped at 128."""
    settings = Settings(model_repository=tiny_repository, device="cpu", intra_op_threads=1, length_bucket=48)
    spec = read_model(tiny_repository / TINY_MODEL)
    assert warm_up_shapes(spec, batching_policy(spec, settings, "cpu"))[:-1] == [(1, 48), (1, 96), (1, 128)]
    pipeline = Pipeline(settings)
    pipeline.discover()
    try:
        model = await pipeline.load(TINY_MODEL)
        assert model.policy.padded_length(100) == 128 and model.policy.padded_length(20) == 48
        result = await pipeline.infer(_token_request(2, 100), pipeline.reservation())
        assert result.outputs["embedding"].shape == (2, 32)
    finally:
        await pipeline.close(1)


def test_warm_up_covers_the_bucketed_lengths_and_the_largest_batch(tiny_repository: Path) -> None:
    spec = read_model(tiny_repository / TINY_MODEL)
    budget = Settings(device="cpu", length_bucket=32, max_batch_tokens=1024, max_batch_size=64)
    shapes = warm_up_shapes(spec, batching_policy(spec, budget, "cpu"))
    assert shapes == [(1, 32), (1, 64), (1, 96), (1, 128), (8, 128)]
    # A single row longer than the budget is still served, so it is warmed.
    tight = Settings(device="cpu", max_batch_tokens=100)
    assert warm_up_shapes(spec, batching_policy(spec, tight, "cpu")) == [(1, 8), (1, 128)]


async def test_every_instance_is_reported_in_metrics_and_model_config(tiny_repository: Path) -> None:
    pipeline = Pipeline(Settings(model_repository=tiny_repository, device="cpu", intra_op_threads=1, instances=2))
    pipeline.discover()
    try:
        model = await pipeline.load(TINY_MODEL)
        config = codec.effective_config(model)
        assert [(group.kind, group.count) for group in config.instance_group] == [(mc.ModelInstanceGroup.KIND_CPU, 2)]
        assert config.parameters["execution_provider"].string_value == "CPUExecutionProvider"
        assert config.parameters["variant"].string_value == "fp32"
        gauge = metrics.PROVIDER.labels(TINY_MODEL, model.spec.version, "CPUExecutionProvider", "fp32")
        assert gauge._value.get() == 2
    finally:
        await pipeline.close(1)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--device", "cpu", "--require-gpu"], "require_gpu contradicts device cpu: choose one"),
        (
            ["--variant", "int8", "--require-gpu"],
            "require_gpu contradicts variant int8: the int8 variant runs on the CPU only",
        ),
    ],
)
def test_contradictory_device_settings_are_refused_at_start(
    tiny_repository: Path, flags: list[str], message: str
) -> None:
    command = [sys.executable, "-m", "service", "--model-repository", str(tiny_repository), *flags]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
    assert (result.returncode, result.stderr.strip()) == (2, f"service: error: {message}")


def test_hidden_folders_of_the_repository_are_not_models(repository_copy: Path) -> None:
    # What a publish interrupted between its renames leaves behind: the replaced model, hidden.
    shutil.copytree(repository_copy / TINY_MODEL, repository_copy / f".retired-{TINY_MODEL}-staging")
    assert Pipeline(Settings(model_repository=repository_copy, device="cpu")).discover() == [TINY_MODEL]


@pytest.mark.parametrize(
    ("written", "named"),
    [
        ('string_value: "model.onnx"', 'string_value: "../../../../etc/hostname"'),
        ('string_value: "tokenizer.json"', 'string_value: "/etc/hostname"'),
    ],
)
def test_files_named_outside_the_model_folder_are_refused(repository_copy: Path, written: str, named: str) -> None:
    config = repository_copy / TINY_MODEL / "config.pbtxt"
    assert written in config.read_text()
    config.write_text(config.read_text().replace(written, named))
    with pytest.raises(RepositoryError, match="must be a path inside the model's folder"):
        read_model(repository_copy / TINY_MODEL)
