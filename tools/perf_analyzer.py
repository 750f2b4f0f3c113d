"""Triton's perf_analyzer against this server: input data, the command, and a sweep.

`python -m tools.perf_analyzer --target 127.0.0.1:8001 --http-target 127.0.0.1:8000` writes
perf_analyzer input data for the model (the short corpus, once as `text` and once as token ids made
by the model's own tokenizer), then measures each mode (tokens, text and text over `--streaming` on
the gRPC port; tokens and text over KServe REST on the HTTP port) at each `--concurrency`, and
prints one line per measurement with the server-side breakdown perf_analyzer reads from the
model's statistics (the ModelStatistics RPC, or GET .../stats over HTTP). Each measurement's CSV
lands in --output-dir.

perf_analyzer comes from the tritonclient 2.41.1 manylinux wheel (later wheels do not ship it).
It links libb64 (Debian's libb64-0d) and libcudart.so.12, which PyPI's nvidia-cuda-runtime-cu12
provides; it needs no GPU. `make setup` installs all three.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import nvidia.cuda_runtime

from client import DEFAULT_MODEL
from service.core.repository import read_model
from service.pipeline.tokenizer import TextTokenizer
from tools.loadtest.corpus import load_corpus

MODES = ("tokens", "text", "streaming", "http-tokens", "http-text")
"""Token ids and texts over ModelInfer, texts over ModelStreamInfer; token ids and texts over KServe REST."""
HTTP_PREFIX = "http-"
RUN_TIMEOUT_S = 600
FAILURE = re.compile(r"had error|^error:|Failed to", re.MULTILINE)
"""How perf_analyzer reports failed requests ("Thread [0] had error: ...") and failed set-up, at times with exit 0."""


@dataclass(frozen=True)
class InputData:
    """perf_analyzer --input-data files: one sentence per request, as text and as token ids."""

    text: Path
    tokens: Path

    def for_mode(self, mode: str) -> Path:
        """The file a mode sends."""
        return self.tokens if mode.endswith("tokens") else self.text


def protocol_of(mode: str) -> str:
    """perf_analyzer's `-i` for a mode: http for the KServe REST modes, else grpc."""
    return "http" if mode.startswith(HTTP_PREFIX) else "grpc"


def executable() -> Path:
    """The perf_analyzer binary: the one beside this Python (a virtual environment's), else on PATH."""
    search = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    found = shutil.which("perf_analyzer", path=search)
    if found is None:
        raise FileNotFoundError(
            "perf_analyzer is not installed: it ships in the tritonclient 2.41.1 manylinux wheel (make setup)"
        )
    return Path(found)


def environment() -> dict[str, str]:
    """The environment to run perf_analyzer in: this one, with libcudart.so.12's folder on the library path."""
    library_folders = [str(Path(folder) / "lib") for folder in nvidia.cuda_runtime.__path__]
    existing = os.environ.get("LD_LIBRARY_PATH")
    return {**os.environ, "LD_LIBRARY_PATH": os.pathsep.join([*library_folders, *([existing] if existing else [])])}


def write_input_data(model_directory: Path, folder: Path, sentences: Sequence[str]) -> InputData:
    """Write the sentences as perf_analyzer input data, texts and tokens (by the model's own tokenizer)."""
    spec = read_model(model_directory)
    if spec.tokenizer_file is None:
        raise ValueError(f"{model_directory} has no tokenizer: it takes token inputs only")
    tokenizer = TextTokenizer.of_model(spec)
    text_steps, token_steps = [], []
    for sentence in sentences:
        text_steps.append({"text": {"content": [sentence], "shape": [1]}})
        feed = tokenizer.encode([sentence]).feed(spec.input_names)
        token_steps.append(
            {name: {"content": array[0].tolist(), "shape": [array.shape[1]]} for name, array in feed.items()}
        )
    folder.mkdir(parents=True, exist_ok=True)
    data = InputData(text=folder / "text.json", tokens=folder / "tokens.json")
    data.text.write_text(json.dumps({"data": text_steps}))
    data.tokens.write_text(json.dumps({"data": token_steps}))
    return data


def command(
    target: str,
    model: str,
    input_data: Path,
    concurrency_range: str,
    csv_path: Path,
    *,
    protocol: str = "grpc",
    streaming: bool = False,
    measurement: Sequence[str] = (),
) -> list[str]:
    """The perf_analyzer command line for one input file over `start[:end[:step]]` concurrency.

    `target` is the host:port of the `protocol`'s port (grpc or http); streaming is gRPC's only.
    """
    if streaming and protocol != "grpc":
        raise ValueError("perf_analyzer streams over gRPC only")
    arguments = [
        str(executable()),
        *("-m", model, "-u", target, "-i", protocol),
        *("--input-data", str(input_data), "--concurrency-range", concurrency_range, "-f", str(csv_path)),
        *measurement,
    ]
    return [*arguments, "--streaming"] if streaming else arguments


@dataclass(frozen=True)
class Measurement:
    """One row of perf_analyzer's CSV: client throughput and latency, and the server's breakdown (µs)."""

    concurrency: int
    throughput: float
    """Inferences per second."""
    p50_us: int
    p99_us: int
    server_queue_us: int
    server_compute_input_us: int
    server_compute_infer_us: int
    server_compute_output_us: int

    @classmethod
    def from_row(cls, row: dict[str, str]) -> Measurement:
        """From a CSV row (perf_analyzer's column names)."""
        return cls(
            concurrency=int(row["Concurrency"]),
            throughput=float(row["Inferences/Second"]),
            p50_us=int(row["p50 latency"]),
            p99_us=int(row["p99 latency"]),
            server_queue_us=int(row["Server Queue"]),
            server_compute_input_us=int(row["Server Compute Input"]),
            server_compute_infer_us=int(row["Server Compute Infer"]),
            server_compute_output_us=int(row["Server Compute Output"]),
        )


def run(arguments: Sequence[str], csv_path: Path) -> list[Measurement]:
    """Run perf_analyzer; its measurements, or RuntimeError with its output if any request failed."""
    result = subprocess.run(
        list(arguments), check=False, capture_output=True, text=True, env=environment(), timeout=RUN_TIMEOUT_S
    )
    output = result.stdout + result.stderr
    if result.returncode != 0 or FAILURE.search(output) or not csv_path.is_file():
        raise RuntimeError(f"perf_analyzer failed (exit status {result.returncode}):\n{output}")
    with csv_path.open(newline="") as handle:
        return [Measurement.from_row(row) for row in csv.DictReader(handle)]


def _format(mode: str, measurement: Measurement) -> str:
    return (
        f"{mode:<12} {measurement.concurrency:>11} {measurement.throughput:>9.1f} {measurement.p50_us / 1000:>8.2f}"
        f" {measurement.p99_us / 1000:>8.2f} {measurement.server_queue_us / 1000:>8.2f}"
        f" {measurement.server_compute_input_us / 1000:>8.2f} {measurement.server_compute_infer_us / 1000:>8.2f}"
        f" {measurement.server_compute_output_us / 1000:>8.2f}"
    )


HEADER = (
    f"{'mode':<12} {'concurrency':>11} {'infer/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'queue':>8} {'input':>8}"
    f" {'infer':>8} {'output':>8}   (server-side ms per request)"
)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="127.0.0.1:8001", help="host:port of the gRPC port")
    parser.add_argument("--http-target", default="127.0.0.1:8000", help="host:port of the HTTP port (http-* modes)")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--repository", type=Path, default=Path("model_repository"), help="for the model's tokenizer")
    parser.add_argument("--concurrency", default="1,8,32", help="comma-separated levels")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--requests", type=int, default=200, help="requests per measurement window")
    parser.add_argument(
        "--stability-percentage", type=float, default=20.0, help="perf_analyzer's bar for a stable measurement"
    )
    parser.add_argument("--output-dir", type=Path, default=Path("perf-results"))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Sweep the modes over the concurrency levels and print the figures; 1 if any measurement failed."""
    parser = _parser()
    options = parser.parse_args(argv)
    levels = [int(level) for level in options.concurrency.split(",")]
    modes = options.modes.split(",")
    unknown = set(modes) - set(MODES)
    if unknown:
        parser.error(f"unknown mode(s) {', '.join(sorted(unknown))}")
    data = write_input_data(options.repository / options.model, options.output_dir, load_corpus("short"))
    measurement = [
        *("--measurement-mode", "count_windows", "--measurement-request-count", str(options.requests)),
        *("--stability-percentage", str(options.stability_percentage)),
    ]
    print(HEADER)
    failed = False
    for mode in modes:
        for level in levels:
            csv_path = options.output_dir / f"{mode}-c{level}.csv"
            try:
                protocol = protocol_of(mode)
                arguments = command(
                    options.http_target if protocol == "http" else options.target,
                    options.model,
                    data.for_mode(mode),
                    str(level),
                    csv_path,
                    protocol=protocol,
                    streaming=mode == "streaming",
                    measurement=measurement,
                )
                rows = run(arguments, csv_path)
            except (FileNotFoundError, RuntimeError) as error:
                print(f"{mode} at concurrency {level}: {error}", file=sys.stderr)
                failed = True
                continue
            for row in rows:
                print(_format(mode, row), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
