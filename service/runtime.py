"""ONNX Runtime sessions: execution providers (CUDA first, CPU as fallback), threads, warm-up, run.

A `ModelRuntime` is one model instance: one session, run from one worker thread at a time.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import onnxruntime as ort

from service.repository import ModelSpec

CUDA = "CUDAExecutionProvider"
CPU = "CPUExecutionProvider"

log = logging.getLogger(__name__)


class ExecutionError(RuntimeError):
    """A session that cannot be created as configured (e.g. --require-gpu without a usable GPU)."""


class BatchContractError(RuntimeError):
    """The model returned outputs that do not match the batch that went in."""


@dataclass(frozen=True)
class ExecutionSettings:
    """How sessions are created; a subset of the server settings."""

    device: str = "auto"
    """auto (CUDA when usable, else CPU, logged) or cpu."""
    require_gpu: bool = False
    """Fail instead of falling back to the CPU."""
    variant: str = "auto"
    """auto (the repository's preferred variant for the device), fp32, int8 or fp16."""
    intra_op_threads: int = 1
    """ONNX Runtime intra-op threads per instance (already resolved, > 0)."""
    allow_spinning: bool = False
    """Busy-wait in ONNX Runtime's thread pool; off on shared nodes (burns CPU, skews autoscaling)."""
    cuda_device_id: int = 0
    gpu_mem_limit_bytes: int = 0
    """Cap on the CUDA memory arena; 0 is no cap."""
    arena_extend_strategy: str = "kSameAsRequested"
    """kNextPowerOfTwo or kSameAsRequested (tighter: the arena is never returned)."""
    cudnn_conv_algo_search: str = "HEURISTIC"
    """EXHAUSTIVE, HEURISTIC or DEFAULT."""


def cuda_provider_options(settings: ExecutionSettings) -> dict[str, str]:
    """CUDA execution provider options from the settings."""
    options = {
        "device_id": str(settings.cuda_device_id),
        "arena_extend_strategy": settings.arena_extend_strategy,
        "cudnn_conv_algo_search": settings.cudnn_conv_algo_search,
        "do_copy_in_default_stream": "1",
    }
    if settings.gpu_mem_limit_bytes:
        options["gpu_mem_limit"] = str(settings.gpu_mem_limit_bytes)
    return options


def wants_cuda(settings: ExecutionSettings, available_providers: list[str]) -> bool:
    """Whether to try the CUDA provider first."""
    if settings.device == "cpu":
        return False
    if CUDA in available_providers:
        return True
    if settings.require_gpu:
        raise ExecutionError(
            f"a GPU is required but this ONNX Runtime build has no {CUDA} (available: {', '.join(available_providers)})"
        )
    return False


def choose_variant(spec: ModelSpec, settings: ExecutionSettings, device: str) -> str:
    """The variant to load on a device: the configured one, else the repository's preferred one."""
    if settings.variant != "auto":
        if settings.variant not in spec.variants:
            raise ExecutionError(
                f"model {spec.name}: variant {settings.variant} is not published "
                f"(published: {', '.join(sorted(spec.variants))})"
            )
        return settings.variant
    preferred = spec.preferred_variants.get(device, "fp32")
    return preferred if preferred in spec.variants else "fp32"


def session_options(settings: ExecutionSettings) -> ort.SessionOptions:
    """Session options for a server: fixed thread counts, spinning off unless asked for."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = settings.intra_op_threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    spinning = "1" if settings.allow_spinning else "0"
    options.add_session_config_entry("session.intra_op.allow_spinning", spinning)
    options.add_session_config_entry("session.inter_op.allow_spinning", spinning)
    options.log_severity_level = 3
    return options


class ModelRuntime:
    """One model instance: an ONNX Runtime session on the best available provider."""

    def __init__(self, spec: ModelSpec, settings: ExecutionSettings) -> None:
        self.spec = spec
        self.fell_back_to_cpu = False
        if wants_cuda(settings, ort.get_available_providers()):
            self.variant = choose_variant(spec, settings, "cuda")
            providers: list = [(CUDA, cuda_provider_options(settings)), CPU]
            self.session = self._create(settings, providers)
            if self.session.get_providers()[0] == CUDA:
                self._finish_init()
                return
            if settings.require_gpu:
                raise ExecutionError(f"model {spec.name}: the CUDA execution provider could not be created")
            self.fell_back_to_cpu = True
            log.warning("model %s: CUDA execution provider unavailable, falling back to CPU", spec.name)
        self.variant = choose_variant(spec, settings, "cpu")
        self.session = self._create(settings, [CPU])
        self._finish_init()

    def _create(self, settings: ExecutionSettings, providers: list) -> ort.InferenceSession:
        path = self.spec.variants[self.variant]
        try:
            return ort.InferenceSession(str(path), session_options(settings), providers=providers)
        except Exception as error:  # ONNX Runtime raises its own untyped failures for bad graphs
            raise ExecutionError(f"model {self.spec.name}: cannot load {path}: {error}") from error

    def _finish_init(self) -> None:
        self.provider = self.session.get_providers()[0]
        self.device = "cuda" if self.provider == CUDA else "cpu"
        graph_inputs = tuple(i.name for i in self.session.get_inputs())
        if set(graph_inputs) != set(self.spec.input_names):
            raise ExecutionError(
                f"model {self.spec.name}: graph inputs {graph_inputs} differ from config.pbtxt {self.spec.input_names}"
            )
        self.input_names = graph_inputs
        self.output_names = tuple(o.name for o in self.session.get_outputs())
        log.info("model %s: variant %s on %s", self.spec.name, self.variant, self.provider)

    def run(self, feed: dict[str, np.ndarray], outputs: tuple[str, ...]) -> dict[str, np.ndarray]:
        """Run one batch (blocking) and check the batch contract on what comes back."""
        inputs = {name: feed[name] for name in self.input_names}
        bound = self.device == "cuda"
        results = self._run_bound(inputs, outputs) if bound else self.session.run(list(outputs), inputs)
        rows, length = feed["input_ids"].shape
        produced = dict(zip(outputs, results, strict=True))
        expected_shapes = {
            "embedding": (rows, self.spec.hidden_size),
            "last_hidden_state": (rows, length, self.spec.hidden_size),
        }
        for name, array in produced.items():
            if array.shape != expected_shapes[name] or array.dtype != np.float32:
                raise BatchContractError(
                    f"model {self.spec.name}: output {name} is {array.dtype}{list(array.shape)}, "
                    f"expected float32{list(expected_shapes[name])}"
                )
        return produced

    def _run_bound(self, inputs: dict[str, np.ndarray], outputs: tuple[str, ...]) -> list[np.ndarray]:
        """CUDA: I/O binding, outputs written once straight into host memory."""
        binding = self.session.io_binding()
        for name, array in inputs.items():
            binding.bind_cpu_input(name, array)
        for name in outputs:
            binding.bind_output(name, "cpu")
        self.session.run_with_iobinding(binding)
        return [value.numpy() for value in binding.get_outputs()]

    def warm_up(self, shapes: list[tuple[int, int]]) -> None:
        """Run the given (rows, length) shapes once, largest last, so first requests are not slow."""
        for rows, length in shapes:
            feed = {
                "input_ids": np.full((rows, length), 1, dtype=np.int64),
                "attention_mask": np.ones((rows, length), dtype=np.int64),
                "token_type_ids": np.zeros((rows, length), dtype=np.int64),
            }
            self.run(feed, self.output_names)
