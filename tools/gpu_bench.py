"""The CUDA figures: ONNX Runtime in process on the GPU, and the server's scaling by front-end processes.

`python -m tools.gpu_bench --repository REPO` on a machine with a CUDA device:

- in process: one CUDA session per variant (fp16, fp32), token batches of rows x tokens (random ids,
  full masks), the p50 of timed runs after warm-up and the sequences per second it means;
- served: `python -m service --require-gpu --frontends N` for each N, driven by `python -m
  tools.loadtest` processes on the same machine (closed loop, one sentence a request); requests per
  second and p50 from the clients, rows per model run from the server's metrics, the server's CPU
  (every process, as /proc counts it).

The figures go to stdout and, as JSON, to --output. The load generator shares the machine's CPUs with
the server: say so with the figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from service.core.repository import read_model
from service.core.runtime import CUDA, ExecutionSettings, ModelRuntime
from tools.local_server import RunningServer, rows_per_run, server_cpu_seconds, start_server

MODEL = "all-MiniLM-L6-v2"
SHAPES = ((1, 32), (8, 32), (32, 32), (64, 32), (64, 64), (64, 128), (64, 256))
TIMED_RUNS = 50


def token_feed(spec_inputs: tuple[str, ...], rows: int, tokens: int, seed: int = 0) -> dict[str, np.ndarray]:
    """A batch of random token ids (100-20,000) with full masks, for the inputs the model declares."""
    generator = np.random.default_rng(seed)
    feed = {"input_ids": generator.integers(100, 20_000, size=(rows, tokens), dtype=np.int64)}
    feed["attention_mask"] = np.ones((rows, tokens), dtype=np.int64)
    if "token_type_ids" in spec_inputs:
        feed["token_type_ids"] = np.zeros((rows, tokens), dtype=np.int64)
    return feed


def in_process(repository: Path, variant: str, shapes: tuple[tuple[int, int], ...]) -> list[dict[str, float]]:
    """p50 ms per batch and sequences/s of one CUDA session of `variant` for each rows x tokens shape."""
    spec = read_model(repository / MODEL)
    runtime = ModelRuntime(spec, ExecutionSettings(require_gpu=True, variant=variant))
    if runtime.provider != CUDA:
        raise RuntimeError(f"{variant} runs on {runtime.provider}, not {CUDA}")
    inputs = tuple(entry.name for entry in runtime.session.get_inputs())
    figures = []
    for rows, tokens in shapes:
        feed = token_feed(inputs, rows, tokens)
        for _ in range(5):
            runtime.run(feed, ("embedding",))
        timings = []
        for _ in range(TIMED_RUNS):
            started = time.perf_counter()
            runtime.run(feed, ("embedding",))
            timings.append(time.perf_counter() - started)
        p50_s = statistics.median(timings)
        figures.append(
            {"variant": variant, "rows": rows, "tokens": tokens, "p50_ms": p50_s * 1e3, "sequences_per_s": rows / p50_s}
        )
    return figures


def drive(server: RunningServer, clients: int, in_flight: int, seconds: float, output: Path) -> dict[str, float]:
    """`clients` loadtest processes of `in_flight` closed-loop workers each; their sums and the server's side."""
    folders = [output / f"client-{index}" for index in range(clients)]
    command = [sys.executable, "-m", "tools.loadtest", "--target", server.target, "--concurrency", str(in_flight)]
    command += ["--duration-s", str(seconds), "--warmup-s", "2", "--no-progress"]
    batches_before = server.batch_totals(MODEL)
    cpu_before = server_cpu_seconds(server.process.pid)
    processes = [
        subprocess.Popen([*command, "--output-dir", str(folder)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        for folder in folders
    ]
    started = time.perf_counter()
    for process in processes:
        _, errors = process.communicate(timeout=seconds + 120)
        if process.returncode != 0:
            raise RuntimeError(f"loadtest failed ({process.returncode}): {errors.decode()[-2000:]}")
    elapsed_s = time.perf_counter() - started
    cpu_s = server_cpu_seconds(server.process.pid) - cpu_before
    levels = [json.loads(next(folder.glob("*.json")).read_text())["levels"][0] for folder in folders]
    return {
        "requests_per_s": sum(level["throughput_rps"] for level in levels),
        "p50_ms": statistics.median(level["latency_p50_ms"] for level in levels),
        "failed": sum(level["failed"] for level in levels),
        "rows_per_run": rows_per_run(batches_before, server.batch_totals(MODEL)) or 0.0,
        "server_cpu_cores": cpu_s / elapsed_s,
    }


def served(
    repository: Path, frontends: list[int], clients: int, in_flight: int, seconds: float
) -> list[dict[str, float]]:
    """One server per front-end count, fp16 on CUDA, each under the same client load; and one client alone."""
    figures = []
    with tempfile.TemporaryDirectory() as folder:
        scratch = Path(folder)
        for count in frontends:
            log = scratch / f"server-{count}.log"
            with start_server(repository, log, "--require-gpu", "--frontends", str(count)) as server:
                if count == frontends[0]:
                    alone = drive(server, 1, 1, seconds, scratch / f"alone-{count}")
                    figures.append({"frontends": count, "clients": 1, "in_flight": 1, **alone})
                load = drive(server, clients, in_flight, seconds, scratch / f"load-{count}")
                figures.append({"frontends": count, "clients": clients, "in_flight": in_flight, **load})
            print(json.dumps(figures[-1]), flush=True)
    return figures


def main(argv: list[str] | None = None) -> int:
    """Measure, print and write the figures."""
    parser = argparse.ArgumentParser(prog="python -m tools.gpu_bench", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--repository", type=Path, required=True, help=f"a model repository holding {MODEL} (fp16 and fp32)"
    )
    parser.add_argument("--variants", default="fp16,fp32")
    parser.add_argument("--frontends", default="1,2,4,8", help="front-end process counts, one server each")
    parser.add_argument("--clients", type=int, default=8, help="loadtest processes")
    parser.add_argument("--in-flight", type=int, default=32, help="closed-loop workers per loadtest process")
    parser.add_argument("--seconds", type=float, default=8.0, help="measured window per level")
    parser.add_argument("--skip-served", action="store_true")
    parser.add_argument("--output", type=Path, default=Path("bench-results/gpu_bench.json"))
    arguments = parser.parse_args(argv)
    results: dict[str, list[dict[str, float]]] = {"in_process": []}
    for variant in arguments.variants.split(","):
        for row in in_process(arguments.repository, variant, SHAPES):
            results["in_process"].append(row)
            print(json.dumps(row), flush=True)
    if not arguments.skip_served:
        counts = [int(count) for count in arguments.frontends.split(",")]
        results["served"] = served(
            arguments.repository, counts, arguments.clients, arguments.in_flight, arguments.seconds
        )
    arguments.output.parent.mkdir(parents=True, exist_ok=True)
    arguments.output.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
