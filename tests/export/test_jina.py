"""jina-embeddings-v3 (export.families.rotary_bert, export.layers.task_adapters) against transformers + PEFT, per task.

One tiny random JinaEmbeddingsV3Model with XLM-R's Unigram tokenizer, saved as a sentence-transformers
folder (mean pooling, Normalize, prompts named after the tasks as jina-embeddings-v3's are), with
one PEFT LoRA folder per task as jinaai/jina-embeddings-v3-hf ships them (ranks and scales differ
between tasks; the token embedding and every projection adapted). It is exported once, fp32, by
`python -m export --source`; our encoder, the published graph and a real server (gRPC with
tritonclient, and the openai SDK) are compared with transformers + PEFT with that task's adapter
(and with sentence-transformers' encode with the task's prompt, its model wrapped by PEFT), every
task's texts in one mixed batch.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import onnxruntime as ort
import openai
import pytest
import torch
import transformers
import tritonclient.grpc as grpcclient
from peft import LoraConfig, PeftModel, get_peft_model
from sentence_transformers import SentenceTransformer
from sentence_transformers.sentence_transformer import modules as st_models
from tritonclient.utils import InferenceServerException

from client import EmbeddingClient
from export.checkpoints.checkpoint import CheckpointError, load_checkpoint
from export.layers.task_adapters import JINA_TASKS
from service.core.repository import ADAPTER_IDS, read_model
from tests.export import tiny_models
from tests.servers import start_server
from tests.vectors import assert_same_vectors

ROOT = Path(__file__).resolve().parents[2]
TASKS = tuple(JINA_TASKS.values())
PROMPTS = {
    "retrieval.query": "Represent the query for retrieving evidence documents: ",
    "retrieval.passage": "Represent the document for retrieval: ",
    "separation": "",
    "classification": "",
    "text-matching": "",
}
"""jina-embeddings-v3's sentence-transformers prompts, named after its tasks."""
ADAPTERS = {
    "retrieval_query": {"r": 4, "lora_alpha": 1},
    "retrieval_passage": {"r": 4, "lora_alpha": 1},
    "separation": {"r": 2, "lora_alpha": 4},
    "classification": {"r": 4, "lora_alpha": 2, "use_rslora": True},
    "text_matching": {"r": 3, "lora_alpha": 1},
}
"""Each task folder's LoRA settings (jina-embeddings-v3's own are rank 4, alpha 1)."""
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "fc1", "fc2", "word_embeddings"]
SENTENCES = ["Hi.", *tiny_models.training_sentences()[:5], "A much longer sentence that goes on and on, " * 3]
NAME = "jina"


def _save_source(folder: Path) -> Path:
    """The sentence-transformers folder with its five adapter folders; returns it."""
    base = folder / "base"
    base.mkdir(parents=True)
    tokenizer = tiny_models.save_tokenizer("xlm-roberta", base)
    config = transformers.JinaEmbeddingsV3Config(
        vocab_size=len(tokenizer),
        hidden_size=tiny_models.HIDDEN,
        num_hidden_layers=tiny_models.LAYERS,
        num_attention_heads=tiny_models.HEADS,
        intermediate_size=2 * tiny_models.HIDDEN,
        max_position_embeddings=tiny_models.MAX_POSITIONS,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = transformers.AutoModel.from_config(config, attn_implementation="eager").eval()
    tiny_models._randomise(model, 0)
    model.save_pretrained(str(base))
    transformer = st_models.Transformer(str(base), max_seq_length=tiny_models.MAX_POSITIONS - 2)
    modules = [transformer, st_models.Pooling(transformer.get_embedding_dimension(), "mean"), st_models.Normalize()]
    target = folder / "model"
    SentenceTransformer(modules=modules, prompts=PROMPTS).save(str(target))
    for seed, (task, settings) in enumerate(ADAPTERS.items(), start=1):
        torch.manual_seed(seed)
        lora = LoraConfig(target_modules=TARGETS, init_lora_weights=False, **settings)
        get_peft_model(transformers.AutoModel.from_pretrained(str(target)), lora).save_pretrained(str(target / task))
    return target


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny jina-embeddings-v3 folder."""
    return _save_source(tmp_path_factory.mktemp("jina-source"))


@pytest.fixture(scope="module")
def repository(source: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The model exported by the command line, fp32."""
    repository = tmp_path_factory.mktemp("jina-repository")
    command = [sys.executable, "-m", "export", "--source", str(source), "--repository", str(repository)]
    command += ["--name", NAME, "--variants", "fp32", "--threads", "1"]
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    return repository


@pytest.fixture(scope="module")
def reference(source: Path) -> PeftModel:
    """transformers' JinaEmbeddingsV3Model with every task's PEFT adapter loaded (set_adapter picks one)."""
    base = transformers.AutoModel.from_pretrained(str(source), attn_implementation="eager").eval()
    folders = list(JINA_TASKS)
    model = PeftModel.from_pretrained(base, str(source / folders[0]), adapter_name=folders[0])
    for folder in folders[1:]:
        model.load_adapter(str(source / folder), adapter_name=folder)
    return model.eval()


@torch.inference_mode()
def _reference_states(reference: PeftModel, batch: dict[str, torch.Tensor], folder: str | None) -> torch.Tensor:
    """The last hidden states with one task's adapter (None: none)."""
    if folder is None:
        with reference.disable_adapter():
            return reference(**batch).last_hidden_state
    reference.set_adapter(folder)
    return reference(**batch).last_hidden_state


def _mixed_adapter_ids(rows: int, length: int) -> np.ndarray:
    """Row i on task i mod 6 (0: none), every token of a row alike: each task in one batch."""
    return np.repeat((np.arange(rows) % (len(TASKS) + 1))[:, None], length, axis=1).astype(np.int64)


def _batch(source: Path) -> dict[str, torch.Tensor]:
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(source))
    return dict(tokenizer(SENTENCES, padding=True, return_tensors="pt"))


def test_encoder_equals_transformers_with_each_adapter(source: Path, reference: PeftModel) -> None:
    """Our encoder, rows of every task (and none) in one batch, against transformers + PEFT per task (fp32, 1e-5)."""
    checkpoint = load_checkpoint(source)
    assert checkpoint.config.tasks == TASKS
    model = checkpoint.build_model()
    batch = _batch(source)
    ids = torch.from_numpy(_mixed_adapter_ids(*batch["input_ids"].shape))
    with torch.inference_mode():
        ours = model(batch["input_ids"], batch["attention_mask"], adapter_ids=ids)[0]
    mask = batch["attention_mask"].bool()
    for task_id, folder in enumerate((None, *JINA_TASKS)):
        expected = _reference_states(reference, batch, folder)
        rows = ids[:, 0] == task_id
        difference = (ours[rows] - expected[rows])[mask[rows]].abs().max().item()
        assert difference <= 1e-5, (folder, difference)


def test_published_graph_equals_encoder(source: Path, repository: Path) -> None:
    """The fp32 graph, fed rows of every task as the server feeds them, against our encoder (fp32)."""
    spec = read_model(repository / NAME)
    assert spec.adapter_tasks == TASKS
    assert spec.input_names == ("input_ids", "attention_mask", ADAPTER_IDS)
    session = ort.InferenceSession(str(spec.variants["fp32"]), providers=["CPUExecutionProvider"])
    batch = _batch(source)
    feed = {name: tensor.numpy() for name, tensor in batch.items() if name in spec.input_names}
    feed[ADAPTER_IDS] = _mixed_adapter_ids(*feed["input_ids"].shape)
    states, embeddings = session.run(["last_hidden_state", "embedding"], feed)
    model = load_checkpoint(source).build_model()
    with torch.inference_mode():
        expected = model(**{name: torch.from_numpy(array) for name, array in feed.items()})
    mask = feed["attention_mask"].astype(bool)
    assert np.abs(states - expected[0].numpy())[mask].max() <= 1e-5
    assert_same_vectors(embeddings, expected[1].numpy(), min_cosine=0.99999)


def _sentence_transformers(source: Path, reference: PeftModel) -> SentenceTransformer:
    """sentence-transformers on the folder, its transformer wrapped by PEFT with every task's adapter."""
    model = SentenceTransformer(str(source), device="cpu")
    model[0].model = reference
    return model


def _library_embeddings(
    model: SentenceTransformer, reference: PeftModel, task: str | None, prompt: bool = True
) -> np.ndarray:
    """sentence-transformers' encode of SENTENCES with a task's adapter and (prompt) its prompt; None: neither."""
    if task is None:
        with reference.disable_adapter():
            return model.encode(SENTENCES)
    reference.set_adapter(next(folder for folder, name in JINA_TASKS.items() if name == task))
    return model.encode(SENTENCES, prompt_name=task if prompt else None)


def test_served_tasks_equal_the_reference(source: Path, repository: Path, reference: PeftModel, tmp_path: Path) -> None:
    """Every task (and none) at once over gRPC (tritonclient, task and prompt_name) and the openai SDK (task), in
    batches that mix them, against sentence-transformers with the task's prompt and adapter; unknown tasks refused.
    Two front ends: the rows and their adapter ids travel the engine's wire."""
    library = _sentence_transformers(source, reference)
    expected = {task: _library_embeddings(library, reference, task) for task in (None, *TASKS)}
    for task in TASKS:  # each adapter changes the vectors, so a task served with another's would be seen
        assert (np.sum(expected[task] * expected[None], axis=1) < 0.99).all(), task
    texts = np.array([text.encode() for text in SENTENCES], dtype=np.object_)

    def over_grpc(task: str | None, parameter: str) -> np.ndarray:
        with grpcclient.InferenceServerClient(server.target) as client:
            tensor = grpcclient.InferInput("text", [len(SENTENCES)], "BYTES")
            tensor.set_data_from_numpy(texts)
            parameters = {} if task is None else {parameter: task}
            return client.infer(NAME, [tensor], parameters=parameters).as_numpy("embedding")

    def over_openai(task: str | None) -> np.ndarray:
        sdk = openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="unused", max_retries=0)
        extra = {} if task is None else {"task": task}
        answer = sdk.embeddings.create(model=NAME, input=SENTENCES, encoding_format="float", extra_body=extra)
        return np.array([item.embedding for item in answer.data], dtype=np.float32)

    calls = [(task, "task", over_grpc) for task in (None, *TASKS)]
    calls += [(task, "prompt_name", over_grpc) for task in TASKS]
    calls += [(task, "", over_openai) for task in (None, *TASKS)]
    with start_server(
        repository, tmp_path / "server.log", "--max-queue-delay-us", "20000", "--frontends", "2"
    ) as server:
        with ThreadPoolExecutor(len(calls)) as pool:
            answers = list(pool.map(lambda call: call[2](call[0], call[1]) if call[1] else call[2](call[0]), calls))
        for (task, _, _), served in zip(calls, answers, strict=True):
            assert_same_vectors(served, expected[task], min_cosine=0.9999)
        with pytest.raises(InferenceServerException) as refused:
            over_grpc("retrieval", "task")
        assert refused.value.status() == str(grpc.StatusCode.INVALID_ARGUMENT)
        assert "tasks: retrieval.query, retrieval.passage, separation, classification, text-matching" in str(
            refused.value
        )
        _assert_token_rows_of_every_task_in_one_request(server.target, source, library, reference)
        _assert_refused(server.target, source)
        with grpcclient.InferenceServerClient(server.target) as client:
            config = client.get_model_config(NAME).config
        assert json.loads(config.parameters["adapter_tasks"].string_value) == list(TASKS)
        assert {tensor.name: tensor.optional for tensor in config.input}[ADAPTER_IDS]
        card = openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="unused").models.retrieve(NAME)
        assert card.model_extra["tasks"] == list(TASKS)
        with EmbeddingClient(server.target, model=NAME) as sdk:  # the project's own client
            assert sdk.model_info().tasks == TASKS
            for task in (None, *TASKS):
                assert_same_vectors(sdk.embed(SENTENCES, task=task), expected[task], min_cosine=0.9999)


REMOTE_CODE = {"model_type": "xlm-roberta", "lora_adaptations": list(TASKS), "position_embedding_type": "rotary"}


@pytest.mark.parametrize(
    ("file", "changes", "refusal"),
    [
        ("config.json", REMOTE_CODE, r"jina-embeddings-v3 remote-code form .*its transformers-native form"),
        ("separation/adapter_config.json", {"use_dora": True}, r"separation/adapter_config.json: unsupported use_dora"),
        ("separation/adapter_config.json", {"bias": "all"}, r"unsupported bias 'all' \(only 'none'\)"),
        ("separation/adapter_config.json", {"peft_type": "IA3"}, r"unsupported peft_type 'IA3' \(only LORA\)"),
    ],
)
def test_what_is_not_implemented_is_refused_by_name(
    source: Path, tmp_path: Path, file: str, changes: dict[str, object], refusal: str
) -> None:
    """The remote-code config (xlm-roberta with lora_adaptations) and PEFT settings that change the delta otherwise
    are refused in one line naming them."""
    folder = tmp_path / "changed"
    shutil.copytree(source, folder)
    path = folder / file
    path.write_text(json.dumps(json.loads(path.read_text()) | changes))
    with pytest.raises(CheckpointError, match=refusal) as refused:
        load_checkpoint(folder)
    assert "\n" not in str(refused.value)


def _assert_token_rows_of_every_task_in_one_request(
    target: str, source: Path, library: SentenceTransformer, reference: PeftModel
) -> None:
    """Token inputs with adapter_ids, row i on task i mod 6, in one gRPC request: one batch whose rows each take
    their own task's adapter (no prompts: the rows are the texts' own tokens)."""
    batch = _batch(source)
    feed = {name: batch[name].numpy().astype(np.int64) for name in ("input_ids", "attention_mask")}
    tensors = _token_inputs(feed, 0)
    feed[ADAPTER_IDS] = _mixed_adapter_ids(*feed["input_ids"].shape)
    tensors[-1].set_data_from_numpy(feed[ADAPTER_IDS])
    with grpcclient.InferenceServerClient(target) as client:
        served = client.infer(NAME, tensors).as_numpy("embedding")
    task_of_row = [(None, *TASKS)[i] for i in feed[ADAPTER_IDS][:, 0]]
    expected = {task: _library_embeddings(library, reference, task, prompt=False) for task in set(task_of_row)}
    rows = np.stack([expected[task][row] for row, task in enumerate(task_of_row)])
    assert_same_vectors(served, rows, min_cosine=0.9999)


def _assert_refused(target: str, source: Path) -> None:
    """A prompt_name naming another task than task, adapter_ids beside task, and an adapter id past the tasks."""
    batch = _batch(source)
    feed = {name: batch[name].numpy().astype(np.int64) for name in ("input_ids", "attention_mask")}
    text = grpcclient.InferInput("text", [1], "BYTES")
    text.set_data_from_numpy(np.array([b"Hi."], dtype=np.object_))
    cases = [
        ([text], {"task": "separation", "prompt_name": "retrieval.query"}, "names another task than parameter task"),
        ([*_token_inputs(feed, 1)], {"task": "separation"}, "both choose the task"),
        ([*_token_inputs(feed, len(TASKS) + 1)], {}, "adapter_ids: values must be in [0, 5]"),
    ]
    with grpcclient.InferenceServerClient(target) as client:
        for inputs, parameters, message in cases:
            with pytest.raises(InferenceServerException) as refused:
                client.infer(NAME, inputs, parameters=parameters)
            assert refused.value.status() == str(grpc.StatusCode.INVALID_ARGUMENT)
            assert message in str(refused.value), str(refused.value)


def _token_inputs(feed: dict[str, np.ndarray], adapter_id: int) -> list[grpcclient.InferInput]:
    """The token inputs, with every token on one adapter id."""
    arrays = feed | {ADAPTER_IDS: np.full_like(feed["input_ids"], adapter_id)}
    tensors = []
    for name, array in arrays.items():
        tensor = grpcclient.InferInput(name, list(array.shape), "INT64")
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    return tensors
