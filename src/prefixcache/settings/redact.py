"""Secrets kept out of what the server says: settings errors and the settings' dump.

A setting is secret when its annotation carries ``config.SECRET`` (API keys, the admin
key, the tenant secret, every URL that may carry a password). Two rules follow from the
mark alone, so that a new secret field is safe by being marked:

- an error about a secret names the setting and what is wrong, never the value: the
  error's place stops at the secret field (a mapping's key may be a key itself), its
  input is not shown, and every secret value found in what was given is cut out of the
  message (a validator that quotes its input cannot leak it);
- the dump (startup log) shows a secret as ``***``, a URL with its password as
  ``redis://:***@host``.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

from pydantic import BaseModel

from prefixcache.config import field_hint, is_secret, section_of

__all__ = ["MASK", "mask_url", "masked", "scrub"]

MASK = "***"
_MIN_SECRET = 4  # shorter strings are cut out of no message (they would maim its words)
_QUERY_PASSWORD = re.compile(r"(?i)((?:^|&)password=)[^&]*")


def mask_url(url: str) -> str:
    """``url`` with its password (in the user part or a ``password=`` query) as ``***``;
    a URL that does not parse is masked whole."""
    try:
        parts = urlsplit(url)
        has_password = parts.password is not None
    except ValueError:
        return MASK
    netloc, query = parts.netloc, _QUERY_PASSWORD.sub(rf"\g<1>{MASK}", parts.query)
    if not has_password and query == parts.query:
        return url
    if has_password:
        user, _, host = netloc.rpartition("@")
        netloc = f"{user.partition(':')[0]}:{MASK}@{host}"
    # NOTE: by hand, not geturl(): that drops the "//" of an empty host (unix:///path)
    return (
        f"{parts.scheme}://{netloc}{parts.path}"
        + (f"?{query}" if query else "")
        + (f"#{parts.fragment}" if parts.fragment else "")
    )


def masked(value: Any) -> Any:
    """``value`` (settings: pydantic models, dataclasses, mappings, sequences) as plain
    data, with every field marked secret masked."""
    fields = _fields(value)
    if fields is not None:
        kind = type(value)
        return {name: _mask(v) if is_secret(field_hint(kind, name)) else masked(v) for name, v in fields.items()}
    if isinstance(value, Mapping):
        return {k: masked(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [masked(v) for v in value]
    return value


def _mask(value: Any) -> Any:
    if not value:
        return value
    if isinstance(value, str) and "://" in value:
        return mask_url(value)
    return MASK


def _fields(value: Any) -> dict[str, Any] | None:
    if isinstance(value, BaseModel):
        return {name: getattr(value, name) for name in type(value).model_fields}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    return None


def scrub(message: str, root: type, path: Sequence[str], given: Any) -> str:
    """``message`` (an error about ``given``, the input found at ``path`` under
    ``root``) with every secret value in ``given`` cut out."""
    kind: Any = root
    for name in path:
        kind = section_of(field_hint(kind, name))
    for secret in sorted(_secrets_in(kind, given), key=len, reverse=True):
        message = message.replace(secret, MASK)
    return message


def _secrets_in(kind: Any, data: Any) -> set[str]:
    """The secret strings inside ``data``, raw input for a ``kind`` (model or dataclass)."""
    fields = _fields(data)
    data = fields if fields is not None else data
    if isinstance(data, list | tuple):
        return set().union(*(_secrets_in(kind, item) for item in data))
    if not isinstance(data, Mapping):
        return set()
    found: set[str] = set()
    for name, value in data.items():
        hint = field_hint(kind, str(name))
        if is_secret(hint):
            found |= _strings(value)
        elif hint is not None:
            found |= _secrets_in(section_of(hint), value)
    return found


def _strings(value: Any) -> set[str]:
    """The text a secret's value could show up as in a message: the whole of it, a URL's
    password, the keys of ``KEY=TENANT`` pairs or of a mapping."""
    if isinstance(value, Mapping):
        return set().union(*(_strings(k) for k in value))
    if isinstance(value, list | tuple):
        return set().union(*(_strings(v) for v in value))
    text = str(value)
    found = {text, repr(text)}
    found |= {pair.partition("=")[0].strip() for pair in text.split(",")}
    try:
        password = urlsplit(text).password
    except ValueError:
        password = None
    if password:
        found.add(password)
    return {s for s in found if len(s) >= _MIN_SECRET}
