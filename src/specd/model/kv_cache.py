"""KV cache: per-sequence slots in one growable tensor per layer.

Design (chosen for CPU decoding, where copying KV is as expensive as reading weights):

* Layer l stores keys and values in one tensor `kv[l]`: `[2, num_slots, num_kv_heads, capacity, head_dim]`;
  `keys[l]` = `kv[l][0]` and `values[l]` = `kv[l][1]` are `[num_slots, num_kv_heads, capacity, head_dim]`
  views. One tensor lets a forward write a token's keys and values with one indexed copy (the projection emits
  them side by side), and each half stays a plain slot-major tensor whose slot ranges are views. A running
  sequence owns one slot; token t of it lives at `[slot, :, t]` of each half. When the scheduler keeps the
  batch's slots contiguous (it assigns the lowest free slot and orders the batch by slot), attention reads a
  *view* of the cache: no gather, no copy.
* Memory grows with use: both `num_slots` (up to `max_slots`) and `capacity` (up to `max_len`, in steps of
  `grow_step` tokens) start small and are enlarged, by reallocating and copying once, only when a sequence
  actually needs more. Growth is amortised (geometric in slots, chunked in length). `budget_tokens` caps the
  slot x capacity product so the engine can refuse work instead of exhausting RAM.
* Each slot has its own committed length (`seq_lens`, kept by `set_len`). Rolling a sequence back by r
  tokens is setting it r lower: O(1), no copying; the stale entries are overwritten by the next write at
  those positions, and attention never reads them because it masks by the positions of each forward
  (a sequence's keys are read up to its start position plus its new tokens).
* A freed slot is returned to the free list immediately (finish or abort); its stale contents are never
  read because the next owner starts at length 0.
"""

from __future__ import annotations

import torch

from specd.errors import SpecdError


class KVCacheFullError(SpecdError):
    """The cache cannot grow to what was asked within its configured limits."""


class KVCache:
    """Slot-based KV cache with O(1) rollback. Not thread-safe: owned by one engine thread."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        max_slots: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        grow_step: int = 256,
        budget_tokens: int | None = None,
    ) -> None:
        if max_slots <= 0 or max_len <= 0 or grow_step <= 0:
            raise ValueError("max_slots, max_len and grow_step must be > 0")
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.max_slots = max_slots
        self.max_len = max_len
        self.dtype = dtype
        self.device = torch.device(device)
        self.grow_step = grow_step
        self.budget_tokens = budget_tokens if budget_tokens is not None else max_slots * max_len
        self.num_slots = 0
        self.capacity = 0
        self.kv: list[torch.Tensor] = []  # per layer [2, num_slots, num_kv_heads, capacity, head_dim]
        self.keys: list[torch.Tensor] = []  # per layer [num_slots, num_kv_heads, capacity, head_dim] (view of kv)
        self.values: list[torch.Tensor] = []  # per layer [num_slots, num_kv_heads, capacity, head_dim] (view of kv)
        self.seq_lens: list[int] = []  # committed tokens per slot
        self._free: list[int] = []
        self._used: set[int] = set()

    # ------------------------------------------------------------------ slots
    @property
    def num_used_slots(self) -> int:
        return len(self._used)

    @property
    def num_free_slots(self) -> int:
        return self.max_slots - len(self._used)

    def allocate(self) -> int:
        """Take the lowest free slot (growing the slot dimension if needed); its length starts at 0."""
        if len(self._used) >= self.max_slots:
            raise KVCacheFullError(f"all {self.max_slots} KV-cache slots are in use")
        if not self._free:
            self._grow(max(1, min(self.max_slots, max(self.num_slots * 2, self.num_slots + 1))), self.capacity)
        slot = min(self._free)
        self._free.remove(slot)
        self._used.add(slot)
        self.seq_lens[slot] = 0
        return slot

    def free(self, slot: int) -> None:
        """Return a slot; its contents become garbage. Freeing twice is an error."""
        if slot not in self._used:
            raise ValueError(f"slot {slot} is not allocated")
        self._used.remove(slot)
        self._free.append(slot)
        self.seq_lens[slot] = 0

    # ----------------------------------------------------------------- length
    def reserve(self, max_needed_len: int) -> None:
        """Make sure positions [0, max_needed_len) exist in every slot (grows capacity in grow_step chunks)."""
        if max_needed_len > self.max_len:
            raise KVCacheFullError(f"sequence length {max_needed_len} exceeds max_len {self.max_len}")
        if max_needed_len <= self.capacity:
            return
        new_cap = min(self.max_len, -(-max_needed_len // self.grow_step) * self.grow_step)
        self._grow(self.num_slots, new_cap)

    def set_len(self, slot: int, length: int) -> None:
        """Commit or roll back: the slot's valid prefix becomes `length` tokens. O(1)."""
        if length < 0 or length > self.capacity:
            raise ValueError(f"length {length} out of range [0, {self.capacity}]")
        self.seq_lens[slot] = length

    def bytes_allocated(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.kv)

    def _grow(self, num_slots: int, capacity: int) -> None:
        if num_slots * capacity > self.budget_tokens and capacity > 0:
            raise KVCacheFullError(
                f"KV cache of {num_slots} slots x {capacity} tokens exceeds budget_tokens={self.budget_tokens}"
            )
        shape = (2, num_slots, self.num_kv_heads, capacity, self.head_dim)
        for layer in range(self.num_layers):
            new = torch.zeros(shape, dtype=self.dtype, device=self.device)
            if layer < len(self.kv):
                old = self.kv[layer]
                new[:, : old.shape[1], :, : old.shape[3]] = old
                self.kv[layer] = new
            else:
                self.kv.append(new)
        self.keys = [kv[0] for kv in self.kv]
        self.values = [kv[1] for kv in self.kv]
        self._free.extend(range(self.num_slots, num_slots))
        self.seq_lens.extend([0] * (num_slots - self.num_slots))
        self.num_slots = num_slots
        self.capacity = capacity
