"""Each encoder family at its example checkpoint's size (random weights): export, size, RSS, texts/s.

    python -m tools.family_bench --work DIR [--families gte,qwen3] [--seconds 20] [--output FILE]
    python -m tools.family_bench --work DIR --families qwen3 --export-only   # the export's time and memory only

For each family, in one run on this machine:
1. A folder of the example checkpoint's shape (its config's sizes, transformers' own random
   initialisation) with a small tokenizer of the family's kind (tests.export.family_tokenizers
   and tiny_models), wrapped as the checkpoint is (sentence-transformers folder, CrossEncoder,
   the causal LM's own folder for Qwen3-Reranker, PEFT task adapters for jina-embeddings-v3).
   The tokenizer's vocabulary does not change the graph's cost: the config's vocab_size sets the
   embedding table. max_seq_length is 512 everywhere, so that the export gate's cases stay
   small; it does not change the graph.
2. `python -m export --variants fp32 --threads 2`, timed (the parity gate included), its peak
   resident memory (the kernel's maximum RSS of the exporter's process), each stage's time and
   resident memory (VmRSS sampled every RSS_SAMPLE_S from /proc), and the size of the published
   graph and its weights. --export-only stops there (no server).
3. A server on that model alone (`--intra-op-threads 2`), warmed up, then one tritonclient gRPC
   client sending 8 rows of 128 random tokens (token inputs) one request at a time for
   --seconds: texts/s, and the resident memory of every server process (VmRSS from /proc,
   summed) at the end.
Families are measured one after another (one server at a time, so that RSS is the model's own).
Needs the test extra (transformers, sentence-transformers, tritonclient).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO

import numpy as np
import torch
import transformers
import tritonclient.grpc as triton
from sentence_transformers import CrossEncoder, SentenceTransformer
from sentence_transformers.base.modules import Dense
from sentence_transformers.sentence_transformer import modules as st_models
from torch import nn

from service.core.repository import read_model
from service.launch.processes import children
from tests.export import family_tokenizers, tiny_models
from tools.local_server import start_server
from tools.stress.monitor import read_rss_bytes

ROWS, TOKENS = 8, 128
THREADS = 2
MAX_SEQ_LENGTH = 512
RSS_SAMPLE_S = 0.05
"""How often the exporter's resident memory is read while it runs."""
STAGE_LINE = re.compile(r"stage\s+\d+ of \d+: (?P<stage>.*)$")
"""A stage line of `python -m export` on stderr."""


@dataclass(frozen=True)
class Family:
    """A family's example checkpoint and how to make a folder of its shape."""

    example: str
    make: Callable[[Path], Path]
    """Writes the folder the exporter reads as `model` under the given directory and returns it."""
    parameters: dict[str, str] = field(default_factory=dict)
    """The requests' parameters (jina-embeddings-v3: the task whose adapter runs)."""


@dataclass
class StageFigures:
    """One export stage: how long it took and the exporter's resident memory while it ran."""

    stage: str
    seconds: float
    start_rss_mb: float
    """VmRSS at the stage's first sample: what the stages before it left held."""
    peak_rss_mb: float
    """The largest VmRSS sampled during the stage (a spike shorter than RSS_SAMPLE_S can be missed)."""


@dataclass
class ExportFigures:
    """One export's time and memory."""

    seconds: float
    peak_rss_mb: float
    """The kernel's maximum resident set of the exporter's process (wait4's ru_maxrss): nothing is missed."""
    stages: list[StageFigures]


@dataclass
class Figures:
    """One family's measured figures."""

    example: str
    export_s: float
    export_peak_rss_mb: float
    model_mb: float
    rss_mb: float | None
    """None: not served (--export-only)."""
    texts_per_s: float | None


def _embedder(
    base: Path,
    folder: Path,
    pooling: str,
    normalize: bool,
    prompts: dict[str, str] | None,
    *,
    dense_widths: tuple[int, ...] = (),
) -> Path:
    """Transformer, Pooling, a Dense module (identity, no bias) to each of dense_widths in turn, Normalize."""
    transformer = st_models.Transformer(str(base), max_seq_length=MAX_SEQ_LENGTH)
    width = transformer.get_embedding_dimension()
    modules: list[nn.Module] = [transformer, st_models.Pooling(width, pooling_mode=pooling)]
    for out_features in dense_widths:
        modules.append(Dense(width, out_features, bias=False, activation_function=None))
        width = out_features
    modules += [st_models.Normalize()] if normalize else []
    SentenceTransformer(modules=modules, prompts=prompts).save(str(folder))
    return folder


BERT_BASE = {"vocab_size": 30528, "hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12}


def _gte(root: Path) -> Path:
    """gte-base-en-v1.5: BERT-base sizes, rotary (theta 500,000), gated GELU; CLS pooling."""
    base = root / "base"
    tiny_models.save_tokenizer("bert", base, max_length=MAX_SEQ_LENGTH)
    config = transformers.GteConfig(
        **BERT_BASE,
        intermediate_size=3072,
        max_position_embeddings=8192,
        type_vocab_size=0,
        pad_token_id=0,
        rope_parameters={"rope_type": "default", "rope_theta": 5e5},
    )
    transformers.AutoModel.from_config(config).eval().save_pretrained(str(base))
    return _embedder(base, root / "model", "cls", False, None)


def _nomic(root: Path) -> Path:
    """nomic-embed-text-v1.5: BERT-base sizes, rotary, SwiGLU; mean pooling, normalised, its prompts."""
    base = root / "base"
    tiny_models.save_tokenizer("bert", base, max_length=MAX_SEQ_LENGTH)
    config = transformers.NomicBertConfig(
        **BERT_BASE, intermediate_size=3072, max_position_embeddings=8192, type_vocab_size=2, pad_token_id=0
    )
    transformers.AutoModel.from_config(config).eval().save_pretrained(str(base))
    prompts = {"search_query": "search_query: ", "search_document": "search_document: "}
    return _embedder(base, root / "model", "mean", True, prompts)


def _deberta(root: Path) -> Path:
    """mxbai-rerank-base-v1 (DeBERTa-v3-base): relative attention, 256 buckets; a one-label CrossEncoder."""
    base = root / "base"
    tiny_models.save_tokenizer("deberta-v2", base, max_length=MAX_SEQ_LENGTH)
    config = transformers.DebertaV2Config(
        vocab_size=128100,
        hidden_size=768,
        num_hidden_layers=12,
        num_attention_heads=12,
        intermediate_size=3072,
        max_position_embeddings=512,
        relative_attention=True,
        position_buckets=256,
        norm_rel_ebd="layer_norm",
        share_att_key=True,
        pos_att_type="p2c|c2p",
        layer_norm_eps=1e-7,
        max_relative_positions=-1,
        position_biased_input=False,
        type_vocab_size=0,
        pad_token_id=0,
        num_labels=1,
        architectures=["DebertaV2ForSequenceClassification"],
    )
    transformers.DebertaV2ForSequenceClassification(config).eval().save_pretrained(str(base))
    CrossEncoder(str(base), device="cpu", max_length=MAX_SEQ_LENGTH).save(str(root / "model"))
    return root / "model"


def _qwen3(root: Path) -> Path:
    """Qwen3-Embedding-0.6B: 28 layers of 1024, 16 query and 8 key/value heads of 128; last-token pooling."""
    base = root / "base"
    tokenizer = family_tokenizers.save_qwen_tokenizer(base, max_length=MAX_SEQ_LENGTH)
    config = transformers.Qwen3Config(
        vocab_size=151669,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=32768,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    transformers.AutoModel.from_config(config).eval().save_pretrained(str(base))
    prompts = {"query": "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery:"}
    return _embedder(base, root / "model", "lasttoken", True, prompts)


def _qwen3_reranker(root: Path) -> Path:
    """Qwen3-Reranker-0.6B: Qwen3ForCausalLM, 28 layers of 1024, 16 query and 8 key/value heads of 128; yes/no.

    Sizes: Qwen3-0.6B's config.json (the reranker's base; its model card: 28 layers, 0.6B), tied embeddings,
    Qwen3-Embedding-0.6B's vocabulary of 151,669. No sentence-transformers files, as Qwen publishes it.
    """
    folder = root / "model"
    tokenizer = family_tokenizers.save_qwen_reranker_tokenizer(folder, max_length=MAX_SEQ_LENGTH)
    config = transformers.Qwen3Config(
        vocab_size=151669,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        architectures=["Qwen3ForCausalLM"],
    )
    transformers.Qwen3ForCausalLM(config).eval().save_pretrained(str(folder))
    return folder


def _eurobert(root: Path) -> Path:
    """EuroBERT-210m: 12 layers of 768, 12 heads of 64, SwiGLU 3072, rotary base 250,000; mean pooling.

    Sizes: EuroBERT/EuroBERT-210m's config.json (vocabulary 128,256, RMSNorm eps 1e-5, 8,192 positions).
    """
    base = root / "base"
    tokenizer = family_tokenizers.save_llama3_tokenizer(base, max_length=MAX_SEQ_LENGTH)
    config = transformers.EuroBertConfig(
        **BERT_BASE | {"vocab_size": 128256},
        intermediate_size=3072,
        num_key_value_heads=12,
        head_dim=64,
        max_position_embeddings=8192,
        rope_parameters={"rope_type": "default", "rope_theta": 2.5e5},
        rms_norm_eps=1e-5,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        mask_token_id=tokenizer.mask_token_id,
    )
    transformers.AutoModel.from_config(config).eval().save_pretrained(str(base))
    return _embedder(base, root / "model", "mean", False, None)


def _gemma(root: Path) -> Path:
    """embeddinggemma-300m: 24 bidirectional layers of 768, 3 query and 1 key/value heads of 256; Dense 3072, 768.

    Five sliding layers (window 512) then one full, GELU 1152, vocabulary 262,144; mean pooling, two Dense
    modules (identity, no bias), Normalize, its query and document prompts (its other task prompts do not
    change the graph). Sizes: config.json as its fine-tunes republish it (acradin/DK_embedding, Etherll/test;
    google's own folder is gated); the window 512 as llama.cpp's converter reads it (ggml-org/llama.cpp#15867).
    """
    base = root / "base"
    tokenizer = family_tokenizers.save_gemma_tokenizer(base, max_length=MAX_SEQ_LENGTH)
    config = transformers.Gemma3TextConfig(
        vocab_size=262144,
        hidden_size=768,
        intermediate_size=1152,
        num_hidden_layers=24,
        num_attention_heads=3,
        num_key_value_heads=1,
        head_dim=256,
        query_pre_attn_scalar=256,
        sliding_window=512,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        },
        use_bidirectional_attention=True,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    transformers.AutoModel.from_config(config).eval().save_pretrained(str(base))
    prompts = {"query": "task: search result | query: ", "document": "title: none | text: "}
    return _embedder(base, root / "model", "mean", True, prompts, dense_widths=(3072, 768))


JINA_PROMPTS = {
    "retrieval.query": "Represent the query for retrieving evidence documents: ",
    "retrieval.passage": "Represent the document for retrieval: ",
}
JINA_ADAPTER_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "fc1", "fc2", "word_embeddings"]
"""The modules jina-embeddings-v3-hf's LoRA adapters (rank 4, alpha 1) adapt."""


def _jina(root: Path) -> Path:
    """jina-embeddings-v3-hf: transformers' JinaEmbeddingsV3Config defaults, which are its sizes.

    XLM-R large (24 layers of 1024, 16 heads, 4096, vocabulary 250,002) with rotary positions; mean
    pooling, normalised; five PEFT task adapters of rank 4. Its requests run the retrieval.passage adapter.
    """
    from peft import LoraConfig, get_peft_model  # noqa: PLC0415  (only this family needs it)

    base = root / "base"
    tokenizer = tiny_models.save_tokenizer("xlm-roberta", base, max_length=MAX_SEQ_LENGTH)
    config = transformers.JinaEmbeddingsV3Config(pad_token_id=tokenizer.pad_token_id)
    transformers.AutoModel.from_config(config).eval().save_pretrained(str(base))
    model = _embedder(base, root / "model", "mean", True, JINA_PROMPTS)
    for task in ("retrieval_query", "retrieval_passage", "separation", "classification", "text_matching"):
        lora = LoraConfig(target_modules=JINA_ADAPTER_TARGETS, r=4, lora_alpha=1, init_lora_weights=False)
        get_peft_model(transformers.AutoModel.from_pretrained(str(model)), lora).save_pretrained(str(model / task))
    return model


FAMILIES = {
    "gte": Family("Alibaba-NLP/gte-base-en-v1.5", _gte),
    "nomic_bert": Family("nomic-ai/nomic-embed-text-v1.5", _nomic),
    "deberta-v2": Family("mixedbread-ai/mxbai-rerank-base-v1", _deberta),
    "qwen3": Family("Qwen/Qwen3-Embedding-0.6B", _qwen3),
    "qwen3-reranker": Family("Qwen/Qwen3-Reranker-0.6B", _qwen3_reranker),
    "eurobert": Family("EuroBERT/EuroBERT-210m", _eurobert),
    "gemma3_text": Family("google/embeddinggemma-300m", _gemma),
    "jina_embeddings_v3": Family("jinaai/jina-embeddings-v3-hf", _jina, {"task": "retrieval.passage"}),
}


class _StageLog:
    """The exporter's stderr, read as it comes: when each stage started, and the last lines (for a failure)."""

    def __init__(self, stream: IO[str]) -> None:
        self.started: list[tuple[str, float]] = [("start", time.perf_counter())]
        self.tail: list[str] = []
        self.thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self.thread.start()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            found = STAGE_LINE.search(line.rstrip())
            if found:
                self.started.append((found["stage"], time.perf_counter()))
            self.tail = [*self.tail[-40:], line]


def _status_mb(pid: int, field_name: str) -> float | None:
    """A memory field of /proc/PID/status in MB (VmRSS, VmHWM); None when the process is gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    found = re.search(rf"^{field_name}:\s+(\d+) kB$", text, re.MULTILINE)
    return None if found is None else int(found.group(1)) * 1024 / 1e6


def _export(source: Path, repository: Path, name: str) -> ExportFigures:
    """Run `python -m export` on a folder: its time, peak RSS and each stage's time and RSS."""
    command = [sys.executable, "-m", "export", "--source", str(source), "--repository", str(repository)]
    command += ["--name", name, "--variants", "fp32", "--threads", str(THREADS)]
    started = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    stages = _StageLog(process.stderr)
    samples: list[tuple[float, float]] = []
    while True:
        # wait4 rather than Popen.wait: it answers the child's own maximum resident set.
        pid, status, usage = os.wait4(process.pid, os.WNOHANG)
        if pid:
            break
        rss = _status_mb(process.pid, "VmRSS")
        if rss is not None:
            samples.append((time.perf_counter(), rss))
        time.sleep(RSS_SAMPLE_S)
    elapsed = time.perf_counter() - started
    process.returncode = os.waitstatus_to_exitcode(status)
    stages.thread.join()
    if process.returncode != 0:
        raise RuntimeError(f"{name}: export failed ({process.returncode}):\n{''.join(stages.tail)[-3000:]}")
    return ExportFigures(
        round(elapsed, 1), round(usage.ru_maxrss * 1024 / 1e6), _stage_figures(stages.started, samples)
    )


def _stage_figures(started: list[tuple[str, float]], samples: list[tuple[float, float]]) -> list[StageFigures]:
    """Each stage's seconds and the RSS samples taken while it ran."""
    ends = [at for _, at in started[1:]] + [samples[-1][0] if samples else started[-1][1]]
    figures = []
    for (stage, begin), end in zip(started, ends, strict=True):
        during = [rss for at, rss in samples if begin <= at <= end] or [0.0]
        figures.append(StageFigures(stage, round(end - begin, 1), round(during[0]), round(max(during))))
    return figures


def _model_bytes(repository: Path, name: str) -> int:
    graph = Path(read_model(repository / name).variants["fp32"])
    return sum(path.stat().st_size for path in graph.parent.glob(graph.name + "*"))


def _token_inputs(vocab: int, seed: int) -> list[triton.InferInput]:
    rng = np.random.default_rng(seed)
    ids = rng.integers(5, vocab, size=(ROWS, TOKENS), dtype=np.int64)
    inputs = [
        triton.InferInput("input_ids", [ROWS, TOKENS], "INT64"),
        triton.InferInput("attention_mask", [ROWS, TOKENS], "INT64"),
    ]
    inputs[0].set_data_from_numpy(ids)
    inputs[1].set_data_from_numpy(np.ones_like(ids))
    return inputs


def _serve(repository: Path, name: str, vocab: int, seconds: float, parameters: dict[str, str]) -> tuple[float, int]:
    """(texts/s, summed RSS bytes of the server's processes) for one model alone on a server."""
    arguments = ("--intra-op-threads", str(THREADS))
    with start_server(repository, repository / "server.log", *arguments) as server:
        client = triton.InferenceServerClient(server.target)
        inputs = _token_inputs(vocab, seed=0)
        for _ in range(2):
            client.infer(name, inputs, parameters=parameters)
        requests, started = 0, time.perf_counter()
        while time.perf_counter() - started < seconds:
            client.infer(name, inputs, parameters=parameters)
            requests += 1
        texts_per_s = requests * ROWS / (time.perf_counter() - started)
        pids = [server.process.pid, *children(server.process.pid)]
        rss = sum(read_rss_bytes(pid) or 0 for pid in pids)
        client.close()
    return texts_per_s, rss


def _print_stages(name: str, export: ExportFigures) -> None:
    """One export's stages as a table."""
    print(f"\n{name}: export {export.seconds} s, peak RSS {export.peak_rss_mb} MB")
    print("| stage | s | RSS at start MB | peak RSS MB |")
    print("| --- | --- | --- | --- |")
    for stage in export.stages:
        print(f"| {stage.stage} | {stage.seconds} | {stage.start_rss_mb} | {stage.peak_rss_mb} |")


def measure(name: str, family: Family, work: Path, seconds: float | None, reuse: str) -> Figures:
    """Make, export and serve one family; its figures.

    `reuse`: "exports" serves a repository an earlier run exported under `work`, with the export figures it
    recorded; "sources" exports the folder an earlier run made there again; "": makes the folder anew.
    `seconds` None: the export only, no server.
    """
    repository = work / "repositories" / name
    recorded = repository / "export.json"
    source = work / "sources" / name / "model"
    if reuse == "exports" and recorded.exists():
        export = json.loads(recorded.read_text())
        export = ExportFigures(**export | {"stages": [StageFigures(**stage) for stage in export["stages"]]})
    else:
        if not (reuse == "sources" and source.is_dir()):
            torch.manual_seed(0)
            source = family.make(work / "sources" / name)
        export = _export(source, repository, name)
        recorded.write_text(json.dumps(asdict(export)) + "\n")
        _print_stages(name, export)
    texts_per_s, rss = None, None
    if seconds is not None:
        vocab = min(len(transformers.AutoTokenizer.from_pretrained(str(source))), 400)
        texts_per_s, rss = _serve(repository, name, vocab, seconds, family.parameters)
    return Figures(
        family.example,
        export.seconds,
        export.peak_rss_mb,
        round(_model_bytes(repository, name) / 1e6, 1),
        None if rss is None else round(rss / 1e6),
        None if texts_per_s is None else round(texts_per_s, 1),
    )


def main(argv: list[str] | None = None) -> int:
    """Measure the chosen families one after another and print a table."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, required=True, help="where the folders and repositories are written")
    parser.add_argument("--families", default=",".join(FAMILIES), help=f"comma-separated, of {', '.join(FAMILIES)}")
    parser.add_argument("--seconds", type=float, default=20.0, help="how long each model is driven")
    parser.add_argument("--output", type=Path, help="also write the figures here as JSON")
    reuse = parser.add_mutually_exclusive_group()
    reuse.add_argument(
        "--reuse-exports", action="store_true", help="serve what an earlier run exported under --work (its figures)"
    )
    reuse.add_argument(
        "--reuse-sources", action="store_true", help="export again the folders an earlier run made under --work"
    )
    parser.add_argument("--export-only", action="store_true", help="measure the exports only, serve nothing")
    options = parser.parse_args(argv)
    names = [name for name in options.families.split(",") if name]
    unknown = [name for name in names if name not in FAMILIES]
    if unknown:
        parser.error(f"unknown families {unknown}; known: {', '.join(FAMILIES)}")
    reused = "exports" if options.reuse_exports else "sources" if options.reuse_sources else ""
    seconds = None if options.export_only else options.seconds
    figures = {}
    for name in names:
        figures[name] = asdict(measure(name, FAMILIES[name], options.work, seconds, reused))
        print(name, json.dumps(figures[name]), flush=True)
    columns = "export s | export peak RSS MB | model MB | RSS served MB"
    print(f"\n| family | example | {columns} | texts/s at {ROWS}x{TOKENS} |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, row in figures.items():
        cells = [name, *("-" if value is None else str(value) for value in row.values())]
        print("| " + " | ".join(cells) + " |")
    if options.output:
        options.output.parent.mkdir(parents=True, exist_ok=True)
        options.output.write_text(json.dumps(figures, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
