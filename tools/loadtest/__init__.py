"""Load generator for KServe v2 gRPC inference servers (ours or Triton), usable in-process.

    config = LoadConfig(target="127.0.0.1:8001", duration_s=10)
    workload = Workload.build(config)            # every request message built once, up front
    await check_target(config, workload)         # ServerReady, ModelReady, ModelMetadata inputs
    result = await run_level(config, Level("closed", 8), workload)

`python -m tools.loadtest --help` runs sweeps from the command line.
"""

from __future__ import annotations

from tools.loadtest.config import ConfigError, Level, LoadConfig, parse_levels, parse_mix
from tools.loadtest.corpus import load_corpus
from tools.loadtest.report import format_table, write_reports
from tools.loadtest.result import LevelResult
from tools.loadtest.runner import TargetError, check_target, run_level
from tools.loadtest.workload import PreparedRequest, Workload

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
