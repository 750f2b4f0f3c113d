"""Checkpoint -> ONNX -> per-provider variants -> parity gate -> model repository."""

from __future__ import annotations

import datetime
import logging
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnxruntime as ort

from export import optimize, parity
from export.checkpoint import Checkpoint
from export.onnx_export import OPSET, export_onnx, input_names
from export.publish import ServingDefaults, build_config, publish
from export.quantize import quantize_int8
from export.timing import compare_throughput, cpu_session, token_feed
from service.runtime import CPU, CUDA, ExecutionSettings, cuda_provider_options, session_options
from service.tokenizer import TextTokenizer

VARIANTS = ("fp32", "int8", "fp16")
CALIBRATION_FILE = Path(__file__).resolve().parent / "data" / "calibration.txt"
SPEEDUP_SHAPE = (8, 128)

log = logging.getLogger(__name__)


class GateRefused(RuntimeError):
    """A variant failed the parity gate (or its speed bar); nothing was published."""


@dataclass(frozen=True)
class ExportOptions:
    """What to build and how strictly to check it."""

    variants: tuple[str, ...] = VARIANTS
    threads: int = 2
    """Intra-op threads for the measurements that choose graph forms."""
    int8_min_speedup: float = 1.6
    """int8 is published only if at least this much faster than fp32 at 8 x 128 on the CPU."""
    serving: ServingDefaults = field(default_factory=ServingDefaults)
    sentences: Path = parity.SENTENCES_FILE
    calibration: Path = CALIBRATION_FILE


def _gate_session(path: Path, variant: str, threads: int) -> ort.InferenceSession:
    """fp16 is checked on CUDA where it can run, everything else (and fp16 without a GPU) on CPU."""
    settings = ExecutionSettings(intra_op_threads=threads)
    providers: list = [CPU]
    if variant == "fp16" and CUDA in ort.get_available_providers():
        providers = [(CUDA, cuda_provider_options(settings)), CPU]
    return ort.InferenceSession(str(path), session_options(settings), providers=providers)


def _calibration_feeds(
    checkpoint: Checkpoint, tokenizer: TextTokenizer | None, options: ExportOptions, names: list[str]
) -> list[dict[str, np.ndarray]]:
    """Calibration batches: shipped sentences through the tokenizer, or random tokens without one."""
    if tokenizer is None:
        return [
            token_feed(names, 8, min(64, checkpoint.max_seq_length), checkpoint.config.vocab_size, seed=seed)
            for seed in range(4)
        ]
    sentences = parity.read_sentences(options.calibration)
    return [tokenizer.encode(sentences[start : start + 16]).feed(names) for start in range(0, len(sentences), 16)]


def _int8_speedup(fp32: Path, int8: Path, checkpoint: Checkpoint, names: list[str], threads: int) -> dict[str, float]:
    batch, tokens = SPEEDUP_SHAPE
    tokens = min(tokens, checkpoint.max_seq_length)
    feed = token_feed(names, batch, tokens, checkpoint.config.vocab_size)
    sessions = {"fp32": cpu_session(str(fp32), threads), "int8": cpu_session(str(int8), threads)}
    rates = compare_throughput(sessions, feed, rounds=5)
    return {
        "shape": f"{batch}x{tokens}",
        "fp32_sequences_per_second": round(rates["fp32"], 1),
        "int8_sequences_per_second": round(rates["int8"], 1),
        "speedup": round(rates["int8"] / rates["fp32"], 3),
    }


def export_model(checkpoint: Checkpoint, repository: Path, options: ExportOptions) -> dict[str, object]:
    """Build every requested variant, gate it, and publish the model; return the parity report.

    Raises GateRefused (repository untouched) when any variant misses its tolerance.
    """
    if "fp32" not in options.variants:
        raise ValueError("the fp32 variant is always built")
    model = checkpoint.build_model()
    names = input_names(model)
    tokenizer = None
    if checkpoint.tokenizer_files:
        tokenizer = TextTokenizer(
            checkpoint.tokenizer_folder / "tokenizer.json", checkpoint.max_seq_length, checkpoint.config.pad_token_id
        )
    with tempfile.TemporaryDirectory(prefix="encoder-export-") as scratch:
        workdir = Path(scratch)
        raw = workdir / "exported.onnx"
        export_onnx(model, raw)
        forms = optimize.write_cpu_forms(raw, workdir, checkpoint.config)
        choices = {"fp32": optimize.choose_fastest(forms, checkpoint.config, names, options.threads)}
        recipes: dict[str, object] = {"fp32": {"graph_form": choices["fp32"].form}}
        if "int8" in options.variants:
            calibration = _calibration_feeds(checkpoint, tokenizer, options, names)
            quantised = {form: workdir / f"int8-{form}.onnx" for form in forms}
            int8_recipes = {form: quantize_int8(path, quantised[form], calibration) for form, path in forms.items()}
            choices["int8"] = optimize.choose_fastest(quantised, checkpoint.config, names, options.threads)
            recipes["int8"] = {"graph_form": choices["int8"].form, **int8_recipes[choices["int8"].form]}
        files = {variant: choice.path for variant, choice in choices.items()}
        if "fp16" in options.variants:
            files["fp16"] = workdir / "fp16.onnx"
            optimize.write_cuda_fp16(raw, files["fp16"], checkpoint.config)
            recipes["fp16"] = {"graph_form": "fully_fused", "target": "CUDAExecutionProvider"}

        cases = parity.token_cases(names, checkpoint.config.vocab_size, checkpoint.max_seq_length)
        if tokenizer is not None:
            cases += parity.sentence_cases(names, tokenizer, parity.read_sentences(options.sentences))
        references = parity.reference_outputs(model, cases)
        results = {
            variant: parity.check_variant(variant, _gate_session(path, variant, options.threads), references)
            for variant, path in files.items()
        }
        failures = [failure for result in results.values() for failure in result.failures]
        speedup = None
        if "int8" in files:
            speedup = _int8_speedup(files["fp32"], files["int8"], checkpoint, names, options.threads)
            if speedup["speedup"] < options.int8_min_speedup:
                failures.append(
                    f"int8: {speedup['speedup']}x fp32 at {speedup['shape']} "
                    f"is below the {options.int8_min_speedup}x bar"
                )
        report = {
            "model": checkpoint.name,
            "source": str(checkpoint.folder) if checkpoint.folder else "random initialisation",
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "encoder": checkpoint.config.to_dict(),
            "max_sequence_length": checkpoint.max_seq_length,
            "onnx": {"exporter": "torch.onnx (TorchScript)", "opset": OPSET},
            "cpu_graph_forms": {
                variant: {
                    "chosen": choice.form,
                    "threads": options.threads,
                    "sequences_per_second": choice.sequences_per_second,
                }
                for variant, choice in choices.items()
            },
            "int8_speed": speedup,
            "variants": {v: {**results[v].to_dict(), "recipe": recipes[v]} for v in files},
        }
        if failures:
            raise GateRefused("parity gate refused: " + "; ".join(failures))
        preferred = {"cpu": "int8" if "int8" in files else "fp32", "cuda": "fp16" if "fp16" in files else "fp32"}
        report["preferred_variants"] = preferred
        config = build_config(checkpoint, names, list(files), preferred, options.serving)
        target = publish(repository, checkpoint, config, files, report)
    log.info("published %s", target)
    return report
