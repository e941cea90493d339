"""The server's half of the ledger: which client request ids the server answered, and how.

cosine_ray records, per ingress replica, every POST that carried ``X-Request-Id`` once its
response is over (``ok``, ``error`` or ``incomplete``, with the status), and serves the record
at ``GET /admin/completions?replica=R&after=N`` behind the API key
(``cosine_ray/serve/completion_ledger.py``). ``ServerLedger.poll`` reads what is new, once a
second during a run and once after it, and keeps every entry by (replica, sequence number).

The record lives in the replica's memory: when an ingress replica is killed, what it recorded
since the last read is gone with it. ``blind_windows`` are those spans (from the last read of
a replica that disappeared to the first read of the replica after it); the audit does not call
a completion lost when it ended inside one, it counts it as unverifiable.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import httpx

ADMIN_PATH = "/admin/completions"
PAGE = 5000


@dataclass
class ServerLedger:
    entries: dict[tuple[str, int], dict[str, Any]] = field(default_factory=dict)
    cursor: dict[str, int] = field(default_factory=dict)
    """Per replica: the last sequence number read."""
    first_read_t: dict[str, float] = field(default_factory=dict)
    last_read_t: dict[str, float] = field(default_factory=dict)
    dropped: int = 0
    """Entries the server evicted (bounded record) before they were read."""
    error: str | None = None
    """Why the record could not be read at all (None once a read succeeded)."""
    reads: int = 0
    prefix: str = ""
    """Only ids starting with this are kept (one run's, on a server others may use too)."""

    async def poll(self, client: httpx.AsyncClient, headers: Mapping[str, str], clock: Callable[[], float],
                   timeout_s: float = 10.0) -> bool:
        """Read what is new from whichever replica answers; False when nothing could be read."""
        replica = max(self.last_read_t, key=self.last_read_t.get, default=None)
        for _ in range(100):  # pages; a replica rarely has more than one new page
            params: dict[str, Any] = {"after": self.cursor.get(replica, -1) if replica else -1, "limit": PAGE}
            if replica:
                params["replica"] = replica
            try:
                resp = await client.get(ADMIN_PATH, params=params, headers=dict(headers), timeout=timeout_s)
            except httpx.HTTPError as exc:
                self._unread(f"GET {ADMIN_PATH}: {type(exc).__name__}")
                return False
            if resp.status_code != 200:
                self._unread(f"GET {ADMIN_PATH} answered {resp.status_code}")
                return False
            try:
                page = resp.json()
                asked, replica = replica, str(page["replica"])
                entries = list(page["entries"])
                if replica == asked or replica not in self.cursor:  # else: another replica's, re-read
                    self.dropped += int(page["dropped"])
            except (ValueError, KeyError, TypeError) as exc:
                self._unread(f"GET {ADMIN_PATH}: unexpected body ({type(exc).__name__})")
                return False
            now = clock()
            self.first_read_t.setdefault(replica, now)
            self.last_read_t[replica] = now
            self.reads += 1
            self.error = None
            for e in entries:
                if str(e.get("request_id", "")).startswith(self.prefix):
                    self.entries[(replica, int(e["seq"]))] = e
            if entries:
                self.cursor[replica] = max(self.cursor.get(replica, -1), max(int(e["seq"]) for e in entries))
            else:
                self.cursor.setdefault(replica, int(page.get("next", 0)) - 1)
            if len(entries) < PAGE:
                return True
        return True

    def _unread(self, why: str) -> None:
        if self.reads == 0:
            self.error = why

    def by_request(self) -> dict[str, list[dict[str, Any]]]:
        out: dict[str, list[dict[str, Any]]] = {}
        for (replica, _), e in sorted(self.entries.items(), key=lambda kv: (kv[1].get("t", 0), kv[0])):
            out.setdefault(str(e["request_id"]), []).append({**e, "replica": replica})
        return out

    def blind_windows(self) -> list[tuple[float, float]]:
        """(last read of a replica that disappeared, first read of the replica that came next)."""
        order = sorted(self.first_read_t, key=self.first_read_t.get)
        return [(self.last_read_t[old], self.first_read_t[new]) for old, new in zip(order, order[1:])]

    def summary(self) -> dict[str, Any]:
        return {"entries": len(self.entries), "replicas": len(self.first_read_t), "reads": self.reads,
                "dropped": self.dropped, "error": self.error, "blind_windows": self.blind_windows()}
