"""Node capacity of a server of several processes, projected from each process's CPU time per request.

    python -m tools.capacity_bench [--frontends 2] [--seconds 8] [--transports grpcio,envoy] [--output FILE]

A tiny random encoder (exported here by the real exporter) served by `--frontends N` front-end
processes and one engine process. One-text requests over gRPC (ModelInfer, 32 in flight over 16
HTTP/2 connections) and over HTTP (OpenAI /v1/embeddings, 32 HTTP/1.1 connections) come from one
client for both protocols: h2load (nghttp2's load generator, in C; Debian's nghttp2-client), whose
own CPU per request is small and alike for both, so neither protocol's figures carry its client's
cost (a Python gRPC client beside the server took so much of this machine that gRPC ran at half
OpenAI's rate, and a front end's CPU per request rises as its rate falls: fewer requests share
each wake-up of its threads). The kernel spreads the connections over the front ends; requests are
counted by the server (encoder_requests_total, status OK; any other status stops the bench), and
each server process's CPU time as the kernel counts it (user + system, every thread, /proc) over
them gives:

- F: the front ends' CPU per request (all front ends together, per request);
- E: the engine's CPU per request, at that load and at saturation (this process then connects to
  the engine's socket as one more front end would and keeps 256 tokenised requests in flight, so
  the engine batches as it would behind a node full of front ends); at saturation also split into
  its event loop's thread (frames, batch formation, answers) and the model's threads.

Projected capacity of a 16-core node: min(1 / E at saturation, 15 / F): one core for the engine,
fifteen for front ends. Targets: >= 15,000 requests/s, E <= 60 us. For comparison, one front end
(`--frontends 1`) is measured the same way: the CPU per request of every process, the model's
included (one process with grpcio; an Envoy front end and the engine with envoy).

Each gRPC transport named (`--transports`, service's --grpc-transport) is measured in turn, the
same way, in one run: their figures compare.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import uvloop

from export.build import ExportOptions, export_model
from export.checkpoints.checkpoint import default_model_folder, random_checkpoint
from service.core.repository import read_model
from service.core.wire import EngineLink
from service.launch.processes import ENGINE_SOCKET, TITLE, children
from service.pipeline.tokenizer import TextTokenizer
from tools import h2load
from tools.bench import TINY_CONFIG, TINY_MODEL
from tools.local_server import RunningServer, process_cpu_seconds, start_server
from tools.protocols_bench import SENTENCE, grpc_request

ROUNDS = 3
"""Each figure is the median of this many rounds (a shared machine's speed drifts from second to second)."""
SATURATION_IN_FLIGHT = 256
SATURATION_RAMP_S = 0.5
"""Time for every caller to get its request in flight before the engine's CPU is counted."""
NODE_CORES = 16
TARGET_CAPACITY = 15_000
TARGET_ENGINE_US = 60.0


@dataclass(frozen=True)
class Load:
    """One protocol's load: requests answered, and each role's CPU microseconds per request."""

    protocol: str
    requests_per_s: float
    frontend_us: float
    engine_us: float
    total_us: float
    """Every process of the server (the supervisor's included)."""


def roles(server: RunningServer) -> dict[str, int]:
    """The server's processes by role (`engine`, `frontend 1`, ...; `server` for a lone process)."""
    pids = [server.process.pid, *children(server.process.pid)]
    named = {}
    for pid in pids:
        title = Path(f"/proc/{pid}/cmdline").read_text().split("\0")[0]
        named[title.removeprefix(f"{TITLE}: ") if title.startswith(TITLE) else "server"] = pid
    return named


def engine_socket(pid: int) -> str:
    """The path of the Unix socket the engine process listens on (its descriptors, looked up in /proc/net/unix)."""
    inodes = set()
    for descriptor in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(descriptor)
        except FileNotFoundError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        fields = line.split()
        if len(fields) == 8 and fields[6] in inodes and fields[7].endswith(f"/{ENGINE_SOCKET}"):
            return fields[7]
    raise RuntimeError(f"process {pid} listens on no {ENGINE_SOCKET}")


def _cpu(pids: dict[str, int]) -> dict[str, float]:
    return {role: process_cpu_seconds(pid) for role, pid in pids.items()}


def load_command(
    server: RunningServer, protocol: str, bodies: Path, *, seconds: float = 0, requests: int = 0
) -> list[str]:
    """h2load's command line for one-text requests of `protocol` (grpc, openai), for `seconds` or `requests`.

    `bodies` is the folder write_bodies wrote.
    """
    if protocol == "grpc":
        return h2load.model_infer(server.target, bodies / protocol, seconds=seconds, requests=requests)
    url = f"{server.http_url}/v1/embeddings"
    json_type = ("content-type: application/json",)
    return h2load.command(
        url, bodies / protocol, json_type, connections=h2load.IN_FLIGHT, streams=0, seconds=seconds, requests=requests
    )


def write_bodies(folder: Path) -> Path:
    """The one-text request body of each protocol, as files named after it; the folder."""
    (folder / "grpc").write_bytes(h2load.grpc_body(grpc_request(TINY_MODEL)))
    (folder / "openai").write_text(json.dumps({"model": TINY_MODEL, "input": SENTENCE, "encoding_format": "float"}))
    return folder


def drive(server: RunningServer, protocol: str, seconds: float) -> tuple[int, float, dict[str, float]]:
    """h2load.IN_FLIGHT one-text requests for `seconds`: requests answered (OK), seconds taken, CPU seconds per role.

    RuntimeError when requests fail (h2load.Answers).
    """
    with tempfile.TemporaryDirectory() as scratch:
        bodies = write_bodies(Path(scratch))
        h2load.run(load_command(server, protocol, bodies, requests=h2load.WARM_UP_REQUESTS))
        pids = roles(server)
        answered, before, started = server.answered(TINY_MODEL), _cpu(pids), time.monotonic()
        h2load.run(load_command(server, protocol, bodies, seconds=seconds))
        elapsed, after, answered_after = time.monotonic() - started, _cpu(pids), server.answered(TINY_MODEL)
    requests = h2load.Answers(answered).ok_since_last(answered_after, abandoned=h2load.IN_FLIGHT)
    return requests, elapsed, {role: after[role] - before[role] for role in pids}


def measure(server: RunningServer, protocol: str, seconds: float) -> Load:
    """A protocol's requests/s and CPU per request of the front ends and of the engine: the median of ROUNDS.

    The median round by CPU per request in all processes, kept whole, so its roles add up to its total.
    """
    rounds = []
    for _ in range(ROUNDS):
        requests, elapsed, cpu = drive(server, protocol, seconds / ROUNDS)
        frontends = sum(used for role, used in cpu.items() if role.startswith("frontend") or role == "server")
        engine, total = cpu.get("engine", 0.0), sum(cpu.values())
        per_request = (used / requests * 1e6 for used in (frontends, engine, total))
        rounds.append(Load(protocol, requests / elapsed, *per_request))
    return sorted(rounds, key=lambda load: load.total_us)[len(rounds) // 2]


@dataclass(frozen=True)
class Saturation:
    """The engine's CPU microseconds per one-text request when it is kept full."""

    engine_us: float
    """Every thread of the engine process."""
    loop_us: float
    """Its event loop's thread alone (frames, batch formation, answers); the rest runs the model."""


async def _saturate(path: str, rows: object, seconds: float, engine_pid: int) -> Saturation:
    """The engine's CPU per request while SATURATION_IN_FLIGHT requests are kept in flight for `seconds`.

    Counted from once every caller is in flight to before any stops: the ramp and the tail (small
    batches, not saturation) are left out.
    """
    link = await EngineLink.connect(path, 0, lambda update: None, lambda: None)
    done = 0
    running = True

    async def caller() -> None:
        nonlocal done
        while running:
            _, future = link.submit(TINY_MODEL, "", rows, ("embedding",), None)
            await future
            done += 1

    for _ in range(100):
        _, future = link.submit(TINY_MODEL, "", rows, ("embedding",), None)
        await future
    callers = asyncio.gather(*(caller() for _ in range(SATURATION_IN_FLIGHT)))
    await asyncio.sleep(SATURATION_RAMP_S)
    counted = done
    before, loop_before = process_cpu_seconds(engine_pid), process_cpu_seconds(engine_pid, engine_pid)
    await asyncio.sleep(seconds)
    used = process_cpu_seconds(engine_pid) - before
    loop_used = process_cpu_seconds(engine_pid, engine_pid) - loop_before
    counted = done - counted
    running = False
    await callers
    link.close()
    return Saturation(used / counted * 1e6, loop_used / counted * 1e6)


def engine_at_saturation(server: RunningServer, repository: Path, seconds: float) -> Saturation:
    """The engine's CPU per one-text request when it is kept full, and its event loop's share: medians of ROUNDS."""
    engine = roles(server)["engine"]
    spec = read_model(repository / TINY_MODEL)
    rows = TextTokenizer.of_model(spec).encode_rows([SENTENCE])
    path = engine_socket(engine)
    rounds = [uvloop.run(_saturate(path, rows, seconds / ROUNDS, engine)) for _ in range(ROUNDS)]
    return Saturation(
        statistics.median(one.engine_us for one in rounds), statistics.median(one.loop_us for one in rounds)
    )


def main(argv: list[str] | None = None) -> int:
    """Measure, project, print (and with --output, save) the figures."""
    parser = argparse.ArgumentParser(prog="python -m tools.capacity_bench", description=__doc__.splitlines()[0])
    parser.add_argument("--frontends", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--transports", default="grpcio", help="gRPC transports to measure, comma-separated")
    parser.add_argument("--output", type=Path)
    arguments = parser.parse_args(argv)
    transports = arguments.transports.split(",")
    loads: dict[str, list[Load]] = {}
    alone: dict[str, list[Load]] = {}
    with tempfile.TemporaryDirectory() as scratch:
        repository = Path(scratch) / "repository"
        checkpoint = random_checkpoint(TINY_CONFIG, TINY_MODEL, seed=1, tokenizer_folder=default_model_folder())
        export_model(checkpoint, repository, ExportOptions(variants=("fp32",), threads=1))
        for transport in transports:
            flags = ("--frontends", str(arguments.frontends), "--grpc-transport", transport)
            with start_server(repository, Path(scratch) / f"{transport}.log", *flags) as server:
                loads[transport] = [measure(server, protocol, arguments.seconds) for protocol in ("grpc", "openai")]
                if transport == transports[0]:
                    saturation = engine_at_saturation(server, repository, arguments.seconds)
            flags = ("--frontends", "1", "--grpc-transport", transport)
            with start_server(repository, Path(scratch) / f"{transport}-single.log", *flags) as single:
                alone[transport] = [measure(single, protocol, arguments.seconds) for protocol in ("grpc", "openai")]
    saturated = saturation.engine_us
    figures: dict[str, object] = {
        "frontends": arguments.frontends,
        "engine_us_at_saturation": round(saturated, 1),
        "engine_loop_us_at_saturation": round(saturation.loop_us, 1),
        "transports": {},
    }
    lines = []
    for transport in transports:
        lines.append(
            f"gRPC on {transport}: {arguments.frontends} front ends + engine, tiny model, one-text requests,"
            f" {h2load.IN_FLIGHT} in flight:"
        )
        protocols = figures["transports"][transport] = {}
        for load, lone in zip(loads[transport], alone[transport], strict=True):
            capacity = min(1e6 / saturated, (NODE_CORES - 1) * 1e6 / load.frontend_us)
            protocols[load.protocol] = {
                **asdict(load),
                "projected_16_core_requests_per_s": round(capacity),
                "one_frontend_all_processes_us": round(lone.total_us, 1),
                "one_frontend_requests_per_s": round(lone.requests_per_s),
            }
            verdict = "met" if capacity >= TARGET_CAPACITY else "MISSED"
            lines.append(
                f"  {load.protocol}: {load.requests_per_s:.0f} req/s here; front ends {load.frontend_us:.0f} us/req,"
                f" engine {load.engine_us:.0f} us/req at this load, {saturated:.1f} us/req at saturation ->"
                f" 16 cores: min(1/{saturated:.1f} us, 15/{load.frontend_us:.0f} us) = {capacity:,.0f} req/s"
                f" (target >= {TARGET_CAPACITY:,}: {verdict}); one front end: {lone.total_us:.0f} us/req in all"
                f" processes, {lone.requests_per_s:.0f} req/s"
            )
        grpc_us, openai_us = (load.frontend_us for load in loads[transport])
        lines.append(f"  gRPC front-end CPU per request / OpenAI's: {grpc_us / openai_us:.2f}")
    lines.append(
        f"engine CPU per request at saturation {saturated:.1f} us (target <= {TARGET_ENGINE_US:g} us:"
        f" {'met' if saturated <= TARGET_ENGINE_US else 'MISSED'}): its event loop {saturation.loop_us:.1f} us,"
        f" the model's threads {saturated - saturation.loop_us:.1f} us"
    )
    print("\n".join(lines))
    if arguments.output:
        arguments.output.parent.mkdir(parents=True, exist_ok=True)
        arguments.output.write_text(json.dumps({**figures, "lines": lines}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
