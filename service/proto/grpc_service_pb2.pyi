from collections.abc import Iterable as _Iterable
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar

from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from google.protobuf.internal import containers as _containers

from service.proto import model_config_pb2 as _model_config_pb2

DESCRIPTOR: _descriptor.FileDescriptor

class ServerLiveRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServerLiveResponse(_message.Message):
    __slots__ = ("live",)
    LIVE_FIELD_NUMBER: _ClassVar[int]
    live: bool
    def __init__(self, live: bool | None = ...) -> None: ...

class ServerReadyRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServerReadyResponse(_message.Message):
    __slots__ = ("ready",)
    READY_FIELD_NUMBER: _ClassVar[int]
    ready: bool
    def __init__(self, ready: bool | None = ...) -> None: ...

class ModelReadyRequest(_message.Message):
    __slots__ = ("name", "version")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: str
    def __init__(self, name: str | None = ..., version: str | None = ...) -> None: ...

class ModelReadyResponse(_message.Message):
    __slots__ = ("ready",)
    READY_FIELD_NUMBER: _ClassVar[int]
    ready: bool
    def __init__(self, ready: bool | None = ...) -> None: ...

class ServerMetadataRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServerMetadataResponse(_message.Message):
    __slots__ = ("extensions", "name", "version")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    EXTENSIONS_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: str
    extensions: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: str | None = ..., version: str | None = ..., extensions: _Iterable[str] | None = ...) -> None: ...

class ModelMetadataRequest(_message.Message):
    __slots__ = ("name", "version")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: str
    def __init__(self, name: str | None = ..., version: str | None = ...) -> None: ...

class ModelMetadataResponse(_message.Message):
    __slots__ = ("inputs", "name", "outputs", "platform", "versions")
    class TensorMetadata(_message.Message):
        __slots__ = ("datatype", "name", "shape")
        NAME_FIELD_NUMBER: _ClassVar[int]
        DATATYPE_FIELD_NUMBER: _ClassVar[int]
        SHAPE_FIELD_NUMBER: _ClassVar[int]
        name: str
        datatype: str
        shape: _containers.RepeatedScalarFieldContainer[int]
        def __init__(self, name: str | None = ..., datatype: str | None = ..., shape: _Iterable[int] | None = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    PLATFORM_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    name: str
    versions: _containers.RepeatedScalarFieldContainer[str]
    platform: str
    inputs: _containers.RepeatedCompositeFieldContainer[ModelMetadataResponse.TensorMetadata]
    outputs: _containers.RepeatedCompositeFieldContainer[ModelMetadataResponse.TensorMetadata]
    def __init__(self, name: str | None = ..., versions: _Iterable[str] | None = ..., platform: str | None = ..., inputs: _Iterable[ModelMetadataResponse.TensorMetadata | _Mapping] | None = ..., outputs: _Iterable[ModelMetadataResponse.TensorMetadata | _Mapping] | None = ...) -> None: ...

class InferParameter(_message.Message):
    __slots__ = ("bool_param", "double_param", "int64_param", "string_param", "uint64_param")
    BOOL_PARAM_FIELD_NUMBER: _ClassVar[int]
    INT64_PARAM_FIELD_NUMBER: _ClassVar[int]
    STRING_PARAM_FIELD_NUMBER: _ClassVar[int]
    DOUBLE_PARAM_FIELD_NUMBER: _ClassVar[int]
    UINT64_PARAM_FIELD_NUMBER: _ClassVar[int]
    bool_param: bool
    int64_param: int
    string_param: str
    double_param: float
    uint64_param: int
    def __init__(self, bool_param: bool | None = ..., int64_param: int | None = ..., string_param: str | None = ..., double_param: float | None = ..., uint64_param: int | None = ...) -> None: ...

class InferTensorContents(_message.Message):
    __slots__ = ("bool_contents", "bytes_contents", "fp32_contents", "fp64_contents", "int64_contents", "int_contents", "uint64_contents", "uint_contents")
    BOOL_CONTENTS_FIELD_NUMBER: _ClassVar[int]
    INT_CONTENTS_FIELD_NUMBER: _ClassVar[int]
    INT64_CONTENTS_FIELD_NUMBER: _ClassVar[int]
    UINT_CONTENTS_FIELD_NUMBER: _ClassVar[int]
    UINT64_CONTENTS_FIELD_NUMBER: _ClassVar[int]
    FP32_CONTENTS_FIELD_NUMBER: _ClassVar[int]
    FP64_CONTENTS_FIELD_NUMBER: _ClassVar[int]
    BYTES_CONTENTS_FIELD_NUMBER: _ClassVar[int]
    bool_contents: _containers.RepeatedScalarFieldContainer[bool]
    int_contents: _containers.RepeatedScalarFieldContainer[int]
    int64_contents: _containers.RepeatedScalarFieldContainer[int]
    uint_contents: _containers.RepeatedScalarFieldContainer[int]
    uint64_contents: _containers.RepeatedScalarFieldContainer[int]
    fp32_contents: _containers.RepeatedScalarFieldContainer[float]
    fp64_contents: _containers.RepeatedScalarFieldContainer[float]
    bytes_contents: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, bool_contents: _Iterable[bool] | None = ..., int_contents: _Iterable[int] | None = ..., int64_contents: _Iterable[int] | None = ..., uint_contents: _Iterable[int] | None = ..., uint64_contents: _Iterable[int] | None = ..., fp32_contents: _Iterable[float] | None = ..., fp64_contents: _Iterable[float] | None = ..., bytes_contents: _Iterable[bytes] | None = ...) -> None: ...

class ModelInferRequest(_message.Message):
    __slots__ = ("id", "inputs", "model_name", "model_version", "outputs", "parameters", "raw_input_contents")
    class InferInputTensor(_message.Message):
        __slots__ = ("contents", "datatype", "name", "parameters", "shape")
        class ParametersEntry(_message.Message):
            __slots__ = ("key", "value")
            KEY_FIELD_NUMBER: _ClassVar[int]
            VALUE_FIELD_NUMBER: _ClassVar[int]
            key: str
            value: InferParameter
            def __init__(self, key: str | None = ..., value: InferParameter | _Mapping | None = ...) -> None: ...
        NAME_FIELD_NUMBER: _ClassVar[int]
        DATATYPE_FIELD_NUMBER: _ClassVar[int]
        SHAPE_FIELD_NUMBER: _ClassVar[int]
        PARAMETERS_FIELD_NUMBER: _ClassVar[int]
        CONTENTS_FIELD_NUMBER: _ClassVar[int]
        name: str
        datatype: str
        shape: _containers.RepeatedScalarFieldContainer[int]
        parameters: _containers.MessageMap[str, InferParameter]
        contents: InferTensorContents
        def __init__(self, name: str | None = ..., datatype: str | None = ..., shape: _Iterable[int] | None = ..., parameters: _Mapping[str, InferParameter] | None = ..., contents: InferTensorContents | _Mapping | None = ...) -> None: ...
    class InferRequestedOutputTensor(_message.Message):
        __slots__ = ("name", "parameters")
        class ParametersEntry(_message.Message):
            __slots__ = ("key", "value")
            KEY_FIELD_NUMBER: _ClassVar[int]
            VALUE_FIELD_NUMBER: _ClassVar[int]
            key: str
            value: InferParameter
            def __init__(self, key: str | None = ..., value: InferParameter | _Mapping | None = ...) -> None: ...
        NAME_FIELD_NUMBER: _ClassVar[int]
        PARAMETERS_FIELD_NUMBER: _ClassVar[int]
        name: str
        parameters: _containers.MessageMap[str, InferParameter]
        def __init__(self, name: str | None = ..., parameters: _Mapping[str, InferParameter] | None = ...) -> None: ...
    class ParametersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: InferParameter
        def __init__(self, key: str | None = ..., value: InferParameter | _Mapping | None = ...) -> None: ...
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    RAW_INPUT_CONTENTS_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    model_version: str
    id: str
    parameters: _containers.MessageMap[str, InferParameter]
    inputs: _containers.RepeatedCompositeFieldContainer[ModelInferRequest.InferInputTensor]
    outputs: _containers.RepeatedCompositeFieldContainer[ModelInferRequest.InferRequestedOutputTensor]
    raw_input_contents: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, model_name: str | None = ..., model_version: str | None = ..., id: str | None = ..., parameters: _Mapping[str, InferParameter] | None = ..., inputs: _Iterable[ModelInferRequest.InferInputTensor | _Mapping] | None = ..., outputs: _Iterable[ModelInferRequest.InferRequestedOutputTensor | _Mapping] | None = ..., raw_input_contents: _Iterable[bytes] | None = ...) -> None: ...

class ModelInferResponse(_message.Message):
    __slots__ = ("id", "model_name", "model_version", "outputs", "parameters", "raw_output_contents")
    class InferOutputTensor(_message.Message):
        __slots__ = ("contents", "datatype", "name", "parameters", "shape")
        class ParametersEntry(_message.Message):
            __slots__ = ("key", "value")
            KEY_FIELD_NUMBER: _ClassVar[int]
            VALUE_FIELD_NUMBER: _ClassVar[int]
            key: str
            value: InferParameter
            def __init__(self, key: str | None = ..., value: InferParameter | _Mapping | None = ...) -> None: ...
        NAME_FIELD_NUMBER: _ClassVar[int]
        DATATYPE_FIELD_NUMBER: _ClassVar[int]
        SHAPE_FIELD_NUMBER: _ClassVar[int]
        PARAMETERS_FIELD_NUMBER: _ClassVar[int]
        CONTENTS_FIELD_NUMBER: _ClassVar[int]
        name: str
        datatype: str
        shape: _containers.RepeatedScalarFieldContainer[int]
        parameters: _containers.MessageMap[str, InferParameter]
        contents: InferTensorContents
        def __init__(self, name: str | None = ..., datatype: str | None = ..., shape: _Iterable[int] | None = ..., parameters: _Mapping[str, InferParameter] | None = ..., contents: InferTensorContents | _Mapping | None = ...) -> None: ...
    class ParametersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: InferParameter
        def __init__(self, key: str | None = ..., value: InferParameter | _Mapping | None = ...) -> None: ...
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    RAW_OUTPUT_CONTENTS_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    model_version: str
    id: str
    parameters: _containers.MessageMap[str, InferParameter]
    outputs: _containers.RepeatedCompositeFieldContainer[ModelInferResponse.InferOutputTensor]
    raw_output_contents: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, model_name: str | None = ..., model_version: str | None = ..., id: str | None = ..., parameters: _Mapping[str, InferParameter] | None = ..., outputs: _Iterable[ModelInferResponse.InferOutputTensor | _Mapping] | None = ..., raw_output_contents: _Iterable[bytes] | None = ...) -> None: ...

class ModelConfigRequest(_message.Message):
    __slots__ = ("name", "version")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: str
    def __init__(self, name: str | None = ..., version: str | None = ...) -> None: ...

class ModelConfigResponse(_message.Message):
    __slots__ = ("config",)
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    config: _model_config_pb2.ModelConfig
    def __init__(self, config: _model_config_pb2.ModelConfig | _Mapping | None = ...) -> None: ...

class RepositoryIndexRequest(_message.Message):
    __slots__ = ("ready", "repository_name")
    REPOSITORY_NAME_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    repository_name: str
    ready: bool
    def __init__(self, repository_name: str | None = ..., ready: bool | None = ...) -> None: ...

class RepositoryIndexResponse(_message.Message):
    __slots__ = ("models",)
    class ModelIndex(_message.Message):
        __slots__ = ("name", "reason", "state", "version")
        NAME_FIELD_NUMBER: _ClassVar[int]
        VERSION_FIELD_NUMBER: _ClassVar[int]
        STATE_FIELD_NUMBER: _ClassVar[int]
        REASON_FIELD_NUMBER: _ClassVar[int]
        name: str
        version: str
        state: str
        reason: str
        def __init__(self, name: str | None = ..., version: str | None = ..., state: str | None = ..., reason: str | None = ...) -> None: ...
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[RepositoryIndexResponse.ModelIndex]
    def __init__(self, models: _Iterable[RepositoryIndexResponse.ModelIndex | _Mapping] | None = ...) -> None: ...
