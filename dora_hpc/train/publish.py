"""Published versions: what each trainer rank keeps of a live version, what travels to an instance, and how
the instance proves it holds exactly that version.

Invariants:
* a version is published in the publish dtype (``train.publish_dtype``: the engine's dtype unless set);
  its layout over the T trainer ranks follows from the tensors' shapes alone: every tensor's dim 0 is cut
  into T ``torch.chunk`` pieces and trainer r keeps piece r (FSDP2's own layout; a 0-dim tensor is
  piece 0's). A trainer rank keeps, per live version, 1/T of the model in the publish dtype; a receiver
  that knows the shapes knows where every piece goes;
* a version's checksum is a function of its whole weights in the publish dtype and of T (which it names):
  sha256 over the T shard digests, each a sha256 over its pieces (name and bytes) in name order. A trainer
  digests its own shard (trainers exchange only digests); an instance digests all T from the weights its engine holds
  after a load, so a corrupted load or a delta applied to the wrong base fails the check;
* a delta of a piece against a base piece of the same name and shape names the positions whose
  publish-dtype bits differ (a bitmask, or their indices where those are fewer bytes) and carries the new
  values there: applying it to the base gives the piece bit for bit (NaN payloads and signed zeros included:
  bits are compared, not values). A piece is sent as a delta only when that is smaller than the piece.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np
import torch

# a view of each publish dtype as integers of its width: deltas and digests compare bits, not values
_BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def publish_dtype(name: str, engine_dtype: str) -> torch.dtype:
    """``train.publish_dtype`` as a torch dtype: ``auto`` is the engine's dtype."""
    return getattr(torch, engine_dtype if name == "auto" else name)


def rows(shape: tuple[int, ...], rank: int, shards: int) -> tuple[int, int]:
    """The rows [start, stop) of dim 0 that trainer ``rank`` of ``shards`` keeps (torch.chunk's split; a
    0-dim tensor counts as one row); empty for ranks past the last chunk."""
    n = shape[0] if shape else 1
    size = -(-n // shards)
    return min(rank * size, n), min((rank + 1) * size, n)


def piece(t: torch.Tensor, rank: int, shards: int) -> torch.Tensor:
    lo, hi = rows(tuple(t.shape), rank, shards)
    return t.reshape(1)[lo:hi] if t.dim() == 0 else t[lo:hi]


def shard_of(state: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], rank: int, shards: int,
             dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Trainer ``rank``'s pieces of whole weights (a dict, or (name, tensor) pairs streamed one at a time), as
    owned CPU copies in ``dtype`` (empty pieces left out)."""
    out = {}
    for name, t in state.items() if isinstance(state, Mapping) else state:
        p = piece(t.detach(), rank, shards)
        if p.numel():
            out[name] = p.to("cpu", dtype, copy=True).contiguous()
    return out


def shard_digest(shard: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(shard):
        h.update(name.encode())
        h.update(shard[name].contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def version_checksum(digests: list[str]) -> str:
    """The checksum of a version from its T shard digests, in trainer order; ``/tT`` names the layout (the
    same weights over another number of trainer ranks have another checksum)."""
    return f"{hashlib.sha256(''.join(digests).encode()).hexdigest()[:16]}/t{len(digests)}"


def checksum_of(state: dict[str, torch.Tensor], shards: int, dtype: torch.dtype) -> str:
    """A version's checksum from its whole weights (an instance after a load, a replicated trainer)."""
    return version_checksum([shard_digest(shard_of(state, r, shards, dtype)) for r in range(shards)])


def positions_dtype(n: int, changed: int) -> type:
    """How a delta of ``changed`` values in a piece of ``n`` names its positions, whichever takes fewer bytes:
    a bitmask over the piece (uint8, packed) or the changed positions' indices (int32; int64 past 2**31)."""
    index = np.int32 if n < 2**31 else np.int64
    return index if changed * np.dtype(index).itemsize < -(-n // 8) else np.uint8


@dataclass(frozen=True)
class Delta:
    """A piece as the positions that changed against a base piece, and their new values."""
    shape: tuple[int, ...]  # the piece's
    positions: np.ndarray   # flat, C order: np.packbits of the changed positions, or their indices (positions_dtype)
    values: torch.Tensor    # the new values there, in the publish dtype

    @property
    def nbytes(self) -> int:
        return self.positions.nbytes + self.values.numel() * self.values.element_size()


def delta(new: torch.Tensor, base: torch.Tensor) -> Delta | None:
    """``new`` against ``base`` (same shape and dtype), or None when sending ``new`` whole is no larger."""
    bits = _BITS[new.dtype]
    changed = (new.view(bits) != base.view(bits)).reshape(-1).numpy()
    kind = positions_dtype(changed.size, int(changed.sum()))
    positions = np.packbits(changed) if kind is np.uint8 else np.flatnonzero(changed).astype(kind)
    d = Delta(tuple(new.shape), positions, new.reshape(-1)[torch.from_numpy(changed)].clone())
    return d if d.nbytes < new.numel() * new.element_size() else None


def apply_delta(base: torch.Tensor, d: Delta) -> torch.Tensor:
    """The piece ``d`` was made from, given the base it was made against."""
    if tuple(base.shape) != d.shape:
        raise ValueError(f"a weight delta for shape {d.shape} against a base of shape {tuple(base.shape)}")
    out = base.reshape(-1).clone()
    if d.positions.dtype == np.uint8:
        at = torch.from_numpy(np.unpackbits(d.positions, count=out.numel()).astype(bool))
        named = int(at.sum())
    else:
        at = torch.from_numpy(d.positions.astype(np.int64))
        named = len(at)
        if named and not (0 <= int(at.min()) and int(at.max()) < out.numel()):
            raise ValueError(f"a weight delta names positions outside a piece of {out.numel()} values")
    if named != d.values.numel():
        raise ValueError(f"a weight delta names {named} positions but carries {d.values.numel()} values")
    out[at] = d.values
    return out.view(base.shape)


def wire_bytes(shape: tuple[int, ...], changed: int, itemsize: int) -> int:
    """The bytes a piece takes on the wire: whole (``changed`` < 0), or as a delta's positions and values."""
    n = int(np.prod(shape))
    if changed < 0:
        return n * itemsize
    kind = positions_dtype(n, changed)
    return (-(-n // 8) if kind is np.uint8 else changed * np.dtype(kind).itemsize) + changed * itemsize


def unwire(shape: tuple[int, ...], changed: int, raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | Delta:
    """A piece back from its bytes on the wire (uint8, as ``wire`` made them): whole (``changed`` < 0) or a delta.
    The bytes are copied into fresh memory: an empty buffer may have stride 0, which a dtype view refuses."""
    raw = raw.clone(memory_format=torch.contiguous_format)
    if changed < 0:
        return raw.view(dtype).view(shape)
    m = wire_bytes(shape, changed, dtype.itemsize) - changed * dtype.itemsize
    positions = raw[:m].numpy().view(positions_dtype(int(np.prod(shape)), changed))
    return Delta(tuple(shape), positions, raw[m:].view(dtype))


def wire(p: torch.Tensor | Delta) -> np.ndarray:
    """A piece's bytes on the wire: the tensor's, or a delta's mask then its values."""
    if isinstance(p, Delta):
        return np.concatenate([p.positions.view(np.uint8), wire(p.values)])
    return p.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()


def assemble(parts: list[tuple[int, int, dict[str, torch.Tensor | Delta]]], current: dict[str, torch.Tensor],
             dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Whole weights in ``dtype`` from every shard's pieces, given as (shard, shards, pieces). ``current`` is
    what the receiver holds: it gives each tensor's whole shape and, to a delta, the rows of its base; an adapter's
    tensor the receiver does not hold yet (engine/lora.py's names: the first adapter after the base) comes whole,
    its rows those of its pieces. The pieces are consumed tensor by tensor, so pieces and whole weights are held
    twice over one tensor at most."""
    out: dict[str, torch.Tensor] = {}
    for name in sorted({n for _, _, pieces in parts for n in pieces}):
        if name in current:
            shape = tuple(current[name].shape)
        elif name.endswith((".lora_A.weight", ".lora_B.weight")) and all(
                isinstance(p.get(name), torch.Tensor | None) for _, _, p in parts):
            got = [p[name] for _, _, p in parts if name in p]
            shape = (sum(t.shape[0] for t in got), *got[0].shape[1:])
        else:
            raise RuntimeError(f"published weights name a tensor the engine does not have: {name}")
        out[name] = torch.empty(shape, dtype=dtype)
        for shard, shards, pieces in parts:
            p = pieces.pop(name, None)
            if isinstance(p, Delta):
                p = apply_delta(piece(current[name], shard, shards).to("cpu", dtype), p)
            if p is not None:
                piece(out[name], shard, shards).copy_(p)
    return out
