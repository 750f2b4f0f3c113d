"""What tenant accounting costs: server CPU per one-text ModelInfer without API keys, with a key per line, with tenants.

    python -m tools.tenants_bench [--seconds 6] [--rounds 3]

A tiny random encoder (exported here by the real exporter) served three times, one process each
(`--frontends 1`): without --api-key-file; with a one-key-per-line file (one unlimited tenant,
`default`: its requests and tokens counted); and with a TOML tenants file of ten tenants, each with
a requests/s and a tokens/minute limit set far above what is sent, so every request is checked
against both buckets, charged and counted and none is refused. Rounds alternate between the
servers, with one request in flight and with 32 (16 connections); each figure is the server's CPU
time (user + system, every thread, /proc) over the requests answered, the median of the rounds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import uvloop

from export.build import ExportOptions, export_model
from export.checkpoints.checkpoint import default_model_folder, random_checkpoint
from tools.bench import TINY_CONFIG, TINY_MODEL
from tools.local_server import start_server
from tools.protocols_bench import model_infer_cpu

KEY = "bench-key-7"
TENANTS = 10


def _tenants_file() -> str:
    """Ten tenants of two keys each, with limits no bench reaches; the bench's key is the last tenant's."""
    tables = [
        f'[tenants.team-{number}]\nkeys = ["bench-key-{number}", "bench-spare-{number}"]\n'
        "requests_per_second = 1000000\ntokens_per_minute = 1000000000\n"
        for number in range(TENANTS)
    ]
    return "\n".join(tables)


def _metadata(key: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),) if key is not None else ()


def main(argv: list[str] | None = None) -> int:
    """Measure the three servers, alternating, and print the figures."""
    parser = argparse.ArgumentParser(prog="python -m tools.tenants_bench", description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=6.0, help="per round and load")
    parser.add_argument("--rounds", type=int, default=3)
    arguments = parser.parse_args(argv)
    modes = ("no keys", "key per line", "tenants")
    keys = (None, KEY, KEY)
    figures: dict[tuple[str, int], list[tuple[float, float]]] = {}
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        repository = folder / "repository"
        checkpoint = random_checkpoint(TINY_CONFIG, TINY_MODEL, seed=1, tokenizer_folder=default_model_folder())
        export_model(checkpoint, repository, ExportOptions(variants=("fp32",), threads=1))
        (folder / "keys").write_text(f"{KEY}\n")
        (folder / "tenants.toml").write_text(_tenants_file())
        flags = ("--frontends", "1", "--intra-op-threads", "1")
        with (
            start_server(repository, folder / "none.log", *flags) as none,
            start_server(repository, folder / "keys.log", *flags, "--api-key-file", str(folder / "keys")) as lines,
            start_server(
                repository, folder / "tenants.log", *flags, "--api-key-file", str(folder / "tenants.toml")
            ) as tenants,
        ):
            for _ in range(arguments.rounds):
                for in_flight in (1, 32):
                    for mode, key, server in zip(modes, keys, (none, lines, tenants), strict=True):
                        requests, used, p50_ms = uvloop.run(
                            model_infer_cpu(server, TINY_MODEL, in_flight, arguments.seconds, _metadata(key))
                        )
                        figures.setdefault((mode, in_flight), []).append((used / requests * 1e6, p50_ms))
    print(f"tiny model, one-text ModelInfer, one server process each; median of {arguments.rounds} rounds:")
    for in_flight in (1, 32):
        medians = {
            mode: [statistics.median(values) for values in zip(*figures[(mode, in_flight)], strict=True)]
            for mode in modes
        }
        base_us, base_p50_ms = medians["no keys"]
        line = [f"  {in_flight:>2} in flight: no keys {base_us:.0f} us CPU/request (p50 {base_p50_ms:.2f} ms)"]
        for mode in modes[1:]:
            us, p50_ms = medians[mode]
            line.append(f"{mode} {us:.0f} us (+{us - base_us:.0f} us, {us / base_us - 1:+.1%}; p50 {p50_ms:.2f} ms)")
        print("; ".join(line))
    return 0


if __name__ == "__main__":
    sys.exit(main())
