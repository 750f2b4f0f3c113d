"""Served images/s at 8 in flight against an in-process ceiling, at a CLIP model's size (issue 48's target).

    python -m tools.image_bench --work DIR [--shape vit-b-32] [--threads 2] [--workers 1] [--in-flight 8]
        [--image-size 640x480] [--rounds 2] [--seconds 10] [--output FILE.json]

1. A CLIPModel folder with random weights (transformers' own initialisation, seeded), made as
   tests.export.two_tower_folders makes its tiny one: its tokenizer and openai/clip-vit-base-patch32's
   preprocessor_config.json. `--shape vit-b-32`: both towers at ViT-B/32's size (transformers'
   CLIPConfig defaults: 224-pixel images in 32-pixel patches, 12 layers of 768, projection 512; the
   text tower 12 layers of 512, its positions the small tokenizer's); `--shape tiny`: the tests' tiny
   CLIP. Exported fp32 (`python -m export --variants fp32`, the parity gate included) into
   DIR/repository, once: a later run reuses it.
2. One photo-like JPEG of --image-size (smooth gradients and shapes, as a camera's picture compresses;
   noise would cost the decoder more than a photo does).
3. In this process (the ceiling): batches of --in-flight copies of the image decoded and preprocessed
   (service.pipeline.images, as the server does it) by --workers threads while ONNX Runtime runs the
   batch before on --threads threads: the server's --tokenizer-threads and --intra-op-threads on the
   same cores. Also the graph alone on ready pixel values, and preprocessing's CPU per image (one
   thread's CPU time over its images, one at a time).
4. A server of the same threads (`--device cpu`): h2load keeps --in-flight ModelInfer calls of one
   image each in flight for --seconds: images/s (answered OK, counted by the server), rows per model
   run (encoder_batch_size), the median call, and the server's CPU per image (/proc, every process).

Reported per round: served ÷ ceiling (target >= 0.8), with the figures above; printed as a markdown
table, and with --output saved as JSON. Needs the test extra (torch, transformers) and h2load.
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import transformers
from PIL import Image, ImageDraw

from protocol import grpc_service_pb2 as pb
from service.core.repository import read_model
from service.core.runtime import ExecutionSettings, ModelRuntime
from service.core.towers import PIXEL_VALUES
from service.pipeline.images import PREPROCESSOR_CONFIG, ImagePreprocessor
from service.pipeline.vocabulary import IMAGE_INPUT
from tests.export.two_tower_folders import save_clip_folder
from tests.processor_configs import CLIP_CONFIG
from tools import h2load
from tools.local_server import RunningServer, server_cpu_seconds, start_server

SHAPES = ("vit-b-32", "tiny")
MODEL_NAMES = {"vit-b-32": "clip-vit-b-32-random", "tiny": "clip-tiny-random"}
TEXT_FIELDS = ("vocab_size", "max_position_embeddings", "bos_token_id", "eos_token_id", "pad_token_id")
"""The tiny folder's text settings a full-size folder keeps: they belong to its tokenizer."""
PROJECTION = 512
SEED = 48
TARGET_SHARE = 0.8
OUTPUT = "embedding"
WARM_UP_CALLS_PER_STREAM = 4
PREPROCESS_CPU_IMAGES = 20
JPEG_QUALITY = 90


@dataclass(frozen=True)
class Round:
    """One round's figures: the ceiling in process, then the server."""

    model: str
    image: str
    """Its width x height and encoded bytes."""
    threads: int
    workers: int
    in_flight: int
    ceiling_images_per_s: float
    """Decode + preprocess + the graph, pipelined, batches of in_flight."""
    graph_images_per_s: float
    """The graph alone on ready pixel values, batches of in_flight."""
    preprocess_cpu_ms: float
    """CPU per image of decoding and preprocessing (one thread)."""
    served_images_per_s: float
    rows_per_run: float
    served_p50_ms: float
    """The median call at in_flight calls in flight."""
    server_cpu_ms: float
    """The server's CPU per served image (every process)."""

    @property
    def share(self) -> float:
        """Served ÷ ceiling."""
        return self.served_images_per_s / self.ceiling_images_per_s


def save_source(folder: Path, shape: str) -> Path:
    """A random-weight CLIPModel folder of `shape` (SHAPES) with its tokenizer and preprocessor_config.json."""
    save_clip_folder(folder, SEED)
    if shape == "tiny":
        return folder
    torch.manual_seed(SEED)
    transformers.CLIPModel(vit_b_32_config(folder)).eval().save_pretrained(str(folder))
    (folder / PREPROCESSOR_CONFIG).write_text(json.dumps(CLIP_CONFIG))
    return folder


def vit_b_32_config(tiny_folder: Path) -> transformers.CLIPConfig:
    """ViT-B/32's CLIPConfig (transformers' defaults), its text settings those of the tiny folder's tokenizer."""
    tiny = transformers.CLIPConfig.from_pretrained(str(tiny_folder)).text_config
    text = {name: getattr(tiny, name) for name in TEXT_FIELDS}
    return transformers.CLIPConfig(text_config=text, vision_config={}, projection_dim=PROJECTION)


def export_model(work: Path, shape: str, threads: int) -> Path:
    """DIR/repository holding the shape's model, exported fp32 by the command line unless it is there already."""
    repository, name = work / "repository", MODEL_NAMES[shape]
    if not (repository / name / "config.pbtxt").is_file():
        source = save_source(work / "source" / name, shape)
        command = [sys.executable, "-m", "export", "--source", str(source), "--repository", str(repository)]
        options = ["--name", name, "--variants", "fp32", "--threads", str(threads)]
        subprocess.run([*command, *options], check=True)
    return repository


def photo_jpeg(width: int, height: int) -> bytes:
    """A photo-like JPEG: smooth colour gradients under a few filled shapes, with a little sensor noise."""
    rows, columns = np.mgrid[0:height, 0:width].astype(np.float32)
    red = 255 * columns / max(width - 1, 1)
    green = 255 * rows / max(height - 1, 1)
    blue = 127.5 + 127.5 * np.sin((rows + columns) / max(width, height) * 6.0)
    noise = np.random.default_rng(SEED).normal(0.0, 4.0, size=(height, width, 3))
    pixels = np.clip(np.stack([red, green, blue], axis=-1) + noise, 0, 255).astype(np.uint8)
    picture = Image.fromarray(pixels, mode="RGB")
    draw = ImageDraw.Draw(picture)
    draw.ellipse((width // 5, height // 4, width // 2, 3 * height // 4), fill=(230, 200, 40))
    draw.rectangle((3 * width // 5, height // 6, 9 * width // 10, height // 2), fill=(40, 90, 160))
    buffer = io.BytesIO()
    picture.save(buffer, format="JPEG", quality=JPEG_QUALITY)
    return buffer.getvalue()


class Ceiling:
    """The model's image tower in this process as the server runs it: preprocessing on workers, the graph on threads."""

    def __init__(self, model_folder: Path, threads: int, workers: int) -> None:
        spec = read_model(model_folder)
        settings = ExecutionSettings(device="cpu", variant="fp32", intra_op_threads=threads)
        self._runtime = ModelRuntime(spec, settings, image=True)
        self._preprocessor = ImagePreprocessor.from_file(spec.image_preprocessor)
        self._workers = ThreadPoolExecutor(workers, thread_name_prefix="preprocess")

    def close(self) -> None:
        """Stop the preprocessing workers."""
        self._workers.shutdown()

    def _submit(self, image: bytes, batch: int) -> list[Future[np.ndarray]]:
        return [self._workers.submit(self._preprocessor.pixel_values, image) for _ in range(batch)]

    def _run(self, pixels: np.ndarray) -> None:
        self._runtime.run({PIXEL_VALUES: pixels}, (OUTPUT,))

    def images_per_s(self, image: bytes, batch: int, seconds: float) -> float:
        """Batches of `batch` copies of the image for `seconds`, the next batch preprocessed while one runs."""
        pending = self._submit(image, batch)
        self._run(np.stack([future.result() for future in pending]))
        pending = self._submit(image, batch)
        done, started = 0, time.perf_counter()
        while time.perf_counter() - started < seconds:
            pixels = np.stack([future.result() for future in pending])
            pending = self._submit(image, batch)
            self._run(pixels)
            done += batch
        elapsed = time.perf_counter() - started
        for future in pending:
            future.result()
        return done / elapsed

    def graph_images_per_s(self, image: bytes, batch: int, seconds: float) -> float:
        """The graph alone on one batch of ready pixel values, run for `seconds` (after one to warm up)."""
        pixels = np.stack([self._preprocessor.pixel_values(image)] * batch)
        self._run(pixels)
        done, started = 0, time.perf_counter()
        while time.perf_counter() - started < seconds:
            self._run(pixels)
            done += batch
        return done / (time.perf_counter() - started)

    def preprocess_cpu_ms(self, image: bytes, images: int = PREPROCESS_CPU_IMAGES) -> float:
        """CPU milliseconds per image of decoding and preprocessing it, one image at a time on this thread."""
        self._preprocessor.pixel_values(image)
        started = time.thread_time()
        for _ in range(images):
            self._preprocessor.pixel_values(image)
        return (time.thread_time() - started) * 1e3 / images


def image_request(model: str, image: bytes) -> pb.ModelInferRequest:
    """One encoded image as BYTES, asking for the embedding."""
    request = pb.ModelInferRequest(model_name=model)
    tensor = request.inputs.add(name=IMAGE_INPUT, datatype="BYTES", shape=[1])
    tensor.contents.bytes_contents.append(image)
    request.outputs.add(name=OUTPUT)
    return request


@dataclass(frozen=True)
class Served:
    """What the server did while h2load kept calls in flight."""

    images_per_s: float
    rows_per_run: float
    p50_ms: float
    cpu_ms_per_image: float


def serve(server: RunningServer, model: str, image: bytes, *, in_flight: int, seconds: float, scratch: Path) -> Served:
    """`in_flight` calls of one image each kept in flight for `seconds` (over as many connections), after a warm-up."""
    body, log = scratch / "request", scratch / "timed.log"
    body.write_bytes(h2load.grpc_body(image_request(model, image)))
    calls = {"connections": in_flight, "streams": 1}
    h2load.run(h2load.model_infer(server.target, body, requests=in_flight * WARM_UP_CALLS_PER_STREAM, **calls))
    answers, batches = h2load.Answers(server.answered(model)), server.batch_totals(model)
    cpu_s, started = server_cpu_seconds(server.process.pid), time.monotonic()
    h2load.run(h2load.model_infer(server.target, body, seconds=seconds, log=log, **calls))
    elapsed = time.monotonic() - started
    cpu_s = server_cpu_seconds(server.process.pid) - cpu_s
    images = answers.ok_since_last(server.answered(model), abandoned=in_flight)
    rows, runs = (after - before for after, before in zip(server.batch_totals(model), batches, strict=True))
    return Served(images / elapsed, rows / runs, statistics.median(h2load.latencies_ms(log)), cpu_s * 1e3 / images)


def measure(
    repository: Path, model: str, image: bytes, *, threads: int, workers: int, in_flight: int, seconds: float
) -> Round:
    """One round: the ceiling and the preprocessing's CPU in this process, then the server at `in_flight`."""
    ceiling = Ceiling(repository / model, threads, workers)
    try:
        ceiling_per_s = ceiling.images_per_s(image, in_flight, seconds)
        graph_per_s = ceiling.graph_images_per_s(image, in_flight, seconds)
        preprocess_ms = ceiling.preprocess_cpu_ms(image)
    finally:
        ceiling.close()
    with tempfile.TemporaryDirectory() as folder:
        scratch = Path(folder)
        flags = ("--device", "cpu", "--intra-op-threads", str(threads), "--tokenizer-threads", str(workers))
        with start_server(repository, scratch / "server.log", *flags) as server:
            served = serve(server, model, image, in_flight=in_flight, seconds=seconds, scratch=scratch)
    with Image.open(io.BytesIO(image)) as opened:
        described = f"{opened.width}x{opened.height} {opened.format}, {len(image)} bytes"
    return Round(
        model,
        described,
        threads,
        workers,
        in_flight,
        ceiling_per_s,
        graph_per_s,
        preprocess_ms,
        served.images_per_s,
        served.rows_per_run,
        served.p50_ms,
        served.cpu_ms_per_image,
    )


TABLE_HEADER = (
    "| round | served images/s | ceiling images/s | served ÷ ceiling | graph alone images/s | rows per run | p50 ms"
    " | preprocessing CPU ms/image | server CPU ms/image |\n" + "| --- " * 9 + "|"
)


def table_row(index: int, result: Round) -> str:
    """One round as a row of TABLE_HEADER's markdown table, with the target's verdict."""
    verdict = "met" if result.share >= TARGET_SHARE else "MISSED"
    return (
        f"| {index} | {result.served_images_per_s:.1f} | {result.ceiling_images_per_s:.1f} | {result.share:.2f}"
        f" ({verdict}) | {result.graph_images_per_s:.1f} | {result.rows_per_run:.1f} | {result.served_p50_ms:.1f}"
        f" | {result.preprocess_cpu_ms:.2f} | {result.server_cpu_ms:.1f} |"
    )


def main(argv: list[str] | None = None) -> int:
    """Make and export the model once, measure round after round; print (and with --output, save) the figures."""
    parser = argparse.ArgumentParser(prog="python -m tools.image_bench", description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True, help="where the source folder and repository are kept")
    parser.add_argument("--shape", choices=SHAPES, default="vit-b-32")
    parser.add_argument("--threads", type=int, default=2, help="ONNX Runtime threads, in process and served")
    parser.add_argument("--workers", type=int, default=1, help="preprocessing threads (the server's tokenizer ones)")
    parser.add_argument("--in-flight", type=int, default=8, help="calls in flight, and the ceiling's batch")
    parser.add_argument("--image-size", default="640x480", help="the test image's WIDTHxHEIGHT")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--output", type=Path, help="also write the figures here as JSON")
    arguments = parser.parse_args(argv)
    width, height = (int(side) for side in arguments.image_size.lower().split("x"))
    repository = export_model(arguments.work, arguments.shape, arguments.threads)
    image = photo_jpeg(width, height)
    results = []
    print(TABLE_HEADER, flush=True)
    for index in range(1, arguments.rounds + 1):
        results.append(
            measure(
                repository,
                MODEL_NAMES[arguments.shape],
                image,
                threads=arguments.threads,
                workers=arguments.workers,
                in_flight=arguments.in_flight,
                seconds=arguments.seconds,
            )
        )
        print(table_row(index, results[-1]), flush=True)
    if arguments.output:
        arguments.output.parent.mkdir(parents=True, exist_ok=True)
        rows = [{**asdict(result), "share": result.share, "target_share": TARGET_SHARE} for result in results]
        arguments.output.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
