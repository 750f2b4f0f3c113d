"""ONNX Runtime sessions: where a model instance runs, which variant, the fidelity check, warm-up, run.

A `ModelRuntime` is one model instance: one session, run from one worker thread at a time. It is
placed in three steps, each logged:

1. Device. `device=cpu`, or the int8 variant (a CPU variant: ONNX Runtime has no CUDA kernels for
   its dynamic-quantisation operators, so on CUDA most of it would run on the CPU anyway), means
   the CPU. Otherwise CUDA, when this ONNX Runtime build has the provider and nothing stands in its
   way here; what does (missing CUDA libraries, no driver, no visible device, a GPU older than the
   build's CUDA supports) is found out and said in our own words (`cuda_unavailable_reason`).
   `require_gpu` turns any such reason into an error instead of a CPU fallback.
2. Variant. The operator's (`variant`), or by default the repository's preference for the device
   among the fidelity variants (fp32, fp16); int8 is never a default.
3. Fidelity check. The repository's reference inputs (`fidelity.npz`) run through the session and
   are compared with the model's fp32 embeddings (see service.core.fidelity). A default fp16 below the
   fidelity rule is replaced by fp32 on the same device, with a warning; an operator-chosen variant
   below its own bar, or fp32 below its bar, fails the load (ExecutionError: the server exits 2).
   A repository without a reference (exported before it existed) is served unchecked, except that
   fp16 is then not chosen by default.

A two-tower model's image tower (service.core.towers) is a ModelRuntime of its own (`image=True`), fed
pixel_values, on the text tower's device and in the text tower's variant: the model's variant applies to both
towers. An image tower without that variant's graph (a repository exported before the image tower had variants)
serves its fp32 graph instead, with a warning. Its check at load is the text's, on the image reference
(`image_fidelity.npz`): the same bars, the same fallback of a default fp16 to fp32, the same errors; a repository
without that reference serves the image tower unchecked (logged).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort

from service.core.fidelity import (
    DEFAULT_VARIANTS,
    FidelityCheck,
    FidelityError,
    FidelityReference,
    compare,
    required_bar,
)
from service.core.layout import feed_shape
from service.core.repository import ModelSpec
from service.core.towers import PIXEL_VALUES
from service.errors import ExecutionError

CUDA = "CUDAExecutionProvider"
CPU = "CPUExecutionProvider"
CPU_ONLY_VARIANTS = ("int8",)
"""Variants that run on the CPU whatever the device setting."""
MIN_COMPUTE_CAPABILITY = {12: (5, 0), 13: (7, 5)}
"""Oldest GPU architecture each CUDA major supports (CUDA 13 dropped Maxwell, Pascal and Volta)."""
_CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75
_CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76

log = logging.getLogger(__name__)


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
    """auto (fp32, or fp16 on CUDA where it meets the fidelity rule), or fp32, int8 or fp16 by choice."""
    intra_op_threads: int = 1
    """ONNX Runtime intra-op threads per instance (already resolved, > 0)."""
    allow_spinning: bool = False
    """Busy-wait in ONNX Runtime's thread pool while a run is under way (never between runs)."""
    cuda_device_id: int = 0
    gpu_mem_limit_bytes: int = 0
    """Cap on the CUDA memory arena; 0 is no cap."""
    arena_extend_strategy: str = "kSameAsRequested"
    """kNextPowerOfTwo or kSameAsRequested (tighter: the arena is never returned)."""
    cudnn_conv_algo_search: str = "HEURISTIC"
    """EXHAUSTIVE, HEURISTIC or DEFAULT."""


def cuda_provider_options(settings: ExecutionSettings) -> dict[str, str]:
    """CUDA execution provider options from the settings.

    TF32 is off: fp32 on CUDA is meant to equal the model (TF32 rounds matmul inputs to 10 bits).
    """
    options = {
        "device_id": str(settings.cuda_device_id),
        "arena_extend_strategy": settings.arena_extend_strategy,
        "cudnn_conv_algo_search": settings.cudnn_conv_algo_search,
        "do_copy_in_default_stream": "1",
        "use_tf32": "0",
    }
    if settings.gpu_mem_limit_bytes:
        options["gpu_mem_limit"] = str(settings.gpu_mem_limit_bytes)
    return options


def _build_cuda_major() -> int | None:
    """The CUDA major this ONNX Runtime build was made for (None for a CPU build)."""
    version = getattr(ort.capi.build_and_package_info, "cuda_version", "") or ""
    major = version.split(".")[0]
    return int(major) if major.isdigit() else None


def _driver_problem(device_id: int, cuda_major: int | None) -> str | None:
    """What the NVIDIA driver says stands in the way of device_id, or None."""
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError as error:
        return f"no NVIDIA driver: {error}"

    def error_text(status: int) -> str:
        text = ctypes.c_char_p()
        driver.cuGetErrorString(status, ctypes.byref(text))
        return (text.value or b"unknown error").decode()

    status = driver.cuInit(0)
    if status != 0:
        return f"the NVIDIA driver cannot initialise CUDA: {error_text(status)} (CUDA error {status})"
    version, count = ctypes.c_int(), ctypes.c_int()
    driver.cuDriverGetVersion(ctypes.byref(version))
    if cuda_major is not None and version.value // 1000 < cuda_major:
        return (
            f"the NVIDIA driver supports CUDA {version.value // 1000}.{version.value % 1000 // 10}; "
            f"this ONNX Runtime build needs CUDA {cuda_major}"
        )
    driver.cuDeviceGetCount(ctypes.byref(count))
    if device_id >= count.value:
        return f"CUDA device {device_id} does not exist ({count.value} visible)"
    device, major, minor = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
    driver.cuDeviceGet(ctypes.byref(device), device_id)
    driver.cuDeviceGetAttribute(ctypes.byref(major), _CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, device)
    driver.cuDeviceGetAttribute(ctypes.byref(minor), _CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, device)
    oldest = MIN_COMPUTE_CAPABILITY.get(cuda_major or 0)
    if oldest is not None and (major.value, minor.value) < oldest:
        return (
            f"CUDA device {device_id} has compute capability {major.value}.{minor.value}; "
            f"CUDA {cuda_major} supports {oldest[0]}.{oldest[1]} and newer"
        )
    return None


@functools.cache
def cuda_unavailable_reason(device_id: int = 0) -> str | None:
    """Why the CUDA execution provider cannot run on device_id here, in our words; None if nothing is known.

    Checked without creating a session (ONNX Runtime would silently fall back to the CPU and
    leave the reason in its own log): the provider in this build, its shared library and the
    libraries it needs, then the driver, the device and its architecture.
    """
    if CUDA not in ort.get_available_providers():
        return f"this ONNX Runtime build ({ort.__version__}) has no {CUDA}"
    folder = Path(ort.__file__).parent / "capi"
    try:
        ctypes.CDLL(str(folder / "libonnxruntime_providers_shared.so"), mode=ctypes.RTLD_GLOBAL)
        ctypes.CDLL(str(folder / "libonnxruntime_providers_cuda.so"))
    except OSError as error:
        return (
            f"ONNX Runtime's CUDA provider cannot be loaded ({error}); this build needs the CUDA "
            f"{_build_cuda_major()} runtime, cuBLAS and cuDNN 9"
        )
    return _driver_problem(device_id, _build_cuda_major())


def target_device(settings: ExecutionSettings, cuda_problem: str | None) -> str:
    """The device ("cuda" or "cpu"), chosen before any session exists; ExecutionError if a required GPU is unusable.

    cuda_problem is cuda_unavailable_reason()'s answer (only consulted when CUDA is wanted).
    """
    if settings.require_gpu and settings.device == "cpu":
        raise ExecutionError("a GPU is required (require_gpu) but the device is set to cpu")
    if settings.require_gpu and settings.variant in CPU_ONLY_VARIANTS:
        raise ExecutionError(f"a GPU is required (require_gpu) but the {settings.variant} variant runs on the CPU only")
    if settings.device == "cpu" or settings.variant in CPU_ONLY_VARIANTS:
        return "cpu"
    if cuda_problem is None:
        return "cuda"
    if settings.require_gpu:
        raise ExecutionError(f"a GPU is required but CUDA cannot be used: {cuda_problem}")
    log.warning("CUDA cannot be used, serving on the CPU: %s", cuda_problem)
    return "cpu"


def choose_variant(spec: ModelSpec, settings: ExecutionSettings, device: str) -> str:
    """The variant to load on a device: the operator's, else the repository's preference among fp32/fp16.

    Without a fidelity reference fp16 is never a default: nothing could check it on this device.
    """
    if settings.variant != "auto":
        if settings.variant not in spec.variants:
            raise ExecutionError(
                f"model {spec.name}: variant {settings.variant} is not published "
                f"(published: {', '.join(sorted(spec.variants))})"
            )
        return settings.variant
    preferred = spec.preferred_variants.get(device, "fp32")
    if preferred not in DEFAULT_VARIANTS or preferred not in spec.variants:
        return "fp32"
    if preferred == "fp16" and spec.fidelity_file is None:
        log.warning("model %s: no fidelity reference in the repository, so fp16 is not chosen by default", spec.name)
        return "fp32"
    return preferred


GRAPH_OPTIMIZATION = {
    "disabled": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}
"""ONNX Runtime's online graph optimisation levels by the names the repository uses."""


def session_options(settings: ExecutionSettings, graph_optimization: str = "all") -> ort.SessionOptions:
    """Session options for a server: fixed thread counts; spinning, if allowed, only while a run is under way.

    Threads that spin between operators skip a wake-up per parallel section: a lone request is
    faster, each request costs more CPU (docs/decisions.md#onnx-runtime-spinning). `force_spinning_stop`
    ends the spinning when the last run returns, so an idle server burns no CPU either way.
    `graph_optimization`: the online graph optimisation (GRAPH_OPTIMIZATION's names).
    """
    options = ort.SessionOptions()
    options.graph_optimization_level = GRAPH_OPTIMIZATION[graph_optimization]
    options.intra_op_num_threads = settings.intra_op_threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    spinning = "1" if settings.allow_spinning else "0"
    options.add_session_config_entry("session.intra_op.allow_spinning", spinning)
    options.add_session_config_entry("session.inter_op.allow_spinning", spinning)
    options.add_session_config_entry("session.force_spinning_stop", "1")
    options.log_severity_level = 3
    return options


class ModelRuntime:
    """One model instance: an ONNX Runtime session on the device and variant chosen as the module says.

    `image`: the instance runs the model's image tower (pixel_values in) instead of its text graph, in
    settings.variant (the text tower's). `chosen_by_default`: whether the variant was the server's choice, not the
    operator's (default: settings.variant is auto); the check at load holds a default variant to the fidelity rule.
    """

    def __init__(
        self,
        spec: ModelSpec,
        settings: ExecutionSettings,
        *,
        image: bool = False,
        chosen_by_default: bool | None = None,
    ) -> None:
        self.spec = spec
        self.settings = settings
        self.image = image
        self.chosen_by_default = settings.variant == "auto" if chosen_by_default is None else chosen_by_default
        self.graphs = spec.image_variants if image else spec.variants
        """The ONNX file of each variant this instance may run."""
        self.reference_file = spec.image_fidelity_file if image else spec.fidelity_file
        """The fidelity reference this instance is checked with at load (None: served unchecked)."""
        self.input_names = (PIXEL_VALUES,) if image else spec.input_names
        self.name = f"{spec.name} (image tower)" if image else spec.name
        wants_cuda = settings.device != "cpu" and settings.variant not in CPU_ONLY_VARIANTS
        self.device = target_device(settings, cuda_unavailable_reason(settings.cuda_device_id) if wants_cuda else None)
        self.fell_back_to_cpu = wants_cuda and self.device == "cpu"
        self.variant = self._variant()
        try:
            self.session = self._create(self.variant)
        except ExecutionError as error:
            if self.device != "cuda" or settings.require_gpu:
                raise
            log.warning("%s; serving on the CPU", error)
            self.device, self.fell_back_to_cpu = "cpu", True
            self.variant = self._variant()
            self.session = self._create(self.variant)
        self.fidelity = self._check_fidelity()
        self.output_names = tuple(o.name for o in self.session.get_outputs())
        self.pixel_shape: tuple[int, ...] = tuple(self.session.get_inputs()[0].shape[1:]) if image else ()
        """An image row's shape (channels, height, width), as the image graph declares it; () for text."""
        log.info("model %s: variant %s on %s", self.name, self.variant, self.provider)

    def _variant(self) -> str:
        """The variant to load: the text graph's rule (choose_variant); the image tower's, the text tower's.

        An image tower without the text tower's variant serves fp32; without its reference, fp16 is not a default.
        """
        if not self.image:
            return choose_variant(self.spec, self.settings, self.device)
        wanted = self.settings.variant
        if wanted not in self.graphs:
            if wanted != "auto":
                log.warning("model %s: no %s graph published for the image tower; serving fp32", self.spec.name, wanted)
            return "fp32"
        if wanted == "fp16" and self.chosen_by_default and self.reference_file is None:
            log.warning("model %s: no image fidelity reference, so the image tower's fp16 is not a default", self.name)
            return "fp32"
        return wanted

    @property
    def provider(self) -> str:
        """The execution provider the session runs on."""
        return self.session.get_providers()[0]

    def _create(self, variant: str) -> ort.InferenceSession:
        path = self.graphs[variant]
        providers: list = [CPU]
        if self.device == "cuda":
            providers = [(CUDA, cuda_provider_options(self.settings)), CPU]
        try:
            options = session_options(self.settings, self.spec.online_optimization(variant, self.device))
            session = ort.InferenceSession(str(path), options, providers=providers)
        except Exception as error:  # ONNX Runtime raises its own untyped failures for bad graphs
            raise ExecutionError(f"model {self.name}: cannot load {path}: {error}") from error
        if self.device == "cuda" and session.get_providers()[0] != CUDA:
            raise ExecutionError(
                f"model {self.name}: ONNX Runtime did not place {path.name} on {CUDA} "
                "although the CUDA libraries, driver and device look usable (see ONNX Runtime's log)"
            )
        graph_inputs = tuple(i.name for i in session.get_inputs())
        if set(graph_inputs) != set(self.input_names):
            raise ExecutionError(
                f"model {self.name}: graph inputs {graph_inputs} differ from the expected {self.input_names}"
            )
        return session

    def _check_fidelity(self) -> FidelityCheck | None:
        """Run the repository's reference inputs; replace a default fp16 that misses the rule by fp32."""
        if self.reference_file is None:
            log.warning(
                "model %s: no fidelity reference in the repository; %s is served unchecked", self.name, self.variant
            )
            return None
        try:
            if self.image:
                reference = FidelityReference.load(self.reference_file, self.input_names)
            else:
                reference = FidelityReference.load(self.reference_file)
        except FidelityError as error:
            raise ExecutionError(f"model {self.name}: {error}") from error
        chosen_by_default = self.chosen_by_default
        check = self._measure(reference, chosen_by_default)
        if check.passed:
            log.info("model %s: fidelity check passed: %s", self.name, check.describe())
            return check
        if not chosen_by_default or self.variant == "fp32":
            raise ExecutionError(f"model {self.name}: fidelity check failed: {check.describe()}")
        log.warning(
            "model %s: FIDELITY CHECK FAILED, serving fp32 instead: %s. --variant %s serves it anyway if it meets"
            " its own bar.",
            self.name,
            check.describe(),
            self.variant,
        )
        self.variant = "fp32"
        self.session = self._create("fp32")
        check = self._measure(reference, chosen_by_default)
        if not check.passed:
            raise ExecutionError(f"model {self.name}: fidelity check failed: {check.describe()}")
        return check

    def _measure(self, reference: FidelityReference, chosen_by_default: bool) -> FidelityCheck:
        try:
            embedding = self.run(reference.feed, (reference.output,))[reference.output]
        except Exception as error:
            raise ExecutionError(
                f"model {self.name}: the fidelity check could not run {self.variant} on {self.provider}: {error}"
            ) from error
        return compare(
            reference,
            embedding,
            self.variant,
            self.provider,
            required_bar(reference.output, self.variant, chosen_by_default),
        )

    def pinned_settings(self) -> ExecutionSettings:
        """Settings that place another instance exactly like this one (same device and variant), or fail."""
        return dataclasses.replace(
            self.settings,
            device="auto" if self.device == "cuda" else "cpu",
            require_gpu=self.device == "cuda",
            variant=self.variant,
        )

    def run(self, feed: dict[str, np.ndarray], outputs: tuple[str, ...]) -> dict[str, np.ndarray]:
        """Run one batch (blocking) and check the batch contract on what comes back."""
        inputs = {name: feed[name] for name in self.input_names}
        bound = self.device == "cuda"
        results = self._run_bound(inputs, outputs) if bound else self.session.run(list(outputs), inputs)
        rows, length = feed_shape(feed)
        produced = dict(zip(outputs, results, strict=True))
        for name, array in produced.items():
            expected = self.spec.output_shape(name, rows, length)
            if array.shape != expected or array.dtype != np.float32:
                raise BatchContractError(
                    f"model {self.name}: output {name} is {array.dtype}{list(array.shape)}, "
                    f"expected float32{list(expected)}"
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
        """Run each (rows, length) shape once, so first requests are not slow and memory is known to suffice.

        A failure (out of memory, a kernel the GPU cannot run) is an ExecutionError naming the shape. The image
        tower runs `rows` images of zeros (length is an image row's one position).
        """
        for rows, length in shapes:
            if self.image:
                feed = {PIXEL_VALUES: np.zeros((rows, *self.pixel_shape), dtype=np.float32)}
            else:
                feed = {
                    "input_ids": np.full((rows, length), 1, dtype=np.int64),
                    "attention_mask": np.ones((rows, length), dtype=np.int64),
                    "token_type_ids": np.zeros((rows, length), dtype=np.int64),
                    "adapter_ids": np.zeros((rows, length), dtype=np.int64),
                }
            try:
                self.run(feed, self.output_names)
            except Exception as error:
                reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
                raise ExecutionError(
                    f"model {self.name}: warm-up at {rows}x{length} failed on {self.provider} "
                    f"({self.variant}): {reason}"
                ) from error


def create_instances(
    spec: ModelSpec,
    settings: ExecutionSettings,
    count: int,
    *,
    image: bool = False,
    chosen_by_default: bool | None = None,
) -> list[ModelRuntime]:
    """A model's instances (count of them), all on the first one's device and variant (or an ExecutionError).

    The first instance makes every choice (device, fallback, variant, fidelity check); the others
    are pinned to it, so metrics and the served configuration describe every instance. `image`: the
    image tower's instances (pass the text instances' pinned settings: the same device and variant, and
    `chosen_by_default`: whether that variant was the server's choice).
    """
    first = ModelRuntime(spec, settings, image=image, chosen_by_default=chosen_by_default)
    return [first, *(ModelRuntime(spec, first.pinned_settings(), image=image) for _ in range(count - 1))]
