"""One request's outputs that its reader has not taken yet, merged into one.

The engine loop hands each request's outputs to its caller through a ``Mailbox``, and the
ingress reads the engine's stream into one: a reader that falls behind (a slow client the
ingress holds back) costs one pending output, whose tokens and log-probabilities grow, never
a queue that grows by an item a step. torch-free: the ingress imports it.
"""

from __future__ import annotations

import asyncio

from cosine_ray.engine.request import RequestOutput, merge_outputs


class Mailbox:
    """One request's outputs that its reader has not taken yet, merged into one."""

    def __init__(self) -> None:
        self._held: RequestOutput | None = None
        self._closed = False
        self._ready = asyncio.Event()

    def put(self, out: RequestOutput) -> None:
        self._held = out if self._held is None else merge_outputs(self._held, out)
        self._ready.set()

    def close(self) -> None:
        """No more outputs: ``get`` returns None once what is held was taken."""
        self._closed = True
        self._ready.set()

    async def get(self) -> RequestOutput | None:
        await self._ready.wait()
        out, self._held = self._held, None
        if not self._closed:
            self._ready.clear()
        return out

    @property
    def holds_end(self) -> bool:
        """What it holds ends the request (an abort that came before the request started)."""
        return self._held is not None and self._held.finished
