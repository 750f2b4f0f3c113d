"""The GPU test plan: what only a CUDA machine can show. `make gpu-check` runs it and writes a report.

Every test here is marked gpu and skipped where ONNX Runtime cannot create a CUDA session
(tests/conftest.py). On a CUDA machine they check, end to end and with --require-gpu: the
provider metric and KIND_GPU for every instance, fp16 (the CUDA default) and fp32 against the
model over a sweep of rows (1-64), lengths (1-256) and every mask shape, the fidelity check at
load on CUDA itself (a reranker's fp16 too), warm-up of the bucketed shapes, two instances under
load, and the CPU fallback (and the refusal with --require-gpu) when no device is visible.

"The model" is the PyTorch model, never the server's own CPU session: sentence-transformers on the
source folder for served texts, and the exporter's encoder on the source checkpoint's weights for
token batches. A fault in how the runtime builds a session's inputs or reads its outputs would
appear on the CPU and on CUDA alike, and cancel out in a comparison of the two.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families
from sentence_transformers import SentenceTransformer

from client import EmbeddingClient
from export.checkpoints.checkpoint import load_checkpoint
from export.gate.cases import mask_row
from export.gate.served import embed_each
from protocol import grpc_service_pb2 as pb
from protocol import grpc_service_pb2_grpc as pb_grpc
from protocol import model_config_pb2 as mc
from service.core.fidelity import FIDELITY_MIN_COSINE, LOGITS_FIDELITY_MAX_ABS_DIFF, VARIANT_MIN_COSINE, cosines
from service.core.loading import load_model
from service.core.policy import warm_up_shapes
from service.core.repository import read_model
from service.core.runtime import CPU, CUDA, ExecutionSettings, ModelRuntime
from service.ops.settings import Settings
from service.pipeline.tokenizer import TextTokenizer
from tests.conftest import DEFAULT_MODEL, ExportedTasks
from tests.export.test_heads import FP16_SOURCE, PAIRS, cross_encoder_logits
from tests.servers import ROOT, RunningServer, start_server
from tests.vectors import FP32_RELATIVE_DIFF, relative_differences, row_cosines

pytestmark = pytest.mark.gpu

SWEEP_ROWS = (1, 2, 7, 16, 33, 64)
SWEEP_LENGTHS = (1, 2, 5, 16, 31, 32, 33, 64, 100, 128, 200, 256)
TEXTS = ["Happy new year!", "The baby finally fell asleep after an hour of rocking.", "final answer"]


def _model_config(server: RunningServer) -> mc.ModelConfig:
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        return stub.ModelConfig(pb.ModelConfigRequest(name=DEFAULT_MODEL), timeout=10).config


def _provider_gauges(server: RunningServer) -> dict[tuple[str, str], float]:
    text = urllib.request.urlopen(server.metrics_url, timeout=5).read().decode()
    return {
        (sample.labels["provider"], sample.labels["variant"]): sample.value
        for family in text_string_to_metric_families(text)
        if family.name == "encoder_execution_provider_info"
        for sample in family.samples
    }


@dataclasses.dataclass(frozen=True)
class SweepCase:
    """A token batch of the sweep and the PyTorch model's embeddings of it."""

    name: str
    feed: dict[str, np.ndarray]
    expected: np.ndarray


def _sweep_feed(rows: int, length: int, style: str, rng: np.random.Generator) -> dict[str, np.ndarray]:
    real = rng.integers(1, length + 1, size=rows)
    real[0] = length
    mask = np.stack([mask_row(length, int(n), style, rng) for n in real])
    return {
        "input_ids": rng.integers(1000, 30000, size=(rows, length), dtype=np.int64) * mask,
        "attention_mask": mask,
        "token_type_ids": np.zeros((rows, length), dtype=np.int64),
    }


def sweep_against_torch(default_folder: Path) -> list[SweepCase]:
    """Every (rows, length, mask style) batch of the sweep, with the fp32 PyTorch model's embeddings.

    The model is the exporter's encoder holding the source checkpoint's weights (tests/export/test_model.py
    holds it to transformers and sentence-transformers), run by torch on the CPU: nothing of the server's.
    """
    model = load_checkpoint(default_folder, DEFAULT_MODEL).build_model()
    rng = np.random.default_rng(0)
    cases = []
    for rows in SWEEP_ROWS:
        for length in SWEEP_LENGTHS:
            for style in cases.MASK_STYLES:
                feed = _sweep_feed(rows, length, style, rng)
                cases.append(SweepCase(f"{rows}x{length} {style}", feed, embed_each(model, [feed])))
    return cases


@pytest.fixture(scope="module")
def torch_sweep(default_folder: Path) -> list[SweepCase]:
    """The sweep and the model's answers, computed once for both variants."""
    return sweep_against_torch(default_folder)


def test_served_end_to_end_on_cuda_with_require_gpu(
    default_repository: Path, default_folder: Path, tmp_path: Path
) -> None:
    server = start_server(default_repository, tmp_path / "server.log", "--require-gpu")
    try:
        config = _model_config(server)
        assert [(group.kind, group.count) for group in config.instance_group] == [(mc.ModelInstanceGroup.KIND_GPU, 1)]
        assert config.parameters["execution_provider"].string_value == CUDA
        assert config.parameters["variant"].string_value == "fp16", server.log()
        assert _provider_gauges(server) == {(CUDA, "fp16"): 1}
        with EmbeddingClient(server.target) as client:
            served = client.embed(TEXTS)
        # The model as its own library runs it: sentence-transformers' tokenizer, model and pooling, on the CPU.
        expected = SentenceTransformer(str(default_folder), device="cpu").encode(TEXTS, convert_to_numpy=True)
        assert served.shape == expected.shape
        assert row_cosines(served, expected).min() >= FIDELITY_MIN_COSINE
        assert "fidelity check passed: fp16 on CUDAExecutionProvider" in server.log()
    finally:
        server.stop()


@pytest.mark.parametrize("variant", ["fp16", "fp32"])
def test_cuda_variants_match_the_model_over_rows_lengths_and_masks(
    default_repository: Path, torch_sweep: list[SweepCase], variant: str
) -> None:
    spec = read_model(default_repository / DEFAULT_MODEL)
    gpu = ModelRuntime(spec, ExecutionSettings(require_gpu=True, variant=variant))
    assert gpu.provider == CUDA and gpu.fidelity is not None and gpu.fidelity.provider == CUDA
    bar = max(FIDELITY_MIN_COSINE, VARIANT_MIN_COSINE[variant]) if variant == "fp16" else VARIANT_MIN_COSINE[variant]
    failing: dict[str, str] = {}
    for case in torch_sweep:
        got = gpu.run(case.feed, ("embedding",))["embedding"]
        assert got.shape == case.expected.shape, case.name
        cosine = float(row_cosines(got, case.expected).min())
        if cosine < bar:
            failing[case.name] = f"cosine {cosine:.6f} < {bar}"
        # fp32 (CUDA with TF32 off) is held to the values too; fp16's rounding is what its cosine bar allows for.
        difference = float(relative_differences(got, case.expected).max())
        if variant == "fp32" and difference > FP32_RELATIVE_DIFF:
            failing[case.name] = f"largest difference {difference:.3g} of the row's norm > {FP32_RELATIVE_DIFF}"
    assert not failing, f"{variant} on CUDA against the PyTorch model: {failing}"


def test_cuda_warm_up_covers_the_bucketed_lengths(default_repository: Path) -> None:
    settings = Settings(model_repository=default_repository, require_gpu=True, intra_op_threads=1)
    model = load_model(default_repository / DEFAULT_MODEL, settings)
    assert model.instances[0].provider == CUDA and model.policy.length_bucket == 32
    shapes = warm_up_shapes(model.spec, model.policy)
    assert [length for _, length in shapes[:-1]] == list(range(32, 257, 32))
    assert shapes[-1] == (min(model.policy.max_batch_size, model.policy.max_batch_tokens // 256), 256)


def test_two_instances_on_cuda_under_load(default_repository: Path, tmp_path: Path) -> None:
    server = start_server(default_repository, tmp_path / "server.log", "--require-gpu", "--instances", "2")
    try:
        config = _model_config(server)
        assert [(group.kind, group.count) for group in config.instance_group] == [(mc.ModelInstanceGroup.KIND_GPU, 2)]
        assert _provider_gauges(server) == {(CUDA, "fp16"): 2}
        texts = [f"request {i}: {TEXTS[i % len(TEXTS)]}" for i in range(256)]
        with EmbeddingClient(server.target) as client, ThreadPoolExecutor(32) as pool:
            results = list(pool.map(lambda text: client.embed([text]), texts))
        assert all(result.shape == (1, 384) for result in results)
        with EmbeddingClient(server.target) as client:
            together = client.embed(texts[:3])
        assert cosines(np.concatenate(results[:3]), together).min() >= FIDELITY_MIN_COSINE
    finally:
        server.stop()


def test_no_visible_device_falls_back_to_the_cpu_with_the_reason(default_repository: Path, tmp_path: Path) -> None:
    hidden = {"CUDA_VISIBLE_DEVICES": ""}
    server = start_server(default_repository, tmp_path / "server.log", env=hidden)
    try:
        config = _model_config(server)
        assert [(group.kind, group.count) for group in config.instance_group] == [(mc.ModelInstanceGroup.KIND_CPU, 1)]
        assert (config.parameters["execution_provider"].string_value, config.parameters["variant"].string_value) == (
            CPU,
            "fp32",
        )
        assert "CUDA cannot be used, serving on the CPU: the NVIDIA driver cannot initialise CUDA" in server.log()
    finally:
        server.stop()
    command = [sys.executable, "-m", "service", "--model-repository", str(default_repository), "--require-gpu"]
    command += ["--grpc-port", "0", "--metrics-port", "0", "--http-port", "0", "--intra-op-threads", "1"]
    result = subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False, env={**os.environ, **hidden}
    )
    assert result.returncode == 2
    # One line says why, whichever of the server's processes (--frontends is several on a GPU node) found it.
    refusal = "service: error: a GPU is required but CUDA cannot be used: the NVIDIA driver"
    reasons = [line for line in result.stderr.splitlines() if line.startswith(refusal)]
    assert len(reasons) == 1, result.stderr


def test_int8_is_reported_on_the_cpu_even_where_cuda_is_usable(default_repository: Path) -> None:
    spec = read_model(default_repository / DEFAULT_MODEL)
    runtime = ModelRuntime(spec, dataclasses.replace(ExecutionSettings(), variant="int8", intra_op_threads=1))
    assert (runtime.provider, runtime.variant) == (CPU, "int8")


def test_a_rerankers_fp16_is_the_cuda_default_within_the_logit_rule(exported_tasks: ExportedTasks) -> None:
    """A reranker on CUDA: fp16 by default, checked at load against the rule for logits, CrossEncoder's order."""
    spec = read_model(exported_tasks.repository / FP16_SOURCE)
    runtime = ModelRuntime(spec, ExecutionSettings(require_gpu=True, intra_op_threads=1))
    assert (runtime.provider, runtime.variant) == (CUDA, "fp16")
    check = runtime.fidelity
    assert check is not None and check.passed and check.required == LOGITS_FIDELITY_MAX_ABS_DIFF
    tokenizer = TextTokenizer(spec.tokenizer_file, spec.max_sequence_length, spec.pad_token_id)
    logits = runtime.run(tokenizer.encode_pairs(PAIRS).feed(spec.input_names), ("logits",))["logits"]
    expected = cross_encoder_logits(exported_tasks.sources[FP16_SOURCE], PAIRS)
    np.testing.assert_allclose(logits, expected, rtol=0, atol=LOGITS_FIDELITY_MAX_ABS_DIFF)


def test_queries_on_the_express_lane_beside_bulk_work_on_cuda(
    default_repository: Path, default_folder: Path, tmp_path: Path
) -> None:
    """Priority-1 queries while lowest-priority bulk requests fill the instance: every answer is the model's.

    With two priority levels the express lane runs the queries on a second thread over the first
    instance's CUDA session, beside the bulk run (ONNX Runtime's concurrent Run on one session).
    """
    server = start_server(default_repository, tmp_path / "server.log", "--require-gpu")
    words = " ".join(TEXTS).split()
    bulk_texts = [" ".join(words[(i + j) % len(words)] for j in range(120)) for i in range(2048)]
    queries = [f"query {i}: {TEXTS[i % len(TEXTS)]}" for i in range(40)]
    try:
        with EmbeddingClient(server.target) as client, ThreadPoolExecutor(4) as pool:
            bulk = [
                pool.submit(client.embed, bulk_texts[start : start + 512], priority=2) for start in (0, 512, 1024, 1536)
            ]
            answered, beside_bulk = [], 0
            for query in queries:
                answered.append(client.embed([query], priority=1)[0])
                beside_bulk += not all(future.done() for future in bulk)
            bulk_answers = np.concatenate([future.result() for future in bulk])
        reference = SentenceTransformer(str(default_folder), device="cpu")
        expected_queries = reference.encode(queries, convert_to_numpy=True)
        assert row_cosines(np.stack(answered), expected_queries).min() >= FIDELITY_MIN_COSINE, (
            f"{beside_bulk} beside bulk"
        )
        sample = list(range(0, 2048, 97))
        expected_bulk = reference.encode([bulk_texts[i] for i in sample], convert_to_numpy=True)
        assert row_cosines(bulk_answers[sample], expected_bulk).min() >= FIDELITY_MIN_COSINE
        assert beside_bulk > 0, "no query was answered while bulk requests were under way"
    finally:
        server.stop()
