"""Prefill compute a prefix cache saves, in FLOPs and GPU-hours.

A hit rate says how many tokens were reused; what an operator pays for is compute.
Attention makes the two differ: a token late in a prompt costs more than an early
one, so a cached prefix saves *less* than its share of the tokens, because the
uncached suffix holds the expensive late positions. This module turns (prompt
length, cached tokens) into FLOPs with one closed form, and FLOPs into GPU time.

Prefill FLOPs of a prompt of ``L`` tokens, for a model of ``P`` parameters, ``n``
layers and hidden size ``d``::

    total(L)   = 2 P L  +  attn(0, L)
    attn(a, b) = 4 n d * sum(p for p in range(a, b))          # positions a .. b-1
               = 4 n d * (b (b - 1) - a (a - 1)) / 2

``2 P`` per token is the dense matmuls (one multiply-add, 2 FLOPs, per parameter);
the token at position ``p`` attends to ``p`` earlier tokens in each layer, through
two products (Q K^T and A V) of ``d`` multiply-adds each: ``4 n d p``. When the
first ``h`` tokens come from the cache, prefill computes only tokens ``[h, L)``::

    computed(L, h) = 2 P (L - h) + attn(h, L)
    saved(L, h)    = total(L) - computed(L, h) = 2 P h + attn(0, h)

It ignores the LM head and embedding details beyond what ``P`` counts, softmax,
norms and the causal-mask halving some kernels exploit; it is a planning model, not
a profiler. A prompt longer than the model's context length is an error: the
model could not have served it, so its "savings" would be fiction.

A profile may also give its KV layout (KV heads, head size, dtype: ``KVLayout``), which
says how many bytes of KV a cached token holds, so a capacity in bytes can be turned
into tokens (``ModelProfile.kv_bytes_per_token``). A model whose layers differ (sliding
windows, recurrent state: ``kv_groups``) gives its ``groups`` instead; the FLOPs above
still count every layer as full attention (a planning upper bound for such a model).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TypeVar

from prefixcache.config import KV_DTYPES, KVLayout, check_int
from prefixcache.kv_groups import GroupedLayout, LayerGroup, LayerKind
from prefixcache.sim.results import ReplayResult

_T = TypeVar("_T")


def _check_name(field_name: str, value: object) -> None:
    if not isinstance(value, str) or not value or ":" in value or "," in value:
        raise ValueError(f"{field_name} must be a non-empty string without ':' or ',', got {value!r}")


def _check_positive(field_name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{field_name} must be a number, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{field_name} must be finite and > 0, got {value!r}")


@dataclass(frozen=True, slots=True)
class ModelProfile:
    """The few numbers of a model that decide its prefill cost, and optionally its KV
    layout (``kv``: the size of a cached token; its layers are the model's), or for a
    model whose layers differ its layer groups (``groups``, which add up to its layers)."""

    name: str
    params: float
    layers: int
    hidden: int
    context_length: int
    kv: KVLayout | None = None
    groups: GroupedLayout | None = None

    def __post_init__(self) -> None:
        _check_name("name", self.name)
        _check_positive("params", self.params)
        check_int("layers", self.layers, 1)
        check_int("hidden", self.hidden, 1)
        check_int("context_length", self.context_length, 1)
        if self.kv is not None and (not isinstance(self.kv, KVLayout) or self.kv.layers != self.layers):
            raise ValueError(f"kv must be a KVLayout of the model's {self.layers} layers, got {self.kv!r}")
        if self.groups is not None:
            if self.kv is not None:
                raise ValueError("give kv (a uniform layout) or groups (layer groups), not both")
            if not isinstance(self.groups, GroupedLayout) or self.groups.layers != self.layers:
                raise ValueError(
                    f"groups must be a GroupedLayout of the model's {self.layers} layers, got {self.groups!r}"
                )

    @property
    def kv_bytes_per_token(self) -> int | None:
        """Bytes of KV one cached token holds (K and V, every layer), ``None`` without a layout."""
        return None if self.kv is None else self.kv.bytes_per_token

    @property
    def layout(self) -> KVLayout | GroupedLayout | None:
        """What the planner sizes with: the uniform ``kv``, else the ``groups``, else ``None``."""
        return self.kv if self.kv is not None else self.groups


@dataclass(frozen=True, slots=True)
class GPUProfile:
    """A GPU by its peak dense throughput (FLOP/s, the datasheet's BF16 dense figure)."""

    name: str
    peak_flops: float

    def __post_init__(self) -> None:
        _check_name("name", self.name)
        _check_positive("peak_flops", self.peak_flops)


_FULL, _SLIDING, _STATE = LayerKind.FULL, LayerKind.SLIDING, LayerKind.STATE

# NOTE: from the models' published Hugging Face configs (config.json; field names given),
# with vLLM's cache dtype default ("auto": the model's, bfloat16). Params are the ones a
# token's prefill multiplies by (a mixture of experts: the active ones).
HYBRID_MODELS = (
    # google/gemma-3-27b-it, text_config: num_hidden_layers 62, hidden_size 5376,
    # num_key_value_heads 16, head_dim 128, sliding_window 1024, sliding_window_pattern 6
    # (layer i is full attention when (i + 1) % 6 == 0: 10 full, 52 sliding, the first
    # sliding), max_position_embeddings 131072. Params: the text model's 27.0e9
    # (embeddings 262208 x 5376 + 62 layers of attention and a 21504-wide MLP; the
    # card's 27.4B includes the 0.4B vision tower).
    ModelProfile(
        "gemma-3-27b", 27.0e9, 62, 5376, 131072,
        groups=GroupedLayout((
            LayerGroup(_SLIDING, 52, 16, 128, "bfloat16", window=1024),
            LayerGroup(_FULL, 10, 16, 128, "bfloat16"),
        )),
    ),
    # openai/gpt-oss-120b: num_hidden_layers 36, layer_types alternating
    # sliding_attention / full_attention (18 each, the first sliding), sliding_window 128,
    # num_key_value_heads 8, head_dim 64, hidden_size 2880, max_position_embeddings 131072.
    # Params: 5.1e9 active of 116.8e9 (the model card: 4 of 128 experts a token).
    ModelProfile(
        "gpt-oss-120b", 5.1e9, 36, 2880, 131072,
        groups=GroupedLayout((
            LayerGroup(_SLIDING, 18, 8, 64, "bfloat16", window=128),
            LayerGroup(_FULL, 18, 8, 64, "bfloat16"),
        )),
    ),
    # Qwen/Qwen3-Next-80B-A3B-Instruct: num_hidden_layers 48, full_attention_interval 4
    # (every 4th layer gated attention: 12 full, 36 Gated DeltaNet, the first linear),
    # num_key_value_heads 2, head_dim 256, hidden_size 2048, max_position_embeddings
    # 262144. A Gated DeltaNet layer's state (vLLM's gated_delta_net_state_shape):
    # the recurrent state linear_num_value_heads 32 x linear_key_head_dim 128 x
    # linear_value_head_dim 128 = 524,288 values, and the convolution's last
    # linear_conv_kernel_dim - 1 = 3 inputs of conv_dim = 2 x 16 (linear_num_key_heads)
    # x 128 + 32 x 128 = 8,192 channels = 24,576 values: 548,864 values x 2 bytes
    # (bfloat16) = 1,097,728 bytes a layer. (A float32 recurrent state, as some
    # deployments pick with mamba_ssm_cache_dtype, doubles its part.) Params: 3.0e9 active
    # of 80e9 (the model card's "A3B").
    ModelProfile(
        "qwen3-next-80b-a3b", 3.0e9, 48, 2048, 262144,
        groups=GroupedLayout((
            LayerGroup(_STATE, 36, state_bytes=1_097_728),
            LayerGroup(_FULL, 12, 2, 256, "bfloat16"),
        )),
    ),
)  # fmt: skip

MODELS: Mapping[str, ModelProfile] = MappingProxyType(
    {
        p.name: p
        for p in (
            ModelProfile("llama-3-8b", 8.03e9, 32, 4096, 131072, KVLayout(32, 8, 128, "bfloat16")),
            ModelProfile("llama-3-70b", 70.6e9, 80, 8192, 131072, KVLayout(80, 8, 128, "bfloat16")),
            ModelProfile("smollm2-135m", 1.35e8, 30, 576, 8192, KVLayout(30, 3, 64, "bfloat16")),
            *HYBRID_MODELS,
        )
    }
)
"""Built-in model profiles by name (read-only: user profiles come from specs, not edits)."""

GPUS: Mapping[str, GPUProfile] = MappingProxyType(
    {
        g.name: g
        for g in (
            GPUProfile("h100", 989e12),
            GPUProfile("h200", 989e12),  # same compute as the H100; more, faster memory
            GPUProfile("a100", 312e12),
            GPUProfile("l40s", 362e12),
        )
    }
)
"""Built-in GPU profiles by name, peak dense BF16 FLOP/s."""

_MODEL_EXAMPLE = "name:params=7e9,layers=32,hidden=4096,context=32768"
_KV_FIELDS = ("kv_heads", "head_dim", "dtype")  # optional, together: the KV layout
_GPU_EXAMPLE = "name:peak=500e12"


def _parse_float(field_name: str, text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{field_name}: not a number: {text!r}") from None


def _parse_int(field_name: str, text: str) -> int:
    """``32`` and also ``128e3``, as long as the value is whole."""
    try:
        return int(text)
    except ValueError:
        value = _parse_float(field_name, text)
    if not math.isfinite(value) or not value.is_integer():
        raise ValueError(f"{field_name} must be an integer, got {text!r}")
    return int(value)


def _parse_spec(
    spec: str, keys: tuple[str, ...], example: str, optional: tuple[str, ...] = ()
) -> tuple[str, dict[str, str]]:
    """Split ``name:key=value,...`` into the name and the raw value of every key given
    (all of ``keys``, any of ``optional``)."""
    name, sep, body = spec.partition(":")
    if not sep:
        raise ValueError(f"profile spec {spec!r} has no ':'; expected e.g. {example!r}")
    _check_name("name", name.strip())
    values: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in body.split(","))):
        key, eq, text = (part.strip() for part in item.partition("="))
        if not eq:
            raise ValueError(f"profile spec {spec!r}: expected key=value, got {item!r}")
        if key not in keys + optional:
            raise ValueError(f"profile spec {spec!r}: unknown field {key!r}; valid: {', '.join(keys + optional)}")
        if key in values:
            raise ValueError(f"profile spec {spec!r}: field {key!r} given twice")
        values[key] = text
    missing = [key for key in keys if key not in values]
    if missing:
        raise ValueError(f"profile spec {spec!r}: missing field(s) {', '.join(missing)}; expected e.g. {example!r}")
    return name.strip(), values


def parse_model_profile(spec: str) -> ModelProfile:
    """A user-defined model from ``name:params=7e9,layers=32,hidden=4096,context=32768``,
    with its KV layout when ``kv_heads=8,head_dim=128`` are given too (``dtype=``, one of
    the KV dtypes, defaults to bfloat16)."""
    name, v = _parse_spec(spec, ("params", "layers", "hidden", "context"), _MODEL_EXAMPLE, _KV_FIELDS)
    layers = _parse_int("layers", v["layers"])
    kv = None
    if any(key in v for key in _KV_FIELDS):
        if "kv_heads" not in v or "head_dim" not in v:
            raise ValueError(f"profile spec {spec!r}: a KV layout needs both kv_heads and head_dim (dtype optional)")
        dtype = v.get("dtype", "bfloat16")
        if dtype not in KV_DTYPES:
            raise ValueError(f"profile spec {spec!r}: unknown dtype {dtype!r}; valid: {', '.join(KV_DTYPES)}")
        kv = KVLayout(layers, _parse_int("kv_heads", v["kv_heads"]), _parse_int("head_dim", v["head_dim"]), dtype)
    return ModelProfile(
        name,
        params=_parse_float("params", v["params"]),
        layers=layers,
        hidden=_parse_int("hidden", v["hidden"]),
        context_length=_parse_int("context", v["context"]),
        kv=kv,
    )


def parse_gpu(spec: str) -> GPUProfile:
    """A user-defined GPU from ``name:peak=500e12`` (peak dense FLOP/s)."""
    name, v = _parse_spec(spec, ("peak",), _GPU_EXAMPLE)
    return GPUProfile(name, peak_flops=_parse_float("peak", v["peak"]))


def _lookup(kind: str, registry: Mapping[str, _T], name_or_spec: str, parse: Callable[[str], _T], example: str) -> _T:
    if ":" in name_or_spec:
        return parse(name_or_spec)
    try:
        return registry[name_or_spec]
    except KeyError:
        valid = ", ".join(sorted(registry))
        raise ValueError(f"unknown {kind} {name_or_spec!r}; valid: {valid} (or a spec like {example!r})") from None


def get_model(name_or_spec: str) -> ModelProfile:
    """A built-in model by name, or a user one from a spec (anything with a ':')."""
    return _lookup("model", MODELS, name_or_spec, parse_model_profile, _MODEL_EXAMPLE)


def get_gpu(name_or_spec: str) -> GPUProfile:
    """A built-in GPU by name, or a user one from a spec (anything with a ':')."""
    return _lookup("gpu", GPUS, name_or_spec, parse_gpu, _GPU_EXAMPLE)


def attention_flops(model: ModelProfile, start: int, end: int) -> float:
    """Attention FLOPs of the tokens at positions ``[start, end)``: ``4 n d * sum(p)``.

    NOTE: the position sum is done in exact integers before the one float multiply, so
    the closed form matches a brute-force loop exactly for any realistic length."""
    positions = (end * (end - 1) - start * (start - 1)) // 2
    return float(4 * model.layers * model.hidden * positions)


@dataclass(frozen=True, slots=True)
class CostModel:
    """Prefill FLOPs of a model on a GPU run at ``utilization`` of its peak (MFU).

    Utilization is a planning assumption, not a measurement: 0.5 is a common prefill
    MFU for well-tuned serving; pass the figure your deployment actually reaches."""

    model: ModelProfile
    gpu: GPUProfile
    utilization: float = 0.5
    defaults: tuple[str, ...] = ()  # which of "model", "gpu", "utilization" nobody chose

    def __post_init__(self) -> None:
        u = self.utilization
        if isinstance(u, bool) or not isinstance(u, int | float) or not (0 < u <= 1):
            raise ValueError(f"utilization must be in (0, 1], got {u!r}")
        unknown = set(self.defaults) - {"model", "gpu", "utilization"}
        if unknown:
            raise ValueError(f"defaults may name model, gpu and utilization, got {sorted(unknown)}")

    @property
    def label(self) -> str:
        return f"{self.model.name}@{self.gpu.name} u={self.utilization:.2f}"

    def request(self, input_length: int, cached_tokens: int, strict: bool = True) -> tuple[float, float]:
        """(total, saved) prefill FLOPs of one prompt whose first ``cached_tokens`` hit.
        With ``strict`` a prompt beyond the model's context is an error; without, the
        formula is applied as is (a replayed trace may come from a longer-context model).

        NOTE: a full hit (``cached_tokens == input_length``) saves everything, although
        a real engine recomputes the last token to get its logits. The cache's reported
        hit length is honest (what was loaded), and the model follows it rather than
        second-guessing one token of one engine."""
        check_int("input_length", input_length, 0)
        check_int("cached_tokens", cached_tokens, 0)
        if strict and input_length > self.model.context_length:
            raise ValueError(
                f"input_length {input_length} exceeds the context_length {self.model.context_length} "
                f"of {self.model.name}; this model could not have served the prompt"
            )
        if cached_tokens > input_length:
            raise ValueError(f"cached_tokens {cached_tokens} exceeds input_length {input_length}")
        dense = 2.0 * self.model.params
        total = dense * input_length + attention_flops(self.model, 0, input_length)
        computed = dense * (input_length - cached_tokens) + attention_flops(self.model, cached_tokens, input_length)
        return total, total - computed

    def gpu_seconds(self, flops: float) -> float:
        """Seconds of one GPU at the assumed utilization to compute ``flops``."""
        return flops / (self.gpu.peak_flops * self.utilization)


@dataclass(slots=True)
class CostAccumulator:
    """Sums the cost of the counted requests of one replay, then writes it into the result.

    Call ``add`` only for requests counted in the result's rates (after the warm-up),
    so that the compute avoided and the hit rates describe the same requests."""

    model: CostModel
    requests: int = field(default=0, init=False)
    flops_total: float = field(default=0.0, init=False)
    flops_saved: float = field(default=0.0, init=False)
    over_context: int = field(default=0, init=False)

    def add(self, input_length: int, cached_tokens: int) -> None:
        """Count one request. A prompt longer than the profile's context is costed by the
        same formula and counted in ``over_context``, a figure of the result: a trace
        from a longer-context model must not abort a capacity plan."""
        total, saved = self.model.request(input_length, cached_tokens, strict=False)
        self.over_context += input_length > self.model.model.context_length
        self.requests += 1
        self.flops_total += total
        self.flops_saved += saved

    def apply(self, result: ReplayResult) -> None:
        """Fill the result's cost fields (it is mutated in place)."""
        result.prefill_flops_total = self.flops_total
        result.prefill_flops_saved = self.flops_saved
        result.gpu_hours_saved = self.model.gpu_seconds(self.flops_saved) / 3600.0
        result.cost_profile = self.model.label
        result.cost_defaults = self.model.defaults
        result.context_length = self.model.model.context_length
        result.prompts_over_context = self.over_context
        result.kv_bytes_per_token = self.model.model.kv_bytes_per_token
