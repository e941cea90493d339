"""The client's ledger: every planned request gets one outcome, in order.

Every planned request id gets events in order: ``planned`` → ``sent`` → exactly one terminal
event (``ok`` | ``failed``), or ``planned`` → ``not_sent`` (the run was aborted or hit
``--duration``); ``terminal`` can name other ending events (``chaos``: ``disconnected``,
``hung``). ``check()`` counts what breaks that: sent without a terminal event, recorded twice,
an event for an id never planned, a completed stream without exactly one ``[DONE]`` (``ok``
events that carry a count), a response id seen twice. All must be 0. This is the client's own
bookkeeping, kept by the code that sends the requests, so it catches harness bugs and broken
streams, not a server that dropped or repeated work: ``cosine-loadgen chaos`` checks that
against the server's own record of the request ids it answered (``chaos/audit.py``).
``ledger.jsonl`` is the event list, one JSON object per line, in the order they happened.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TERMINAL = ("ok", "failed", "not_sent")


@dataclass
class Ledger:
    events: list[dict[str, Any]] = field(default_factory=list)
    terminal: tuple[str, ...] = TERMINAL
    """The events that end a request (``chaos`` adds ``disconnected`` and ``hung``)."""

    def record(self, event: str, request_id: str, t: float | None = None, **extra: Any) -> None:
        self.events.append({"event": event, "request_id": request_id,
                            **({"t": round(t, 6)} if t is not None else {}), **extra})

    def check(self) -> dict[str, Any]:
        """Counts, plus the offending ids (at most 20 of each) when something is wrong."""
        planned = [e["request_id"] for e in self.events if e["event"] == "planned"]
        planned_set = set(planned)
        sent = Counter(e["request_id"] for e in self.events if e["event"] == "sent")
        terminal = Counter(e["request_id"] for e in self.events if e["event"] in self.terminal)
        by_event = Counter(e["event"] for e in self.events)
        oks = [e for e in self.events if e["event"] == "ok"]
        bad_done = [e["request_id"] for e in oks if "done_markers" in e and e["done_markers"] != 1]
        response_ids = Counter(e["response_id"] for e in oks if e.get("response_id"))
        problems = {
            "lost": sorted(i for i in sent if terminal[i] == 0),
            "duplicated": sorted({i for i, n in sent.items() if n > 1} | {i for i, n in terminal.items() if n > 1}
                                 | {i for i, n in Counter(planned).items() if n > 1}),
            "unknown": sorted((set(sent) | set(terminal)) - planned_set),
            "never_finished": sorted(planned_set - set(terminal)),
            "sent_and_not_sent": sorted(e["request_id"] for e in self.events
                                        if e["event"] == "not_sent" and sent[e["request_id"]]),
            "bad_done_markers": sorted(bad_done),
            "reused_response_ids": sorted(i for i, n in response_ids.items() if n > 1),
        }
        out: dict[str, Any] = {
            "planned": len(planned_set), "sent": len(sent), "completed": by_event["ok"],
            "failed": by_event["failed"], "not_sent": by_event["not_sent"],
            **{f"num_{k}": len(v) for k, v in problems.items()},
        }
        out.update({event: by_event[event] for event in self.terminal if event not in out and event != "ok"})
        out["is_consistent"] = all(not v for v in problems.values()) and (
            sum(by_event[event] for event in self.terminal) == out["planned"])
        out["problems"] = {k: v[:20] for k, v in problems.items() if v}
        return out

    def write(self, path: Path) -> None:
        with open(path, "w", encoding="utf-8") as f:
            for event in self.events:
                f.write(json.dumps(event, sort_keys=True) + "\n")

    @classmethod
    def read(cls, path: Path, terminal: tuple[str, ...] = TERMINAL) -> "Ledger":
        return cls([json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line],
                   terminal)
