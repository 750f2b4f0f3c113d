"""Benchmark: PyTorch eager against each published ONNX variant, side by side in one run.

    python -m export.bench --repository model_repository [--output bench-results/export.json]

For each (batch, length) of a grid, every candidate runs the same random token batch with the
same number of threads; rounds are interleaved across candidates and the best round kept, so
the ratios hold even on a noisy machine. Prints a table (sequences/s and ms per batch).
Needs the test extra (transformers).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import BertModel
from transformers import logging as transformers_logging

from export.checkpoints.checkpoint import default_model_folder, load_checkpoint
from export.graph.timing import compare_seconds, cpu_session, token_feed
from service.core.repository import read_model

GRID = ((1, 16), (8, 128), (32, 32), (32, 128), (8, 256))


def _torch_runner(model: torch.nn.Module, feed: dict) -> Callable[[], object]:
    tensors = {name: torch.from_numpy(array) for name, array in feed.items()}

    def run() -> object:
        with torch.inference_mode():
            return model(**tensors)

    return run


def candidates(repository_model: Path, threads: int) -> tuple[dict[str, object], list[str]]:
    """Models to compare: transformers.BertModel, our Encoder (both eager) and the CPU variants."""
    transformers_logging.set_verbosity_error()
    spec = read_model(repository_model)
    torch.set_num_threads(threads)
    folder = default_model_folder()
    models: dict[str, object] = {
        "torch eager (transformers.BertModel)": BertModel.from_pretrained(str(folder), add_pooling_layer=False).eval(),
        "torch eager (export.families.bert.Encoder)": load_checkpoint(folder).build_model(),
    }
    skipped = []
    for variant, path in sorted(spec.variants.items()):
        if variant == "fp16":
            skipped.append("onnx fp16: CUDA-only variant, not benchmarked on the CPU")
            continue
        models[f"onnx {variant}"] = cpu_session(str(path), threads, spec.online_optimization(variant, "cpu"))
    return models, skipped


def run_grid(models: dict[str, object], vocab_size: int, input_names: list[str]) -> list[dict[str, object]]:
    """Seconds per batch of every model on every grid shape."""
    rows = []
    for batch, length in GRID:
        feed = token_feed(input_names, batch, length, vocab_size)
        runs = {}
        for name, model in models.items():
            if isinstance(model, torch.nn.Module):
                runs[name] = _torch_runner(model, feed)
            else:
                runs[name] = lambda session=model, inputs=feed: session.run(None, inputs)
        seconds = compare_seconds(runs, rounds=3, min_seconds=0.5)
        for name, value in seconds.items():
            rows.append(
                {
                    "model": name,
                    "batch": batch,
                    "length": length,
                    "sequences_per_second": round(batch / value, 1),
                    "ms_per_batch": round(value * 1000, 2),
                }
            )
    return rows


def format_table(rows: list[dict[str, object]]) -> str:
    """Sequences/s (and ms per batch) with models as rows and shapes as columns, plus speedups."""
    shapes = [f"{b}x{n}" for b, n in GRID]
    names = list(dict.fromkeys(row["model"] for row in rows))
    by_key = {(row["model"], f"{row['batch']}x{row['length']}"): row for row in rows}
    baseline = names[0]
    width = max(len(n) for n in names) + 2
    lines = [f"{'seq/s (ms/batch) [x eager]':<{width}}" + "".join(f"{s:>26}" for s in shapes)]
    for name in names:
        cells = []
        for shape in shapes:
            row, base = by_key[(name, shape)], by_key[(baseline, shape)]
            ratio = row["sequences_per_second"] / base["sequences_per_second"]
            cells.append(f"{row['sequences_per_second']:>9.1f} ({row['ms_per_batch']:>7.1f}) [{ratio:4.2f}x]")
        lines.append(f"{name:<{width}}" + "".join(f"{c:>26}" for c in cells))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the grid and print the table; write JSON if asked."""
    parser = argparse.ArgumentParser(prog="python -m export.bench", description=__doc__.splitlines()[0])
    parser.add_argument("--repository", type=Path, default=Path("model_repository"))
    parser.add_argument("--model", default="all-MiniLM-L6-v2")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", type=Path, help="write the figures as JSON here")
    arguments = parser.parse_args(argv)
    spec = read_model(arguments.repository / arguments.model)
    models, skipped = candidates(arguments.repository / arguments.model, arguments.threads)
    rows = run_grid(models, spec.vocab_size, list(spec.input_names))
    print(f"threads={arguments.threads}; best of 3 interleaved rounds per cell")
    print(format_table(rows))
    for line in skipped:
        print(line)
    if arguments.output:
        arguments.output.parent.mkdir(parents=True, exist_ok=True)
        arguments.output.write_text(json.dumps({"threads": arguments.threads, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
