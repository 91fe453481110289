"""Paged KV cache: a pool of fixed-size blocks shared by all sequences of one engine.

Invariants:
* every block is either free or owned by exactly one sequence's block table;
* a sequence's KV for token position p lives in slot ``table[p // block_size] * block_size +
  p % block_size`` of every layer;
* ``export`` of a sequence returns its KV as one contiguous tensor [layers, 2, tokens, kv_heads,
  head_dim] (the migration/offload wire format) and ``import_`` writes such a tensor into fresh
  blocks, bit-exactly: import_(export(t)) reproduces every value.
"""

from __future__ import annotations

import torch


class KVFull(RuntimeError):
    """Not enough free blocks."""


class KVPool:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int, block_size: int = 16,
                 dtype: torch.dtype = torch.float32, device: str = "cpu") -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("a KV pool needs at least one block of at least one slot")
        self.block_size, self.num_blocks = block_size, num_blocks
        self.shape = (num_layers, num_blocks * block_size, num_kv_heads, head_dim)
        self.k = torch.zeros(self.shape, dtype=dtype, device=device)
        self.v = torch.zeros(self.shape, dtype=dtype, device=device)
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: low ids first

    # -- memory ------------------------------------------------------------------------------------
    @property
    def resident(self) -> bool:
        return self.k.numel() > 0

    def free_memory(self) -> int:
        """Give the pool's memory back (a borrowed instance while its trainer trains); every block must be
        free. Returns the bytes freed; ``allocate_memory`` brings the pool back, empty."""
        if len(self._free) != self.num_blocks:
            raise RuntimeError(f"KV pool freed with {self.num_blocks - len(self._free)} blocks in use")
        freed = self.k.nbytes + self.v.nbytes
        self.k, self.v = self.k.new_empty(0), self.v.new_empty(0)
        return freed

    def allocate_memory(self) -> None:
        if not self.resident:
            self.k = torch.zeros(self.shape, dtype=self.k.dtype, device=self.k.device)
            self.v = torch.zeros(self.shape, dtype=self.v.dtype, device=self.v.device)

    # -- blocks ------------------------------------------------------------------------------------
    @property
    def free_blocks(self) -> int:
        return len(self._free)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise KVFull(f"need {n} KV blocks, {len(self._free)} free")
        return [self._free.pop() for _ in range(n)]

    def release(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))

    def grow(self, table: list[int], tokens: int) -> None:
        """Extend ``table`` in place so it can hold ``tokens`` tokens."""
        need = self.blocks_for(tokens) - len(table)
        if need > 0:
            table.extend(self.allocate(need))

    def slots(self, table: list[int], start: int, end: int) -> list[int]:
        bs = self.block_size
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    # -- data --------------------------------------------------------------------------------------
    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[layer, slots] = k
        self.v[layer, slots] = v

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[layer][slots], self.v[layer][slots]

    def export(self, table: list[int], tokens: int) -> torch.Tensor:
        idx = torch.tensor(self.slots(table, 0, tokens), dtype=torch.long, device=self.k.device)
        return torch.stack((self.k[:, idx], self.v[:, idx]), dim=1).contiguous()

    def import_(self, data: torch.Tensor) -> list[int]:
        """Write an exported [layers, 2, tokens, kvh, d] tensor into fresh blocks; returns the table."""
        layers, two, tokens, kvh, d = data.shape
        if (layers, kvh, d) != (self.k.shape[0], self.k.shape[2], self.k.shape[3]) or two != 2:
            raise ValueError(f"KV of shape {tuple(data.shape)} does not fit this pool {tuple(self.k.shape)}")
        table = self.allocate(self.blocks_for(tokens))
        idx = torch.tensor(self.slots(table, 0, tokens), dtype=torch.long, device=self.k.device)
        self.k[:, idx] = data[:, 0].to(self.k)
        self.v[:, idx] = data[:, 1].to(self.v)
        return table
