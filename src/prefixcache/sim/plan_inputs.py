"""What the capacity planner is told besides the trace: the model's KV layout (how many
bytes one cached token takes) and the storage tiers (their sizes and bandwidths).

Bytes per token of KV, for a model of ``n`` layers storing ``h`` key/value heads of
``d`` dimensions each at ``b`` bytes per value::

    bytes_per_token = n * 2 * h * d * b          # 2: one key and one value

The layout is the model profile's own where it has one, else the built-in one of the
cost model's built-in profiles (``costmodel.MODELS``) by name; a user model without one
needs ``--kv-layout`` to say its heads. Dtypes are the codec's (``config.KV_DTYPES``).
A model whose layers differ (sliding windows, recurrent state) has layer groups
(``kv_groups``): a built-in profile's own, or a ``--kv-groups`` TOML file of
``[[group]]`` tables, one per group, whose keys are ``LayerGroup``'s fields.

Sizes and bandwidths take a number with an optional unit. ``K``, ``M``, ``G``, ``T``
alone or with ``iB`` are powers of 1024 (``64G`` = ``64GiB`` = 64 x 2^30 bytes, as
memory is sold); with ``B`` alone they are powers of 1000 (``20GB/s`` = 20 x 10^9
bytes a second, as links and disks are rated). A bandwidth ends in ``/s``.

A tier may name the codec it stores frames in (``disk:2T:2GB/s:int8``; default raw):
its size then holds more tokens, and each hit it serves costs a decode on top of its
transfer (``codec_sizing``), at a rate given per codec (``int8=8GB/s``) or measured.
"""

from __future__ import annotations

import math
import re
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from prefixcache.config import KVLayout
from prefixcache.kv_groups import AnyLayout, GroupedLayout
from prefixcache.sim.codec_sizing import RAW, check_codec
from prefixcache.sim.costmodel import ModelProfile

KV_LAYOUTS: Mapping[str, KVLayout] = MappingProxyType(
    {
        "llama-3-8b": KVLayout(32, 8, 128, "bfloat16"),  # grouped-query attention: 8 KV heads of 32
        "llama-3-70b": KVLayout(80, 8, 128, "bfloat16"),
        "smollm2-135m": KVLayout(30, 3, 64, "bfloat16"),
    }
)
"""KV layouts of the cost model's built-in profiles by name, for a profile that does not
carry its own (``ModelProfile.kv``, where the cost model has it, comes first)."""

_LAYOUT_KEYS = ("kv_heads", "head_dim", "dtype")
_LAYOUT_EXAMPLE = "kv_heads=8,head_dim=128,dtype=bfloat16"


def kv_layout(model: ModelProfile, spec: str | None = None) -> KVLayout:
    """The KV layout of ``model`` (its own, else the built-in one of its name), with what
    ``spec`` (``kv_heads=8,head_dim=128,dtype=float16``, any subset) overrides; a model
    without a layout needs ``kv_heads`` and ``head_dim`` in ``spec``. Layers are always
    the model profile's."""
    values: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in (spec or "").split(","))):
        key, eq, text = (part.strip() for part in item.partition("="))
        if not eq or key not in _LAYOUT_KEYS:
            raise ValueError(f"KV layout {spec!r}: expected key=value with keys {', '.join(_LAYOUT_KEYS)}")
        if key in values:
            raise ValueError(f"KV layout {spec!r}: {key!r} given twice")
        values[key] = text
    own = getattr(model, "kv", None)  # NOTE: ModelProfile.kv where the cost model has it
    base = own if isinstance(own, KVLayout) else KV_LAYOUTS.get(model.name)
    if base is None:
        missing = [key for key in ("kv_heads", "head_dim") if key not in values]
        if missing:
            raise ValueError(
                f"model {model.name!r} has no KV layout (built-in: {', '.join(sorted(KV_LAYOUTS))}); "
                f"give --kv-layout {_LAYOUT_EXAMPLE!r} (missing {', '.join(missing)})"
            )
        base = KVLayout(model.layers, 1, 1, "bfloat16")
    try:
        heads = int(values["kv_heads"]) if "kv_heads" in values else base.kv_heads
        dims = int(values["head_dim"]) if "head_dim" in values else base.head_dim
    except ValueError:
        raise ValueError(f"KV layout {spec!r}: kv_heads and head_dim must be integers") from None
    return KVLayout(model.layers, heads, dims, values.get("dtype", base.dtype))


def plan_layout(model: ModelProfile, spec: str | None = None, groups: GroupedLayout | None = None) -> AnyLayout:
    """What the planner sizes ``model`` with: ``groups`` (a ``--kv-groups`` file) where
    given, else the profile's own groups, else its uniform ``kv_layout`` with ``spec``.
    Groups that are one full group are its ``KVLayout`` (a uniform model, planned as
    it always was)."""
    if groups is not None:
        if spec:
            raise ValueError("give --kv-layout (a uniform layout) or --kv-groups (layer groups), not both")
        if groups.layers != model.layers:
            raise ValueError(
                f"the layer groups add up to {groups.layers} layers; model {model.name!r} has {model.layers}"
            )
        return groups.uniform or groups
    if model.groups is not None:
        if spec:
            raise ValueError(
                f"--kv-layout changes a uniform layout; model {model.name!r} has layer groups "
                f"({model.groups.label()}): give them changed in a --kv-groups file"
            )
        return model.groups.uniform or model.groups
    return kv_layout(model, spec)


def load_groups_toml(path: str | Path) -> GroupedLayout:
    """Layer groups from a TOML file of ``[[group]]`` tables and nothing else, each with
    ``kind`` (full, sliding, state) and ``layers``, an attention group's ``kv_heads``,
    ``head_dim``, ``dtype`` and a sliding one's ``window``, a state group's
    ``state_bytes`` (per layer)::

        [[group]]
        kind = "sliding"
        layers = 52
        kv_heads = 16
        head_dim = 128
        dtype = "bfloat16"
        window = 1024

        [[group]]
        kind = "full"
        layers = 10
        kv_heads = 16
        head_dim = 128
        dtype = "bfloat16"
    """
    data = _read_toml(path, "layer groups file")
    if set(data) != {"group"}:
        raise ValueError(f"layer groups file {path}: expected one or more [[group]] tables and nothing else")
    return GroupedLayout.from_tables(data["group"], f"layer groups file {path}")


def layout_label(kv: KVLayout) -> str:
    """``32 layers x 2 (K, V) x 8 KV heads x 128 dims x bfloat16``."""
    return f"{kv.layers} layers x 2 (K, V) x {kv.kv_heads} KV heads x {kv.head_dim} dims x {kv.dtype}"


# ------------------------------------------------------------------------ sizes and tiers

_QUANTITY = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([KMGTP]?)(i?B?)\s*$", re.IGNORECASE)
_POWERS = {"": 0, "K": 1, "M": 2, "G": 3, "T": 4, "P": 5}


def parse_bytes(text: str, what: str = "size") -> float:
    """``64G``, ``64GiB`` (binary), ``64GB`` (decimal), ``1.5e9``: a number of bytes > 0."""
    m = _QUANTITY.match(text)
    if m is None or m.group(3).lower() == "i":
        raise ValueError(f"{what}: not a size: {text!r} (e.g. 64G, 64GiB, 500GB, 2T)")
    number, prefix, unit = float(m.group(1)), m.group(2).upper(), m.group(3).lower()
    base = 1000 if unit == "b" and prefix else 1024
    value = float(number * base ** _POWERS[prefix])
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{what} must be > 0, got {text!r}")
    return value


def parse_bandwidth(text: str, what: str = "bandwidth") -> float:
    """``20GB/s`` (decimal), ``16GiB/s`` (binary): bytes a second > 0."""
    body = text.strip()
    if not body.lower().endswith("/s"):
        raise ValueError(f"{what}: {text!r} must end in /s (e.g. 20GB/s)")
    return parse_bytes(body[:-2], what)


@dataclass(frozen=True, slots=True)
class Tier:
    """One storage tier: a name, its size in stored bytes, the bandwidth it loads them at,
    and the codec its frames are stored in."""

    name: str
    size_bytes: float
    bandwidth: float  # bytes a second
    codec: str = RAW

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip():
            raise ValueError(f"tier name must be a non-empty string, got {self.name!r}")
        check_codec(self.codec, f"tier {self.name!r}")
        for field_name, value in (("size", self.size_bytes), ("bandwidth", self.bandwidth)):
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not (math.isfinite(value) and value > 0)
            ):
                raise ValueError(f"tier {self.name!r}: {field_name} must be finite and > 0, got {value!r}")


TIER_EXAMPLE = "memory:64G:20GB/s"
CODEC_TIER_EXAMPLE = "disk:2T:2GB/s:int8"


def parse_tier(spec: str) -> Tier:
    """``NAME:SIZE:BANDWIDTH[:CODEC]``, e.g. ``memory:64G:20GB/s`` or ``disk:2T:2GB/s:int8``."""
    parts = [part.strip() for part in spec.split(":")]
    if len(parts) not in (3, 4) or not all(parts):
        raise ValueError(
            f"tier {spec!r}: expected NAME:SIZE:BANDWIDTH[:CODEC], e.g. {TIER_EXAMPLE!r} or {CODEC_TIER_EXAMPLE!r}"
        )
    name, size, bandwidth = parts[:3]
    return Tier(
        name,
        parse_bytes(size, f"tier {name!r} size"),
        parse_bandwidth(bandwidth, f"tier {name!r} bandwidth"),
        check_codec(parts[3], f"tier {name!r}") if len(parts) == 4 else RAW,
    )


def parse_decode_rate(spec: str) -> tuple[str, float]:
    """``CODEC=RATE``, e.g. ``int8=8GB/s``: decoded bytes a second of that codec."""
    name, eq, rate = (part.strip() for part in spec.partition("="))
    if not eq or not name or not rate:
        raise ValueError(f"decode rate {spec!r}: expected CODEC=RATE, e.g. 'int8=8GB/s'")
    if check_codec(name, f"decode rate {spec!r}") == RAW:
        raise ValueError(f"decode rate {spec!r}: raw frames are not decoded (they are handed over as they are)")
    return name, parse_bandwidth(rate, f"decode rate of {name}")


def decode_rates(specs: Sequence[tuple[str, float]]) -> tuple[tuple[str, float], ...]:
    """The given rates by codec, each codec once."""
    names = [name for name, _ in specs]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"decode rate given twice for: {', '.join(twice)}")
    return tuple(sorted(specs))


_TIER_KEYS = {"name", "size", "bandwidth"}


def load_tiers_toml(path: str | Path) -> list[Tier]:
    """Tiers from a TOML file of ``[[tier]]`` tables with ``name``, ``size`` and
    ``bandwidth``, and optionally ``codec`` (strings as on the command line)::

        [[tier]]
        name = "memory"
        size = "64G"
        bandwidth = "20GB/s"

        [[tier]]
        name = "disk"
        size = "2T"
        bandwidth = "2GB/s"
        codec = "int8"

    Decode rates, if the file gives them, are read by ``load_decode_rates_toml``."""
    data = _read_toml(path)
    unknown = sorted(set(data) - {"tier", "decode_rate"})
    tables = data.get("tier")
    if unknown or not isinstance(tables, list) or not tables:
        raise ValueError(
            f"tiers file {path}: expected one or more [[tier]] tables (and optionally a [decode_rate] table) "
            "and nothing else"
        )
    tiers = []
    for i, table in enumerate(tables, 1):
        keys = set(table) if isinstance(table, dict) else set()
        if not _TIER_KEYS <= keys <= _TIER_KEYS | {"codec"} or not all(isinstance(table[k], str) for k in keys):
            raise ValueError(
                f"tiers file {path}: tier {i} needs exactly the strings name, size and bandwidth (and optionally codec)"
            )
        codec = f":{table['codec']}" if "codec" in table else ""
        tiers.append(parse_tier(f"{table['name']}:{table['size']}:{table['bandwidth']}{codec}"))
    return tiers


def load_decode_rates_toml(path: str | Path) -> list[tuple[str, float]]:
    """The ``[decode_rate]`` table of a tiers file (codec = rate, e.g. ``int8 = "8GB/s"``),
    empty when it has none."""
    table = _read_toml(path).get("decode_rate", {})
    if not isinstance(table, dict) or not all(isinstance(v, str) for v in table.values()):
        raise ValueError(f'tiers file {path}: [decode_rate] holds codec = "RATE" strings, e.g. int8 = "8GB/s"')
    return [parse_decode_rate(f"{name}={rate}") for name, rate in table.items()]


def _read_toml(path: str | Path, what: str = "tiers file") -> dict[str, Any]:
    try:
        return tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ValueError(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{what} {path}: invalid TOML: {exc}") from None


def check_tiers(tiers: Sequence[Tier]) -> tuple[Tier, ...]:
    """The tiers fastest first (the order the planner fills them); names must differ."""
    names = [t.name for t in tiers]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"tier name(s) given twice: {', '.join(duplicates)}")
    return tuple(sorted(tiers, key=lambda t: -t.bandwidth))
