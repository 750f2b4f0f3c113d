"""A reranker next to the embedder: texts/s and pairs/s at 8 x 128 tokens, in-process and served, in one run.

The embedder is the default model (all-MiniLM-L6-v2); the reranker has the same shape as the
cross-encoders served beside it (ms-marco-MiniLM-L-6-v2: BERT, 6 layers, 384 wide, one label),
randomly initialised (no model hub here: the speed does not depend on the weights) with the
default model's tokenizer, and exported by the real exporter. Both are served by one server, as
one pod would serve them; the bench measures

- in-process: ONNX Runtime alone on batches of 8 sequences of 128 tokens (the ceiling);
- served: TEI's `/embed` with 8 texts of ~128 tokens, and `/rerank` with a query and 8 texts
  whose pairs are ~128 tokens, each from closed-loop HTTP clients, fixed work timed whole.

    python -m tools.task_bench --repository /path/to/repository-with-the-default-model
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import transformers

from export.build import ExportOptions, export_model
from export.checkpoints.checkpoint import default_model_folder, load_checkpoint
from export.graph.timing import compare_throughput, cpu_session, token_feed
from service.core.repository import read_model
from service.pipeline.tokenizer import TextTokenizer
from tools.local_server import start_server

EMBEDDER = "all-MiniLM-L6-v2"
RERANKER = "minilm-reranker"
BATCH, TOKENS = 8, 128
CLIENTS = 4
REQUESTS = 48
"""Requests per route, shared by the clients: fixed work, timed whole."""
WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "rain",
    "falls",
    "on",
    "quiet",
    "streets",
    "near",
    "old",
    "stone",
    "bridges",
]


def reranker_folder(folder: Path, seed: int = 0) -> Path:
    """A one-label BERT sequence classifier of the default model's shape, with its tokenizer files."""
    source = default_model_folder()
    config = transformers.BertConfig.from_pretrained(str(source), num_labels=1)
    config.architectures = ["BertForSequenceClassification"]
    transformers.set_seed(seed)
    transformers.BertForSequenceClassification(config).eval().save_pretrained(str(folder))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
        if (source / name).is_file():
            shutil.copyfile(source / name, folder / name)
    return folder


def text_of(tokenizer: TextTokenizer, tokens: int, offset: int) -> str:
    """A text of about `tokens` tokens (special tokens included)."""
    words: list[str] = []
    while len(tokenizer.encode_rows([" ".join(words)]).input_ids) < tokens:
        words.append(WORDS[(offset + len(words)) % len(WORDS)])
    return " ".join(words[:-1])


def in_process(repository: Path, threads: int) -> dict[str, float]:
    """Sequences per second of each model's published fp32 graph at BATCH x TOKENS."""
    rates = {}
    for name in (EMBEDDER, RERANKER):
        spec = read_model(repository / name)
        feed = token_feed(list(spec.input_names), BATCH, TOKENS, spec.vocab_size)
        session = cpu_session(str(spec.variants["fp32"]), threads, spec.online_optimization("fp32", "cpu"))
        rates[name] = compare_throughput({name: session}, feed, rounds=3)[name]
    return rates


def _post(url: str, body: dict) -> None:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"content-type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(request, timeout=120) as answer:
        answer.read()


def served(url: str, route: str, body: dict) -> float:
    """Requests per second of one route: REQUESTS requests from CLIENTS closed-loop clients, timed whole."""
    _post(url + route, body)  # warm
    started = time.perf_counter()
    with ThreadPoolExecutor(CLIENTS) as pool:
        list(pool.map(lambda _: _post(url + route, body), range(REQUESTS)))
    return REQUESTS / (time.perf_counter() - started)


def main(argv: list[str] | None = None) -> int:
    """Export the reranker beside the embedder, measure both ways, print and write the figures."""
    parser = argparse.ArgumentParser(prog="python -m tools.task_bench", description=__doc__.splitlines()[0])
    parser.add_argument("--repository", type=Path, required=True, help="a repository holding the default model")
    parser.add_argument("--threads", type=int, default=2, help="ONNX Runtime threads, in-process and served")
    parser.add_argument("--output", type=Path, default=Path("bench-results/task_bench.json"))
    arguments = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="task-bench-") as scratch:
        repository = Path(scratch) / "repository"
        repository.mkdir()
        (repository / EMBEDDER).symlink_to((arguments.repository / EMBEDDER).resolve())
        checkpoint = load_checkpoint(reranker_folder(Path(scratch) / "source"), RERANKER)
        export_model(checkpoint, repository, ExportOptions(variants=("fp32",), threads=arguments.threads))
        ceiling = in_process(repository, arguments.threads)
        spec = read_model(repository / EMBEDDER)
        tokenizer = TextTokenizer.of_model(spec)
        query = "where can I find a quiet bridge in the rain"
        query_tokens = len(tokenizer.encode_rows([query]).input_ids) - 1
        texts = [text_of(tokenizer, TOKENS, offset) for offset in range(BATCH)]
        documents = [text_of(tokenizer, TOKENS - query_tokens, offset) for offset in range(BATCH)]
        with start_server(
            repository, Path(scratch) / "server.log", "--intra-op-threads", str(arguments.threads)
        ) as server:
            embed_rps = served(server.http_url, "/embed", {"inputs": texts})
            rerank_rps = served(server.http_url, "/rerank", {"query": query, "texts": documents})
    figures = {
        "shape": f"{BATCH}x{TOKENS}",
        "threads": arguments.threads,
        "in_process": {
            "embedder_texts_per_s": round(ceiling[EMBEDDER], 1),
            "reranker_pairs_per_s": round(ceiling[RERANKER], 1),
        },
        "served": {
            "clients": CLIENTS,
            "embedder_texts_per_s": round(embed_rps * BATCH, 1),
            "reranker_pairs_per_s": round(rerank_rps * BATCH, 1),
        },
    }
    figures["served_share_of_in_process"] = {
        "embedder": round(figures["served"]["embedder_texts_per_s"] / ceiling[EMBEDDER], 3),
        "reranker": round(figures["served"]["reranker_pairs_per_s"] / ceiling[RERANKER], 3),
    }
    arguments.output.parent.mkdir(parents=True, exist_ok=True)
    arguments.output.write_text(json.dumps(figures, indent=2) + "\n")
    print(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
