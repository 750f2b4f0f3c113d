"""Int8 quantisation of an exported encoder for the CPU: activation smoothing + dynamic int8.

Plain dynamic int8 loses accuracy on BERT-style encoders for two reasons: a few outlier weights
in the feed-forward output projections (fixed by per-channel weight scales), and a few outlier
channels in the activations (LayerNorm outputs, GELU outputs), which one per-tensor activation
scale cannot resolve. Smoothing (SmoothQuant, Xiao et al. 2023) moves that range from the
activation into the weights: for every group of weight-consuming nodes sharing an input x,
x' = x / s is computed by one inserted Mul and each weight row j is multiplied by s_j, where
s_j = max|x_j|^alpha / max|W_j|^(1 - alpha), with max|x_j| measured on the calibration feeds.
The product is unchanged in exact arithmetic; only the quantisation error moves.

Smoothing leaves one or two channels of each feed-forward output projection's input (the GELU
output) far wider than the rest (4.7 against a median of 0.06 in all-MiniLM-L6-v2's first layer),
and with one range per tensor those few channels set the step for every other one; short inputs,
whose few tokens share that range, lose most. So (as in LLM.int8(), Dettmers et al. 2022) the
OUTLIER_CHANNELS widest of them on the calibration feeds are taken out of the int8 product and
multiplied in fp32 beside it: y = (x * keep) W_keep + x[..., outliers] W[outliers], a few hundredths
of a percent of the work. The embedding tables stay fp32: a per-tensor uint8 table costs every
token some accuracy and saves no time.

Weights are int8 (uint8 x int8 products) where the CPU sums those products exactly: with VNNI or
AMX on x86, and on other architectures. An x86 CPU with AVX2 but neither sums pairs of them into
saturating 16-bit integers (255 x 127 x 2 > 32767), which lost accuracy on an AVX2-only EPYC (cosine
0.985 to the model on gate sentences); there weights are uint8 (uint8 x uint8 products, which its
kernels widen first): 0.9975 there.
"""

from __future__ import annotations

import logging
import platform
import tempfile
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import numpy_helper
from onnxruntime.quantization import QuantType, quantize_dynamic

from export.graph.onnx_export import save_onnx, too_large_for_one_file

log = logging.getLogger(__name__)

# Operators whose input 1 is a constant weight [in_features, out_features] applied to input 0:
# plain MatMul (unfused graph) and ONNX Runtime's fused Attention (packed QKV weight).
WEIGHT_CONSUMERS = ("MatMul", "Attention")
SMOOTHING_ALPHA = 0.7
"""Share of each channel's range moved into the weights; chosen on calibration.txt (0.6-0.9 tried)."""
INTEGER_OPERATORS = ("MatMulInteger", "DynamicQuantizeMatMul", "QAttention", "QEmbedLayerNormalization")
QUANTIZED_OPERATORS = ("MatMul", "Attention")
"""Operator types quantised; embedding lookups (Gather, EmbedLayerNormalization) stay fp32."""
OUTLIER_CHANNELS = 2
"""Input channels of each feed-forward output projection multiplied in fp32 (1-4 measured; 2 meets the bars)."""


EXACT_INT8_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")
"""x86 CPU flags (/proc/cpuinfo) of the instructions that sum uint8 x int8 products in 32-bit integers."""


def weight_type(cpu_flags: frozenset[str] | None = None) -> tuple[QuantType, str]:
    """The weight type whose products this CPU sums exactly, and why (cpu_flags: /proc/cpuinfo's, read if None)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return QuantType.QInt8, f"int8: {platform.machine()} sums uint8 x int8 products exactly"
    flags = _cpu_flags() if cpu_flags is None else cpu_flags
    exact = sorted(flags.intersection(EXACT_INT8_FLAGS))
    if exact or "avx2" not in flags:
        return QuantType.QInt8, f"int8: this CPU sums uint8 x int8 products exactly ({', '.join(exact) or 'no AVX2'})"
    return QuantType.QUInt8, "uint8: this CPU has AVX2 without VNNI or AMX, whose uint8 x int8 sums saturate"


def _cpu_flags() -> frozenset[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


@dataclass(frozen=True)
class SmoothingGroup:
    """Nodes sharing one activation input, each with a constant weight to absorb the scales."""

    activation: str
    """Name of the shared fp32 input tensor."""
    nodes: tuple[onnx.NodeProto, ...]
    weights: tuple[str, ...]
    """Initializer names, one per node, each [in_features, out_features]."""


def _weight_groups(model: onnx.ModelProto) -> list[SmoothingGroup]:
    """Group the constant-weight MatMul/Attention nodes by the activation they read."""
    initializers = {tensor.name: tensor for tensor in model.graph.initializer}
    by_activation: dict[str, list[tuple[onnx.NodeProto, str]]] = {}
    for node in model.graph.node:
        if node.op_type not in WEIGHT_CONSUMERS or len(node.input) < 2:
            continue
        weight = initializers.get(node.input[1])
        if weight is None or len(weight.dims) != 2 or node.input[0] in initializers:
            continue
        by_activation.setdefault(node.input[0], []).append((node, node.input[1]))
    weight_uses: dict[str, int] = {}
    for node in model.graph.node:
        for name in node.input:
            weight_uses[name] = weight_uses.get(name, 0) + 1
    groups = []
    for activation, members in by_activation.items():
        # A weight shared with any other node cannot be rescaled for this group alone.
        if all(weight_uses[weight] == 1 for _, weight in members):
            groups.append(
                SmoothingGroup(
                    activation,
                    tuple(node for node, _ in members),
                    tuple(weight for _, weight in members),
                )
            )
    return groups


def _activation_absmax(
    model: onnx.ModelProto, names: Sequence[str], calibration: Sequence[dict[str, np.ndarray]]
) -> dict[str, np.ndarray]:
    """Per-channel (last axis) max |x| of the named tensors over every calibration feed."""
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    existing = {output.name for output in probe.graph.output}
    for name in names:
        if name not in existing:
            probe.graph.output.append(onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None))
    options = ort.SessionOptions()
    options.log_severity_level = 3
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "probe.onnx"
        save_onnx(probe, path)
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    input_names = {graph_input.name for graph_input in session.get_inputs()}
    absmax: dict[str, np.ndarray] = {}
    for feed in calibration:
        outputs = session.run(list(names), {k: v for k, v in feed.items() if k in input_names})
        for name, value in zip(names, outputs, strict=True):
            # Padded positions count: served batches are padded too, and their activations share
            # the per-tensor range with the real tokens (leaving them out costs accuracy on batches).
            channel_max = np.abs(value.reshape(-1, value.shape[-1])).max(axis=0)
            absmax[name] = np.maximum(absmax[name], channel_max) if name in absmax else channel_max
    return absmax


def _smoothing_scale(activation_absmax: np.ndarray, weight_absmax: np.ndarray, alpha: float) -> np.ndarray:
    """s_j = max|x_j|^alpha / max|W_j|^(1 - alpha); 1 for a channel that was zero in calibration.

    Without that exception a channel never seen active would get a tiny s, and any value it
    carries at serving time would be multiplied by 1/s and swamp the per-tensor range.
    """
    active = (activation_absmax > 0) & (weight_absmax > 0)
    safe_activation = np.where(active, activation_absmax, 1.0)
    safe_weight = np.where(active, weight_absmax, 1.0)
    return (np.power(safe_activation, alpha) / np.power(safe_weight, 1.0 - alpha)).astype(np.float32)


def _down_projections(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """The feed-forward output projections: constant-weight MatMuls that narrow their input.

    In an encoder only the feed-forward output projection (ffn_dim -> d_model) has an [in, out]
    weight with in > out. A weight another node also reads is left alone.
    """
    initializers = {tensor.name: tensor for tensor in model.graph.initializer}
    uses = Counter(name for node in model.graph.node for name in node.input)
    projections = []
    for node in model.graph.node:
        weight = initializers.get(node.input[1]) if node.op_type == "MatMul" and len(node.input) > 1 else None
        if weight is not None and len(weight.dims) == 2 and weight.dims[0] > weight.dims[1] and uses[weight.name] == 1:
            projections.append(node)
    return projections


def split_outlier_channels(
    model: onnx.ModelProto, calibration: Sequence[dict[str, np.ndarray]], channels: int = OUTLIER_CHANNELS
) -> list[str]:
    """Move the widest input channels of each feed-forward output projection to an fp32 side product, in place.

    y = x W becomes (x * keep) W_keep + Gather(x, outliers) W[outliers], where keep is 0 on the
    outlier channels and W_keep is W with those rows zeroed: the same product in exact
    arithmetic, but the int8 product no longer sees the outliers' range. Returns the names of the
    side MatMuls, which must stay fp32.
    """
    projections = _down_projections(model)
    if not projections:
        return []
    absmax = _activation_absmax(model, [node.input[0] for node in projections], calibration)
    initializers = {tensor.name: tensor for tensor in model.graph.initializer}
    added: dict[int, tuple[list[onnx.NodeProto], onnx.NodeProto]] = {}
    side_products = []
    for index, node in enumerate(projections):
        activation, weight_name = node.input[0], node.input[1]
        outliers = np.sort(np.argsort(absmax[activation])[-channels:]).astype(np.int64)
        weight = numpy_helper.to_array(initializers[weight_name])
        keep = np.ones(weight.shape[0], dtype=weight.dtype)
        keep[outliers] = 0
        prefix = f"outlier_{index}"
        model.graph.initializer.extend(
            [
                numpy_helper.from_array(outliers, f"{prefix}_channels"),
                numpy_helper.from_array(weight[outliers], f"{prefix}_weight"),
                numpy_helper.from_array(keep, f"{prefix}_keep"),
            ]
        )
        initializers[weight_name].CopyFrom(numpy_helper.from_array(weight * keep[:, None], weight_name))
        before = [
            onnx.helper.make_node(
                "Gather", [activation, f"{prefix}_channels"], [f"{prefix}_input"], name=f"{prefix}_Gather", axis=-1
            ),
            onnx.helper.make_node(
                "MatMul", [f"{prefix}_input", f"{prefix}_weight"], [f"{prefix}_product"], name=f"{prefix}_MatMul"
            ),
            onnx.helper.make_node("Mul", [activation, f"{prefix}_keep"], [f"{prefix}_kept"], name=f"{prefix}_Mul"),
        ]
        output = node.output[0]
        node.input[0], node.output[0] = f"{prefix}_kept", f"{prefix}_int8_product"
        after = onnx.helper.make_node("Add", [node.output[0], f"{prefix}_product"], [output], name=f"{prefix}_Add")
        added[id(node)] = (before, after)
        side_products.append(f"{prefix}_MatMul")
    ordered = []
    for node in model.graph.node:
        before, after = added.get(id(node), ([], None))
        ordered += [*before, node] if after is None else [*before, node, after]
    del model.graph.node[:]
    model.graph.node.extend(ordered)
    return side_products


def smooth_activations(model: onnx.ModelProto, calibration: Sequence[dict[str, np.ndarray]], alpha: float) -> int:
    """Insert x / s before every weight group and fold s into the weights, in place; returns groups smoothed."""
    groups = _weight_groups(model)
    if not groups:
        return 0
    absmax = _activation_absmax(model, [group.activation for group in groups], calibration)
    initializers = {tensor.name: tensor for tensor in model.graph.initializer}
    position = {id(node): index for index, node in enumerate(model.graph.node)}
    inserted_before: dict[int, onnx.NodeProto] = {}
    for index, group in enumerate(groups):
        weights = {name: numpy_helper.to_array(initializers[name]) for name in group.weights}
        weight_absmax = np.max([np.abs(w).max(axis=1) for w in weights.values()], axis=0)
        scale = _smoothing_scale(absmax[group.activation], weight_absmax, alpha)
        for name, weight in weights.items():
            initializers[name].CopyFrom(numpy_helper.from_array(weight * scale[:, None], name))
        inverse_name = f"smoothing_{index}_inverse_scale"
        smoothed_name = f"{group.activation}_smoothed"
        model.graph.initializer.append(numpy_helper.from_array(1.0 / scale, inverse_name))
        multiply = onnx.helper.make_node(
            "Mul", [group.activation, inverse_name], [smoothed_name], name=f"smoothing_{index}_Mul"
        )
        for node in group.nodes:
            node.input[0] = smoothed_name
        inserted_before[min(position[id(node)] for node in group.nodes)] = multiply
    ordered = []
    for index, node in enumerate(model.graph.node):
        if index in inserted_before:
            ordered.append(inserted_before[index])
        ordered.append(node)
    del model.graph.node[:]
    model.graph.node.extend(ordered)
    return len(groups)


def quantize_int8(fp32_model: Path, output: Path, calibration: Sequence[dict[str, np.ndarray]]) -> dict[str, object]:
    """Write an int8 version of an fp32 encoder graph (fused or unfused) and describe the recipe.

    calibration holds feeds (input name -> int64 [batch, seq]); they set the smoothing scales and
    pick the outlier channels only, since the quantisation ranges of activations are computed at run time.
    """
    if not calibration:
        raise ValueError("quantize_int8 needs at least one calibration feed")
    model = onnx.load(str(fp32_model))
    smoothed_groups = smooth_activations(model, calibration, SMOOTHING_ALPHA)
    kept_fp32 = split_outlier_channels(model, calibration)
    large = too_large_for_one_file(model)
    weights, weights_reason = weight_type()
    with tempfile.TemporaryDirectory() as folder:
        smoothed = Path(folder) / "smoothed.onnx"
        save_onnx(model, smoothed)
        quantize_dynamic(
            smoothed,
            output,
            per_channel=True,
            reduce_range=False,
            weight_type=weights,
            op_types_to_quantize=list(QUANTIZED_OPERATORS),
            nodes_to_exclude=kept_fp32,
            use_external_data_format=large,
            # Fused graphs contain contrib ops whose output types the quantiser cannot infer.
            extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT},
        )
    operators = Counter(node.op_type for node in onnx.load(str(output), load_external_data=False).graph.node)
    int8_operators = {op: operators[op] for op in INTEGER_OPERATORS if operators[op]}
    log.info("quantised %s -> %s (%d smoothed groups, %s)", fp32_model, output, smoothed_groups, int8_operators)
    return {
        "recipe": "smoothquant+outlier-split+dynamic",
        "tool": f"onnxruntime.quantization.quantize_dynamic {ort.__version__}",
        "weights": f"{weights_reason}; per output channel",
        "activations": "uint8, asymmetric, per tensor, range computed at run time",
        "reduce_range": False,
        "smoothing_alpha": SMOOTHING_ALPHA,
        "smoothed_groups": smoothed_groups,
        "outlier_channels": OUTLIER_CHANNELS,
        "calibration_use": "per-channel activation maxima for the smoothing scales and the outlier channels",
        "calibration_batches": len(calibration),
        "calibration_sequences": int(sum(next(iter(feed.values())).shape[0] for feed in calibration)),
        "quantized_operators": list(QUANTIZED_OPERATORS),
        "nodes_kept_fp32": kept_fp32,
        "int8_operators": int8_operators,
    }
