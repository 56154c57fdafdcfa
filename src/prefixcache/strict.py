"""Strict isolation (``[cache] strict_isolation``): the settings it refuses beside it,
the error that names them, and the refusal of a public path at run time.

No KV reuse across tenants at all (OWASP AISVS 5.5.5): what a configuration allows
that would share is named at start, all of it at once, never dropped silently
(docs/operations.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

__all__ = ["STRICT", "Sharing", "StrictIsolationError", "refuse_public", "strict_conflicts"]


class Sharing(Protocol):
    """What of a cache's configuration (``config.CacheConfig``) decides whether KV is shared."""

    @property
    def strict_isolation(self) -> bool: ...

    @property
    def isolation(self) -> str: ...

    @property
    def publish(self) -> object | None: ...

    @property
    def shared_quota(self) -> object | None: ...


STRICT = "cache.strict_isolation = true"


def strict_conflicts(cache: Sharing) -> list[str]:
    """The settings of ``cache`` that let one tenant's KV serve another, each with how,
    when ``strict_isolation`` forbids that (else none)."""
    if not cache.strict_isolation:
        return []
    found = []
    if cache.isolation == "shared":
        found.append("cache.isolation = 'shared' (all tenants' blocks have one namespace: each reuses the others')")
    if cache.publish is not None:
        found.append(
            "cache.publish (a prefix sent by publish.min_tenants tenants is copied to the public pool, "
            "where every tenant reuses it)"
        )
    if cache.shared_quota is not None:
        found.append("cache.shared_quota (the public pool of partitioned isolation: every tenant reads it)")
    return found


class StrictIsolationError(ValueError):
    """Strict isolation refused beside settings that share KV across tenants: the message
    names each (``conflicts``), so that one start lists them all."""

    def __init__(self, conflicts: Sequence[str]) -> None:
        self.conflicts = list(conflicts)
        super().__init__(
            f"{STRICT} forbids every reuse of KV across tenants (OWASP AISVS 5.5.5), and "
            f"{'these settings allow' if len(self.conflicts) > 1 else 'this setting allows'} one: "
            f"{'; '.join(self.conflicts)}. Remove {'them' if len(self.conflicts) > 1 else 'it'}, "
            "or turn strict isolation off"
        )


def refuse_public(what: str) -> ValueError:
    """The run-time refusal of ``what`` (a path that would publish or read the public
    namespace) under strict isolation."""
    return ValueError(f"{what} is refused: {STRICT} forbids public prefixes (every tenant's KV stays its own)")
