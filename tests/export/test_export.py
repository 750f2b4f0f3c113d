"""The exporter end to end: ONNX graph, repository layout, Triton config, parity gate, bad input."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from google.protobuf import text_format
from onnxruntime.transformers.fusion_options import AttentionMaskFormat, FusionOptions
from tritonclient.grpc import model_config_pb2 as triton_config

from export.build import ExportOptions, export_model
from export.checkpoints.checkpoint import load_checkpoint, random_checkpoint
from export.families import bert as model_module
from export.gate import cases, parity
from export.gate.cases import read_sentences
from export.gate.parity import GateRefused
from export.gate.served import embed_each
from export.graph import forms as optimize
from export.graph.quantize import weight_type
from service.core.fidelity import cosines
from service.core.repository import VARIANT_FILES, read_model
from service.pipeline.tokenizer import TextTokenizer
from tests.conftest import DEFAULT_MODEL, INT8_PROMISED_COSINE, TINY_CONFIG, TINY_MODEL
from tests.servers import cuda_usable

ROOT = Path(__file__).resolve().parents[2]


def run_export(*arguments: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "export", *arguments], check=False, cwd=ROOT, capture_output=True, text=True, timeout=300
    )


def tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_default_repository_layout(default_repository: Path) -> None:
    folder = default_repository / DEFAULT_MODEL
    names = {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()}
    assert {"config.pbtxt", "parity.json", "fidelity.npz", "tokenizer.json", "1/model.onnx"} <= names
    assert [p.name for p in default_repository.iterdir()] == [DEFAULT_MODEL]  # no staging left behind


def test_onnx_graph_has_dynamic_axes_and_passes_the_checker(default_repository: Path) -> None:
    path = default_repository / DEFAULT_MODEL / "1" / "model.onnx"
    onnx.checker.check_model(str(path), full_check=True)
    graph = onnx.load(str(path), load_external_data=False)
    opsets = {o.domain: o.version for o in graph.opset_import}
    assert opsets[""] >= 17
    inputs = {i.name: i for i in graph.graph.input}
    assert list(inputs) == ["input_ids", "attention_mask", "token_type_ids"]
    for tensor in inputs.values():
        assert tensor.type.tensor_type.elem_type == onnx.TensorProto.INT64
        dims = tensor.type.tensor_type.shape.dim
        assert [d.dim_param for d in dims] == ["batch", "sequence"]
    outputs = {o.name: [d.dim_param or d.dim_value for d in o.type.tensor_type.shape.dim] for o in graph.graph.output}
    assert outputs == {"last_hidden_state": ["batch", "sequence", 384], "embedding": ["batch", 384]}


def test_config_pbtxt_is_a_triton_model_config(default_repository: Path) -> None:
    text = (default_repository / DEFAULT_MODEL / "config.pbtxt").read_text()
    config = text_format.Parse(text, triton_config.ModelConfig())  # Triton's own message: strict parse
    assert config.platform == "onnxruntime_onnx"
    assert config.max_batch_size > 0
    assert [(i.name, i.data_type, list(i.dims)) for i in config.input] == [
        (name, triton_config.TYPE_INT64, [-1]) for name in ("input_ids", "attention_mask", "token_type_ids")
    ]
    outputs = {o.name: (o.data_type, list(o.dims)) for o in config.output}
    assert outputs == {
        "last_hidden_state": (triton_config.TYPE_FP32, [-1, 384]),
        "embedding": (triton_config.TYPE_FP32, [384]),
    }
    assert config.optimization.graph.level == -1  # ORT_ENABLE_BASIC in Triton's ONNX Runtime backend
    assert config.HasField("dynamic_batching")
    assert config.dynamic_batching.default_queue_policy.max_queue_size == 1024
    assert len(config.instance_group) == 1
    assert config.parameters["max_sequence_length"].string_value == "256"
    assert config.parameters["pooling"].string_value == "mean"
    assert config.parameters["tokenizer"].string_value == "tokenizer.json"


def test_parity_report_meets_every_tolerance(default_repository: Path) -> None:
    report = json.loads((default_repository / DEFAULT_MODEL / "parity.json").read_text())
    fp32 = report["variants"]["fp32"]
    assert fp32["passed"]
    for kind in ("tokens", "sentences", "sentence_masks"):
        assert fp32["cases"][kind]["max_abs_diff_last_hidden_state"] <= 1e-4
        assert fp32["cases"][kind]["min_cosine"] >= 0.99999
        assert report["variants"]["fp16"]["cases"][kind]["min_cosine"] >= 0.9999
    assert fp32["cases"]["tokens"]["rows"] == sum(b * 4 for b in (1, 2, 7, 32))
    assert fp32["tolerance"]["gated_kinds"] == ["tokens", "sentences", "sentence_masks"]
    int8 = report["variants"]["int8"]
    assert int8["cases"]["sentences"]["min_cosine"] >= INT8_PROMISED_COSINE  # the gate's own bar is 0.99
    assert int8["recipe"]["weights"] == f"{weight_type()[1]}; per output channel"
    assert set(report["int8_speed"]) == {
        "shape",
        "fp32_sequences_per_second",
        "int8_sequences_per_second",
        "speedup",
        "bar",
        "published",
    }
    assert set(report["cpu_graph_forms"]) == {"fp32", "int8"}
    for variant, forms in report["cpu_graph_forms"].items():
        assert forms["chosen"] in forms["sequences_per_second"]
        assert report["variants"][variant]["recipe"]["graph_form"] == forms["chosen"]
        assert report["variants"][variant]["recipe"]["graph_optimization"] == {"fp32": "basic", "int8": "all"}[variant]
        # Every form measured was gated, on every mask shape.
        assert set(forms["gate"]) == {"unfused", "attention_fused", "fully_fused"}
        assert all(gate["passed"] for gate in forms["gate"].values()), variant
    spec = read_model(default_repository / DEFAULT_MODEL)
    assert set(spec.variants) == set(report["variants"])
    assert spec.preferred_variants == report["preferred_variants"] == {"cpu": "fp32", "cuda": "fp16"}


def test_parity_report_says_where_each_figure_came_from(default_repository: Path) -> None:
    report = json.loads((default_repository / DEFAULT_MODEL / "parity.json").read_text())
    on_cuda = cuda_usable()
    for variant, figures in report["variants"].items():
        expected = "CUDAExecutionProvider" if variant == "fp16" and on_cuda else "CPUExecutionProvider"
        assert figures["provider"] == figures["served"]["provider"] == expected, variant
        assert figures["served"]["sentences"] == len(read_sentences())
        # The check the server runs at load passed here, on the same inputs and at the variant's own bar.
        load_check = figures["load_check"]
        assert load_check["provider"] == expected and load_check["min_cosine"] >= load_check["required"], variant
    served = {variant: figures["served"] for variant, figures in report["variants"].items()}
    assert served["fp32"]["min_cosine"] >= 0.99999 and served["fp32"]["meets_fidelity_rule"]
    assert served["fp16"]["meets_fidelity_rule"]
    assert served["int8"]["min_cosine"] >= INT8_PROMISED_COSINE
    cuda = report["preferred_variants_basis"]["cuda"]
    assert cuda["fp16_checked_on_cuda"] is on_cuda
    assert ("only, not CUDA" in cuda["basis"]) is not on_cuda


def _sentence_rows(tokenizer: TextTokenizer, names: list[str]) -> dict[str, dict[str, np.ndarray]]:
    """Real sentences right-padded, left-padded and with holes: the issue's three mask shapes."""
    batch = tokenizer.encode(["Happy new year!", "The baby finally fell asleep after an hour of rocking."])
    feed = batch.feed(names)
    return {"right-padded": feed, "left-padded": cases.left_padded(feed), "holed": cases.holed(feed)}


def _token_rows(names: list[str]) -> dict[str, dict[str, np.ndarray]]:
    """The issue's reproduction: random ids, one row left-padded, one with a hole, one right-padded."""
    rng = np.random.default_rng(0)
    mask = np.ones((3, 12), dtype=np.int64)
    mask[0, :5] = 0
    mask[1, 4:7] = 0
    mask[2, 8:] = 0
    feed = {
        "input_ids": rng.integers(1000, 5000, size=(3, 12)) * mask,
        "attention_mask": mask,
        "token_type_ids": np.zeros((3, 12), dtype=np.int64),
    }
    return {"mixed": {name: feed[name] for name in names}}


def test_every_variant_handles_every_mask_shape(default_repository: Path, default_folder: Path) -> None:
    """fp32 and fp16 equal the model on every mask shape; int8 meets its own gate (0.99) on every one.

    With the optimiser's old mask format the fused graphs read a mask as a count of ones: left-padded
    rows fell to cosine 0.06-0.14 and holed rows to 0.78-0.87. int8 measured 0.9968 / 0.9991 / 0.9986 on
    the issue's three random rows (left-padded, holed, right-padded) with its outlier-split recipe.
    """
    model = load_checkpoint(default_folder, DEFAULT_MODEL).build_model()
    spec = read_model(default_repository / DEFAULT_MODEL)
    tokenizer = TextTokenizer(spec.tokenizer_file, spec.max_sequence_length, spec.pad_token_id)
    names = list(spec.input_names)
    shapes = {**_sentence_rows(tokenizer, names), **_token_rows(names)}
    bars = {"fp32": 0.99999, "fp16": 0.9999, "int8": 0.99}
    for variant, path in spec.variants.items():
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        for shape, feed in shapes.items():
            (embedding,) = session.run(["embedding"], feed)
            expected = embed_each(model, [feed])
            worst = float(cosines(embedding, expected).min())
            assert worst >= bars[variant], f"{variant} {shape}: {worst}"


def test_every_published_variant_runs_with_dynamic_shapes(default_repository: Path) -> None:
    spec = read_model(default_repository / DEFAULT_MODEL)
    for variant, path in spec.variants.items():
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        for rows, length in ((1, 3), (5, 17)):
            feed = {
                "input_ids": np.full((rows, length), 2023, dtype=np.int64),
                "attention_mask": np.ones((rows, length), dtype=np.int64),
                "token_type_ids": np.zeros((rows, length), dtype=np.int64),
            }
            hidden, embedding = session.run(["last_hidden_state", "embedding"], feed)
            assert hidden.shape == (rows, length, 384), variant
            assert embedding.shape == (rows, 384), variant
            np.testing.assert_allclose(np.linalg.norm(embedding, axis=1), 1.0, atol=1e-3)


def test_broken_model_is_refused_and_repository_left_as_it_was(
    repository_copy: Path, default_folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An exporter that disagrees with eager PyTorch: the traced attention output is 1% off."""
    before = tree(repository_copy)
    original = model_module.MultiHeadAttention.forward

    def off_when_exporting(self, hidden, attention_bias):
        output = original(self, hidden, attention_bias)
        return output * 1.01 if torch.onnx.is_in_onnx_export() else output

    monkeypatch.setattr(model_module.MultiHeadAttention, "forward", off_when_exporting)
    checkpoint = random_checkpoint(TINY_CONFIG, TINY_MODEL, seed=1, tokenizer_folder=default_folder)
    with pytest.raises(GateRefused, match=r"fp32: .* at (tokens \d+x\d+|sentence \d+)"):
        export_model(checkpoint, repository_copy, ExportOptions(variants=("fp32",), threads=1))
    assert tree(repository_copy) == before


def test_int8_speed_bar_withdraws_a_variant_that_is_not_faster(
    tmp_path: Path, default_folder: Path, caplog: pytest.LogCaptureFixture
) -> None:
    checkpoint = random_checkpoint(TINY_CONFIG, TINY_MODEL, seed=1, tokenizer_folder=default_folder)
    options = ExportOptions(variants=("fp32", "int8"), threads=1, int8_min_speedup=100.0)
    report = export_model(checkpoint, tmp_path, options)
    assert report["int8_speed"]["published"] is False and report["int8_speed"]["bar"] == 100.0
    assert re.search(r"int8 not published: [\d.]+x fp32 at \d+x\d+ is below the 100.0x bar", caplog.text)
    spec = read_model(tmp_path / TINY_MODEL)
    assert set(spec.variants) == {"fp32"}  # the model itself is published; int8 is left out
    assert not (tmp_path / TINY_MODEL / spec.version / VARIANT_FILES["int8"]).exists()


def _old_mask_format(monkeypatch: pytest.MonkeyPatch) -> None:
    """Build fused graphs as before the fix: the optimiser's BERT default, a per-row count of ones."""
    original = optimize._fusion_options

    def mask_index(form: str) -> FusionOptions:
        options = original(form)
        options.attention_mask_format = AttentionMaskFormat.MaskIndexEnd
        return options

    monkeypatch.setattr(optimize, "_fusion_options", mask_index)


def test_graph_forms_that_mishandle_masks_are_never_published(
    repository_copy: Path, default_folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _old_mask_format(monkeypatch)
    checkpoint = random_checkpoint(TINY_CONFIG, TINY_MODEL, seed=2, tokenizer_folder=default_folder)
    report = export_model(checkpoint, repository_copy, ExportOptions(variants=("fp32",), threads=1))
    forms = report["cpu_graph_forms"]["fp32"]
    assert forms["chosen"] == "unfused"
    assert forms["sequences_per_second"] == {}  # only passing forms are candidates: the sole one is not measured
    for form in ("attention_fused", "fully_fused"):
        failures = " ".join(forms["gate"][form]["failures"])
        assert not forms["gate"][form]["passed"] and ("left-padded" in failures or "holed" in failures), form


def test_fp16_gate_withdraws_a_graph_that_mishandles_masks(
    tmp_path: Path, default_folder: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """fp16 alone is left out: the model is published in fp32, which serves CUDA, and parity.json says why."""
    _old_mask_format(monkeypatch)
    checkpoint = random_checkpoint(TINY_CONFIG, TINY_MODEL, seed=2, tokenizer_folder=default_folder)
    export_model(checkpoint, tmp_path, ExportOptions(variants=("fp32", "fp16"), threads=1))
    reason = r"refused by the parity gate: fp16: embedding cosine [\d.]+ < 0.999 at .*(left-padded|holed)"
    assert re.search("fp16 not published: " + reason, caplog.text)
    spec = read_model(tmp_path / TINY_MODEL)
    assert set(spec.variants) == {"fp32"} and spec.preferred_variants == {"cpu": "fp32", "cuda": "fp32"}
    assert not (tmp_path / TINY_MODEL / spec.version / VARIANT_FILES["fp16"]).exists()
    report = json.loads((tmp_path / TINY_MODEL / "parity.json").read_text())
    assert set(report["variants"]) == {"fp32"} and set(report["withdrawn"]) == {"fp16"}
    withdrawn = report["withdrawn"]["fp16"]
    assert not withdrawn["passed"] and re.match(reason, withdrawn["reason"])
    assert withdrawn["cases"]["sentence_masks"]["min_cosine"] < 0.999
    assert re.match("fp16 not published: " + reason, report["preferred_variants_basis"]["cuda"]["basis"])


def test_int8_accuracy_gate_refuses_to_publish(
    repository_copy: Path, default_folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bar the quantised graph cannot meet (its real bar is 0.99): every int8 form is refused."""
    before = tree(repository_copy)
    monkeypatch.setitem(parity.TOLERANCES, "int8", dataclasses.replace(parity.TOLERANCES["int8"], min_cosine=0.9999999))
    checkpoint = random_checkpoint(TINY_CONFIG, TINY_MODEL, seed=2, tokenizer_folder=default_folder)
    options = ExportOptions(variants=("fp32", "int8"), threads=1, int8_min_speedup=0.0)
    with pytest.raises(GateRefused, match=r"int8: embedding cosine [\d.]+ < 0.9999999 at sentence"):
        export_model(checkpoint, repository_copy, options)
    assert tree(repository_copy) == before


def test_re_export_replaces_the_model_atomically(repository_copy: Path, default_folder: Path) -> None:
    checkpoint = random_checkpoint(TINY_CONFIG, TINY_MODEL, seed=2, tokenizer_folder=default_folder)
    old_model = (repository_copy / TINY_MODEL / "1" / "model.onnx").read_bytes()
    export_model(checkpoint, repository_copy, ExportOptions(variants=("fp32",), threads=1))
    assert (repository_copy / TINY_MODEL / "1" / "model.onnx").read_bytes() != old_model
    assert sorted(p.name for p in repository_copy.iterdir()) == [TINY_MODEL]


def test_cli_exports_a_random_model_without_tokenizer(tmp_path: Path) -> None:
    result = run_export(
        "--repository",
        str(tmp_path),
        "--random",
        "--name",
        "random-encoder",
        "--random-config",
        '{"num_layers": 1}',
        "--variants",
        "fp32,fp16",
        "--threads",
        "1",
    )
    assert result.returncode == 0, result.stderr
    assert "published random-encoder (fp32, fp16)" in result.stdout
    assert "default on cpu: fp32" in result.stdout and "default on cuda: " in result.stdout
    stages = [line for line in result.stderr.splitlines() if line.startswith("export [")]
    assert any(line.endswith("publish") for line in stages) and len(stages) >= 8
    # Each stage says how many there are, and the count planned is the count run (the server shows it).
    assert all(f"stage {index + 1:2d} of {len(stages)}: " in line for index, line in enumerate(stages)), stages
    # Library chatter (optimiser and quantiser logs) stays out of the default output.
    assert " INFO " not in result.stderr and "onnx_model" not in result.stderr
    if not cuda_usable():
        assert "fp16 was checked on the CPU only" in result.stderr
    spec = read_model(tmp_path / "random-encoder")
    assert spec.tokenizer_file is None and spec.vocab_size == 1000


def _broken_folder(tmp_path: Path, default_folder: Path, change: str) -> Path:
    folder = tmp_path / "checkpoint"
    shutil.copytree(default_folder, folder, ignore=shutil.ignore_patterns("model.safetensors"))
    (folder / "model.safetensors").symlink_to(default_folder / "model.safetensors")
    config = json.loads((folder / "config.json").read_text())
    if change == "malformed":
        (folder / "config.json").write_text("{not json")
        return folder
    if change == "no_config":
        (folder / "config.json").unlink()
        return folder
    if change == "no_weights":
        (folder / "model.safetensors").unlink()
        return folder
    if change == "t5":
        config["model_type"] = "t5"
    if change == "heads":
        config["num_attention_heads"] = 7
    if change == "layers":
        config["num_hidden_layers"] = 7
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("missing", "not a directory"),
        ("no_config", "no config.json"),
        ("malformed", "malformed JSON"),
        ("no_weights", "no model.safetensors or pytorch_model.bin"),
        (
            "t5",
            "unsupported architecture 't5' (supported: bert, roberta, xlm-roberta, distilbert, mpnet, modernbert,",
        ),
        ("heads", "d_model 384 is not divisible by num_heads 7"),
        ("layers", "weights missing for layers.6"),
    ],
)
def test_bad_checkpoint_is_one_line_and_writes_nothing(
    tmp_path: Path, default_folder: Path, change: str, message: str
) -> None:
    source = tmp_path / "nowhere" if change == "missing" else _broken_folder(tmp_path, default_folder, change)
    repository = tmp_path / "repository"
    result = run_export("--repository", str(repository), "--source", str(source))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("export: error:") and message in lines[0], result.stderr
    assert not repository.exists()
