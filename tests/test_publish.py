"""Published versions (train/publish.py): the shard layout, lossless deltas and the version checksum."""

import numpy as np
import pytest
import torch

from dora_hpc.train.publish import (
    Delta,
    apply_delta,
    assemble,
    checksum_of,
    delta,
    rows,
    shard_digest,
    shard_of,
    unwire,
    version_checksum,
    wire,
    wire_bytes,
)

SHAPES = {"embed": (7, 3), "norm": (2,), "scale": (), "row": (1, 4), "odd": (5,)}


def weights(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}


@pytest.mark.parametrize("shards", [1, 2, 3, 4])
def test_the_shards_cover_every_element_once_and_put_together_give_the_weights(shards):
    w = weights()
    for name, t in w.items():
        spans = [rows(tuple(t.shape), r, shards) for r in range(shards)]
        assert spans[0][0] == 0 and spans[-1][1] == (t.shape[0] if t.dim() else 1)
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False)), (name, spans)
    parts = [(r, shards, shard_of(w, r, shards, torch.bfloat16)) for r in range(shards)]
    assert sum(p.numel() for _, _, s in parts for p in s.values()) == sum(t.numel() for t in w.values())
    whole = assemble(parts, w, torch.bfloat16)
    assert all(torch.equal(whole[n], w[n].to(torch.bfloat16)) for n in w)
    assert not any(s for _, _, s in parts)  # consumed as they were copied


@pytest.mark.parametrize("every,kind", [(50, np.int32), (3, np.uint8)])  # sparse: indices; denser: a bitmask
def test_a_delta_gives_back_the_new_piece_bit_for_bit_and_only_when_it_is_smaller(every, kind):
    base = torch.randn(4096).to(torch.bfloat16)
    new = base.clone()
    new[::every] += 1.0
    new[7], base[7] = torch.tensor(0.0), torch.tensor(-0.0)  # equal values, different bits: changed
    new[9] = float("nan")
    d = delta(new, base)
    changed = int((new.view(torch.int16) != base.view(torch.int16)).sum())
    assert d is not None and d.values.numel() == changed and d.positions.dtype == kind
    assert torch.equal(apply_delta(base, d).view(torch.int16), new.view(torch.int16))
    raw = wire(d)
    assert d.nbytes == wire_bytes(tuple(new.shape), changed, 2) == len(raw) < new.numel() * 2
    back = unwire(d.shape, changed, torch.from_numpy(raw), torch.bfloat16)
    assert torch.equal(apply_delta(base, back).view(torch.int16), new.view(torch.int16))
    assert delta(base + 1.0, base) is None  # everything changed: whole is smaller
    with pytest.raises(ValueError, match="positions"):
        apply_delta(base, Delta(d.shape, d.positions, d.values[1:]))
    with pytest.raises(ValueError, match="shape"):
        apply_delta(base[:10], d)


def test_a_bucket_of_only_unchanged_and_empty_pieces_reads_back():
    """An all-unchanged bucket is 0 bytes on the wire, and an empty buffer can have stride 0 (CI found it)."""
    base = torch.randn(8, 4)
    pieces = {"a": delta(base.clone(), base), "b": torch.empty(0, 4), "c": delta(base.clone(), base)}
    flat = torch.from_numpy(np.empty((0,), np.uint8))
    assert flat.stride() == (0,)
    for name, part in zip(pieces, flat.split([0, 0, 0]), strict=True):
        p = pieces[name]
        back = unwire(tuple(p.shape), p.values.numel() if isinstance(p, Delta) else -1, part, torch.float32)
        if isinstance(p, Delta):
            assert torch.equal(apply_delta(base, back), base)
        else:
            assert back.shape == (0, 4)


def test_a_piece_sent_as_a_delta_is_put_together_against_the_receivers_base():
    old, new = weights(0), weights(0)
    new["embed"][3, 1] += 0.5
    dtype = torch.float32
    parts = []
    for r in range(2):
        mine, was = shard_of(new, r, 2, dtype), shard_of(old, r, 2, dtype)
        parts.append((r, 2, {n: delta(p, was[n]) or p for n, p in mine.items()}))
    assert any(isinstance(p, Delta) for _, _, s in parts for p in s.values())
    whole = assemble(parts, old, dtype)
    assert checksum_of(whole, 2, dtype) == checksum_of(new, 2, dtype)


def test_the_version_checksum_comes_from_the_shard_digests_and_sees_one_changed_bit():
    w = weights()
    for shards in (1, 3):
        digests = [shard_digest(shard_of(w, r, shards, torch.float32)) for r in range(shards)]
        assert checksum_of(w, shards, torch.float32) == version_checksum(digests)
    flipped = {**w, "odd": w["odd"].clone()}
    flipped["odd"].view(torch.int32)[2] ^= 1
    assert checksum_of(flipped, 2, torch.float32) != checksum_of(w, 2, torch.float32)
    assert checksum_of(w, 2, torch.bfloat16) != checksum_of(w, 2, torch.float32)
