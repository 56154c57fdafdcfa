"""What ``prefixcache warm`` tells its operator: a progress bar on stderr (one plain line
per prompt when stderr is not a terminal, so that a log or a test can follow it), and
the summary at the end."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TextIO

__all__ = ["Progress", "Tally", "TierDelta"]

BAR = 30


@dataclass(frozen=True, slots=True)
class TierDelta:
    """What one tier gained during the warm: blocks held now less before, bytes written."""

    name: str
    blocks: int
    tokens: int
    bytes_written: int
    writes_dropped: int = 0  # refused by a full write queue: a rerun stores them


@dataclass
class Tally:
    """The running counts of one warm (mutable: the loop adds to it)."""

    prompts: int = 0  # lines read as prompts
    warmed: int = 0  # prompts that were prefilled (whole or past a cached prefix)
    skipped: int = 0  # prompts whose every storable block was already cached
    short: int = 0  # prompts shorter than one block: nothing a restarted server could find
    bad: int = 0  # lines skipped with --skip-bad
    prefilled_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens found in the cache instead of prefilled
    seconds: float = 0.0
    tiers: list[TierDelta] = field(default_factory=list)
    interrupted: bool = False

    def summary(self) -> list[str]:
        head = "warm interrupted" if self.interrupted else "warm done"
        lines = [
            f"{head}: {self.prompts} prompts in {self.seconds:.1f} s: {self.warmed} prefilled, "
            f"{self.skipped} already cached (skipped), {self.short} shorter than a block, {self.bad} bad lines skipped",
            f"  tokens prefilled {self.prefilled_tokens:,}, already cached {self.cached_tokens:,}",
        ]
        for tier in self.tiers:
            lines.append(
                f"  tier {tier.name}: +{tier.blocks:,} blocks ({tier.tokens:,} tokens), "
                f"{tier.bytes_written:,} bytes written"
                + (f", {tier.writes_dropped:,} writes dropped (a rerun stores them)" if tier.writes_dropped else "")
            )
        return lines


class Progress:
    """Where the warm is, after each prompt."""

    def __init__(self, stream: TextIO, total: int | None) -> None:
        self._out = stream
        self._total = total
        self._tty = stream.isatty()

    def update(self, tally: Tally, line: int, what: str) -> None:
        done = tally.prompts + tally.bad
        total = f"/{self._total}" if self._total else ""
        counts = f"prefilled {tally.prefilled_tokens:,} cached {tally.cached_tokens:,} tokens"
        if not self._tty:
            self._out.write(f"warm: {done}{total} line {line} {what}; {counts}\n")
        else:
            frac = done / self._total if self._total else 0.0
            bar = "#" * int(frac * BAR)
            self._out.write(f"\r[{bar:<{BAR}}] {done}{total} {counts}")
        self._out.flush()

    def end(self) -> None:
        if self._tty:
            self._out.write("\n")
            self._out.flush()
