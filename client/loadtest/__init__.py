"""Load generator for KServe v2 gRPC inference servers (ours or Triton), usable in-process.

    config = LoadConfig(target="127.0.0.1:8001", duration_s=10)
    workload = Workload.build(config)            # every request message built once, up front
    await check_target(config, workload)         # ServerReady, ModelReady, ModelMetadata inputs
    result = await run_level(config, Level("closed", 8), workload)

`python -m client.loadtest --help` runs sweeps from the command line.
"""

from __future__ import annotations

from client.loadtest.config import ConfigError, Level, LoadConfig, parse_levels, parse_mix
from client.loadtest.corpus import load_corpus
from client.loadtest.report import format_table, write_reports
from client.loadtest.result import LevelResult
from client.loadtest.runner import TargetError, check_target, run_level
from client.loadtest.workload import PreparedRequest, Workload

__all__ = [
    "ConfigError",
    "Level",
    "LevelResult",
    "LoadConfig",
    "PreparedRequest",
    "TargetError",
    "Workload",
    "check_target",
    "format_table",
    "load_corpus",
    "parse_levels",
    "parse_mix",
    "run_level",
    "write_reports",
]
