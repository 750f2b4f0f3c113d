"""Server settings: one typed object from flags and ENCODER_* environment variables, checked once.

Every field is a flag (`--grpc-port`) and an environment variable (`ENCODER_GRPC_PORT`); a flag
beats the environment, which beats the default. Built in main(), never at import.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from service.core.sources import SourceSyntaxError, parse_model_argument

ENV_PREFIX = "ENCODER_"
CPUS_PER_FRONTEND_ON_CPU = 8
"""--frontends 0 with the model on the CPU: one front end per this many CPUs (one process below twice
that): the front end's share of a one-sentence request's CPU is about 1/8
(docs/decisions.md#front-ends-per-cpu)."""
MAX_CONNECTION_AGE_S = 2_000_000
"""gRPC takes the connection age and its grace (the age + 30 s) as 32-bit milliseconds: ~2.1 million s at most."""
DEFAULT_REPOSITORY = Path("model_repository")
EXPORT_VARIANTS = ("fp32", "int8", "fp16")
"""What --export-variants may name (the exporter's variants)."""
TRUE_WORDS = {"1", "true", "yes", "on"}
FALSE_WORDS = {"0", "false", "no", "off"}
PILLOW_MAX_IMAGE_PIXELS = 89_478_485
"""Pillow's own decompression-bomb bound (PIL.Image.MAX_IMAGE_PIXELS): --max-image-pixels stays within it."""


class SettingsError(ValueError):
    """A setting out of range or of the wrong form; the message names it."""


def _doc(text: str, **extra: Any) -> dict[str, Any]:
    return {"help": text, **extra}


@dataclass(frozen=True)
class Settings:
    """Everything the server can be told; see each field's help."""

    model_repository: Path = field(default=DEFAULT_REPOSITORY, metadata=_doc("model repository to serve"))
    model: tuple[str, ...] = field(
        default=(),
        metadata=_doc(
            "a model to serve by its name, [NAME=]SOURCE: SOURCE a Hugging Face id (org/name, org/name@REVISION,"
            " hf://org/name) or a model folder, NAME the name it is served under (default: the id's last part, or the"
            " folder's name); exported at start behind the parity gate into --export-cache, once per source and"
            " options (docs/operations.md#serving-a-model-by-name). Repeatable (in the environment: comma-separated);"
            " beside --model-repository, which is then optional"
        ),
    )
    export_cache: str = field(
        default="",
        metadata=_doc(
            "the export cache --model exports into and serves from (a volume shared by replicas is safe: a lock"
            " makes one export and the others wait for it); '' = $XDG_CACHE_HOME/encoder-serve, else"
            " ~/.cache/encoder-serve"
        ),
    )
    export_variants: str = field(
        default="auto",
        metadata=_doc(
            "the variants --model exports, comma-separated (fp32 always); auto = what this server can serve: fp32,"
            " fp16 too where CUDA is usable (--device auto), int8 only with --variant int8"
        ),
    )
    host: str = field(default="0.0.0.0", metadata=_doc("address the gRPC, HTTP and metrics ports bind to"))
    grpc_port: int = field(default=8001, metadata=_doc("gRPC port (KServe v2, health, reflection)"))
    http_port: int = field(
        default=8000, metadata=_doc("HTTP port (OpenAI /v1/embeddings and KServe v2 REST); 0 = no HTTP")
    )
    metrics_port: int = field(default=8002, metadata=_doc("Prometheus /metrics HTTP port"))
    device: str = field(
        default="auto",
        metadata=_doc(
            "auto: the CUDA execution provider when usable, else the CPU; cpu: the CPU only", choices=("auto", "cpu")
        ),
    )
    require_gpu: bool = field(default=False, metadata=_doc("fail at start instead of falling back to the CPU"))
    variant: str = field(
        default="auto",
        metadata=_doc(
            "model variant. auto: fp32, or fp16 on CUDA where its embeddings measure >= 0.9999 cosine to the model"
            " (a classifier's logits: within 0.02 of the model's)"
            " (checked again at load on the device itself; fp32 with a warning if not). fp32, fp16, int8: that"
            " variant, which must pass its own bar at load or the server exits; int8 (faster, less exact) runs on"
            " the CPU only",
            choices=("auto", "fp32", "int8", "fp16"),
        ),
    )
    instances: int = field(
        default=1, metadata=_doc("model instances (sessions) per model, each on its own worker thread")
    )
    intra_op_threads: int = field(
        default=0, metadata=_doc("ONNX Runtime threads per instance; 0 = CPUs available to this process / instances")
    )
    allow_spinning: bool = field(
        default=False,
        metadata=_doc(
            "let ONNX Runtime threads busy-wait between operators while a batch runs (never between batches):"
            " faster lone requests for more CPU"
        ),
    )
    cuda_device_id: int = field(default=0, metadata=_doc("CUDA device ordinal"))
    gpu_mem_limit_bytes: int = field(default=0, metadata=_doc("cap on the CUDA memory arena; 0 = no cap"))
    arena_extend_strategy: str = field(
        default="kSameAsRequested",
        metadata=_doc("CUDA arena growth", choices=("kSameAsRequested", "kNextPowerOfTwo")),
    )
    cudnn_conv_algo_search: str = field(
        default="HEURISTIC", metadata=_doc("cuDNN algorithm search", choices=("EXHAUSTIVE", "HEURISTIC", "DEFAULT"))
    )
    max_batch_size: int = field(default=0, metadata=_doc("sequences per batch; 0 = the model's config.pbtxt"))
    max_batch_tokens: int = field(
        default=0,
        metadata=_doc(
            "padded tokens (rows x longest) per batch; 0 = 4096 on CPU (larger batches of long texts run slower"
            " per sequence there), 16384 on CUDA"
        ),
    )
    max_queue_delay_us: int = field(
        default=-1, metadata=_doc("longest wait for a fuller batch, microseconds; -1 = the model's config.pbtxt")
    )
    max_queue_size: int = field(
        default=0,
        metadata=_doc(
            "queued requests per model (at a new request's priority or higher) before RESOURCE_EXHAUSTED;"
            " 0 = config.pbtxt, else 1024"
        ),
    )
    express_lane: bool = field(
        default=True,
        metadata=_doc(
            "with priorities, a batch of the highest priority that finds every instance running lower-priority rows"
            " starts at once on the express lane (another thread running the first instance's session beside them,"
            " sharing their CPUs or GPU for its run) instead of waiting for a run of bulk work to end"
        ),
    )
    max_queue_rows: int = field(
        default=0,
        metadata=_doc(
            "queued rows (texts, pairs or sequences) per model at a new request's priority or higher before it is"
            " refused RESOURCE_EXHAUSTED (HTTP 429) with a retry-after; 0 = no bound but --max-queue-size"
        ),
    )
    max_queue_tokens: int = field(
        default=0,
        metadata=_doc(
            "tokens of the rows queued per model at a new request's priority or higher before it is refused"
            " RESOURCE_EXHAUSTED (HTTP 429) with a retry-after; 0 = no such bound"
        ),
    )
    max_queue_wait_ms: int = field(
        default=0,
        metadata=_doc(
            "expected wait, milliseconds, past which a new request is refused RESOURCE_EXHAUSTED (HTTP 429) with a"
            " retry-after: the rows queued per model at its priority or higher over the model's measured rows per"
            " second (its recent batches; no bound until one has run); 0 = no such bound"
        ),
    )
    priority_levels: int = field(
        default=0,
        metadata=_doc(
            "priorities a request may ask for (parameter or body field `priority`: 1 the highest), as Triton's"
            " priority_levels; 0 = the model's config.pbtxt, else 2 (1 interactive, 2 bulk)"
        ),
    )
    default_priority: int = field(
        default=0,
        metadata=_doc(
            "priority of a request that names none and whose tenant sets none; 0 = the model's config.pbtxt"
            " default_priority_level, else 1 (the highest)"
        ),
    )
    min_lower_priority_share: float = field(
        default=0.1,
        metadata=_doc(
            "while rows of a lower priority wait behind higher ones, at least this share of the model's batches is"
            " theirs (0.1: one in ten), so no priority starves; 0 = strict priority"
        ),
    )
    length_bucket: int = field(
        default=0,
        metadata=_doc("pad batch length to a multiple of this (bounds distinct shapes); 0 = 32 on CUDA, 1 on CPU"),
    )
    frontends: int = field(
        default=0,
        metadata=_doc(
            "front-end processes, each serving the gRPC and HTTP ports (protocols, keys, TLS, validation,"
            " tokenising) beside one engine process that batches every front end's rows; 1 = one process, as a"
            " plain server; 0 = automatic: with the model on CUDA, every CPU but one; on the CPU, one per 8 CPUs"
            " (one process below 16)"
        ),
    )
    tokenizer_threads: int = field(default=1, metadata=_doc("worker threads that tokenise text"))
    inline_tokenize_chars: int = field(
        default=1024,
        metadata=_doc(
            "requests with at most this many characters of text are tokenised on the event loop (cheaper than a thread"
            " hand-off: ~35 us for a sentence); larger ones on the tokenizer threads"
        ),
    )
    warmup: bool = field(default=True, metadata=_doc("run the model before reporting ready"))
    triton_metrics: bool = field(
        default=False,
        metadata=_doc(
            "also export Triton's nv_inference_* counters (from the ModelStatistics figures) on /metrics, so"
            " dashboards and alerts written for Triton work unchanged"
        ),
    )
    drain_timeout_s: float = field(
        default=30.0, metadata=_doc("on SIGTERM, how long accepted requests may take to finish")
    )
    max_connection_age_s: float = field(
        default=300.0,
        metadata=_doc(
            f"close client connections after this long so they rebalance; 0 = never; at most {MAX_CONNECTION_AGE_S}"
        ),
    )
    envoy_reset_flood_streams: int = field(
        default=0,
        metadata=_doc(
            "Envoy only: once a connection has carried this many streams, close it (abruptly: every call on it fails"
            " UNAVAILABLE) when half of them were reset by the client within 1 s, before an answer (Envoy's HTTP/2"
            " rapid-reset protection); 0 = never. gRPC cancels a call past its deadline with such a reset, so a"
            " client with short deadlines on a busy server looks like that attack (grpcio closes nothing for it)"
        ),
    )
    max_message_bytes: int = field(
        default=2 * 1024 * 1024,
        metadata=_doc(
            "largest request message, bytes (RESOURCE_EXHAUSTED past it, HTTP 413); where a model takes images, raised"
            " to carry one image of --max-image-bytes (its bytes over gRPC, its base64 over HTTP, and 64 KiB more)"
        ),
    )
    max_response_bytes: int = field(
        default=32 * 1024 * 1024,
        metadata=_doc(
            "largest answer, bytes as sent (4 per value raw, up to 16 as JSON): larger ones are refused"
            " RESOURCE_EXHAUSTED (HTTP 413) before running (last_hidden_state of 64 x 256 tokens x 384 values is"
            " 24 MiB raw, 96 MiB as JSON)"
        ),
    )
    max_answer_bytes_in_flight: int = field(
        default=256 * 1024 * 1024,
        metadata=_doc(
            "answers (bytes as sent) the server holds between accepting a request and handing its answer to the"
            " transport, shared evenly by the front ends; past it requests are refused RESOURCE_EXHAUSTED (HTTP 429)"
            " until some are sent. A quarter of the 1 GiB memory budget: an answer costs about twice its size while"
            " it is encoded"
        ),
    )
    max_concurrent_http_requests: int = field(
        default=512,
        metadata=_doc(
            "HTTP requests the server reads, runs or answers at once, shared evenly by the front ends; more are"
            " answered 429 with Retry-After before their body is read"
        ),
    )
    max_text_bytes: int = field(
        default=64 * 1024,
        metadata=_doc("largest single text of a request, UTF-8 bytes; larger ones are refused INVALID_ARGUMENT"),
    )
    max_request_text_bytes: int = field(
        default=1024 * 1024,
        metadata=_doc("largest total of the texts of one request, UTF-8 bytes; more is refused INVALID_ARGUMENT"),
    )
    max_image_bytes: int = field(
        default=20 * 1024 * 1024,
        metadata=_doc(
            "largest single encoded image of a request (input image), bytes; larger ones are refused INVALID_ARGUMENT"
            " (HTTP 413) before any is decoded; one of up to this size is never refused by --max-message-bytes"
        ),
    )
    max_image_pixels: int = field(
        default=50_000_000,
        metadata=_doc(
            "largest image, width x height pixels, as its header says (checked before its pixels are decoded: the"
            " decompression-bomb bound) and as resized; larger ones are refused INVALID_ARGUMENT (HTTP 413)"
        ),
    )
    max_chunks_per_request: int = field(
        default=1024,
        metadata=_doc(
            "windows the long texts of one request may be split into (truncate false: a text longer than the model"
            " is embedded in windows and combined); more are refused 413 / INVALID_ARGUMENT"
        ),
    )
    chunk_overlap_tokens: int = field(
        default=0,
        metadata=_doc(
            "tokens each window of a long text shares with the one before it (truncate false); below the model's"
            " length less its special tokens"
        ),
    )
    max_embedding_inputs: int = field(
        default=2048,
        metadata=_doc(
            "texts in one OpenAI /v1/embeddings request (OpenAI's own cap); more are refused 413. They run in batches"
            " of --max-batch-size, within --max-request-text-bytes"
        ),
    )
    grpc_transport: str = field(
        default="auto",
        metadata=_doc(
            "what serves the gRPC and health ports: envoy (each front end an Envoy process running the front end"
            " on its embedded Python: HTTP/2 and TLS in compiled code; always under a supervisor: with one front"
            " end Envoy's process is the whole server, models included; with several, an engine process and"
            " --frontends Envoy front ends), grpcio (grpc.aio in each front end), or auto: envoy where it can run"
            " here (pyvoy, Envoy and a shared libpython), else grpcio, saying why",
            choices=("auto", "envoy", "grpcio"),
        ),
    )
    max_concurrent_streams: int = field(
        default=8192,
        metadata=_doc(
            "concurrent RPCs per client connection (HTTP/2 streams); gRPC refuses more (UNAVAILABLE, never run, safe"
            " to retry)"
        ),
    )
    max_pending_rpcs: int = field(
        default=16384,
        metadata=_doc(
            "RPCs received by gRPC and not yet picked up by the server's handlers, over all connections; past it gRPC"
            " itself cancels calls, so keep it above connections x queue size"
        ),
    )
    max_stream_inflight: int = field(
        default=32,
        metadata=_doc(
            "unanswered requests per ModelStreamInfer stream; the stream reads no further message until one is"
            " answered (flow control: a fast producer waits, server memory stays bounded)"
        ),
    )
    max_batch_run_s: float = field(
        default=120.0,
        metadata=_doc(
            "a model run longer than this fails its requests UNAVAILABLE and takes the instance out of service until"
            " it returns; with no instance left the model reports NOT_SERVING"
        ),
    )
    tls_cert: str = field(
        default="",
        metadata=_doc("PEM certificate chain: serve gRPC and HTTP over TLS (with --tls-key); reloaded on change"),
    )
    tls_key: str = field(default="", metadata=_doc("PEM private key of --tls-cert"))
    tls_client_ca: str = field(
        default="", metadata=_doc("PEM CA bundle: require client certificates signed by it (mutual TLS)")
    )
    api_key_file: str = field(
        default="",
        metadata=_doc(
            "file of API keys, one per line: every RPC but grpc.health.v1, and every HTTP request but /v2/health/*,"
            " needs 'authorization: Bearer <key>'; re-read when it changes. Or a TOML file of tenants, each with"
            " its keys and limits (docs/tenants.md)"
        ),
    )
    health_port: int = field(
        default=0,
        metadata=_doc("plaintext port serving only grpc.health.v1, for probes that cannot speak TLS; 0 = none"),
    )
    otlp_endpoint: str = field(
        default="",
        metadata=_doc(
            "OTLP receiver for OpenTelemetry traces (e.g. http://collector:4317 for grpc, http://collector:4318 for"
            " http/protobuf, as OTEL_EXPORTER_OTLP_PROTOCOL says); '' = OTEL_EXPORTER_OTLP_ENDPOINT if set, else no"
            " tracing. The other OTEL_* variables (service name, sampler, headers) apply; see docs/tracing.md"
        ),
    )
    log_level: str = field(
        default="INFO", metadata=_doc("logging level", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    )

    def __post_init__(self) -> None:
        object.__setattr__(self, "model", tuple(self.model))  # a list, when the settings came as JSON
        self._check_models()
        for item in dataclasses.fields(self):
            value = getattr(self, item.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise SettingsError(f"{item.name} must be a finite number, got {value}")
        for name in ("grpc_port", "http_port", "metrics_port", "health_port"):
            port = getattr(self, name)
            if not 0 <= port <= 65535:
                raise SettingsError(f"{name} must be 0-65535, got {port}")
        positive = (
            "instances",
            "tokenizer_threads",
            "max_message_bytes",
            "max_response_bytes",
            "max_answer_bytes_in_flight",
            "max_concurrent_http_requests",
            "max_text_bytes",
            "max_request_text_bytes",
            "max_image_bytes",
            "max_image_pixels",
            "max_embedding_inputs",
            "max_chunks_per_request",
            "max_concurrent_streams",
            "max_pending_rpcs",
            "max_stream_inflight",
            "max_batch_run_s",
        )
        for name in positive:
            if getattr(self, name) < 1:
                raise SettingsError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.max_image_pixels > PILLOW_MAX_IMAGE_PIXELS:
            raise SettingsError(
                f"max_image_pixels must be at most {PILLOW_MAX_IMAGE_PIXELS} (Pillow's own decompression-bomb bound),"
                f" got {self.max_image_pixels}"
            )
        non_negative = (
            "frontends",
            "intra_op_threads",
            "max_batch_tokens",
            "cuda_device_id",
            "gpu_mem_limit_bytes",
            "max_batch_size",
            "max_queue_size",
            "max_queue_rows",
            "max_queue_tokens",
            "max_queue_wait_ms",
            "priority_levels",
            "default_priority",
            "length_bucket",
            "inline_tokenize_chars",
            "chunk_overlap_tokens",
            "drain_timeout_s",
            "max_connection_age_s",
            "envoy_reset_flood_streams",
        )
        for name in non_negative:
            if getattr(self, name) < 0:
                raise SettingsError(f"{name} must be >= 0, got {getattr(self, name)}")
        self._check_special_bounds()
        self._check_security()
        for item in dataclasses.fields(self):
            choices = item.metadata.get("choices")
            if choices and getattr(self, item.name) not in choices:
                raise SettingsError(
                    f"{item.name} must be one of {', '.join(choices)}, got {getattr(self, item.name)!r}"
                )
        self._check_device()

    def _check_special_bounds(self) -> None:
        """Bounds that are not a plain sign."""
        if self.max_connection_age_s > MAX_CONNECTION_AGE_S:
            raise SettingsError(
                f"max_connection_age_s must be at most {MAX_CONNECTION_AGE_S} (gRPC takes it, and the age plus its"
                f" grace, as 32-bit milliseconds), got {self.max_connection_age_s}"
            )
        if not 0 <= self.min_lower_priority_share <= 1:
            raise SettingsError(f"min_lower_priority_share must be from 0 to 1, got {self.min_lower_priority_share}")
        if self.priority_levels and self.default_priority > self.priority_levels:
            raise SettingsError(
                f"default_priority {self.default_priority} is not one of the {self.priority_levels} priority_levels"
            )
        if self.max_queue_delay_us < -1:
            raise SettingsError(
                f"max_queue_delay_us must be >= 0 (or -1 for the model's), got {self.max_queue_delay_us}"
            )

    def _check_models(self) -> None:
        """Each --model readable, no name given twice, --export-variants from the exporter's variants."""
        names = set()
        for text in self.model:
            try:
                name = parse_model_argument(text).name
            except SourceSyntaxError as error:
                raise SettingsError(f"model: {error}") from error
            if name in names:
                raise SettingsError(f"model: two models are named {name!r}: name one of them (--model NAME=SOURCE)")
            names.add(name)
        if self.export_variants != "auto":
            variants = [variant.strip() for variant in self.export_variants.split(",")]
            if "fp32" not in variants or not set(variants) <= set(EXPORT_VARIANTS):
                raise SettingsError(
                    f"export_variants must be auto or a comma-separated list of {', '.join(EXPORT_VARIANTS)} with"
                    f" fp32, got {self.export_variants!r}"
                )

    @property
    def serves_repository(self) -> bool:
        """Whether --model-repository is served: always, but when only --model was given (the default folder absent)."""
        return not self.model or self.model_repository != DEFAULT_REPOSITORY or self.model_repository.is_dir()

    def _check_device(self) -> None:
        """Refuse device settings that contradict each other rather than quietly serve on the CPU."""
        if self.require_gpu and self.device == "cpu":
            raise SettingsError("require_gpu contradicts device cpu: choose one")
        if self.require_gpu and self.variant == "int8":
            raise SettingsError("require_gpu contradicts variant int8: the int8 variant runs on the CPU only")

    def _check_security(self) -> None:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise SettingsError("tls_cert and tls_key must be given together")
        if self.tls_client_ca and not self.tls_cert:
            raise SettingsError("tls_client_ca (mutual TLS) needs tls_cert and tls_key")
        for name in ("tls_cert", "tls_key", "tls_client_ca", "api_key_file"):
            path = getattr(self, name)
            if path and not Path(path).is_file():
                raise SettingsError(f"{name}: {path} is not a readable file")
        if self.health_port and self.health_port == self.grpc_port:
            raise SettingsError(f"health_port must differ from grpc_port ({self.grpc_port})")
        if self.http_port and self.http_port in (self.grpc_port, self.metrics_port, self.health_port):
            raise SettingsError(f"http_port {self.http_port} must differ from the gRPC, metrics and health ports")

    @property
    def uses_tls(self) -> bool:
        """Whether the gRPC port serves TLS."""
        return bool(self.tls_cert)

    def resolved_intra_op_threads(self) -> int:
        """Threads per instance: the setting, or the CPUs the model has (beside front ends) split across instances."""
        if self.intra_op_threads:
            return self.intra_op_threads
        model_cpus = available_cpus() - (self.frontends if self.frontends > 1 else 0)
        return max(1, model_cpus // self.instances)

    def resolved_frontends(self, on_cuda: bool) -> int:
        """Front-end processes: the setting, or the automatic choice for the CPUs this process may use."""
        if self.frontends:
            return self.frontends
        cpus = available_cpus()
        return max(1, cpus - 1) if on_cuda else max(1, cpus // CPUS_PER_FRONTEND_ON_CPU)


def available_cpus() -> int:
    """CPUs this process may use: its affinity mask, capped by a cgroup v2 CPU quota if one is set."""
    cpus = len(os.sched_getaffinity(0))
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
    except (OSError, ValueError):
        return cpus
    if quota == "max":
        return cpus
    return max(1, min(cpus, int(int(quota) / int(period))))


def _env_name(name: str) -> str:
    return ENV_PREFIX + name.upper()


def _convert(kind: type, name: str, text: str) -> Any:
    if kind is tuple:
        return tuple(part.strip() for part in text.split(",") if part.strip())
    if kind is bool:
        word = text.strip().lower()
        if word in TRUE_WORDS | FALSE_WORDS:
            return word in TRUE_WORDS
        raise SettingsError(f"{_env_name(name)} must be a boolean (1/0, true/false), got {text!r}")
    try:
        return kind(text)
    except ValueError as error:
        raise SettingsError(f"{name} must be {kind.__name__}, got {text!r}") from error


def _field_types() -> dict[str, type]:
    kinds = {"Path": Path, "str": str, "int": int, "float": float, "bool": bool, "tuple[str, ...]": tuple}
    return {f.name: kinds[str(f.type)] for f in dataclasses.fields(Settings)}


def build_parser() -> argparse.ArgumentParser:
    """A parser with one flag per Settings field (defaults unset: the environment fills gaps)."""
    parser = argparse.ArgumentParser(
        prog="python -m service",
        description="Serve a model repository over gRPC (KServe v2 / Triton protocol).",
        argument_default=argparse.SUPPRESS,
    )
    kinds = _field_types()
    for item in dataclasses.fields(Settings):
        flag = "--" + item.name.replace("_", "-")
        help_text = f"{item.metadata['help']} [env {_env_name(item.name)}, default {item.default}]"
        if kinds[item.name] is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, help=help_text)
        elif kinds[item.name] is tuple:
            parser.add_argument(flag, action="append", help=help_text, metavar=item.name.upper())
        else:
            parser.add_argument(flag, type=str, help=help_text, metavar=item.name.upper())
    return parser


def load_settings(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> Settings:
    """Settings from flags, then ENCODER_* variables, then defaults; SettingsError names a bad one."""
    environ = os.environ if environ is None else environ
    flags = vars(build_parser().parse_args(argv))
    values: dict[str, Any] = {}
    for name, kind in _field_types().items():
        if name in flags:
            raw = flags[name]
            values[name] = raw if isinstance(raw, bool) else tuple(raw) if kind is tuple else _convert(kind, name, raw)
        elif _env_name(name) in environ:
            values[name] = _convert(kind, name, environ[_env_name(name)])
    return Settings(**values)
