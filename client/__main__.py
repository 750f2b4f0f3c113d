"""`python -m client embed|rerank|classify`: bulk ingestion of a file or images, quick reranking and classification.

python -m client embed docs.jsonl --field body --output vectors.npy --target dns:///encoder:8001
python -m client embed photos/ --model clip --output image-vectors.npy
python -m client embed photos.jsonl --image-column path --model clip --output image-vectors.npy
python -m client rerank --query "how do I bake bread?" --model my-reranker passages.txt
python -m client classify --model my-classifier reviews.txt
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path

from client.aio import AsyncEmbeddingClient
from client.base import DEFAULT_MODEL
from client.checkpoint import CheckpointError
from client.errors import EmbeddingError
from client.ingest import TRANSPORTS, IngestReport, IngestSettings, embed_file_async, embed_images_async
from client.inputs import DEFAULT_FIELD, InputError, InputFile, image_sources
from client.tasks import EmbedOptions
from protocol.channel_security import SecurityError, add_security_arguments, security_from_args

TARGET_VARIABLE = "ENCODER_CLIENT_TARGET"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m client", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    embed = commands.add_parser("embed", help="embed every text of a file, or images, into .npy or .parquet, resumable")
    rerank = commands.add_parser("rerank", help="rank a file's texts for a query")
    classify = commands.add_parser("classify", help="classify each text of a file")
    embed.add_argument(
        "inputs",
        type=Path,
        nargs="+",
        help=".txt (a text a line), .jsonl, .csv or .parquet; or images: folders (their .png, .jpg, .jpeg, .webp and"
        " .gif files, every level, sorted by path) and image files, or a table of paths with --image-column",
    )
    embed.add_argument(
        "--image-column",
        help="the field (.jsonl) or column (.csv, .parquet) holding each row's image path (relative ones from the"
        " file's folder): the rows are images",
    )
    for command in (rerank, classify):
        command.add_argument("input", type=Path, help=".txt (a text a line), .jsonl, .csv or .parquet")
    for command in (embed, rerank, classify):
        command.add_argument(
            "--target",
            default=os.environ.get(TARGET_VARIABLE, "localhost:8001"),
            help=f"host:port or dns:///name:port (default: ${TARGET_VARIABLE} or localhost:8001)",
        )
        command.add_argument("--model", default=DEFAULT_MODEL, help="the model (default: %(default)s)")
        command.add_argument("--field", default=DEFAULT_FIELD, help=".jsonl: the field holding the text")
        command.add_argument("--column", default=DEFAULT_FIELD, help=".csv, .parquet: the column holding the text")
        command.add_argument(
            "--batch-size", type=int, default=64, help="texts or images per request (default: %(default)s)"
        )
        command.add_argument("--connections", type=int, default=2, help="connections per address (default: 2)")
        command.add_argument("--truncate", choices=("true", "false"), help="false: long texts whole, or refused")
        add_security_arguments(command)
    embed.add_argument("--output", type=Path, required=True, help=".npy (float32 [rows, width]) or .parquet")
    embed.add_argument("--resume", action="store_true", help="continue the run whose checkpoint is beside --output")
    embed.add_argument("--quiet", action="store_true", help="no progress and no summary")
    embed.add_argument("--prompt-name", help="one of the model's prompts, put before each text")
    embed.add_argument("--dimensions", type=int, help="a Matryoshka width the model declares")
    embed.add_argument(
        "--in-flight",
        type=int,
        default=16,
        help="requests unanswered per connection at most; below it as many as keep the server busy (default: 16)",
    )
    embed.add_argument(
        "--priority",
        type=int,
        default=0,
        help="the priority the rows wait at, 1 the highest (default: the model's lowest, so queries go first)",
    )
    embed.add_argument("--transport", choices=TRANSPORTS, default="stream", help="(default: %(default)s)")
    rerank.add_argument("--query", required=True, help="the query the texts are ranked for")
    rerank.add_argument("--top-n", type=int, help="print only the best n")
    for command in (rerank, classify):
        command.add_argument("--raw-scores", action="store_true", help="the model's logits, not probabilities")
    return parser


async def _embed(args: argparse.Namespace) -> None:
    truncate = None if args.truncate is None else args.truncate == "true"
    arguments = {
        "target": args.target,
        "model": args.model,
        "resume": args.resume,
        "options": EmbedOptions(args.prompt_name, args.dimensions, truncate),
        "settings": IngestSettings(
            args.batch_size, args.connections, args.in_flight, args.transport, priority=args.priority
        ),
        "security": security_from_args(args),
        "progress_stream": None if args.quiet else sys.stderr,
    }
    report: IngestReport
    if args.image_column is not None or image_sources(args.inputs):
        report = await embed_images_async(args.inputs, args.output, image_column=args.image_column, **arguments)
    elif len(args.inputs) == 1:
        (source,) = args.inputs
        report = await embed_file_async(source, args.output, field=args.field, column=args.column, **arguments)
    else:
        raise InputError("texts come from one file; several inputs are folders or image files")
    if not args.quiet:
        summary = {"rows": report.rows, "embedded": report.embedded, "retries": report.retries}
        rate = {f"{report.unit}_per_s": round(report.rows_per_s, 1), "output": str(report.output)}
        print(json.dumps(summary | rate))


async def _score(args: argparse.Namespace) -> None:
    texts = list(InputFile(args.input, args.field, args.column).texts())
    truncate = None if args.truncate is None else args.truncate == "true"
    client = AsyncEmbeddingClient(
        args.target, args.model, batch_size=args.batch_size, security=security_from_args(args),
        connections=args.connections,
    )  # fmt: skip
    async with client:
        if args.command == "rerank":
            ranking = await client.rerank(
                args.query, texts, top_n=args.top_n, truncate=truncate, raw_scores=args.raw_scores
            )
            for index, score in zip(ranking.indices.tolist(), ranking.scores.tolist(), strict=True):
                print(json.dumps({"index": index, "score": score, "text": texts[index]}))
        else:
            classes = await client.classify(texts, truncate=truncate, raw_scores=args.raw_scores)
            for text, label, scores in zip(texts, classes.labels, classes.scores.tolist(), strict=True):
                named = dict(zip(classes.label_names, scores, strict=True))
                print(json.dumps({"label": label, "scores": named, "text": text}))


def main(argv: list[str] | None = None) -> int:
    """Run a command; exit 1 with one line on what the server refused or the input holds, 130 on Ctrl-C."""
    args = _parser().parse_args(argv)
    try:
        asyncio.run(_embed(args) if args.command == "embed" else _score(args))
    except (InputError, CheckpointError, SecurityError, EmbeddingError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted: run again with --resume to do the rest", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
