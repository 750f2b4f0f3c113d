"""Where a model instance runs, which variant, the fidelity check at load, warm-up and the batch contract.

Everything here runs on the CPU (device cpu, or the fallback on a machine without a usable GPU);
the CUDA side of the same logic is in test_gpu.py.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper
from onnxruntime.transformers.fusion_options import AttentionMaskFormat

from export.build import ExportOptions, export_model
from export.checkpoints.checkpoint import random_checkpoint
from export.graph import forms as optimize
from export.graph.onnx_export import export_onnx
from service.core.fidelity import (
    FIDELITY_MIN_COSINE,
    LOGITS_FIDELITY_MAX_ABS_DIFF,
    LOGITS_MAX_ABS_DIFF,
    VARIANT_MIN_COSINE,
    FidelityReference,
    required_bar,
    required_cosine,
)
from service.core.repository import CONFIG_FILE, FIDELITY_FILE, RepositoryError, read_model
from service.core.runtime import (
    CPU,
    BatchContractError,
    ExecutionError,
    ExecutionSettings,
    ModelRuntime,
    choose_variant,
    create_instances,
    cuda_unavailable_reason,
    target_device,
)
from tests.conftest import DEFAULT_MODEL, TINY_CONFIG, TINY_MODEL
from tests.servers import ROOT

CPU_SETTINGS = ExecutionSettings(device="cpu", intra_op_threads=1)


def feed(rows: int, length: int) -> dict[str, np.ndarray]:
    return {
        "input_ids": np.full((rows, length), 2023, dtype=np.int64),
        "attention_mask": np.ones((rows, length), dtype=np.int64),
        "token_type_ids": np.zeros((rows, length), dtype=np.int64),
    }


@pytest.fixture(scope="module")
def tiny_fp16_repository(tmp_path_factory: pytest.TempPathFactory, default_folder: Path) -> Path:
    """The tiny model with fp32 and fp16 (fp16 is gated on CUDA where usable, else on the CPU)."""
    repository = tmp_path_factory.mktemp("tiny-fp16")
    checkpoint = random_checkpoint(TINY_CONFIG, TINY_MODEL, seed=1, tokenizer_folder=default_folder)
    export_model(checkpoint, repository, ExportOptions(variants=("fp32", "fp16"), threads=1))
    return repository


def test_device_choice_is_made_before_any_session() -> None:
    assert target_device(ExecutionSettings(device="cpu"), None) == "cpu"
    assert target_device(ExecutionSettings(variant="int8"), None) == "cpu"  # a CPU variant
    assert target_device(ExecutionSettings(), None) == "cuda"
    assert target_device(ExecutionSettings(), "no NVIDIA driver: libcuda.so.1") == "cpu"
    with pytest.raises(ExecutionError, match=r"CUDA cannot be used: no NVIDIA driver: libcuda\.so\.1"):
        target_device(ExecutionSettings(require_gpu=True), "no NVIDIA driver: libcuda.so.1")
    with pytest.raises(ExecutionError, match="the device is set to cpu"):
        target_device(ExecutionSettings(require_gpu=True, device="cpu"), None)
    with pytest.raises(ExecutionError, match="int8 variant runs on the CPU only"):
        target_device(ExecutionSettings(require_gpu=True, variant="int8"), None)


@pytest.mark.no_gpu
def test_the_reason_cuda_cannot_be_used_is_ours_and_concrete() -> None:
    reason = cuda_unavailable_reason(0)
    assert reason is not None
    # One of the concrete causes, in our words: no CUDA build, a library that cannot load, the driver, the device.
    assert any(
        cause in reason
        for cause in ("has no CUDAExecutionProvider", "cannot be loaded", "NVIDIA driver", "CUDA device")
    ), reason


OBSERVE_THREADS = """
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from service.core.repository import read_model
from service.core.runtime import ExecutionSettings, ModelRuntime


def tasks():
    return {int(tid) for tid in os.listdir("/proc/self/task")}


def cpu_ns(tid):
    return int(Path(f"/proc/self/task/{tid}/schedstat").read_text().split()[0])


def sleeps(tid):
    for line in Path(f"/proc/self/task/{tid}/status").read_text().splitlines():
        if line.startswith("voluntary_ctxt_switches:"):
            return int(line.split()[1])


def asleep(tid):
    text = Path(f"/proc/self/task/{tid}/stat").read_text()
    return text[text.rindex(")") + 2] == "S"


model, threads, spinning = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
rounds, runs, idle_s, wait_s = int(sys.argv[4]), int(sys.argv[5]), float(sys.argv[6]), float(sys.argv[7])
before = tasks()
settings = ExecutionSettings(device="cpu", intra_op_threads=threads, allow_spinning=spinning)
runtime = ModelRuntime(read_model(model), settings)
workers = sorted(tasks() - before)
feed = {
    "input_ids": np.full((1, 8), 2023, dtype=np.int64),
    "attention_mask": np.ones((1, 8), dtype=np.int64),
    "token_type_ids": np.zeros((1, 8), dtype=np.int64),
}
report = {"workers": len(workers), "sleeps_running": 0, "cpu_ns_after": 0, "never_slept": 0}
for _ in range(rounds):
    slept = sum(sleeps(tid) for tid in workers)
    for _ in range(runs):
        runtime.run(feed, ("embedding",))
    returned = sum(cpu_ns(tid) for tid in workers)
    report["sleeps_running"] += sum(sleeps(tid) for tid in workers) - slept
    deadline = time.monotonic() + wait_s
    while not all(asleep(tid) for tid in workers):
        if time.monotonic() > deadline:
            report["never_slept"] += 1
            break
    time.sleep(idle_s)
    report["cpu_ns_after"] += sum(cpu_ns(tid) for tid in workers) - returned
print(json.dumps(report))
"""
"""A fresh process (so that no other thread starts meanwhile) creates a ModelRuntime and reports the threads
its session started and, from the kernel's per-thread accounting, what they did: the times they went to
sleep (voluntary context switches) during rounds of runs, and the CPU time (nanoseconds) they used from each
round's last return until they were asleep and through an idle wait after it.

Both are counts of what the threads did, not of how fast: a slower or busier machine stretches the
wall-clock time of every step, not the number of sleeps, nor the CPU time a thread spends once it is asleep."""
ROUNDS = 4
RUNS = 100
"""Runs a round of the model observed. For the spinning test that is the default model (six layers: some thirty
parallel sections a run, where the tiny model's two layers have a few, too few to tell the two apart on a
loaded machine). Measured on 2 vCPUs, a worker that may not spin slept 29 times a run (18-21 with the cores
overloaded: a preempted worker sometimes finds its next piece of work already waiting); one that may spin
slept once a run (when force_spinning_stop ends its spinning with the run), or less when loaded."""
IDLE_S = 0.1
"""The idle wait after each round, once the workers are asleep: a worker that woke up to spin would show in it."""
ASLEEP_WAIT_S = 10.0
"""Bounds the wait for the workers to be asleep after a round; never what is asserted."""
SPIN_AFTER_RETURN_NS = 2_000_000
"""CPU a round's workers may use after its last run returned: measured ~10 microseconds (going to sleep);
without force_spinning_stop a worker allowed to spin went on for 11-35 ms of CPU after every round."""


def observe_threads(model: Path, threads: int, *, spinning: bool) -> dict[str, int]:
    """Workers the session of a `threads`-thread instance of `model` started, how often they slept while runs
    went on, and the CPU they used once the runs had returned."""
    arguments = [str(model), str(threads), "1" if spinning else "0", str(ROUNDS), str(RUNS)]
    arguments += [str(IDLE_S), str(ASLEEP_WAIT_S)]
    finished = subprocess.run(
        [sys.executable, "-c", OBSERVE_THREADS, *arguments],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert finished.returncode == 0, finished.stderr
    return json.loads(finished.stdout)


@pytest.mark.parametrize("threads", [1, 3])
def test_an_instance_runs_on_the_intra_op_threads_asked_for(tiny_repository: Path, threads: int) -> None:
    # ONNX Runtime's intra-op pool is the calling thread and threads - 1 workers (left to its default,
    # one per core); sequential execution starts no inter-op pool beside it.
    assert observe_threads(tiny_repository / TINY_MODEL, threads, spinning=False)["workers"] == threads - 1


def test_threads_spin_only_when_allowed_and_only_while_a_run_is_under_way(default_repository: Path) -> None:
    still = observe_threads(default_repository / DEFAULT_MODEL, 2, spinning=False)
    spinning = observe_threads(default_repository / DEFAULT_MODEL, 2, spinning=True)
    assert still["workers"] == spinning["workers"] == 1
    runs = ROUNDS * RUNS
    # A worker that may not spin goes to sleep whenever it runs out of work, between the operators of a run;
    # one that may spin busy-waits for the next operator instead, and sleeps when the run ends (or when a
    # wait outlasts its spin). Bounds with a wide margin on both sides of what was measured: see RUNS.
    assert still["sleeps_running"] >= 5 * runs, (still, spinning)
    assert spinning["sleeps_running"] <= 2 * runs, (still, spinning)
    # Once a round's last run has returned, neither burns any CPU: each is asleep at once (force_spinning_stop
    # ends the spinning with the run) and stays asleep.
    for observed in (still, spinning):
        assert observed["never_slept"] == 0, (still, spinning)
        assert observed["cpu_ns_after"] <= ROUNDS * SPIN_AFTER_RETURN_NS, (still, spinning)


def test_default_variant_follows_the_fidelity_rule(default_repository: Path) -> None:
    spec = read_model(default_repository / DEFAULT_MODEL)
    assert spec.preferred_variants == {"cpu": "fp32", "cuda": "fp16"}
    assert choose_variant(spec, ExecutionSettings(), "cpu") == "fp32"
    assert choose_variant(spec, ExecutionSettings(), "cuda") == "fp16"
    assert choose_variant(spec, ExecutionSettings(variant="int8"), "cpu") == "int8"
    assert choose_variant(spec, ExecutionSettings(variant="fp32"), "cuda") == "fp32"
    # A repository from before the fidelity rule preferred int8 on the CPU: never a default now.
    older = dataclasses.replace(spec, preferred_variants={"cpu": "int8", "cuda": "fp16"}, fidelity_file=None)
    assert choose_variant(older, ExecutionSettings(), "cpu") == "fp32"
    # Without a reference nothing can check fp16 on the device, so it is not chosen by default.
    assert choose_variant(older, ExecutionSettings(), "cuda") == "fp32"
    without_fp16 = dataclasses.replace(spec, variants={"fp32": spec.variants["fp32"]})
    assert choose_variant(without_fp16, ExecutionSettings(), "cuda") == "fp32"
    with pytest.raises(ExecutionError, match="variant fp16 is not published"):
        choose_variant(without_fp16, ExecutionSettings(variant="fp16"), "cpu")


def test_required_cosine_is_the_variant_bar_and_the_rule_for_defaults() -> None:
    assert required_cosine("fp16", chosen_by_default=True) == FIDELITY_MIN_COSINE
    assert required_cosine("fp16", chosen_by_default=False) == VARIANT_MIN_COSINE["fp16"]
    assert required_cosine("fp32", chosen_by_default=True) == VARIANT_MIN_COSINE["fp32"]
    assert required_cosine("int8", chosen_by_default=False) == VARIANT_MIN_COSINE["int8"]


def test_a_classifiers_bar_is_its_variants_logit_difference_and_the_rule_for_defaults() -> None:
    assert required_bar("logits", "fp16", chosen_by_default=True) == LOGITS_FIDELITY_MAX_ABS_DIFF
    assert required_bar("logits", "fp16", chosen_by_default=False) == LOGITS_MAX_ABS_DIFF["fp16"]
    assert required_bar("logits", "fp32", chosen_by_default=True) == LOGITS_MAX_ABS_DIFF["fp32"]
    assert required_bar("embedding", "fp16", chosen_by_default=True) == FIDELITY_MIN_COSINE
    assert LOGITS_MAX_ABS_DIFF["fp32"] < LOGITS_FIDELITY_MAX_ABS_DIFF < LOGITS_MAX_ABS_DIFF["fp16"]


@pytest.mark.no_gpu
def test_without_a_gpu_auto_falls_back_to_cpu_and_require_gpu_refuses_with_the_reason(
    default_repository: Path,
) -> None:
    spec = read_model(default_repository / DEFAULT_MODEL)
    runtime = ModelRuntime(spec, ExecutionSettings(intra_op_threads=1))
    assert runtime.provider == CPU and runtime.variant == "fp32"
    assert runtime.fell_back_to_cpu
    with pytest.raises(ExecutionError, match="a GPU is required but CUDA cannot be used: ") as refused:
        ModelRuntime(spec, ExecutionSettings(intra_op_threads=1, require_gpu=True))
    assert str(refused.value).endswith(cuda_unavailable_reason(0))


@pytest.mark.parametrize("variant", ["fp32", "int8", "fp16"])
def test_every_variant_passes_its_fidelity_check_at_load(default_repository: Path, variant: str) -> None:
    spec = read_model(default_repository / DEFAULT_MODEL)
    runtime = ModelRuntime(spec, dataclasses.replace(CPU_SETTINGS, variant=variant))
    check = runtime.fidelity
    assert check is not None and check.passed
    assert (check.variant, check.provider, check.required) == (variant, CPU, VARIANT_MIN_COSINE[variant])
    assert check.min_cosine >= VARIANT_MIN_COSINE[variant]


def test_fidelity_reference_holds_every_mask_shape_and_the_models_embeddings(default_repository: Path) -> None:
    reference = FidelityReference.load(default_repository / DEFAULT_MODEL / FIDELITY_FILE)
    mask = reference.feed["attention_mask"]
    assert reference.embedding.shape == (mask.shape[0], 384)
    assert mask.shape[1] <= 48, "short enough to run at every load (tens of ms on a CPU)"
    assert any("left-padded" in label for label in reference.labels)
    assert any("holed" in label for label in reference.labels)
    assert (mask[:, 0] == 0).any(), "a row starts with padding"
    holes = [row for row in mask if 0 in row[: np.flatnonzero(row)[-1]] and row[0] == 1]
    assert holes, "a row has a hole in its mask"
    np.testing.assert_allclose(np.linalg.norm(reference.embedding, axis=1), 1.0, atol=1e-5)


def _mask_index_fp16(raw_source: Path, output: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """fp16 built the way it was before the fix: fused Attention reading the mask as a count of ones."""
    original = optimize._fusion_options

    def old_format(form: str):
        options = original(form)
        options.attention_mask_format = AttentionMaskFormat.MaskIndexEnd
        return options

    monkeypatch.setattr(optimize, "_fusion_options", old_format)
    optimize.write_cuda_fp16(raw_source, output, TINY_CONFIG)


@pytest.fixture
def broken_fp16_repository(
    tmp_path: Path, tiny_fp16_repository: Path, default_folder: Path, monkeypatch: pytest.MonkeyPatch
) -> Path:
    """The tiny fp16 repository with its fp16 graph replaced by one that mishandles left padding and holes."""
    repository = tmp_path / "repository"
    shutil.copytree(tiny_fp16_repository, repository)
    checkpoint = random_checkpoint(TINY_CONFIG, TINY_MODEL, seed=1, tokenizer_folder=default_folder)
    raw = tmp_path / "raw.onnx"
    export_onnx(checkpoint.build_model(), raw)
    _mask_index_fp16(raw, repository / TINY_MODEL / "1" / "model.fp16.onnx", monkeypatch)
    return repository


def test_a_default_fp16_below_the_rule_is_replaced_by_fp32_loudly(
    broken_fp16_repository: Path, caplog: pytest.LogCaptureFixture
) -> None:
    spec = read_model(broken_fp16_repository / TINY_MODEL)
    # The CPU stands in for the device: the repository's preference there is made fp16.
    spec = dataclasses.replace(spec, preferred_variants={"cpu": "fp16", "cuda": "fp16"})
    with caplog.at_level(logging.WARNING, logger="service.core.runtime"):
        runtime = ModelRuntime(spec, CPU_SETTINGS)
    assert runtime.variant == "fp32" and runtime.fidelity.passed
    warning = next(r.getMessage() for r in caplog.records if "FIDELITY CHECK FAILED" in r.getMessage())
    assert "fp16 on CPUExecutionProvider" in warning and ("left-padded" in warning or "holed" in warning)


def test_an_operator_chosen_variant_below_its_bar_fails_the_load(broken_fp16_repository: Path) -> None:
    spec = read_model(broken_fp16_repository / TINY_MODEL)
    with pytest.raises(ExecutionError, match=r"fidelity check failed: fp16 on CPUExecutionProvider: min cosine"):
        ModelRuntime(spec, dataclasses.replace(CPU_SETTINGS, variant="fp16"))


def test_fp32_that_is_not_the_model_fails_the_load(repository_copy: Path, default_folder: Path, tmp_path: Path) -> None:
    other = random_checkpoint(TINY_CONFIG, TINY_MODEL, seed=7, tokenizer_folder=default_folder)
    export_onnx(other.build_model(), repository_copy / TINY_MODEL / "1" / "model.onnx")
    with pytest.raises(ExecutionError, match=r"fidelity check failed: fp32 on CPUExecutionProvider"):
        ModelRuntime(read_model(repository_copy / TINY_MODEL), CPU_SETTINGS)


def test_an_unreadable_fidelity_reference_is_an_execution_error(repository_copy: Path) -> None:
    (repository_copy / TINY_MODEL / FIDELITY_FILE).write_bytes(b"not an npz")
    with pytest.raises(ExecutionError, match="not a fidelity reference"):
        ModelRuntime(read_model(repository_copy / TINY_MODEL), CPU_SETTINGS)


def test_cpu_device_never_tries_cuda(tiny_repository: Path) -> None:
    runtime = ModelRuntime(read_model(tiny_repository / TINY_MODEL), CPU_SETTINGS)
    assert runtime.provider == CPU and not runtime.fell_back_to_cpu
    outputs = runtime.run(feed(3, 5), ("embedding", "last_hidden_state"))
    assert outputs["embedding"].shape == (3, 32) and outputs["last_hidden_state"].shape == (3, 5, 32)


def _online_level(runtime: ModelRuntime) -> ort.GraphOptimizationLevel:
    return runtime.session.get_session_options().graph_optimization_level


def test_the_fp32_graph_runs_at_the_online_optimisation_its_form_was_measured_at(
    repository_copy: Path, default_repository: Path
) -> None:
    """The exported fp32 form runs as measured (basic: not fused again); int8, and configs saying so, at all."""
    config = repository_copy / TINY_MODEL / CONFIG_FILE
    assert "optimization {\n  graph {\n    level: -1\n  }\n}" in config.read_text()
    assert _online_level(ModelRuntime(read_model(repository_copy / TINY_MODEL), CPU_SETTINGS)) == (
        ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    )
    int8 = ModelRuntime(
        read_model(default_repository / DEFAULT_MODEL), dataclasses.replace(CPU_SETTINGS, variant="int8")
    )
    assert _online_level(int8) == ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    config.write_text(config.read_text().replace("level: -1", "level: 0"))
    assert _online_level(ModelRuntime(read_model(repository_copy / TINY_MODEL), CPU_SETTINGS)) == (
        ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    )
    config.write_text(config.read_text().replace("level: 0", "level: 3"))
    with pytest.raises(RepositoryError, match=r"optimization.graph.level 3 is not one of -1 \(basic\), 0 \(all\)"):
        read_model(repository_copy / TINY_MODEL)


def test_instances_are_pinned_to_the_first_ones_device_and_variant(default_repository: Path) -> None:
    spec = read_model(default_repository / DEFAULT_MODEL)
    runtimes = create_instances(spec, ExecutionSettings(intra_op_threads=1, variant="int8"), 2)
    assert [(r.provider, r.variant) for r in runtimes] == [(CPU, "int8")] * 2
    assert runtimes[1].settings.device == "cpu" and runtimes[1].settings.variant == "int8"


def _wrong_batch_model(path: Path) -> None:
    """A graph that ignores the batch: always one row out."""
    inputs = [
        helper.make_tensor_value_info(name, TensorProto.INT64, ["batch", "sequence"])
        for name in ("input_ids", "attention_mask", "token_type_ids")
    ]
    constant = helper.make_tensor("one_row", TensorProto.FLOAT, [1, 32], [0.5] * 32)
    nodes = [
        helper.make_node("Constant", [], ["embedding"], value=constant),
        helper.make_node(
            "Constant",
            [],
            ["last_hidden_state"],
            value=helper.make_tensor("h", TensorProto.FLOAT, [1, 1, 32], [0.5] * 32),
        ),
    ]
    outputs = [
        helper.make_tensor_value_info("last_hidden_state", TensorProto.FLOAT, [1, 1, 32]),
        helper.make_tensor_value_info("embedding", TensorProto.FLOAT, [1, 32]),
    ]
    graph = helper.make_graph(nodes, "wrong", inputs, outputs)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9), str(path))


@pytest.fixture
def wrong_batch_repository(repository_copy: Path) -> Path:
    """The tiny repository with a graph that breaks the batch contract, and no reference to catch it at load."""
    _wrong_batch_model(repository_copy / TINY_MODEL / "1" / "model.onnx")
    (repository_copy / TINY_MODEL / FIDELITY_FILE).unlink()
    return repository_copy


def test_batch_contract_is_checked_loudly(wrong_batch_repository: Path) -> None:
    runtime = ModelRuntime(read_model(wrong_batch_repository / TINY_MODEL), CPU_SETTINGS)
    assert runtime.fidelity is None
    with pytest.raises(BatchContractError, match=r"output embedding is float32\[1, 32\], expected float32\[2, 32\]"):
        runtime.run(feed(2, 4), ("embedding",))


def test_a_warm_up_failure_is_an_execution_error_naming_the_shape(wrong_batch_repository: Path) -> None:
    runtime = ModelRuntime(read_model(wrong_batch_repository / TINY_MODEL), CPU_SETTINGS)
    with pytest.raises(ExecutionError, match=r"warm-up at 4x16 failed on CPUExecutionProvider \(fp32\): model"):
        runtime.warm_up([(1, 1), (4, 16)])


@pytest.mark.parametrize("transport", ["grpcio", "envoy"])
def test_a_warm_up_failure_stops_the_server_with_one_line_and_exit_2(
    wrong_batch_repository: Path, transport: str
) -> None:
    """Alone, or (Envoy) the whole server in Envoy's process under the supervisor, which then exits 2 too."""
    command = [sys.executable, "-m", "service", "--model-repository", str(wrong_batch_repository)]
    command += ["--device", "cpu", "--grpc-port", "0", "--metrics-port", "0", "--http-port", "0"]
    command += ["--intra-op-threads", "1", "--grpc-transport", transport, "--frontends", "1"]
    result = subprocess.run(
        command,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    if transport == "envoy":
        assert lines[-1].endswith("server exited with status 2: stopping the server"), result.stderr
        lines = [line for line in lines if line.startswith("service: error: ")]
    assert lines[-1].startswith(f"service: error: model {TINY_MODEL}: warm-up at "), result.stderr
