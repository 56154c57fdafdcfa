"""What ``prefixcache replay`` accepts, checked before a long replay starts.

Capacities are typed as people say them (``1M``, ``2.5k``, ``1e6``, ``inf`` tokens;
``10GiB``, ``80GB`` of KV bytes with a model whose KV layout turns bytes into tokens),
and the table prints them back in a form the same flag accepts (``format_capacity``).
An option that cannot apply to any configuration replayed, or to the trace given, is
an error naming it (``static_errors``, ``trace_errors``), never a silent no-op: a user
who passed ``--ttl`` to flat mode would otherwise read hit rates of a cache they did
not ask for.
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable, Iterable, Sequence
from decimal import Decimal, InvalidOperation
from typing import TypeVar

from prefixcache.sim.costmodel import CostModel, get_gpu, get_model
from prefixcache.sim.summary import TraceSummary

T = TypeVar("T")

TOKEN_FORMS = "a whole number of tokens (16384), an exponent (1e6), a suffix k, M, G or T (2.5k, 1M), or inf"
BYTE_FORMS = (
    "bytes with a unit: B, KB, MB, GB, TB (powers of 1000; K, M, G, T alone too) or KiB, MiB, GiB, TiB "
    "(powers of 1024), e.g. 10GiB, 80GB, 512MiB; or inf"
)
_NUMBER = re.compile(r"^\s*(?P<num>(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?)\s*(?P<unit>[A-Za-z]*)\s*$")
_TOKEN_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BYTE_UNITS = {
    "": 1,
    "b": 1,
    **{f"{p}{b}": 1000**i for i, p in enumerate("kmgt", 1) for b in ("", "b")},
    **{f"{p}i{b}": 1024**i for i, p in enumerate("kmgt", 1) for b in ("", "b")},
}
_DISPLAY = (("T", 10**12), ("G", 10**9), ("M", 10**6), ("K", 10**3))
_BYTE_DISPLAY = tuple((f"{p}iB", 1024**i) for i, p in enumerate("KMGT", 1)) + tuple(
    (f"{p}B", 1000**i) for i, p in enumerate("KMGT", 1)
)


def _amount(text: str, units: dict[str, int], what: str, forms: str) -> float:
    """A whole, non-negative amount (or ``math.inf``) from ``NUMBER[UNIT]``."""
    if text.strip().lower() == "inf":
        return math.inf
    match = _NUMBER.match(text)
    scale = units.get(match["unit"].lower()) if match else None
    if match is None or scale is None:
        raise ValueError(f"not {what}: {text!r}; accepted: {forms}")
    try:
        value = Decimal(match["num"]) * scale  # NOTE: exact: 2.5k is 2500, not 2499.9999
    except InvalidOperation:
        raise ValueError(f"not {what}: {text!r}; accepted: {forms}") from None
    if value != value.to_integral_value():
        raise ValueError(f"not {what}: {text!r} is not a whole number; accepted: {forms}")
    return float(int(value))


def parse_tokens(text: str) -> float:
    """A capacity in tokens: ``16384``, ``1e6``, ``2.5k``, ``1M``, ``inf`` (``math.inf``)."""
    return _amount(text, _TOKEN_UNITS, "a capacity in tokens", TOKEN_FORMS)


def parse_bytes(text: str) -> float:
    """A capacity in bytes: ``10GiB``, ``80GB``, ``10G`` (= GB), ``4096``, ``inf``."""
    return _amount(text, _BYTE_UNITS, "a capacity in bytes", BYTE_FORMS)


def bytes_to_tokens(capacity_bytes: float, bytes_per_token: int, text: str = "") -> float:
    """The tokens whose KV fits in ``capacity_bytes`` (rounded down; ``inf`` stays)."""
    if math.isinf(capacity_bytes):
        return math.inf
    tokens = int(capacity_bytes) // bytes_per_token
    if capacity_bytes and not tokens:
        shown = text or format_bytes(int(capacity_bytes))
        raise ValueError(f"{shown} holds no token's KV ({bytes_per_token:,} bytes a token)")
    return float(tokens)


def format_capacity(tokens: float) -> str:
    """A capacity in tokens as ``--capacity-tokens`` accepts it back, exactly: ``inf``,
    ``1M``, ``81.92K``, ``1048576`` (a suffix only where it keeps every digit short)."""
    if math.isinf(tokens):
        return "inf"
    n = int(tokens)
    for suffix, scale in _DISPLAY:
        if n >= scale:
            mantissa = format(Decimal(n) / scale, "f")
            mantissa = mantissa.rstrip("0").rstrip(".") if "." in mantissa else mantissa
            if len(mantissa.replace(".", "").lstrip("0")) <= 4:
                return mantissa + suffix
            break
    return str(n)


def format_bytes(n: int) -> str:
    """Bytes as ``--capacity-bytes`` accepts them, in the shorter of binary and decimal
    units that is exact: ``128KiB``, ``10GiB``, ``80GB``, ``1000B``."""
    best = f"{n}B"
    for suffix, scale in _BYTE_DISPLAY:
        if n >= scale:
            mantissa = format(Decimal(n) / scale, "f")
            mantissa = mantissa.rstrip("0").rstrip(".") if "." in mantissa else mantissa
            if len(mantissa) <= 6 and len(mantissa + suffix) < len(best):
                best = mantissa + suffix
    return best


def parse_list(text: str, convert: Callable[[str], T], what: str, valid: Iterable[str] | None = None) -> list[T]:
    """A comma-separated list for argparse; a bad item is named with the accepted forms."""
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"{what}: give at least one value")
    out = []
    for item in items:
        if valid is not None and item not in valid:
            raise argparse.ArgumentTypeError(f"{what}: unknown {item!r}; valid: {', '.join(sorted(valid))}")
        try:
            out.append(convert(item))
        except ValueError as exc:
            why = str(exc)
            reason = f"; {why}" if why and why != item else ""
            raise argparse.ArgumentTypeError(f"{what}: not a valid value: {item!r}{reason}") from None
    return out


# ---------------------------------------------------------------------------- options that apply


def _given(args: argparse.Namespace, name: str) -> bool:
    return getattr(args, name, None) is not None


def static_errors(args: argparse.Namespace) -> list[str]:
    """Options that apply to none of the configurations the other flags list."""
    modes, isolations = set(args.mode), set(args.isolation)
    flat_only = modes == {"flat"}
    errors = []
    tree_only_flags = (
        ("--ttl", _given(args, "ttl"), "flat mode has no clock"),
        ("--publish", _given(args, "publish"), "flat mode has no pools to publish to"),
        ("--partial-blocks", args.partial_blocks, "flat mode looks up whole blocks"),
        ("--include-output", args.include_output, "flat mode inserts only prompts"),
        ("--metrics", _given(args, "metrics"), "they are the PrefixCache's metrics"),
        ("--engine " + str(args.engine), args.engine != "auto", "it picks tree mode's engine"),
    )
    for flag, on, why in tree_only_flags:
        if on and flat_only:
            errors.append(f"{flag} applies to tree mode only ({why}), and --mode is flat")
    if _given(args, "publish") and isolations == {"shared"}:
        errors.append(
            "--publish applies to namespace and partitioned isolation (shared isolation already shares every "
            "prefix); add them to --isolation"
        )
    if _given(args, "publish_min_tokens") and not _given(args, "publish"):
        errors.append("--publish-min-tokens applies only with --publish K")
    if args.model == "none":
        errors += [f"{flag} prices the cost model, which --model none turns off" for flag in _given_cost_flags(args)]
    if _given(args, "capacity_bytes"):
        if _given(args, "capacity_tokens"):
            errors.append("give capacities once: --capacity-tokens or --capacity-bytes, not both")
        if args.model is None or args.model == "none":
            errors.append(
                "--capacity-bytes needs --model NAME: the model's KV layout says how many bytes a token holds"
            )
    if _given(args, "codec"):
        if not _given(args, "capacity_bytes"):
            errors.append(
                "--codec says what the bytes of --capacity-bytes are stored as; with capacities in tokens it "
                "changes nothing: give --capacity-bytes"
            )
        if _given(args, "tenant_capacity"):
            errors.append("--tenant-capacity cannot name one of several codecs' capacities: leave it out with --codec")
    if _given(args, "tenant_capacity") and args.html is None:
        errors.append("--tenant-capacity picks the capacity of the HTML report's per-tenant chart: add --html FILE")
    return errors


def _given_cost_flags(args: argparse.Namespace) -> list[str]:
    return [f"--{name}" for name in ("gpu", "utilization") if _given(args, name)]


def trace_errors(args: argparse.Namespace, summary: TraceSummary, name: str) -> list[str]:
    """What the trace itself rules out: no request at all, or options for another kind of trace."""
    if summary.requests == 0:
        return [f"{name}: no requests: the trace is empty or holds only blank lines"]
    native = summary.native_block_size
    if native is None:
        if args.hashed_blocks != "auto":
            return [f"--hashed-blocks {args.hashed_blocks} applies to pre-hashed traces; {name} has token prompts"]
        return []
    hashed = f"{name} is pre-hashed (hash_ids in blocks of {native} tokens)"
    errors = []
    if _given(args, "block_size"):
        errors.append(f"--block-size applies to token traces: {hashed}, which fixes the block size")
    if args.partial_blocks:
        errors.append(f"--partial-blocks needs the tokens inside a block: {hashed}")
    if args.include_output:
        errors.append(f"--include-output inserts output token ids: {hashed}, with none")
    if _given(args, "tokenizer"):
        errors.append(f"--tokenizer reads 'text' prompts: {hashed}")
    return errors


def pick_capacity(capacities: Sequence[float], wanted: float | None, shown: str) -> float:
    """``wanted`` if it is one of ``capacities``, the largest when ``None``; otherwise an
    error listing the replayed ones as they can be typed."""
    if wanted is None:
        return max(capacities)
    if wanted not in capacities:
        listed = ", ".join(format_capacity(c) for c in sorted(set(capacities)))
        raise ValueError(f"--tenant-capacity {shown} was not replayed; replayed capacities (tokens): {listed}")
    return wanted


# ---------------------------------------------------------------------------- the cost model and capacities


DEFAULT_MODEL, DEFAULT_GPU, DEFAULT_UTILIZATION = "llama-3-8b", "h100", 0.5


def cost_model(args: argparse.Namespace) -> CostModel | None:
    """The cost model the flags name; the parts left to their defaults are recorded, so
    that every report says which figures rest on a profile nobody chose."""
    if args.model == "none":
        return None
    chosen = {"model": args.model, "gpu": args.gpu, "utilization": args.utilization}
    defaults = tuple(name for name, value in chosen.items() if value is None)
    return CostModel(
        get_model(args.model or DEFAULT_MODEL),
        get_gpu(args.gpu or DEFAULT_GPU),
        DEFAULT_UTILIZATION if args.utilization is None else args.utilization,
        defaults,
    )


def capacities(args: argparse.Namespace, cost: CostModel | None) -> tuple[float | None, list[str]]:
    """Sets ``args.capacity_tokens`` (from ``--capacity-bytes`` when given); returns the
    per-tenant chart's capacity in tokens (``--tenant-capacity``, in the unit of the
    capacities; ``None`` for the largest) and notes for the report on how bytes became
    tokens."""
    wanted = args.tenant_capacity
    if args.capacity_bytes is None:
        args.capacity_tokens = args.capacity_tokens or [math.inf]
        tenant = None if wanted is None else parse_tokens(wanted)
        return tenant_capacity(args.capacity_tokens, tenant, wanted), []
    assert cost is not None  # static_errors: --capacity-bytes needs --model
    model = cost.model
    bpt = model.kv_bytes_per_token
    if model.groups is not None:
        raise ValueError(
            f"--capacity-bytes: model {model.name!r} has layer groups ({model.groups.label()}), whose bytes per "
            "token depend on the block size; give --capacity-tokens, or size it with 'prefixcache plan', which "
            "stores the groups per block (docs/planner.md)"
        )
    if bpt is None:
        raise ValueError(
            f"--capacity-bytes needs the KV layout of model {model.name!r}: give kv_heads=,head_dim= in its spec"
        )
    assert model.kv is not None
    args.capacity_tokens = [bytes_to_tokens(b, bpt) for b in args.capacity_bytes]
    tenant = None if wanted is None else bytes_to_tokens(parse_bytes(wanted), bpt, wanted)
    pairs = ", ".join(
        f"{'inf' if math.isinf(b) else format_bytes(int(b))} = {format_capacity(t)}"
        for b, t in zip(args.capacity_bytes, args.capacity_tokens, strict=True)
    )
    note = (
        f"Capacities from --capacity-bytes, in tokens of {model.name} KV ({model.kv.dtype}, "
        f"{format_bytes(bpt)} a token): {pairs}"
    )
    return tenant_capacity(args.capacity_tokens, tenant, wanted), [note]


def tenant_capacity(capacities: list[float], tokens: float | None, text: str | None) -> float | None:
    return None if tokens is None or text is None else pick_capacity(capacities, tokens, text)
