"""Interactive queries while a bulk ingestion runs: their latency and the ingestion's speed, priorities on and off.

    python -m tools.priority_bench --repository REPO [--texts 6000] [--seconds 15] [--rounds 2]

One server on the default model (REPO holds all-MiniLM-L6-v2, exported), started twice a round:
with priorities (the defaults: two levels, the express lane; the ingestion CLI sends its rows at the
lowest priority) and without (`--priority-levels 1 --no-express-lane`, how the server queued
before: first come, first served). Each start measures, in turn:

- queries alone: one one-sentence query every 50 ms (the next one 50 ms after the last was sent,
  or at once if it took longer) for `--seconds`, at the default priority: p50 and p99 latency;
- the ingestion alone: `python -m client embed` (its defaults) of `--texts` texts of 20-120 words:
  texts per second, the command's wall time;
- both together: the same query loop for as long as the same ingestion runs.

Rounds alternate the two servers. Figures go to stdout and bench-results/priority_bench.json.
Targets (issue 45): with priorities, the queries' p99 during ingestion within 2x their p99 alone,
and the ingestion at 0.8 or more of its speed alone.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from client import EmbeddingClient
from tools.local_server import RunningServer, start_server

MODEL = "all-MiniLM-L6-v2"
QUERY_INTERVAL_S = 0.05
QUERY = "how do I reset my password"
MODES = {"priorities": (), "off": ("--priority-levels", "1", "--no-express-lane")}
RESULTS = Path("bench-results") / "priority_bench.json"


def corpus(path: Path, texts: int, seed: int = 7) -> None:
    """`texts` lines of 20-120 words drawn from the load test's text, as JSON lines."""
    words = (Path(__file__).parent / "loadtest" / "long.txt").read_text().split()
    generator = random.Random(seed)
    with path.open("w") as output:
        for _ in range(texts):
            count = generator.randint(20, 120)
            start = generator.randrange(len(words) - count)
            output.write(json.dumps({"text": " ".join(words[start : start + count])}) + "\n")


def query_latencies_ms(server: RunningServer, keep_going: threading.Event | None, seconds: float) -> list[float]:
    """One query every QUERY_INTERVAL_S for `seconds` (or while `keep_going` is set): each one's latency."""
    latencies = []
    with EmbeddingClient(server.target, MODEL) as client:
        client.embed([QUERY])  # the connection made before timing
        ends = time.monotonic() + seconds
        following = time.monotonic()
        while keep_going.is_set() if keep_going is not None else time.monotonic() < ends:
            started = time.perf_counter()
            client.embed([QUERY])
            latencies.append((time.perf_counter() - started) * 1e3)
            following += QUERY_INTERVAL_S
            time.sleep(max(0.0, following - time.monotonic()))
            following = max(following, time.monotonic())
    return latencies


def ingest_s(server: RunningServer, source: Path, output: Path) -> float:
    """Wall time of `python -m client embed` of the whole source, with its defaults."""
    output.unlink(missing_ok=True)
    command = [sys.executable, "-m", "client", "embed", str(source), "--output", str(output)]
    command += ["--target", server.target, "--model", MODEL, "--quiet"]
    started = time.perf_counter()
    subprocess.run(command, check=True, timeout=3600)
    return time.perf_counter() - started


def measure(server: RunningServer, source: Path, texts: int, seconds: float, scratch: Path) -> dict[str, float]:
    """Queries alone, the ingestion alone, then both together, on one server."""
    alone = query_latencies_ms(server, None, seconds)
    alone_s = ingest_s(server, source, scratch / "alone.npy")
    running = threading.Event()
    running.set()
    during: list[float] = []
    loop = threading.Thread(target=lambda: during.extend(query_latencies_ms(server, running, 0)))
    loop.start()
    try:
        together_s = ingest_s(server, source, scratch / "together.npy")
    finally:
        running.clear()
        loop.join()
    return {
        "queries_alone_p50_ms": float(np.percentile(alone, 50)),
        "queries_alone_p99_ms": float(np.percentile(alone, 99)),
        "queries_during_p50_ms": float(np.percentile(during, 50)),
        "queries_during_p99_ms": float(np.percentile(during, 99)),
        "queries_during_max_ms": float(max(during)),
        "queries_during": len(during),
        "ingest_alone_texts_per_s": texts / alone_s,
        "ingest_during_texts_per_s": texts / together_s,
    }


def main(argv: list[str] | None = None) -> int:
    """Measure both servers, alternating, and print the figures."""
    parser = argparse.ArgumentParser(prog="python -m tools.priority_bench", description=__doc__.splitlines()[0])
    parser.add_argument("--repository", type=Path, required=True, help=f"a model repository holding {MODEL}")
    parser.add_argument("--texts", type=int, default=6000, help="texts the ingestion embeds (20-120 words each)")
    parser.add_argument("--seconds", type=float, default=15.0, help="how long the queries alone are measured")
    parser.add_argument("--rounds", type=int, default=2)
    arguments = parser.parse_args(argv)
    rounds = []
    with tempfile.TemporaryDirectory() as folder:
        scratch = Path(folder)
        source = scratch / "texts.jsonl"
        corpus(source, arguments.texts)
        for number in range(arguments.rounds):
            for mode, flags in MODES.items():
                with start_server(arguments.repository, scratch / f"{mode}-{number}.log", *flags) as server:
                    figures = measure(server, source, arguments.texts, arguments.seconds, scratch)
                rounds.append({"round": number + 1, "mode": mode, **figures})
                print(_line(rounds[-1]), flush=True)
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(rounds, indent=2))
    return 0


def _line(figures: dict[str, float]) -> str:
    p99_ratio = figures["queries_during_p99_ms"] / figures["queries_alone_p99_ms"]
    speed = figures["ingest_during_texts_per_s"] / figures["ingest_alone_texts_per_s"]
    return (
        f"round {figures['round']} {figures['mode']:>10}: queries p50/p99 alone"
        f" {figures['queries_alone_p50_ms']:.1f}/{figures['queries_alone_p99_ms']:.1f} ms, during ingestion"
        f" {figures['queries_during_p50_ms']:.1f}/{figures['queries_during_p99_ms']:.1f} ms"
        f" (max {figures['queries_during_max_ms']:.0f}, n={figures['queries_during']:.0f}; p99 x{p99_ratio:.2f});"
        f" ingestion {figures['ingest_alone_texts_per_s']:.0f} texts/s alone,"
        f" {figures['ingest_during_texts_per_s']:.0f} during (x{speed:.2f})"
    )


if __name__ == "__main__":
    sys.exit(main())
