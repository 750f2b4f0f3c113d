"""Checkpoint -> ONNX -> per-provider variants -> parity gate -> model repository.

Every graph form that is measured is gated too: a CPU candidate that misses its variant's
tolerance (on any mask shape) is never eligible, and a variant with no passing form refuses the
whole export, except fp16: CUDA's alternative to fp32, a refused fp16 is withdrawn (not published,
the reason in parity.json) and fp32 serves CUDA. What a user of the server gets (texts in,
`embedding` out) is measured for every published variant and decides the default on CUDA (the
fidelity rule, service.core.fidelity).
Every published variant is also held to the library that made the source folder, run on that
folder (export.gate.references.library; FlagEmbedding for bge-m3's three outputs, export.gate.references.bge_m3):
the other gates compare with our own reading of the folder.

Memory: what needs PyTorch runs first and one model at a time (the libraries answer and are let go, then our
model is built, exported, answers every reference and is let go), and ONNX Runtime sessions come after, one
graph at a time, each closed when its checks are done (docs/benchmarks.md, "An export's memory").
"""

from __future__ import annotations

import dataclasses
import datetime
import gc
import logging
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnxruntime as ort
from torch import nn

from export.checkpoints import library_tokenizer
from export.checkpoints.checkpoint import Checkpoint
from export.families.registry import family_of
from export.gate import cases, parity
from export.gate.parity import GateRefused
from export.gate.references.published import (
    LibraryAnswers,
    LibraryVerdicts,
    ModelVerdict,
    library_answers,
    model_verdicts,
)
from export.gate.served import ServedPath, embed_each, fidelity_reference
from export.gate.verdicts import VariantGate, load_check_figures, preferred_variants
from export.graph import forms as optimize
from export.graph.calibration import calibration_feeds, calibration_ranges
from export.graph.onnx_export import OPSET, export_onnx, input_names
from export.graph.quantize import quantize_int8
from export.graph.timing import compare_throughput, cpu_session, fp16_session, token_feed
from export.heads.head import LibraryStep
from export.publish import ServingDefaults, build_config, publish
from export.tower_build import export_towers
from export.tower_build import planned_stages as planned_tower_stages
from service.core.repository import VARIANT_FILES
from service.core.runtime import CUDA
from service.pipeline.tokenizer import TextTokenizer

VARIANTS = tuple(VARIANT_FILES)
"""Every variant: fp32 (always built), int8 (CPU), fp16 (CUDA)."""
CALIBRATION_FILE = Path(__file__).resolve().parent / "data" / "calibration.txt"
SPEEDUP_SHAPE = (8, 128)

log = logging.getLogger(__name__)

Stage = Callable[[str], None]
"""Called with the name of each export stage as it starts (a progress display)."""


@dataclass(frozen=True)
class ExportOptions:
    """What to build and how strictly to check it."""

    variants: tuple[str, ...] = VARIANTS
    threads: int = 2
    """Intra-op threads for the measurements that choose graph forms."""
    int8_min_speedup: float = 1.6
    """int8 is published only if at least this much faster than fp32 at 8 x 128 on the CPU."""
    serving: ServingDefaults = field(default_factory=ServingDefaults)
    sentences: Path = cases.SENTENCES_FILE
    calibration: Path = CALIBRATION_FILE
    """Texts the int8 graph's activations are calibrated on."""
    embedding_calibration: Path = cases.SENTENCES_FILE
    """Texts the embedding's ranges (int8/uint8 embeddings) are measured on."""
    gate_forms: str = "all"
    """all: gate every CPU graph form, then choose the fastest that passed; fastest-first: measure every form, then
    gate them fastest first and choose the first that passes (the same gate on what is published, less time)."""


def _calibration_feeds(
    checkpoint: Checkpoint, tokenizer: TextTokenizer | None, options: ExportOptions, names: list[str]
) -> list[dict[str, np.ndarray]]:
    """Calibration batches: shipped sentences through the tokenizer, right- and left-padded, or random tokens.

    Left-padded copies put padding where right-padded batches have real tokens; without them the
    int8 recipe is tuned to one mask shape (measured: left-padded cosine 0.990 against 0.996 with them).
    """
    if tokenizer is None:
        return [
            token_feed(names, 8, min(64, checkpoint.max_seq_length), checkpoint.config.vocab_size, seed=seed)
            for seed in range(4)
        ]
    sentences = cases.read_sentences(options.calibration)
    feeds = [tokenizer.encode(sentences[start : start + 16]).feed(names) for start in range(0, len(sentences), 16)]
    return feeds + [cases.left_padded(feed) for feed in feeds]


def _int8_speedup(fp32: Path, int8: Path, checkpoint: Checkpoint, names: list[str], threads: int) -> dict[str, float]:
    batch, tokens = SPEEDUP_SHAPE
    tokens = min(tokens, checkpoint.max_seq_length)
    feed = token_feed(names, batch, tokens, checkpoint.config.vocab_size)
    sessions = {
        variant: cpu_session(str(path), threads, optimize.cpu_graph_optimization(variant))
        for variant, path in (("fp32", fp32), ("int8", int8))
    }
    rates = compare_throughput(sessions, feed, rounds=5)
    return {
        "shape": f"{batch}x{tokens}",
        "fp32_sequences_per_second": round(rates["fp32"], 1),
        "int8_sequences_per_second": round(rates["int8"], 1),
        "speedup": round(rates["int8"] / rates["fp32"], 3),
    }


def _known_embeddings(references: list[parity.Reference], feeds: list[dict[str, np.ndarray]]) -> np.ndarray | None:
    """The references' embeddings of these feeds when the gate's sentence cases are exactly these batches; else None."""
    sentences = [reference for reference in references if reference.case.kind == "sentences"]
    same = len(sentences) == len(feeds) and all(
        reference.case.feed.keys() == feed.keys()
        and all(np.array_equal(reference.case.feed[name], feed[name]) for name in feed)
        for reference, feed in zip(sentences, feeds, strict=False)
    )
    return np.concatenate([reference.output for reference in sentences]) if same else None


@dataclass(frozen=True)
class _Chosen:
    """A CPU variant's chosen form, and a session on it (the gate's own, where the gate opened one for it)."""

    form: optimize.FormChoice
    session: ort.InferenceSession


class _Build:
    """One export in a scratch folder: candidates, gate verdicts and choices as they are made."""

    def __init__(self, checkpoint: Checkpoint, options: ExportOptions, workdir: Path, stage: Stage) -> None:
        self.checkpoint, self.options, self.workdir, self.stage = checkpoint, options, workdir, stage
        self.model: nn.Module | None = None
        """The PyTorch model, from build_model to release_model (the stages after it run ONNX Runtime sessions only)."""
        self.names = input_names(checkpoint.config)
        self.tokenizer = None
        if checkpoint.tokenizer_files:
            self.tokenizer = TextTokenizer(
                checkpoint.tokenizer_folder / "tokenizer.json",
                checkpoint.max_seq_length,
                checkpoint.config.pad_token_id,
                checkpoint.pair_template,
            )
        self.raw = workdir / "exported.onnx"
        self.choices: dict[str, optimize.FormChoice] = {}
        self.files: dict[str, Path] = {}
        self.recipes: dict[str, dict[str, object]] = {}
        self.refusals: list[str] = []
        self.withdrawn: dict[str, str] = {}
        """variant -> why it was left out of what is published (the export goes on without it)."""
        self.cuda_problem: str | None = None

    def build_model(self) -> nn.Module:
        """Build the PyTorch model from the checkpoint's weights."""
        self.model = self.checkpoint.build_model()
        return self.model

    def pytorch_model(self) -> nn.Module:
        """The PyTorch model (from build_model to release_model)."""
        if self.model is None:
            raise RuntimeError("the PyTorch model is used outside build_model ... release_model")
        return self.model

    def release_model(self) -> None:
        """Let the PyTorch model go before any ONNX Runtime session is built (a 0.6B model holds 2.4 GB)."""
        self.model = None
        gc.collect()

    def references(self) -> VariantGate:
        """The gate: PyTorch references for every case kind, the served path, the server's fidelity reference."""
        checkpoint, names, tokenizer, model = self.checkpoint, self.names, self.tokenizer, self.pytorch_model()
        gate_cases = cases.token_cases(names, checkpoint.config.vocab_size, checkpoint.max_seq_length)
        sentences: list = cases.read_sentences(self.options.sentences) if tokenizer is not None else []
        if checkpoint.task == "classify":  # a classifier is gated on pairs, as a reranker is asked
            sentences = cases.sentence_pairs(sentences)
        if tokenizer is not None:
            gate_cases += cases.sentence_cases(names, tokenizer, sentences)
            gate_cases += cases.sentence_mask_cases(names, tokenizer, sentences)
        references = parity.reference_outputs(model, gate_cases)
        served = None
        if tokenizer is not None and checkpoint.task == "embed":
            expected = np.concatenate([r.output for r in references if r.case.kind == "sentences"])
            served = ServedPath(
                expected,
                names,
                tokenizer,
                sentences,
                max_length=checkpoint.max_seq_length,
                pad_token_id=checkpoint.config.pad_token_id,
            )
        fidelity = fidelity_reference(model, names, tokenizer, sentences, checkpoint.max_seq_length)
        return VariantGate(references, served, fidelity, self.options.threads)

    def embedding_ranges(self, gate: VariantGate) -> tuple[dict[int, np.ndarray], dict[str, object] | None]:
        """An embedder's calibrated ranges and what they rest on (none without a tokenizer: ({}, None)).

        The gate's references answer for the calibration texts where they are the same batches (the gate
        sentences without a prompt, the default); else the PyTorch model embeds them.
        """
        if self.checkpoint.task != "embed" or self.tokenizer is None:
            return {}, None
        self.stage("embedding ranges for int8 and uint8 embeddings")
        corpus = self.options.embedding_calibration
        feeds = calibration_feeds(self.checkpoint, self.tokenizer, self.names, corpus)
        embeddings = _known_embeddings(gate.references, feeds)
        if embeddings is None:
            embeddings = embed_each(self.pytorch_model(), feeds)
        return calibration_ranges(self.checkpoint, embeddings, corpus)

    def library_answers(self) -> list[LibraryAnswers]:
        """The reference libraries' answers on the folder, each library run and let go before our model is built.

        Every published variant is held to them later, while its session is open (gate.libraries).
        """
        sentences = cases.read_sentences(self.options.sentences)
        return library_answers(self.checkpoint, self.tokenizer, self.names, sentences=sentences, stage=self.stage)

    def model_verdicts(self) -> list[ModelVerdict]:
        """The libraries the head holds the PyTorch model to (SPLADE's masked LM), on the folder."""
        sentences = cases.read_sentences(self.options.sentences)
        return model_verdicts(
            self.checkpoint, self.pytorch_model(), self.tokenizer, self.names, sentences=sentences, stage=self.stage
        )

    def cpu_variants(self, gate: VariantGate, forms: dict[str, Path]) -> None:
        """fp32 (and int8) in every CPU form; each variant's fastest form among those the gate passes."""
        candidates = {"fp32": forms}
        int8_recipes: dict[str, dict[str, object]] = {}
        if "int8" in self.options.variants:
            self.stage("int8 quantisation")
            calibration = _calibration_feeds(self.checkpoint, self.tokenizer, self.options, self.names)
            candidates["int8"] = {form: self.workdir / f"int8-{form}.onnx" for form in forms}
            for form, path in forms.items():
                int8_recipes[form] = quantize_int8(path, candidates["int8"][form], calibration)
        for variant, paths in candidates.items():
            level = optimize.cpu_graph_optimization(variant)
            if self.options.gate_forms == "fastest-first":
                chosen = self._fastest_passing(gate, variant, paths, level)
            else:
                chosen = self._fastest_of_passing(gate, variant, paths, level)
            if chosen is None:
                self.refusals += [failure for result in gate.forms[variant].values() for failure in result.failures]
                continue
            choice = chosen.form
            gate.record(variant, choice.form, chosen.session)
            self.choices[variant], self.files[variant] = choice, choice.path
            self.recipes[variant] = {
                "graph_form": choice.form,
                "graph_optimization": level,
                **int8_recipes.get(choice.form, {}),
            }

    def _fastest_of_passing(
        self, gate: VariantGate, variant: str, paths: dict[str, Path], level: str
    ) -> _Chosen | None:
        """Gate every form, then measure those that passed: the fastest is chosen (None: none passes)."""
        self.stage(f"{variant}: parity gate on every graph form")
        passing = gate.publishable(variant, paths)
        if not passing:
            return None
        if len(paths) > 1:
            measuring = "measuring graph forms" if len(passing) > 1 else "one graph form passed, none to measure"
            self.stage(f"{variant}: {measuring}")
        choice = optimize.choose_fastest(passing, self.checkpoint.config, self.names, self.options.threads, level)
        return _Chosen(choice, cpu_session(str(choice.path), self.options.threads, level))

    def _fastest_passing(self, gate: VariantGate, variant: str, paths: dict[str, Path], level: str) -> _Chosen | None:
        """Measure every form, then gate them fastest first: the first that passes is chosen (None: none passes).

        What is published is gated exactly as with every form gated; forms slower than the chosen one are
        not gated (parity.json lists the forms that were). The chosen form's session goes on to its record. A
        family with one CPU form is gated unmeasured (no figures).
        """
        figures: dict[str, dict[str, float]] = {}
        order = list(paths)
        if len(paths) > 1:
            self.stage(f"{variant}: measuring graph forms")
            figures = optimize.measure_forms(paths, self.checkpoint.config, self.names, self.options.threads, level)
            order.sort(key=lambda name: -optimize.geometric_mean(list(figures[name].values())))
        self.stage(f"{variant}: parity gate, fastest graph form first")
        gate.forms[variant] = {}
        for form in order:
            session = cpu_session(str(paths[form]), self.options.threads, level)
            if gate.passes(variant, form, session):
                return _Chosen(optimize.FormChoice(form, paths[form], figures), session)
        return None

    def withdraw(self, variant: str, reason: str) -> None:
        """Leave a built variant out of what is published, with a warning; the reason goes into parity.json."""
        log.warning("%s not published: %s", variant, reason)
        del self.files[variant]
        self.withdrawn[variant] = reason

    def fp16_variant(self, gate: VariantGate) -> None:
        """The fp16 graph for CUDA (optimize.fp16_form), gated on CUDA where usable here, else (said plainly) on CPU.

        A refused fp16 is withdrawn rather than refusing the export: CUDA serves fp16 only where it meets
        the fidelity rule, and fp32 otherwise, so fp32 serves CUDA in its place.
        """
        self.stage("fp16: build and parity gate")
        path = self.workdir / "fp16.onnx"
        optimize.write_cuda_fp16(self.raw, path, self.checkpoint.config)
        session, self.cuda_problem = fp16_session(path, self.options.threads)
        gate.record("fp16", None, session)
        self.files["fp16"] = path
        self.recipes["fp16"] = {"graph_form": optimize.fp16_form(self.checkpoint.config), "target": CUDA}
        if self.cuda_problem:
            log.warning(
                "fp16 was checked on the CPU only (CUDA cannot be used here: %s); "
                "the server checks it again on CUDA when it loads it",
                self.cuda_problem,
            )
        failures = gate.failures(["fp16"])
        if failures:
            self.withdraw("fp16", "refused by the parity gate: " + "; ".join(failures))

    def int8_speed(self) -> dict[str, object]:
        """int8 against fp32 at the reference shape; int8 is withdrawn (not published) if it misses the bar.

        int8 is an explicit, opt-in choice (fp32 is the default), so a variant that is not worth
        choosing is left out with a warning rather than failing the whole export: a timing taken on
        a busy machine must not stop the model from being published.
        """
        self.stage("int8: speed bar")
        speedup: dict[str, object] = dict(
            _int8_speedup(self.files["fp32"], self.files["int8"], self.checkpoint, self.names, self.options.threads)
        )
        bar = self.options.int8_min_speedup
        speedup["bar"] = bar
        speedup["published"] = speedup["speedup"] >= bar
        if not speedup["published"]:
            self.withdraw("int8", f"{speedup['speedup']}x fp32 at {speedup['shape']} is below the {bar}x bar")
        return speedup


def _gated_options(checkpoint: Checkpoint, options: ExportOptions) -> ExportOptions:
    """The options without the variants the checkpoint's outputs are not gated in (warned about)."""
    ungated = _ungated_variants(checkpoint)
    if ungated is not None and set(ungated[0]) & set(options.variants):
        log.warning("%s is %s", checkpoint.name, ungated[1])
        return dataclasses.replace(options, variants=tuple(v for v in options.variants if v not in ungated[0]))
    return options


def planned_stages(checkpoint: Checkpoint, options: ExportOptions) -> int:
    """How many stages export_model announces for this checkpoint and these options (when every gate passes)."""
    if family_of(checkpoint.config).towers:
        return planned_tower_stages(options)
    variants = options.variants
    ungated = _ungated_variants(checkpoint)
    if ungated is not None:
        variants = tuple(v for v in variants if v not in ungated[0])
    with_tokenizer = bool(checkpoint.tokenizer_files)
    return (
        4  # load checkpoint, export to ONNX, PyTorch references, publish
        + len(optimize.cpu_forms(checkpoint.config))
        + (1 + (len(optimize.cpu_forms(checkpoint.config)) > 1)) * len({"fp32", "int8"} & set(variants))
        # each CPU variant: gate, and measure where there are forms to choose between
        + ("int8" in variants) * 2  # quantisation, speed bar
        + ("fp16" in variants)
        + 1  # the reference library
        + sum(step.runs(with_tokenizer) for step in _head_library_steps(checkpoint))
        + (checkpoint.task == "embed" and with_tokenizer)  # embedding ranges
    )


def export_model(
    checkpoint: Checkpoint,
    repository: Path,
    options: ExportOptions,
    stage: Stage | None = None,
    scratch: Path | None = None,
) -> dict[str, object]:
    """Build every requested variant, gate it, and publish the model; return the parity report.

    stage is told each export stage as it starts (the command line shows progress with it). scratch: the
    folder the intermediate graphs are written in (a temporary folder inside it; default: the system's).
    Raises GateRefused (repository untouched) when fp32 or int8 misses its tolerance (a refused fp16 is withdrawn).
    """
    if "fp32" not in options.variants:
        raise ValueError("the fp32 variant is always built")
    stage = stage or (lambda name: log.info("export stage: %s", name))
    if family_of(checkpoint.config).towers:
        return export_towers(checkpoint, repository, options, stage, scratch)
    options = _gated_options(checkpoint, options)
    with tempfile.TemporaryDirectory(prefix="encoder-export-", dir=scratch) as workdir:
        stage("load checkpoint")
        checkpoint = library_tokenizer.with_converted_tokenizer(checkpoint, Path(workdir))
        checkpoint = library_tokenizer.with_library_tokenizer(checkpoint, Path(workdir), options.sentences)
        build = _Build(checkpoint, options, Path(workdir), stage)
        # What needs PyTorch runs first, one model at a time: the libraries' models, then ours, which is let go
        # before any ONNX Runtime session is built.
        libraries = build.library_answers()
        stage("export to ONNX")
        export_onnx(build.build_model(), build.raw)
        forms = optimize.write_cpu_forms(build.raw, build.workdir, checkpoint.config, stage)
        stage("PyTorch references")
        gate = build.references()
        ranges, calibration = build.embedding_ranges(gate)
        gate.libraries = LibraryVerdicts(libraries, build.model_verdicts())
        build.release_model()
        build.cpu_variants(gate, forms)
        if "fp16" in options.variants:
            build.fp16_variant(gate)
        failures = build.refusals + gate.failures(build.files)
        speedup = build.int8_speed() if "int8" in build.files and not failures else None
        if failures:
            raise GateRefused("parity gate refused: " + "; ".join(failures))
        report = _report(build, gate, speedup)
        preferred = preferred_variants(gate, list(build.files), build.withdrawn, build.cuda_problem)
        report["preferred_variants"] = {device: choice["variant"] for device, choice in preferred.items()}
        report["preferred_variants_basis"] = preferred
        gate.libraries.record(list(build.files), report)
        if calibration is not None:
            report["embedding_ranges"] = calibration
        stage("publish")
        config = build_config(
            checkpoint,
            build.names,
            list(build.files),
            report["preferred_variants"],
            options.serving,
            calibration=calibration,
        )
        target = publish(
            repository, checkpoint, config, build.files, parity=report, fidelity=gate.fidelity, embedding_ranges=ranges
        )
    log.info("published %s", target)
    return report


def _ungated_variants(checkpoint: Checkpoint) -> tuple[tuple[str, ...], str] | None:
    """The variants a model's outputs are not gated in (never published), and why; None: all are gated."""
    declaration = checkpoint.head_declaration
    return None if declaration is None else declaration.ungated


def _head_library_steps(checkpoint: Checkpoint) -> tuple[LibraryStep, ...]:
    """The library checks the model's head adds to the reference library's (on each variant, then on the model)."""
    declaration = checkpoint.head_declaration
    return () if declaration is None else (*declaration.references, *declaration.model_references)


def _report(build: _Build, gate: VariantGate, speedup: dict[str, float] | None) -> dict[str, object]:
    """parity.json: every figure, with the provider each one was measured on."""
    checkpoint, choices = build.checkpoint, build.choices
    return {
        "model": checkpoint.name,
        "source": str(checkpoint.folder) if checkpoint.folder else "random initialisation",
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "model_type": checkpoint.model_type,
        "task": checkpoint.task,
        "encoder": checkpoint.config.to_dict(),
        "head": None if checkpoint.head is None else checkpoint.head.to_dict(),
        "max_sequence_length": checkpoint.max_seq_length,
        "onnx": {"exporter": "torch.onnx (TorchScript)", "opset": OPSET, "attention_mask": "raw 0/1 mask"},
        "cpu_graph_forms": {
            variant: {
                "chosen": choices[variant].form,
                "threads": build.options.threads,
                "sequences_per_second": choices[variant].sequences_per_second,
                "gate": {form: result.to_dict() for form, result in gate.forms[variant].items()},
            }
            for variant in choices
        },
        "int8_speed": speedup,
        "variants": {variant: _variant_figures(build, gate, variant) for variant in build.files},
        "withdrawn": {
            variant: {"reason": reason, **_variant_figures(build, gate, variant)}
            for variant, reason in build.withdrawn.items()
        },
    }


def _variant_figures(build: _Build, gate: VariantGate, variant: str) -> dict[str, object]:
    """One variant's gate verdict, served figures, load check and recipe, as parity.json records them."""
    return {
        **gate.results[variant].to_dict(),
        "served": gate.served_figures[variant].to_dict() if variant in gate.served_figures else None,
        "load_check": load_check_figures(gate.load_checks[variant]),
        "recipe": build.recipes[variant],
    }
