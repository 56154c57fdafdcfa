"""A Messages answer's ``usage``, as Anthropic defines it, from what the engine measured.

Anthropic splits the prompt in three, which add up to its length::

    prompt tokens:  [ cache read ........ | cache creation ........ | input ......... ]
                    0                  read                  last breakpoint       prompt

- ``cache_read_input_tokens``: the prompt tokens whose KV came from the cache;
- ``cache_creation_input_tokens``: the tokens up to the last breakpoint that were not
  read (what this request wrote for the next one to read); 0 without breakpoints;
- ``input_tokens``: the rest, computed and not kept for a breakpoint.

``cache_creation`` splits the creation tokens by the ttl of the breakpoint that ends each
segment (the tokens between two breakpoints belong to the later one).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from prefixcache.api.messages import Ttl
from prefixcache.api.messages_prompt import Breakpoint

__all__ = ["MessagesUsage", "messages_usage"]


@dataclass(frozen=True, slots=True)
class MessagesUsage:
    input_tokens: int
    cache_read_input_tokens: int
    cache_creation_input_tokens: int
    ephemeral_5m_input_tokens: int
    ephemeral_1h_input_tokens: int
    output_tokens: int

    def body(self) -> dict[str, Any]:
        """Anthropic's ``usage`` object."""
        return {
            "input_tokens": self.input_tokens,
            "cache_creation_input_tokens": self.cache_creation_input_tokens,
            "cache_read_input_tokens": self.cache_read_input_tokens,
            "cache_creation": {
                "ephemeral_5m_input_tokens": self.ephemeral_5m_input_tokens,
                "ephemeral_1h_input_tokens": self.ephemeral_1h_input_tokens,
            },
            "output_tokens": self.output_tokens,
        }


def messages_usage(
    prompt_tokens: int, cached_tokens: int, breakpoints: Sequence[Breakpoint], output_tokens: int
) -> MessagesUsage:
    """The usage of a prompt of ``prompt_tokens`` of which ``cached_tokens`` were read
    from the cache, with ``breakpoints`` (any order; a position past the prompt counts
    as its end). Raises ``ValueError`` for a negative count."""
    if min(prompt_tokens, cached_tokens, output_tokens) < 0:
        raise ValueError("token counts are >= 0")
    read = min(cached_tokens, prompt_tokens)
    created = {Ttl.FIVE_MINUTES: 0, Ttl.ONE_HOUR: 0}
    start = 0  # where the segment the next breakpoint ends begins
    for b in sorted(breakpoints, key=lambda b: b.tokens):
        end = min(max(b.tokens, 0), prompt_tokens)
        created[b.ttl] += max(0, end - max(start, read))
        start = max(start, end)
    creation = sum(created.values())
    return MessagesUsage(
        input_tokens=prompt_tokens - read - creation,
        cache_read_input_tokens=read,
        cache_creation_input_tokens=creation,
        ephemeral_5m_input_tokens=created[Ttl.FIVE_MINUTES],
        ephemeral_1h_input_tokens=created[Ttl.ONE_HOUR],
        output_tokens=output_tokens,
    )
