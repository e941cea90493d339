"""API keys and the tenants they name: who a request is, and what it may hold.

A server has one key (``--api-key``, ``COSINE_RAY_API_KEY``), a key file (``--api-key-file``,
``COSINE_RAY_API_KEY_FILE``), both, or none. A key file holds one key a line, optionally with
its tenant's name and limits, as ``key name=... max_concurrent=... max_tokens_in_flight=...``
(``#`` starts a comment; blank lines are skipped); a malformed line is an error naming the line.
A key's name is what metrics and logs show: the key itself never leaves this module, and a key
without a name is named by a short hash of it.

``ApiKeyMiddleware`` checks ``Authorization: Bearer KEY`` before anything else runs (no engine
call for a refused request) and leaves the tenant on the ASGI scope (``TENANT_SCOPE_KEY``), where
admission (``serve.guards.admission``) and the HTTP metrics read it. Keys are compared in constant
time, against every key, so the time of a refusal says nothing about which key came close.
Without any key every request is the tenant ``anonymous``.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from starlette.types import ASGIApp, Receive, Scope, Send

from cosine_ray.serve.errors import error_response

TENANT_SCOPE_KEY = "cosine_ray.tenant"
"""The ASGI scope entry holding the request's ``ApiKey`` (set by ``ApiKeyMiddleware``)."""
ANONYMOUS = "anonymous"
"""The tenant of every request on a server without keys."""
MAX_NAME_CHARS = 64
LIMIT_NAMES = ("max_concurrent", "max_tokens_in_flight")


@dataclass(frozen=True, slots=True)
class ApiKey:
    """One key and the tenant it names (a line of the key file)."""

    key: str = ""
    """The secret itself (empty for the anonymous tenant of a server without keys)."""
    name: str = ANONYMOUS
    """The tenant's name: the ``key`` label of the per-key metrics, and what the logs show."""
    max_concurrent: int | None = None
    """Most API requests this key may have in flight at once (None: no limit of its own)."""
    max_tokens_in_flight: int | None = None
    """Most tokens its requests in flight may claim, each ``n × (prompt + max_tokens)``
    (None: no limit of its own)."""

    def __repr__(self) -> str:  # never the key itself, not even in a traceback
        return f"ApiKey(name={self.name!r}, max_concurrent={self.max_concurrent}, " \
               f"max_tokens_in_flight={self.max_tokens_in_flight})"


NO_KEY = ApiKey()


def default_name(key: str) -> str:
    """The name of a key given without one: a short hash (stable, and not the key)."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:8]


def parse_key_line(line: str) -> ApiKey | None:
    """One line of a key file; None for a blank or comment line; ValueError saying what is wrong."""
    words = line.split()
    comment = next((i for i, w in enumerate(words) if w.startswith("#")), len(words))
    if comment == 0:
        return None
    key, *fields = words[:comment]
    if "=" in key:
        raise ValueError("a line starts with the key, then name=... and the limits")
    values: dict[str, Any] = {}
    for item in fields:
        name, sep, value = item.partition("=")
        if not sep or not value:
            raise ValueError(f"{item!r} is not name=value")
        if name in values:
            raise ValueError(f"{name} is given twice")
        if name == "name":
            if len(value) > MAX_NAME_CHARS or not all(c.isalnum() or c in "-_." for c in value):
                raise ValueError(f"name must be 1-{MAX_NAME_CHARS} letters, digits, '-', '_' or '.'")
            values[name] = value
        elif name in LIMIT_NAMES:
            if not (value.isascii() and value.isdigit()) or int(value) < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
            values[name] = int(value)
        else:
            raise ValueError(f"unknown setting {name!r} (name, {', '.join(LIMIT_NAMES)})")
    return ApiKey(key=key, name=values.pop("name", None) or default_name(key), **values)


def parse_key_file(text: str, source: str) -> list[ApiKey]:
    """Every key of a key file's ``text``; ValueError naming ``source`` and the line."""
    keys = []
    for number, line in enumerate(text.splitlines(), 1):
        try:
            entry = parse_key_line(line)
        except ValueError as exc:
            raise ValueError(f"{source} line {number}: {exc}") from None
        if entry is not None:
            keys.append(entry)
    if not keys:
        raise ValueError(f"{source} holds no key")
    return keys


def read_key_file(path: str) -> list[ApiKey]:
    """``parse_key_file`` of the file at ``path`` (ValueError if it cannot be read)."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read the API key file {path}: {getattr(exc, 'strerror', None) or exc}") from None
    return parse_key_file(text, f"API key file {path}")


def as_key_entries(keys: Iterable[ApiKey]) -> list[dict[str, Any]]:
    """Keys as plain data (the ``api_keys`` ingress arg a Serve replica receives)."""
    return [{"key": k.key, "name": k.name, "max_concurrent": k.max_concurrent,
             "max_tokens_in_flight": k.max_tokens_in_flight} for k in keys]


def key_from_entry(entry: Any) -> ApiKey:
    """An ``ApiKey`` from its plain-data form (``as_key_entries``, or ``api_keys`` in a config),
    checked as a key file's line is; ValueError saying what is wrong."""
    if not isinstance(entry, Mapping) or not isinstance(entry.get("key"), str):
        raise ValueError("each api_keys entry is a mapping with a string `key`")
    unknown = set(entry) - {"key", "name", *LIMIT_NAMES}
    if unknown:
        raise ValueError(f"unknown setting {sorted(unknown)[0]!r} in an api_keys entry")
    words = [entry["key"]] + [f"{k}={v}" for k, v in entry.items() if k != "key" and v is not None]
    parsed = parse_key_line(" ".join(words)) if len(entry["key"].split()) == 1 else None
    if parsed is None:
        raise ValueError("an API key must be one word without spaces")
    return parsed


def key_ring(api_key: str | None = None, api_keys: Iterable[ApiKey | Mapping[str, Any]] = ()) -> list[ApiKey]:
    """The server's keys: ``api_key`` (tenant ``default``) and ``api_keys`` (``ApiKey``s or their
    plain-data form); ValueError for a key given twice or two keys of one name."""
    ring = [ApiKey(key=api_key, name="default")] if api_key else []
    for entry in api_keys:
        ring.append(entry if isinstance(entry, ApiKey) else key_from_entry(entry))
    for kind, values in (("key", [k.key for k in ring]), ("name", [k.name for k in ring])):
        seen: set[str] = set()
        for value in values:
            if not value:
                raise ValueError(f"an API key's {kind} must not be empty")
            if value in seen:
                raise ValueError("an API key is given twice" if kind == "key" else f"two API keys are named {value!r}")
            seen.add(value)
    return ring


class ApiKeyMiddleware:
    """``Authorization: Bearer KEY`` on every path except ``public_paths``; leaves the matching
    ``ApiKey`` on the scope (``TENANT_SCOPE_KEY``). Every key is compared, in constant time."""

    def __init__(self, app: ASGIApp, *, keys: list[ApiKey], public_paths: frozenset[str]) -> None:
        self.app = app
        self.keys = [(f"Bearer {k.key}".encode(), k) for k in keys]
        self.public_paths = public_paths

    def match(self, given: bytes) -> ApiKey | None:
        found = None
        for expected, entry in self.keys:  # no early exit: the time does not depend on which key
            if hmac.compare_digest(given, expected):
                found = entry
        return found

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            given = dict(scope.get("headers") or []).get(b"authorization", b"").strip()
            entry = self.match(given) if given else None
            if entry is not None:
                scope[TENANT_SCOPE_KEY] = entry
            elif scope["path"] not in self.public_paths:
                response = error_response(401, "missing or invalid API key: send `Authorization: Bearer KEY`",
                                          headers={"WWW-Authenticate": "Bearer"})
                return await response(scope, receive, send)
        await self.app(scope, receive, send)


def tenant_of(scope: Mapping[str, Any]) -> ApiKey:
    """The request's tenant (``NO_KEY``, the anonymous tenant, on a server without keys)."""
    return scope.get(TENANT_SCOPE_KEY) or NO_KEY
