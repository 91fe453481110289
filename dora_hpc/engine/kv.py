"""Paged KV cache: a pool of fixed-size blocks shared by all sequences of one engine, with a prefix cache, so a
prompt that several sequences share (a group's samples, every episode's system prompt) is held once.

Invariants:
* every block is free or held, and a held block's ``ref`` equals the number of block tables holding it;
  a block held by two or more tables (shared) is never written: ``prepare`` gives the writer its own copy
  first (copy-on-write);
* a cached block has an entry naming what its first slots hold: (the chain digest of every token before
  the block, the tokens in its first slots). A full block's entry is also keyed by its own chain digest
  (``digest``), so a prefix is matched block by block; the last, partial block is matched by its tokens
  (a tail), among the entries with its parent and first token. A write into slots an entry names first
  cuts the entry to the slots before it;
* a cached block whose ``ref`` falls to 0 stays cached and counts as free; it is reused only when no
  uncached free block is left, least recently released first, and its entry goes with it;
* ``clear_cache`` forgets every entry (the engine does so when its weights change: KV computed under one
  version is never matched under another);
* a sequence's KV for token position p lives in slot ``table[p // block_size] * block_size +
  p % block_size`` of every layer;
* ``export`` of a sequence returns its KV as one contiguous tensor [layers, 2, tokens, kv_heads,
  head_dim] (the migration/offload wire format) and ``import_`` writes such a tensor into the sequence's
  blocks, bit-exactly: import_(export(t)) reproduces every value. A prefix ``import_`` finds cached with
  bit-equal values is shared instead of written (deduplicated).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence

import torch


class KVFull(RuntimeError):
    """Not enough free blocks."""


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def digest(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The chain digest of a full block: its parent's digest (b"" for the first block) and its tokens."""
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


class KVPool:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int, block_size: int = 16,
                 dtype: torch.dtype = torch.float32, device: str = "cpu") -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("a KV pool needs at least one block of at least one slot")
        self.block_size, self.num_blocks = block_size, num_blocks
        self.shape = (num_layers, num_blocks * block_size, num_kv_heads, head_dim)
        self.k = torch.zeros(self.shape, dtype=dtype, device=device)
        self.v = torch.zeros(self.shape, dtype=dtype, device=device)
        self.ref = [0] * num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # uncached free blocks, a stack: low ids first
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached free blocks, least recently released first
        self._entry: dict[int, tuple[bytes, tuple[int, ...]]] = {}  # block -> (parent digest, tokens it holds)
        # (parent digest, first token) -> {block: tokens}: the blocks that may continue a prefix with that token
        self._children: dict[tuple[bytes, int], dict[int, tuple[int, ...]]] = {}
        self._full: dict[bytes, int] = {}  # a full block's own digest -> the block
        self.copies = 0  # copy-on-write copies made

    # -- memory ------------------------------------------------------------------------------------
    @property
    def resident(self) -> bool:
        return self.k.numel() > 0

    def free_memory(self) -> int:
        """Give the pool's memory back (a borrowed instance while its trainer trains); every block must be
        free. The cache is forgotten. Returns the bytes freed; ``allocate_memory`` brings the pool back, empty."""
        if self.free_blocks != self.num_blocks:
            raise RuntimeError(f"KV pool freed with {self.num_blocks - self.free_blocks} blocks in use")
        self.clear_cache()
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
        """Blocks no table holds, cached ones included (they are reused when nothing else is free)."""
        return len(self._free) + len(self._lru)

    @property
    def cached_blocks(self) -> int:
        return len(self._entry)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def allocate(self, n: int) -> list[int]:
        if n > self.free_blocks:
            raise KVFull(f"need {n} KV blocks, {self.free_blocks} free")
        out = []
        for _ in range(n):
            if self._free:
                b = self._free.pop()
            else:
                b = self._lru.popitem(last=False)[0]
                self._forget(b)
            self.ref[b] = 1
            out.append(b)
        return out

    def release(self, blocks: list[int]) -> None:
        """Drop one hold on each block; the last blocks of a table become reusable first."""
        for b in reversed(blocks):
            self.ref[b] -= 1
            if self.ref[b] == 0:
                if b in self._entry:
                    self._lru[b] = None
                else:
                    self._free.append(b)

    def share(self, b: int) -> None:
        if self.ref[b] == 0:
            del self._lru[b]
        self.ref[b] += 1

    def grow(self, table: list[int], tokens: int) -> None:
        """Extend ``table`` in place so it can hold ``tokens`` tokens."""
        need = self.blocks_for(tokens) - len(table)
        if need > 0:
            table.extend(self.allocate(need))

    def prepare(self, table: list[int], start: int, end: int) -> None:
        """Make positions [start, end) of ``table`` writable: grow the table, give it its own copy of each
        shared block in the range (copy-on-write) and cut the entries of cached ones to the slots before
        the write. Raises KVFull, changing nothing, when the blocks it needs are not free."""
        bs = self.block_size
        first, have = start // bs, min(len(table), self.blocks_for(end))
        # copied: blocks another table holds, and cached full blocks (a tail match of one keeps its chain)
        shared = [i for i in range(first, have) if self.ref[table[i]] > 1 or self._is_full(table[i])]
        if self.blocks_for(end) - len(table) + len(shared) > self.free_blocks:
            raise KVFull(f"need {self.blocks_for(end) - len(table) + len(shared)} KV blocks, {self.free_blocks} free")
        for i in shared:
            (b,), old = self.allocate(1), table[i]
            self.k[:, b * bs:(b + 1) * bs] = self.k[:, old * bs:(old + 1) * bs]
            self.v[:, b * bs:(b + 1) * bs] = self.v[:, old * bs:(old + 1) * bs]
            table[i] = b
            self.release([old])  # another table still holds it, or it stays cached
            self.copies += 1
        for i in range(first, have):
            b = table[i]
            if b in self._entry and len(self._entry[b][1]) > max(start - i * bs, 0):
                self._cut(b, max(start - i * bs, 0))
        self.grow(table, end)

    def slots(self, table: list[int], start: int, end: int) -> list[int]:
        bs = self.block_size
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    # -- prefix cache ------------------------------------------------------------------------------
    def match(self, tokens: Sequence[int], limit: int, root: bytes = b"") -> tuple[list[int], int, list[bytes]]:
        """The longest cached prefix of ``tokens``, at most ``limit`` tokens: (its blocks, now held by the
        caller too; its length in tokens; the digests of its full blocks). Full blocks match by digest; the
        block after them may match in part (its first slots), and is then the caller's to copy on write.
        ``root`` is the first block's parent (b"": one cache; a version's: one cache per version)."""
        bs, blocks, digests, parent = self.block_size, [], [], root
        for i in range(limit // bs):
            b = self._full.get(d := digest(parent, tokens[i * bs:(i + 1) * bs]))
            if b is None:
                break
            blocks.append(b)
            digests.append(d)
            parent = d
        n = len(blocks) * bs
        best, best_n = None, 0
        kids = self._children.get((parent, tokens[n]), {}) if n < limit else {}
        for b, held in kids.items():
            common = common_prefix(held, tokens[n:limit])
            if common > best_n:
                best, best_n = b, common
        if best is not None:
            blocks.append(best)
            n += best_n
        for b in blocks:
            self.share(b)
        return blocks, n, digests

    def register(self, b: int, parent: bytes, tokens: tuple[int, ...], full: bytes | None = None) -> None:
        """Record that block ``b``'s first slots hold ``tokens`` after the prefix whose digest is ``parent``
        (``full``: the block's own digest when it is full). A block whose content another block already
        holds stays unregistered."""
        if len(tokens) == self.block_size:
            full = full or digest(parent, tokens)
            if full in self._full:
                return
        elif any(held[:len(tokens)] == tokens for held in self._children.get((parent, tokens[0]), {}).values()):
            return
        if b in self._entry:
            self._forget(b)
        self._entry[b] = (parent, tokens)
        self._children.setdefault((parent, tokens[0]), {})[b] = tokens
        if len(tokens) == self.block_size:
            self._full[full] = b

    def clear_cache(self) -> None:
        for b in list(self._entry):
            self._forget(b)
        self._free.extend(sorted(self._lru, reverse=True))
        self._lru.clear()

    def _is_full(self, b: int) -> bool:
        entry = self._entry.get(b)
        return entry is not None and len(entry[1]) == self.block_size

    def _cut(self, b: int, keep: int) -> None:
        parent, tokens = self._entry[b]
        self._forget(b)
        if keep:
            self._entry[b] = (parent, tokens[:keep])
            self._children.setdefault((parent, tokens[0]), {})[b] = tokens[:keep]

    def _forget(self, b: int) -> None:
        parent, tokens = self._entry.pop(b)
        kids = self._children[(parent, tokens[0])]
        del kids[b]
        if not kids:
            del self._children[(parent, tokens[0])]
        if len(tokens) == self.block_size:
            d = digest(parent, tokens)
            if self._full.get(d) == b:
                del self._full[d]

    # -- data --------------------------------------------------------------------------------------
    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[layer, slots] = k
        self.v[layer, slots] = v

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[layer][slots], self.v[layer][slots]

    def export(self, table: list[int], tokens: int) -> torch.Tensor:
        idx = torch.tensor(self.slots(table, 0, tokens), dtype=torch.long, device=self.k.device)
        return torch.stack((self.k[:, idx], self.v[:, idx]), dim=1).contiguous()

    def import_(self, data: torch.Tensor, tokens: Sequence[int] | None = None,
                root: bytes = b"") -> tuple[list[int], int]:
        """Write an exported [layers, 2, tokens, kvh, d] tensor into blocks; returns (the table, the tokens
        deduplicated). With ``tokens`` (the sequence's, as many as ``data`` holds) the longest cached prefix
        whose values equal ``data``'s bit for bit is shared instead of written. Raises KVFull when the blocks
        it needs are not free, changing nothing but the recency order of the cached blocks it matched."""
        layers, two, n, kvh, d = data.shape
        if (layers, kvh, d) != (self.k.shape[0], self.k.shape[2], self.k.shape[3]) or two != 2:
            raise ValueError(f"KV of shape {tuple(data.shape)} does not fit this pool {tuple(self.k.shape)}")
        table, shared = self._equal_prefix(data, tokens, root) if tokens is not None and n else ([], 0)
        try:
            self.prepare(table, shared, n)
        except KVFull:
            self.release(table)
            raise
        idx = torch.tensor(self.slots(table, shared, n), dtype=torch.long, device=self.k.device)
        self.k[:, idx] = data[:, 0, shared:].to(self.k)
        self.v[:, idx] = data[:, 1, shared:].to(self.v)
        return table, shared

    def _equal_prefix(self, data: torch.Tensor, tokens: Sequence[int], root: bytes = b"") -> tuple[list[int], int]:
        """The cached prefix of ``tokens`` (blocks held; ``root`` as ``match``'s) as far as its values equal
        ``data``'s, slot by slot."""
        blocks, n, _ = self.match(tokens, data.shape[2], root)
        bs, keep = self.block_size, 0
        for i, b in enumerate(blocks):
            m = min(n - i * bs, bs)
            src = data[:, :, i * bs:i * bs + m].to(self.k.device)
            same = ((self.k[:, b * bs:b * bs + m] == src[:, 0].to(self.k))
                    & (self.v[:, b * bs:b * bs + m] == src[:, 1].to(self.v))).transpose(0, 1).reshape(m, -1).all(1)
            equal = int(same.int().cumprod(0).sum())  # its leading slots that hold the same bits
            keep += equal
            if equal < m:
                break
        used = self.blocks_for(keep) if keep % bs else keep // bs
        self.release(blocks[used:])
        return blocks[:used], keep
