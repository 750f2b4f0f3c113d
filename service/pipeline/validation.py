"""All validation of what an inference request carries, against the model it names.

Every front end hands the engine the same `InferenceRequest` (service.pipeline.api): inputs as received,
names, datatypes, shapes and data unchecked. Here they are checked against the model's signature,
once for every protocol, and become a `ValidRequest`: texts, token rows, or (a two-tower model) encoded
images, checked for their sizes here and decoded on the pipeline's workers (service.pipeline.models).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence

import numpy as np

from service.core.repository import ADAPTER_IDS, ModelSpec
from service.core.rows import TokenRows
from service.errors import InvalidArgument, RequestTooLarge
from service.pipeline.multivector import input_type_choice
from service.pipeline.outputs import asks_for_tokens, check_output, default_outputs
from service.pipeline.requests import InputTensor, ModelSignature, RowLimit, TextLimits, ValidRequest
from service.pipeline.sparse import top_k_choice
from service.pipeline.vocabulary import (
    ADD_SPECIAL_TOKENS,
    CHUNK_COUNTS,
    CHUNKS,
    DIMENSIONS,
    IMAGE_INPUT,
    INDICES,
    INSTRUCTION,
    LATE_CHUNKING,
    PRIORITY,
    PROMPT_NAME,
    QUERY_INPUT,
    REQUIRED_TOKEN_INPUTS,
    SCHEDULING,
    SCORE,
    TASK,
    TEXT_INPUT,
    TIMEOUT,
    TOKEN_OUTPUTS,
    TOKEN_STATES,
    TOKENS,
    TRUNCATE,
)

ELEMENT_BYTES = {"INT64": 8}
"""Bytes per element of the fixed-size datatypes the models take."""
_LENGTH_PREFIX = struct.Struct("<I")
_INT64 = np.dtype("<i8")


def shape_text(shape: Sequence[int]) -> str:
    """A shape as messages write it: [2, 3]."""
    return "[" + ", ".join(str(d) for d in shape) + "]"


def _split_bytes(name: str, raw: bytes, count: int) -> list[bytes]:
    """BYTES raw contents: each element a 4-byte little-endian length then the bytes."""
    view = memoryview(raw)
    elements: list[bytes] = []
    offset = 0
    while offset < len(view):
        if offset + 4 > len(view):
            raise InvalidArgument(f"input {name}: truncated length prefix at byte {offset} of raw contents")
        (size,) = _LENGTH_PREFIX.unpack_from(view, offset)
        offset += 4
        if offset + size > len(view):
            raise InvalidArgument(
                f"input {name}: element {len(elements)} claims {size} bytes, {len(view) - offset} remain"
            )
        elements.append(bytes(view[offset : offset + size]))
        offset += size
    if len(elements) != count:
        raise InvalidArgument(f"input {name}: raw contents hold {len(elements)} elements, shape needs {count}")
    return elements


def _tensor_data(tensor: InputTensor) -> np.ndarray | list[bytes]:
    """The tensor's elements, from raw or typed data, checked against its shape."""
    count = math.prod(tensor.shape)
    if tensor.raw:
        if tensor.datatype == "BYTES":
            return _split_bytes(tensor.name, tensor.data, count)
        size = count * ELEMENT_BYTES[tensor.datatype]
        if len(tensor.data) != size:
            raise InvalidArgument(
                f"input {tensor.name}: raw contents are {len(tensor.data)} bytes, shape {shape_text(tensor.shape)} of "
                f"{tensor.datatype} needs {size}"
            )
        return np.frombuffer(tensor.data, dtype=_INT64).reshape(tensor.shape)
    if len(tensor.data) != count:
        field = "bytes_contents" if tensor.datatype == "BYTES" else "int64_contents"
        shape = shape_text(tensor.shape)
        raise InvalidArgument(
            f"input {tensor.name}: {len(tensor.data)} elements in {field}, shape {shape} needs {count}"
        )
    if tensor.datatype == "BYTES":
        return list(tensor.data)
    return np.array(tensor.data, dtype=np.int64).reshape(tensor.shape)


def check_text_sizes(inputs: dict[str, Sequence[bytes]], limits: TextLimits) -> None:
    """Refuse a text (named by its input and place), or the texts of a request together, over their byte limits."""
    total = 0
    for name, elements in inputs.items():
        for index, element in enumerate(elements):
            if len(element) > limits.max_text_bytes:
                raise RequestTooLarge(
                    f"input {name}[{index}] is {len(element)} bytes, over the limit of {limits.max_text_bytes} bytes"
                    " per text (--max-text-bytes)",
                    "text_too_large",
                )
            total += len(element)
    if total > limits.max_request_text_bytes:
        raise RequestTooLarge(
            f"the texts of this request total {total} bytes, over the limit of {limits.max_request_text_bytes} bytes"
            " per request (--max-request-text-bytes)",
            "request_text_too_large",
        )


def decode_texts(elements: list[bytes], name: str) -> list[str]:
    """UTF-8 elements as texts; InvalidArgument naming the first that is not valid UTF-8 or is blank."""
    texts = []
    for index, element in enumerate(elements):
        try:
            text = element.decode("utf-8")
        except UnicodeDecodeError as error:
            raise InvalidArgument(
                f"input {name}[{index}] is not valid UTF-8 ({error.reason} at byte {error.start})"
            ) from error
        if not text.strip():
            raise InvalidArgument(f"input {name}[{index}] is empty")
        texts.append(text)
    return texts


def _check_tokens(tokens: dict[str, np.ndarray], signature: ModelSignature) -> None:
    spec = signature.spec
    missing = [n for n in REQUIRED_TOKEN_INPUTS if n not in tokens]
    if missing:
        raise InvalidArgument(f"missing input {missing[0]} (token inputs are input_ids and attention_mask)")
    shape = tokens["input_ids"].shape
    for name, array in tokens.items():
        if array.ndim != 2:
            raise InvalidArgument(f"input {name}: shape {shape_text(array.shape)} must be [batch, sequence]")
        if array.shape != shape:
            raise InvalidArgument(
                f"input {name}: shape {shape_text(array.shape)} differs from input_ids {shape_text(shape)}"
            )
    length = shape[1]
    if length < 1:
        raise InvalidArgument("token inputs must hold at least one token per sequence")
    if length > spec.max_sequence_length:
        raise InvalidArgument(f"sequence length {length} exceeds the model's maximum {spec.max_sequence_length}")
    ids = tokens["input_ids"]
    if ids.size and (ids.min() < 0 or ids.max() >= spec.vocab_size):
        bad = ids[(ids < 0) | (ids >= spec.vocab_size)][0]
        raise InvalidArgument(f"input_ids: token id {bad} is outside the vocabulary [0, {spec.vocab_size})")
    mask = tokens["attention_mask"]
    if ((mask != 0) & (mask != 1)).any():
        raise InvalidArgument("attention_mask: values must be 0 or 1")
    empty_rows = np.flatnonzero(mask.sum(axis=1) == 0)
    if empty_rows.size:
        raise InvalidArgument(f"attention_mask: row {empty_rows[0]} attends to no token")
    types = tokens.get("token_type_ids")
    if types is not None and types.size and (types.min() < 0 or types.max() >= signature.spec.type_vocab_size):
        raise InvalidArgument(f"token_type_ids: values must be in [0, {signature.spec.type_vocab_size})")
    adapters = tokens.get(ADAPTER_IDS)
    if adapters is not None and adapters.size and (adapters.min() < 0 or adapters.max() > len(spec.adapter_tasks)):
        raise InvalidArgument(
            f"{ADAPTER_IDS}: values must be in [0, {len(spec.adapter_tasks)}] (0: no adapter; task i + 1:"
            f" {', '.join(spec.adapter_tasks)})"
        )


def requested_outputs(names: Sequence[str], signature: ModelSignature, pairs: bool) -> tuple[str, ...]:
    """The outputs to answer with, in order: the names given (each served, once), or the model's defaults.

    A multi-vector model answers pairs with their scores only, and scores only for pairs.
    """
    spec = signature.spec
    scored_pairs = pairs and spec.task != "classify"
    if not names:
        return (SCORE,) if scored_pairs else default_outputs(spec, pairs)
    for name in names:
        check_output(name, spec, signature.outputs)
    if len(set(names)) != len(names):
        raise InvalidArgument("an output is requested twice")
    if scored_pairs and tuple(names) != (SCORE,):
        raise InvalidArgument(f"model {spec.name} answers (query, text) pairs with output {SCORE} only")
    if SCORE in names and not scored_pairs:
        raise InvalidArgument(f"output {SCORE} scores (query, text) pairs: send the queries in input {QUERY_INPUT}")
    tokens = [name for name in names if signature.outputs[name].source == TOKENS]
    if tokens and len(tokens) != len(names):
        raise InvalidArgument(
            f"outputs {', '.join(TOKEN_OUTPUTS)} are the texts' tokens, answered without running the model:"
            " request them apart from the model's other outputs"
        )
    return tuple(names)


def add_special_tokens_choice(
    parameters: dict[str, object], outputs: tuple[str, ...], texts: list[str] | None, pairs: bool
) -> bool:
    """The `add_special_tokens` parameter (default true), checked with a request for the texts' tokens."""
    tokens_only = asks_for_tokens(outputs)
    special = parameters.get(ADD_SPECIAL_TOKENS, True)
    if not isinstance(special, bool):
        raise InvalidArgument(f"parameter {ADD_SPECIAL_TOKENS} must be true or false")
    if ADD_SPECIAL_TOKENS in parameters and not tokens_only:
        raise InvalidArgument(f"parameter {ADD_SPECIAL_TOKENS} applies to the outputs {', '.join(TOKEN_OUTPUTS)} only")
    if tokens_only and texts is None:
        raise InvalidArgument(f"output {outputs[0]} is the tokens of texts: send input {TEXT_INPUT}, not token ids")
    if tokens_only and pairs:
        raise InvalidArgument(f"output {outputs[0]} is the tokens of single texts: send no input {QUERY_INPUT}")
    return special


def scheduling_parameters(fields: dict[str, object]) -> dict[str, object]:
    """The scheduling parameters (priority, timeout) among a JSON body's fields, where given."""
    return {name: fields[name] for name in SCHEDULING if fields.get(name) is not None}


def priority_choice(parameters: dict[str, object], levels: int) -> int:
    """Triton's `priority` parameter: 1 (the highest) to the model's levels; 0 or absent: the default."""
    value = parameters.get(PRIORITY, 0)
    if type(value) is not int or not 0 <= value <= levels:
        raise InvalidArgument(
            f"parameter {PRIORITY} must be an integer from 1 (the highest) to {levels} (this model's priority levels),"
            f" or 0 for the default; got {value!r}"
        )
    return value


def timeout_s(parameters: dict[str, object]) -> float | None:
    """Triton's `timeout` parameter (microseconds, a non-negative integer; 0 = none) in seconds."""
    if TIMEOUT not in parameters:
        return None
    value = parameters[TIMEOUT]
    if type(value) is not int or value < 0:
        raise InvalidArgument(f"parameter {TIMEOUT} must be a non-negative integer (microseconds)")
    return value / 1e6 if value else None


def prompt_prefix(parameters: dict[str, object], spec: ModelSpec) -> str:
    """The prefix the request's prompt_name or task names (or the model's default prompt's); "" for none."""
    return prompt_and_task(parameters, spec)[0]


def _task_id(task: object, spec: ModelSpec) -> int:
    """The id of the task adapter a task parameter names, checked."""
    if not isinstance(task, str) or task not in spec.adapter_tasks:
        known = ", ".join(spec.adapter_tasks) or "none"
        raise InvalidArgument(f"parameter {TASK} {task!r} is not a task of model {spec.name} (tasks: {known})")
    return spec.adapter_id(task)


def prompt_and_task(parameters: dict[str, object], spec: ModelSpec) -> tuple[str, int]:
    """The prefix the request's prompt puts before each text, and the id of the task adapter its rows run with.

    prompt_name names a prompt, task a task adapter; either one, where its name is both a prompt and a
    task (jina-embeddings-v3 names its prompts after its tasks), selects both, and given together
    they must not name two tasks. Neither: the model's default prompt, and the task of that name if
    there is one (else no adapter, as transformers and sentence-transformers run the model).
    """
    prompt, task = parameters.get(PROMPT_NAME), parameters.get(TASK)
    if task is None:
        name = spec.default_prompt_name if prompt is None else prompt
        prefix = _prompt(prompt, spec)
        return prefix, spec.adapter_id(name) if name in spec.adapter_tasks else 0
    adapter_id = _task_id(task, spec)
    if prompt is not None and prompt != task and prompt in spec.adapter_tasks:
        raise InvalidArgument(f"parameter {PROMPT_NAME} {prompt!r} names another task than parameter {TASK} {task!r}")
    if prompt is None and task in spec.prompts:
        prompt = task
    return _prompt(prompt, spec), adapter_id


def _prompt(name: object, spec: ModelSpec) -> str:
    """The prefix of a prompt_name (None: the model's default prompt's); "" for none."""
    if name is None:
        return spec.prompts.get(spec.default_prompt_name, "")
    if spec.task == "classify":
        raise InvalidArgument(f"parameter {PROMPT_NAME}: model {spec.name} is a {spec.task} model and has no prompts")
    if not isinstance(name, str) or name not in spec.prompts:
        known = ", ".join(spec.prompts) or "none"
        raise InvalidArgument(
            f"parameter {PROMPT_NAME} {name!r} is not a prompt of model {spec.name} (prompts: {known})"
        )
    return spec.prompts[name]


def truncate_choice(parameters: dict[str, object]) -> bool:
    """The `truncate` parameter: true (default) cuts long sequences at the model's maximum, false refuses them."""
    value = parameters.get(TRUNCATE, True)
    if not isinstance(value, bool):
        raise InvalidArgument(f"parameter {TRUNCATE} must be true or false")
    return value


def late_chunking_choice(
    parameters: dict[str, object], signature: ModelSignature, pairs: bool, outputs: tuple[str, ...]
) -> bool:
    """The `late_chunking` parameter (default false), checked against the model, the inputs and the outputs."""
    value = parameters.get(LATE_CHUNKING, False)
    if not isinstance(value, bool):
        raise InvalidArgument(f"parameter {LATE_CHUNKING} must be true or false")
    if not value:
        return False
    spec = signature.spec
    if spec.task != "embed":
        raise InvalidArgument(f"parameter {LATE_CHUNKING}: model {spec.name} is a {spec.task} model, not an embedder")
    if spec.pooled_projection:
        raise InvalidArgument(
            f"parameter {LATE_CHUNKING}: model {spec.name} maps its pooled vector through {spec.pooled_projection}"
            " layers, which a chunk's pooled token states would not pass through"
        )
    if TOKEN_STATES not in spec.output_names:
        raise InvalidArgument(
            f"parameter {LATE_CHUNKING}: model {spec.name} pools inside its graph ({spec.pooling}) and answers no"
            f" {TOKEN_STATES} to pool a chunk's tokens from"
        )
    if pairs:
        raise InvalidArgument(f"parameter {LATE_CHUNKING} embeds chunks of one document: send no {QUERY_INPUT} input")
    for name in outputs:
        output = signature.outputs[name]
        if output.source != "embedding" or output.form in (CHUNKS, CHUNK_COUNTS):
            raise InvalidArgument(f"output {name} cannot be answered with {LATE_CHUNKING}: ask for the embedding")
    return True


def instruction_choice(parameters: dict[str, object], spec: ModelSpec, pairs: bool) -> str | None:
    """The `instruction` parameter (a reranker with a pair template, on pairs), checked; None: the default."""
    value = parameters.get(INSTRUCTION)
    if value is None:
        return None
    if spec.pair_template is None:
        raise InvalidArgument(
            f"parameter {INSTRUCTION}: model {spec.name} has no pair template (only a reranker that reads a prompt,"
            " as Qwen3-Reranker, takes one)"
        )
    if not pairs:
        raise InvalidArgument(f"parameter {INSTRUCTION} goes with (query, text) pairs: send input {QUERY_INPUT}")
    if not isinstance(value, str) or not value.strip():
        raise InvalidArgument(f"parameter {INSTRUCTION} must be a non-empty string")
    return value


def dimensions_choice(requested: int | None, parameters: dict[str, object], spec: ModelSpec) -> int | None:
    """The embedding width asked for (OpenAI's `dimensions` or the `dimensions` parameter), checked; None: full."""
    value = parameters.get(DIMENSIONS, requested)
    if value is None:
        return None
    if type(value) is not int or value < 1:
        raise InvalidArgument(f"dimensions must be a positive integer, got {value!r}")
    if spec.task != "embed":
        raise InvalidArgument(f"dimensions: model {spec.name} is a {spec.task} model and answers no embedding")
    if value == spec.hidden_size:
        return None
    if value not in spec.matryoshka_dimensions:
        if not spec.matryoshka_dimensions:
            raise InvalidArgument(
                f"model {spec.name} gives {spec.hidden_size} dimensions and cannot give {value}:"
                " its embeddings are not trained to be shortened"
            )
        allowed = ", ".join(str(d) for d in (spec.hidden_size, *spec.matryoshka_dimensions))
        raise InvalidArgument(f"model {spec.name} can give {allowed} dimensions, not {value}")
    return value


def _decode_inputs(inputs: Sequence[InputTensor], accepted: dict[str, str]) -> dict[str, np.ndarray | list[bytes]]:
    """Each input's elements by name, checked for name, datatype, shape and content size."""
    if not inputs:
        raise InvalidArgument(f"no inputs; the model takes {', '.join(accepted)}")
    decoded: dict[str, np.ndarray | list[bytes]] = {}
    for tensor in inputs:
        if tensor.name == IMAGE_INPUT and tensor.name not in accepted:
            raise InvalidArgument(
                f"input {IMAGE_INPUT}: this model has no image tower, it takes no images"
                f" (inputs: {', '.join(accepted)})"
            )
        if tensor.name not in accepted:
            raise InvalidArgument(f"unknown input {tensor.name!r} (inputs: {', '.join(accepted)})")
        if tensor.name in decoded:
            raise InvalidArgument(f"input {tensor.name} given twice")
        if tensor.datatype != accepted[tensor.name]:
            raise InvalidArgument(
                f"input {tensor.name}: datatype {tensor.datatype or '(none)'}, expected {accepted[tensor.name]}"
            )
        if any(d < 0 for d in tensor.shape) or not tensor.shape:
            raise InvalidArgument(f"input {tensor.name}: shape {shape_text(tensor.shape)} is not a valid shape")
        decoded[tensor.name] = _tensor_data(tensor)
    return decoded


def _valid_images(
    decoded: dict[str, np.ndarray | list[bytes]],
    shape: tuple[int, ...],
    parameters: dict[str, object],
    signature: ModelSignature,
    row_limit: RowLimit | None,
) -> list[bytes]:
    """A request's encoded images, checked: alone, [batch] or [batch, 1], rows, each one's size (not yet decoded)."""
    others = sorted(set(decoded) - {IMAGE_INPUT})
    if others:
        raise InvalidArgument(
            f"input {IMAGE_INPUT} cannot be combined with input {others[0]}: a request carries images, texts or"
            " token inputs, one of them"
        )
    if len(shape) not in (1, 2) or (len(shape) == 2 and shape[1] != 1):
        raise InvalidArgument(f"input {IMAGE_INPUT}: shape {shape_text(shape)} must be [batch] or [batch, 1]")
    if parameters.get(LATE_CHUNKING):
        raise InvalidArgument(f"parameter {LATE_CHUNKING} embeds chunks of a text: send input {TEXT_INPUT}")
    images = list(decoded[IMAGE_INPUT])
    check_rows(len(images), signature, row_limit)
    for index, image in enumerate(images):
        if not image:
            raise InvalidArgument(f"input {IMAGE_INPUT}[{index}] is empty (0 bytes)", "image_unreadable")
        if len(image) > signature.max_image_bytes:
            raise RequestTooLarge(
                f"input {IMAGE_INPUT}[{index}] is {len(image)} bytes, over the limit of {signature.max_image_bytes}"
                " bytes per image (--max-image-bytes)",
                "image_too_large",
            )
    return images


def valid_texts(
    inputs: dict[str, Sequence[bytes]], prefix: str, signature: ModelSignature, row_limit: RowLimit | None
) -> list[str]:
    """The texts of a request's first input, checked (rows, sizes with the other inputs', UTF-8) and prompted.

    Every route that reads texts checks them here: inferences (`validate`) and /tokenize alike.
    """
    name, elements = next(iter(inputs.items()))
    check_rows(len(elements), signature, row_limit)
    check_text_sizes(inputs, signature.text_limits)
    texts = decode_texts(list(elements), name)
    return [prefix + text for text in texts] if prefix else texts


def validate(
    inputs: Sequence[InputTensor],
    outputs: Sequence[str],
    parameters: dict[str, object],
    signature: ModelSignature,
    row_limit: RowLimit | None = None,
    *,
    dimensions: int | None = None,
) -> ValidRequest:
    """Check a request's inputs, outputs and parameters against a model; texts (or pairs) or token rows come back.

    dimensions: the embedding width a front end asked for in its own field (OpenAI's), if any.
    """
    spec = signature.spec
    decoded = _decode_inputs(inputs, signature.input_datatypes)
    texts = tokens = queries = images = None
    prefix, adapter_id = prompt_and_task(parameters, spec)
    if IMAGE_INPUT in decoded:
        shape = next(tensor.shape for tensor in inputs if tensor.name == IMAGE_INPUT)
        images = _valid_images(decoded, shape, parameters, signature, row_limit)
    elif TEXT_INPUT in decoded:
        if set(decoded) - {TEXT_INPUT, QUERY_INPUT}:
            raise InvalidArgument("input text cannot be combined with token inputs")
        shape = next(tensor.shape for tensor in inputs if tensor.name == TEXT_INPUT)
        if len(shape) not in (1, 2) or (len(shape) == 2 and shape[1] != 1):
            raise InvalidArgument(f"input text: shape {shape_text(shape)} must be [batch] or [batch, 1]")
        elements = decoded[TEXT_INPUT]
        query_elements = decoded.get(QUERY_INPUT)
        if query_elements is not None and len(query_elements) != len(elements):
            raise InvalidArgument(
                f"input query holds {len(query_elements)} elements and text {len(elements)}: each text needs its query"
            )
        texts = valid_texts({TEXT_INPUT: elements, QUERY_INPUT: query_elements or ()}, prefix, signature, row_limit)
        if query_elements is not None:
            queries = decode_texts(query_elements, QUERY_INPUT)
    elif QUERY_INPUT in decoded:
        raise InvalidArgument("input query needs input text: row i is the pair (query[i], text[i])")
    elif parameters.get(LATE_CHUNKING):
        raise InvalidArgument(f"parameter {LATE_CHUNKING} needs texts (input {TEXT_INPUT}), not token inputs")
    else:
        arrays = {name: np.asarray(value) for name, value in decoded.items()}
        _check_tokens(arrays, signature)
        if ADAPTER_IDS in arrays and TASK in parameters:
            raise InvalidArgument(f"input {ADAPTER_IDS} and parameter {TASK} both choose the task: send one")
        check_rows(arrays["input_ids"].shape[0], signature, row_limit)
        tokens = TokenRows.from_padded(arrays)
    pairs = queries is not None
    requested = requested_outputs(outputs, signature, pairs)
    if not outputs and parameters.get(LATE_CHUNKING) is True:
        requested = ("embedding",)
    return ValidRequest(
        texts,
        tokens,
        requested,
        timeout_s(parameters),
        queries=queries,
        truncate=truncate_choice(parameters),
        dimensions=dimensions_choice(dimensions, parameters, spec),
        top_k=top_k_choice(parameters, INDICES in signature.outputs, spec.name),
        input_type=input_type_choice(parameters, spec),
        late_chunking=late_chunking_choice(parameters, signature, pairs, requested),
        instruction=instruction_choice(parameters, spec, pairs),
        adapter_id=adapter_id if tokens is None or ADAPTER_IDS not in decoded else 0,
        add_special_tokens=add_special_tokens_choice(parameters, requested, texts, pairs),
        priority=priority_choice(parameters, signature.priority_levels),
        images=images,
    )


def check_rows(rows: int, signature: ModelSignature, limit: RowLimit | None) -> None:
    """Refuse an empty batch, or one over the front end's limit (or else the model's max_batch_size)."""
    if rows < 1:
        raise InvalidArgument("the batch is empty")
    if limit is not None and rows > limit.rows:
        raise RequestTooLarge(
            f"{rows} inputs, over the limit of {limit.rows} per request ({limit.setting})", "too_many_inputs"
        )
    if limit is None and rows > signature.max_batch_size:
        raise InvalidArgument(f"batch of {rows} exceeds the model's max_batch_size {signature.max_batch_size}")
