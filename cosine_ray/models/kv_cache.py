"""Per-request KV cache of one pipeline stage, with a committed and a speculative level.

Each request owns one buffer for all the stage's layers::

    buffer  # [num_layers, 2 (k|v), num_kv_heads, capacity, head_dim]

            0 ........... committed_length ....... + num_speculative ...... capacity
            |  committed  |  speculative (this step's tree nodes, node order)  | free |

A forward writes the new tokens' keys/values into the speculative level (slot
``committed_length + node_index``; the RoPE position is separate and depth-based).
After verification, ``commit(keep)`` compacts the kept speculative slots (the accepted
path, in depth order) onto the end of the committed level and drops the rest (PipeDec
§3.4's two-level cache). ``rollback(n)`` drops the last n committed tokens (a drafter that
ran ahead, or a test). Keys are stored after RoPE, so moving a slot never changes it.

PipeDec (``engine.pipedec``) grows the speculative level a tree layer at a time instead:
``extend(n)`` appends n slots after the ones already there, and ``keep(slots, num_committed)``
prunes the level to ``slots`` of which the first ``num_committed`` join the
committed level (a hit commits the old root and keeps the new root's subtree).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass(slots=True)
class _Entry:
    buffer: torch.Tensor  # [num_layers, 2, num_kv_heads, capacity, head_dim]
    committed_length: int = 0
    num_speculative: int = 0


class KVCache:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, *,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 initial_capacity: int = 256, max_tokens: int | None = None) -> None:
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.initial_capacity = initial_capacity
        self.max_tokens = max_tokens
        """Cap on tokens held over all requests (committed + speculative); None = no cap."""
        self._entries: dict[str, _Entry] = {}

    # ---- bookkeeping --------------------------------------------------------------------
    def __contains__(self, request_id: str) -> bool:
        return request_id in self._entries

    @property
    def request_ids(self) -> list[str]:
        return list(self._entries)

    def committed_length(self, request_id: str) -> int:
        return self._entries[request_id].committed_length

    def num_tokens(self) -> int:
        return sum(e.committed_length + e.num_speculative for e in self._entries.values())

    def bytes_per_token(self) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    def allocate(self, request_id: str) -> None:
        if request_id in self._entries:
            raise KeyError(f"request {request_id!r} already has a KV cache")
        self._entries[request_id] = _Entry(self._new_buffer(self.initial_capacity))

    def free(self, request_id: str) -> None:
        self._entries.pop(request_id, None)

    @torch.inference_mode()  # buffers are only ever touched under inference mode
    def _new_buffer(self, capacity: int) -> torch.Tensor:
        return torch.empty(self.num_layers, 2, self.num_kv_heads, capacity, self.head_dim,
                           dtype=self.dtype, device=self.device)

    # ---- forward-time writes and reads --------------------------------------------------
    @torch.inference_mode()
    def reserve(self, request_id: str, num_new_tokens: int) -> int:
        """Open a speculative level of ``num_new_tokens`` slots; returns its first slot."""
        entry = self._entries[request_id]
        start = entry.committed_length
        needed = start + num_new_tokens
        if self.max_tokens is not None:
            total = self.num_tokens() - entry.num_speculative + num_new_tokens
            if total > self.max_tokens:
                raise MemoryError(f"KV cache full: {total} tokens > max_tokens={self.max_tokens}")
        self._grow(entry, needed, start)
        entry.num_speculative = num_new_tokens
        return start

    @torch.inference_mode()
    def extend(self, request_id: str, num_new_tokens: int) -> int:
        """Append ``num_new_tokens`` slots to the speculative level (PipeDec's next tree layer);
        returns the first new slot."""
        entry = self._entries[request_id]
        start = entry.committed_length + entry.num_speculative
        if self.max_tokens is not None and self.num_tokens() + num_new_tokens > self.max_tokens:
            raise MemoryError(f"KV cache full: {self.num_tokens() + num_new_tokens} tokens > "
                              f"max_tokens={self.max_tokens}")
        self._grow(entry, start + num_new_tokens, start)
        entry.num_speculative += num_new_tokens
        return start

    def _grow(self, entry: _Entry, needed: int, used: int) -> None:
        capacity = entry.buffer.shape[3]
        if needed > capacity:
            grown = self._new_buffer(max(needed, 2 * capacity))
            grown[:, :, :, :used] = entry.buffer[:, :, :, :used]
            entry.buffer = grown

    def num_speculative(self, request_id: str) -> int:
        return self._entries[request_id].num_speculative

    @torch.inference_mode()
    def write(self, request_id: str, layer: int, start: int,
              keys: torch.Tensor, values: torch.Tensor) -> None:
        """keys, values  # [num_kv_heads, num_new, head_dim]"""
        buf = self._entries[request_id].buffer
        end = start + keys.shape[1]
        buf[layer, 0, :, start:end] = keys
        buf[layer, 1, :, start:end] = values

    def view(self, request_id: str, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of slots [0, end)  # each [num_kv_heads, end, head_dim]"""
        buf = self._entries[request_id].buffer
        return buf[layer, 0, :, :end], buf[layer, 1, :, :end]

    # ---- after verification -------------------------------------------------------------
    @torch.inference_mode()
    def commit(self, request_id: str, keep: Sequence[int] | None = None) -> None:
        """Keep speculative slots ``keep`` (indices into the level, in path order); drop the rest.

        ``keep=None`` keeps the whole level (prefill, or a chain accepted in full).
        """
        entry = self._entries[request_id]
        if keep is None:
            entry.committed_length += entry.num_speculative
            entry.num_speculative = 0
        else:
            self.keep(request_id, list(keep), len(keep))

    @torch.inference_mode()
    def keep(self, request_id: str, slots: Sequence[int], num_committed: int) -> None:
        """Keep speculative slots ``slots`` (in this order) and drop the rest of the level; the
        first ``num_committed`` of them join the committed level, the others stay speculative."""
        entry = self._entries[request_id]
        start = entry.committed_length
        slots = list(slots)
        if any(not 0 <= k < entry.num_speculative for k in slots):
            raise IndexError(f"keep {slots} outside the speculative level of {entry.num_speculative}")
        if not 0 <= num_committed <= len(slots):
            raise ValueError(f"cannot commit {num_committed} of {len(slots)} kept slots")
        if slots != list(range(len(slots))):  # already in place when the kept slots lead
            index = torch.tensor(slots, dtype=torch.long, device=self.device) + start
            entry.buffer[:, :, :, start:start + len(slots)] = entry.buffer[:, :, :, index]
        entry.committed_length += num_committed
        entry.num_speculative = len(slots) - num_committed

    def rollback(self, request_id: str, num_tokens: int) -> None:
        """Drop the last ``num_tokens`` committed tokens (and any speculative level)."""
        entry = self._entries[request_id]
        if not 0 <= num_tokens <= entry.committed_length:
            raise ValueError(f"cannot roll back {num_tokens} of {entry.committed_length} tokens")
        entry.committed_length -= num_tokens
        entry.num_speculative = 0

    def truncate(self, request_id: str, length: int) -> None:
        """Keep only the first ``length`` committed tokens."""
        self.rollback(request_id, self.committed_length(request_id) - length)
