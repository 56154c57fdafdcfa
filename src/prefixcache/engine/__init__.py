"""The model engine: a transformers backend whose prefill starts from the prefix cache."""

from prefixcache.engine.model import DEFAULT_MODEL, LoadedModel, load_model
from prefixcache.engine.requests import (
    ContextLengthError,
    DoneEvent,
    EngineError,
    EngineStats,
    ErrorEvent,
    Event,
    Handle,
    KVBudgetExceeded,
    QueueFull,
    Request,
    RequestTimeout,
    TenantBusy,
    TokenEvent,
    Usage,
)
from prefixcache.engine.sampling import SamplingParams
from prefixcache.engine.scheduler import Admission, Order, TenantLimits
from prefixcache.engine.worker import Engine

__all__ = [
    "DEFAULT_MODEL",
    "Admission",
    "ContextLengthError",
    "DoneEvent",
    "Engine",
    "EngineError",
    "EngineStats",
    "ErrorEvent",
    "Event",
    "Handle",
    "KVBudgetExceeded",
    "LoadedModel",
    "Order",
    "QueueFull",
    "Request",
    "RequestTimeout",
    "SamplingParams",
    "TenantBusy",
    "TenantLimits",
    "TokenEvent",
    "Usage",
    "load_model",
]
