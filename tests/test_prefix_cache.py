"""The KV pool's prefix cache (engine/kv.py) and the built-in engine sharing prompts through it."""

import hashlib
from array import array

import pytest
import torch
from engine_util import run_all
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dora_hpc.engine.engine import Engine
from dora_hpc.engine.kv import KVFull, KVPool, digest
from dora_hpc.engine.local_models import build_tiny_model
from dora_hpc.engine.sampling import SamplingParams

BS = 4


def value(prefix: list[int]) -> float:
    """What a slot holds for the last token of ``prefix``: a function of the whole prefix, as KV is."""
    return float(int.from_bytes(hashlib.blake2b(array("q", prefix).tobytes(), digest_size=3).digest(), "big"))


class Model:
    """Sequences on a bare pool, driven as the engine drives it; each written slot holds ``value``."""

    def __init__(self, blocks: int) -> None:
        self.pool = KVPool(1, 1, 1, blocks, BS)
        self.seqs: dict[int, tuple[list[int], list[int], int]] = {}  # id -> (tokens, table, tokens with KV)
        self.prefixes: dict[bytes, list[int]] = {b"": []}  # a digest -> the tokens it names

    def write(self, table: list[int], tokens: list[int], start: int, end: int) -> None:
        slots = torch.tensor(self.pool.slots(table, start, end), dtype=torch.long)
        vals = torch.tensor([value(tokens[:p + 1]) for p in range(start, end)]).view(-1, 1, 1)
        self.pool.write(0, slots, vals, -vals)

    def register(self, table: list[int], tokens: list[int], old: int, new: int, prompt: int) -> None:
        parent = b""
        for i in range(new // BS):
            block = tuple(tokens[i * BS:(i + 1) * BS])
            d = digest(parent, block)
            self.prefixes[d] = tokens[:(i + 1) * BS]
            if i >= old // BS:
                self.pool.register(table[i], parent, block, d)
            parent = d
        if old < prompt <= new and prompt % BS:
            self.pool.register(table[prompt // BS], parent, tuple(tokens[prompt // BS * BS:prompt]))

    def start(self, sid: int, tokens: list[int]) -> bool:
        table, n, _ = self.pool.match(tokens, len(tokens) - 1)
        try:
            self.pool.prepare(table, n, len(tokens))
        except KVFull:
            self.pool.release(table)
            return False
        self.write(table, tokens, n, len(tokens))
        self.register(table, tokens, n, len(tokens), len(tokens))
        self.seqs[sid] = (tokens, table, len(tokens))
        return True

    def decode(self, sid: int, tok: int) -> None:
        tokens, table, n = self.seqs[sid]
        tokens.append(tok)
        try:
            self.pool.prepare(table, n, n + 1)
        except KVFull:
            tokens.pop()
            return
        self.write(table, tokens, n, n + 1)
        self.register(table, tokens, n, n + 1, 0)
        self.seqs[sid] = (tokens, table, n + 1)

    def move(self, sid: int) -> None:
        """Export then import (migration or offload): the values come back, a bit-equal prefix shared."""
        tokens, table, n = self.seqs.pop(sid)
        data = self.pool.export(table, n)
        self.pool.release(table)
        try:
            table, shared = self.pool.import_(data, tokens)
        except KVFull:
            return
        assert shared <= n
        self.seqs[sid] = (tokens, table, n)

    def check(self) -> None:
        p = self.pool
        holders = [0] * p.num_blocks
        for tokens, table, n in self.seqs.values():
            assert len(set(table)) == len(table) and len(table) == p.blocks_for(n)
            for b in table:
                holders[b] += 1
            got = p.k[0, p.slots(table, 0, n), 0, 0].tolist()
            assert got == [value(tokens[:i + 1]) for i in range(n)]  # nobody wrote over a shared slot
        assert p.ref == holders  # a block's count is its holders
        assert p.free_blocks == holders.count(0)  # free = held by none (cached or not)
        for b, (parent, toks) in p._entry.items():  # a cached entry names what its slots hold
            prefix = self.prefixes[parent]
            assert p.k[0, p.slots([b], 0, len(toks)), 0, 0].tolist() == \
                [value(prefix + list(toks[:j + 1])) for j in range(len(toks))]
        for d, b in p._full.items():
            assert p._entry[b][1] and digest(*p._entry[b]) == d


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_blocks_are_free_or_held_by_their_count_and_cached_ones_hold_what_they_name(data):
    """Random sequences over a few shared prompts (start, decode, move, release, a weight change): a
    block's count equals its holders, shared slots are never written, and a cached block's first slots
    hold exactly the prefix its entry names, through eviction and copy-on-write."""
    m = Model(blocks=data.draw(st.integers(4, 24)))
    stems = [[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 9], [8] * 9]
    for step in range(data.draw(st.integers(5, 60))):
        op = data.draw(st.sampled_from(["start", "start", "decode", "decode", "move", "release", "clear"]))
        live = sorted(m.seqs)
        if op == "start":
            stem = data.draw(st.sampled_from(stems))
            cut = data.draw(st.integers(1, len(stem)))
            m.start(step, stem[:cut] + data.draw(st.lists(st.integers(1, 3), max_size=3)))
        elif op == "clear":
            m.pool.clear_cache()
        elif live:
            sid = data.draw(st.sampled_from(live))
            if op == "decode":
                m.decode(sid, data.draw(st.integers(1, 3)))
            elif op == "move":
                m.move(sid)
            else:
                m.pool.release(m.seqs.pop(sid)[1])
        m.check()
    for _, table, _ in m.seqs.values():
        m.pool.release(table)
    assert m.pool.free_blocks == m.pool.num_blocks and all(r == 0 for r in m.pool.ref)


def test_a_shared_prefix_is_matched_block_by_block_then_in_part():
    m = Model(blocks=16)
    assert m.start(0, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10])  # 2 full blocks and a tail of 2
    table, n, digests = m.pool.match([1, 2, 3, 4, 5, 6, 7, 8, 9, 11, 12], 10)
    assert n == 9 and table[:2] == m.seqs[0][1][:2] and table[2] == m.seqs[0][1][2] and len(digests) == 2
    assert [m.pool.ref[b] for b in table] == [2, 2, 2]
    m.pool.prepare(table, 9, 11)  # the shared tail is copied before the write
    assert table[2] != m.seqs[0][1][2] and m.pool.copies == 1 and m.pool.ref[m.seqs[0][1][2]] == 1
    m.pool.release(table)
    assert m.pool.match([7, 7, 7, 7, 7], 4)[1] == 0  # nothing shares a first block with it


def test_cached_blocks_are_reused_last_and_least_recently_released_first():
    m = Model(blocks=4)
    assert m.start(0, [1, 2, 3, 4, 5, 6, 7, 8])
    m.pool.release(m.seqs.pop(0)[1])
    assert m.pool.free_blocks == 4 and m.pool.cached_blocks == 2
    assert m.start(1, [9, 9])  # an uncached free block first (its tail is cached then)
    assert m.pool.cached_blocks == 3
    assert m.start(2, [5, 5, 5, 5, 5])  # the last uncached block, then the least recently released cached one
    assert m.pool.cached_blocks == 4  # [5..8] was evicted (released after [1..4]); [5,5,5,5] and [5] cached
    table, n, _ = m.pool.match([1, 2, 3, 4, 5, 6, 7, 8, 0], 8)
    assert n == 4  # the chain's first block is still there
    m.pool.release(table)
    m.check()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen2")


def groups(engine, prompts, g, params, version=0):
    rid = 0
    for p in prompts:
        for _ in range(g):
            engine.add(rid, p, params, version)
            rid += 1


@pytest.mark.parametrize("lens", [(37, 64, 50), (16, 33, 8)])
def test_a_groups_prompt_is_prefilled_once_and_its_samples_are_unchanged(tiny_dir, lens):
    """G=8 samples of each prompt (block-aligned and not, shorter than a block too): with sharing each
    prompt is prefilled once and each other sample computes its last prompt token only; every token is the
    unshared engine's. Logprobs differ from the unshared engine's by rounding only, as the unshared engine's
    own do between two batch layouts of the same requests (the engine is not batch-invariant)."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in lens]
    params = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    out, stats = {}, {}
    for name, shared, seqs in (("off", False, 32), ("on", True, 32), ("off-serial", False, 1)):
        e = Engine(tiny_dir, kv_blocks=200, block_size=16, max_num_seqs=seqs, max_batched_tokens=512,
                   prefix_caching=shared)
        groups(e, prompts, 8, params)
        out[name], stats[name] = run_all(e), e.stats()
        assert stats[name]["kv_blocks_used"] == 0
    long = [n for n in lens if n > 16]  # a prompt of one block or less is not waited for
    assert stats["on"]["prefill_tokens"] == sum(long) + 7 * len(long) + 8 * (sum(lens) - sum(long))
    assert stats["off"]["prefill_tokens"] == 8 * sum(lens)
    assert stats["on"]["prefix_hit_tokens"] == 7 * sum(n - 1 for n in long)
    ids = sorted(out["off"])
    assert all(out["on"][i].response == out["off"][i].response for i in ids)

    def gap(a, b):
        return max(abs(x - y) for i in ids for x, y in zip(out[a][i].logprobs, out[b][i].logprobs, strict=True))

    assert gap("on", "off") < 1e-5 and gap("off-serial", "off") < 1e-5


def test_sharing_fits_more_sequences_in_the_same_kv(tiny_dir):
    """One 120-token prompt, 8 samples, a pool of 40 blocks of 8: unshared, 16 blocks a sample leave room
    for 2 at a time; shared, the 15 full prompt blocks are held once."""
    prompt = torch.randint(3, 500, (120,), generator=torch.Generator().manual_seed(2)).tolist()
    params = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    peak = {}
    for shared in (False, True):
        e = Engine(tiny_dir, kv_blocks=40, block_size=8, max_num_seqs=8, max_batched_tokens=512,
                   prefix_caching=shared, on_kv_full="recompute")
        groups(e, [prompt], 8, params)
        peak[shared] = 0
        while e.has_work():
            e.step()
            peak[shared] = max(peak[shared], e.stats()["running"])
    assert peak[False] == 2 and peak[True] == 8, peak


def test_weights_of_a_new_version_match_nothing_cached_under_the_old(tiny_dir):
    e = Engine(tiny_dir, kv_blocks=64, block_size=8)
    prompt = list(range(3, 40))
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    e.add(0, prompt, params, 0)
    run_all(e)
    assert e.stats()["kv_blocks_cached"] > 0
    e.load_weights(e.weights(), 1)
    assert e.stats()["kv_blocks_cached"] == 0
    e.add(1, prompt, params, 1)
    run_all(e)
    assert e.stats()["prefix_hit_tokens"] == 0 and e.stats()["prefill_tokens"] == 2 * len(prompt)


def test_a_moved_sequence_shares_the_bit_equal_prefix_its_target_holds(tiny_dir):
    """Two engines prefill the same prompt alone (the same layout, so the same bits); a sequence exported
    from one is imported into the other, which shares the prompt's cached blocks instead of writing them
    and goes on as if it had never moved (batched with another sequence now: equal to rounding)."""
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    prompt = torch.randint(3, 500, (40,), generator=torch.Generator().manual_seed(4)).tolist()
    ref = Engine(tiny_dir, kv_blocks=64, block_size=8)
    ref.add(7, prompt, params, 0)
    expected = run_all(ref)[7]
    a, b = Engine(tiny_dir, kv_blocks=64, block_size=8), Engine(tiny_dir, kv_blocks=64, block_size=8)
    a.add(7, prompt, params, 0)
    b.add(8, prompt, params, 0)
    for _ in range(4):
        a.step()
        b.step()
    meta, kv = a.export(7)
    b.import_(meta, kv)
    assert b.stats()["dedup_tokens"] == 40  # the prompt: 5 full blocks held once
    assert b.stats()["kv_blocks_used"] == 6 + 1  # 43 tokens each, the first 40 held once
    got = run_all(b)[7]
    assert got.response == expected.response
    assert max(abs(x - y) for x, y in zip(got.logprobs, expected.logprobs, strict=True)) < 1e-5


def test_requests_sharing_a_cached_system_prompt_start_together(tiny_dir):
    """8 requests: a 32-token shared prefix, then 20 tokens of their own. The first prefills the prefix; in
    the next step every other takes it from the cache and prefills only its own tokens, all at once (waiting
    pays only while a block or more of one's prompt is being prefilled by another)."""
    head = list(range(3, 35))
    e = Engine(tiny_dir, kv_blocks=64, block_size=16, max_num_seqs=8, max_batched_tokens=512)
    params = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True)
    for i in range(8):
        e.add(i, head + [100 + 20 * i + j for j in range(20)], params, 0)
    running = []
    for _ in range(3):
        e.step()
        running.append(e.stats()["running"])
    assert running[:2] == [1, 8], running
    assert e.stats()["prefix_hit_tokens"] == 7 * 32


def test_a_sequence_moved_without_its_kv_takes_the_prompt_its_target_holds(tiny_dir):
    prompt = torch.randint(3, 500, (57,), generator=torch.Generator().manual_seed(5)).tolist()
    params = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True)
    a, b = Engine(tiny_dir, kv_blocks=64, block_size=8), Engine(tiny_dir, kv_blocks=64, block_size=8)
    b.add(1, prompt, params, 0)
    run_all(b)  # b holds the prompt's 7 full blocks, cached
    a.add(2, prompt, params, 0)
    meta, kv = a.export(2)  # not started: no KV
    b.import_(meta, kv)
    run_all(b)
    assert b.stats()["prefix_hit_tokens"] == 56 and b.stats()["prefill_tokens"] == 57 + 1


def test_a_tail_match_on_a_freed_full_block_keeps_the_chain_after_it():
    """A sequence that takes the first slots of a cached full block nobody holds copies it, so the chain
    of blocks cached after it stays matchable."""
    m = Model(blocks=12)
    assert m.start(0, list(range(1, 13)))  # 3 full blocks of 4
    m.pool.release(m.seqs.pop(0)[1])
    assert m.start(1, [1, 2, 3, 4, 5, 6, 99])  # takes block 0 whole and 2 slots of block 1
    table, n, _ = m.pool.match(list(range(1, 14)), 12)
    assert n == 12  # blocks 1 and 2 are still cached
    m.pool.release(table)
    m.check()


def test_a_restore_that_cannot_pay_for_a_partly_shared_blocks_copy_restores_without_sharing(tiny_dir):
    """Restoring an offloaded sequence shares the cached blocks its KV equals; when it takes a cached full
    block only in part it needs one more block (its copy) than its KV fills. With exactly as many free blocks
    as its KV fills it is restored without sharing (the pool pays nothing extra: it was refused once in CI,
    and before that would wait for ever); with fewer it waits, the pool as it was; either way it ends as if
    it had never left."""
    prompt = torch.randint(3, 500, (12,), generator=torch.Generator().manual_seed(6)).tolist()
    params = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    ref_e = Engine(tiny_dir, kv_blocks=64, block_size=8)
    ref_e.add(2, prompt, params, 0)
    expected = run_all(ref_e)[2].response
    for spare in (0, -1):
        e = Engine(tiny_dir, kv_blocks=8, block_size=8)
        e.add(1, prompt, params, 0)
        run_all(e)  # 20 tokens: blocks [0, 8) and [8, 16) cached full, the second holding the prompt's tail
        e.add(2, prompt, params, 0)
        for _ in range(3):
            e.step()  # 12 + 2 tokens with KV; the first 11 came from the cache (the second block copied)
        e.offload(2)
        assert e.kv.cached_blocks == 2 and e.kv.free_blocks == 8
        others = e.kv.allocate(6 - spare)  # another table holds every block the cache does not (and one more)
        free, cached, ref = e.kv.free_blocks, e.kv.cached_blocks, list(e.kv.ref)
        e.seqs[2].auto_restore = True
        e.step()
        if spare < 0:
            assert e.seqs[2].table == [] and (e.kv.free_blocks, e.kv.cached_blocks, e.kv.ref) == (free, cached, ref)
        else:
            assert e.seqs[2].table and e.stats()["dedup_tokens"] == 0
        e.kv.release(others)
        assert run_all(e)[2].response == expected
