"""Graph forms for each execution provider, chosen by measurement rather than assumed.

CPU: the exported graph is rewritten into a few candidate forms by ONNX Runtime's transformer
optimiser and the fastest one, measured side by side on this machine, is published (the int8
variant is chosen the same way among the quantised forms). (On some
CPUs the fused SkipLayerNormalization is slower than Add + LayerNormalization, so "fully fused"
is a candidate, not a given.) The fp32 forms are measured, gated and served at ONNX Runtime's
basic online optimisation (FP32_GRAPH_OPTIMIZATION, written into config.pbtxt): at its default
level ONNX Runtime would fuse every form's Add + LayerNormalization again, whatever was measured.
CUDA: the fully fused graph (fused attention is the fast path there) converted to fp16.
The optimiser's fusions are BERT's: a model with RMSNorm and rotary grouped-query attention (the
Qwen3 decoder, EuroBERT, Gemma) is offered its unfused graph alone (`cpu_forms`), and its fp16 form for
CUDA is that unfused graph converted to fp16 (`fp16_form`), the gate deciding whether its fp16
activations hold (a refused fp16 is withdrawn, not published: export.build).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import onnx
from onnxruntime.transformers.fusion_options import FusionOptions
from onnxruntime.transformers.onnx_model import OnnxModel
from onnxruntime.transformers.optimizer import optimize_model

from export.families.family import BERT_FUSIONS, EncoderSettings
from export.families.registry import family_of
from export.graph.onnx_export import copy_onnx, too_large_for_one_file
from export.graph.timing import compare_throughput, cpu_session, token_feed
from service.core.repository import online_optimization

log = logging.getLogger(__name__)

DECODER_FUSION_REFUSAL = (
    "ONNX Runtime's BERT fusions do not apply to RMSNorm and rotary grouped-query attention (a Qwen3 decoder,"
    " EuroBERT, Gemma): its attention fusion matches no rotary grouped-query attention, and its RMSNorm fusion writes"
    " SimplifiedLayerNormalization, an ONNX Runtime op the ONNX checker refuses"
)
FP32_GRAPH_OPTIMIZATION = "basic"
"""ONNX Runtime's online graph optimisation for the fp32 graph on the CPU: constant folding and
eliminations only, so the form chosen is the form that runs. Measured with `python -m tools.capacity_bench`'s
tiny model (d_model 32, 59 rows x 14 tokens, 1 thread): 35-36 us per row where the default level,
which turns its attention-fused form's Add + LayerNormalization into SkipLayerNormalization, took
43-44; all-MiniLM-L6-v2's in-process batch-32 ceiling 5-7% higher (`python -m tools.bench`, 2 threads)."""
# Shapes (batch, tokens) the CPU forms are compared on: a lone short request, a batch of
# short sentences, and the 8 x 128 reference shape.
CPU_MEASURE_SHAPES = ((1, 16), (32, 32), (8, 128))


@dataclass(frozen=True)
class FormChoice:
    """The CPU form picked and the throughput figures it was picked on."""

    form: str
    path: Path
    sequences_per_second: dict[str, dict[str, float]]
    """form -> "batch x tokens" -> seq/s."""


def _fusion_options(form: str) -> FusionOptions:
    options = FusionOptions("bert")
    # The optimiser's BERT default (MaskIndexEnd) turns the mask into a count of ones per row,
    # which fused Attention reads as "the first N tokens are real": wrong for left-padded rows
    # or rows with holes. The raw 0/1 mask is exact for every mask the codec accepts.
    options.use_raw_attention_mask(True)
    if form == "attention_fused":
        options.enable_skip_layer_norm = False
        options.enable_bias_skip_layer_norm = False
    return options


def _optimise(raw: Path, config: EncoderSettings, form: str, use_gpu: bool) -> OnnxModel:
    return optimize_model(
        str(raw),
        model_type="bert",
        num_heads=config.num_heads,
        hidden_size=config.d_model,
        optimization_options=_fusion_options(form),
        opt_level=0,
        use_gpu=use_gpu,
    )


def _save(model: OnnxModel, output: Path) -> None:
    """Save through the optimiser (topological sort, com.microsoft opset import) and check."""
    large = too_large_for_one_file(model.model)
    model.save_model_to_file(str(output), use_external_data_format=large)
    onnx.checker.check_model(str(output), full_check=True)


def cpu_forms(config: EncoderSettings) -> tuple[str, ...]:
    """The CPU candidate forms for an encoder, as its family declares them (the unfused graph alone: Qwen3, ...)."""
    return family_of(config).graph_forms


def fp16_form(config: EncoderSettings) -> str:
    """The graph form converted to fp16 for CUDA: the fully fused one, or the unfused one (Qwen3, EuroBERT, Gemma).

    BERT's fusions do not apply to those (DECODER_FUSION_REFUSAL).
    """
    return family_of(config).fp16_form


def write_cpu_form(raw: Path, output: Path, config: EncoderSettings, form: str) -> None:
    """Write one CPU candidate form of the exported graph."""
    if form == "unfused":
        copy_onnx(raw, output)
    else:
        _save(_optimise(raw, config, form, use_gpu=False), output)


def write_cuda_fp16(raw: Path, output: Path, config: EncoderSettings) -> None:
    """Write the fp16_form graph in fp16 with fp32/int64 inputs and outputs kept."""
    form = fp16_form(config)
    model = OnnxModel(onnx.load(str(raw))) if form == "unfused" else _optimise(raw, config, form, use_gpu=True)
    model.convert_float_to_float16(keep_io_types=True)
    _save(model, output)


def geometric_mean(values: list[float]) -> float:
    """The geometric mean: no one shape dominates the comparison."""
    product = 1.0
    for value in values:
        product *= value
    return product ** (1.0 / len(values))


def cpu_graph_optimization(variant: str) -> str:
    """The online graph optimisation a CPU variant is measured, gated and served at."""
    return online_optimization(variant, "cpu", FP32_GRAPH_OPTIMIZATION)


def write_cpu_forms(
    raw: Path, workdir: Path, config: EncoderSettings, stage: Callable[[str], None] | None = None
) -> dict[str, Path]:
    """Every CPU candidate form of the exported graph (`cpu_forms`), written into workdir (stage is told each one)."""
    forms = cpu_forms(config)
    if forms != BERT_FUSIONS:
        log.info("CPU graph forms %s only: %s", ", ".join(forms), DECODER_FUSION_REFUSAL)
    paths = {form: workdir / f"cpu-{form}.onnx" for form in forms}
    for form, path in paths.items():
        if stage is not None:
            stage(f"CPU graph form {form}")
        write_cpu_form(raw, path, config, form)
    return paths


def measure_forms(
    candidates: dict[str, Path],
    config: EncoderSettings,
    input_names: list[str],
    threads: int,
    graph_optimization: str = "all",
) -> dict[str, dict[str, float]]:
    """Each candidate graph's sequences/s on the CPU shapes, side by side: form -> "batch x tokens" -> seq/s.

    Each shape's rounds stop once their order is settled (timing.compare_seconds): the figures choose a form.
    """
    sessions = {form: cpu_session(str(path), threads, graph_optimization) for form, path in candidates.items()}
    figures: dict[str, dict[str, float]] = {form: {} for form in candidates}
    for batch, wanted_tokens in CPU_MEASURE_SHAPES:
        tokens = min(wanted_tokens, config.max_sequence_positions)
        feed = token_feed(input_names, batch, tokens, config.vocab_size)
        for form, rate in compare_throughput(sessions, feed, until_settled=True).items():
            figures[form][f"{batch}x{tokens}"] = round(rate, 1)
    return figures


def choose_fastest(
    candidates: dict[str, Path],
    config: EncoderSettings,
    input_names: list[str],
    threads: int,
    graph_optimization: str = "all",
) -> FormChoice:
    """Measure candidate graphs side by side on the CPU shapes and return the fastest (geometric mean).

    `graph_optimization`: the online optimisation the chosen graph will be served at. A sole candidate is
    chosen unmeasured (no figures): there is nothing to choose between.
    """
    if len(candidates) == 1:
        [(form, path)] = candidates.items()
        return FormChoice(form=form, path=path, sequences_per_second={})
    figures = measure_forms(candidates, config, input_names, threads, graph_optimization)
    best = max(candidates, key=lambda form: geometric_mean(list(figures[form].values())))
    log.info("graph forms (seq/s): %s; chose %s", figures, best)
    return FormChoice(form=best, path=candidates[best], sequences_per_second=figures)
