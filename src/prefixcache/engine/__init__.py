"""The model engine: a transformers backend whose prefill starts from the prefix cache."""

from prefixcache.engine.model import DEFAULT_MODEL, KVShape, LoadedModel, load_model
from prefixcache.engine.sampling import SamplingParams
from prefixcache.engine.worker import (
    ContextLengthError,
    DoneEvent,
    Engine,
    EngineError,
    EngineStats,
    ErrorEvent,
    Event,
    Handle,
    QueueFull,
    Request,
    RequestTimeout,
    TokenEvent,
    Usage,
)

__all__ = [
    "DEFAULT_MODEL",
    "ContextLengthError",
    "DoneEvent",
    "Engine",
    "EngineError",
    "EngineStats",
    "ErrorEvent",
    "Event",
    "Handle",
    "KVShape",
    "LoadedModel",
    "QueueFull",
    "Request",
    "RequestTimeout",
    "SamplingParams",
    "TokenEvent",
    "Usage",
    "load_model",
]
