"""Speculative decoding in the built-in engine (engine.speculation): drafts from the run's own text, verified
by the request's version, lossless -- the same greedy tokens, the same logprobs, the same distribution."""

import math

import pytest
import torch
from engine_util import run_all

from dora_hpc.engine.draft import HISTORY, MIN_PATH_P, Budget, Drafter
from dora_hpc.engine.engine import Engine
from dora_hpc.engine.local_models import build_tiny_model
from dora_hpc.engine.model import Batch, load_model
from dora_hpc.engine.sampling import SamplingParams


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_model(build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen2"))


def engine(model, method="none", seed=0, **kw):
    kw = {"kv_blocks": 256, "block_size": 8, "max_num_seqs": 64, "max_batched_tokens": 512, **kw}
    return Engine(model, seed=seed, speculation=method, draft_tokens=4, **kw)


def forced_logprobs(model, prompt, response, temperature=1.0):
    """The logprob of each response token from one forward over prompt + response (no cache, no draft)."""
    from dora_hpc.engine.kv import KVPool

    s, ids = model.spec, prompt + response
    kv = KVPool(s.num_layers, s.num_kv_heads, s.head_dim, num_blocks=len(ids) // 8 + 1, block_size=8)
    table = kv.allocate(kv.blocks_for(len(ids)))
    rows = torch.arange(len(prompt) - 1, len(ids) - 1)
    logits = model(torch.tensor(ids), Batch.build([len(ids)], [len(ids)], [table], 8), kv, rows=rows)
    logp = torch.log_softmax(logits / temperature, -1)
    return logp.gather(1, torch.tensor(response)[:, None])[:, 0].tolist()


@pytest.mark.parametrize("method", ["ngram", "group"])
def test_greedy_tokens_and_their_logprobs_are_those_of_decoding_without_drafts(tiny, method):
    """Greedy decoding (the tiny model falls into loops, which its own text and its siblings' draft well):
    every response equals the one decoded without drafts, drafts were made and accepted, and each token's
    logprob equals a plain forward's over the whole sequence."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, tiny.spec.vocab_size, (n,), generator=g).tolist() for n in (5, 12, 30)]
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    out = {}
    for m in ("none", method):
        e = engine(tiny, m)
        for i, p in enumerate(prompts * 2):  # two siblings a prompt
            e.add(i, p, params, 0)
        out[m], stats = run_all(e), e.stats()
    assert stats["drafted_tokens"] > 0 and stats["accepted_tokens"] > 0, stats
    assert stats["decode_tokens"] == stats["decodes"] + stats["accepted_tokens"]
    assert stats["decodes"] < sum(len(f.response) for f in out[method].values()) - len(out[method])  # fewer forwards
    for i, f in out[method].items():
        assert f.response == out["none"][i].response
        forced = forced_logprobs(tiny, f.prompt, f.response)
        assert max(abs(a - b) for a, b in zip(f.logprobs, forced, strict=True)) < 1e-5


class Scripted(Drafter):
    """Proposes the tokens of ``script`` at the response positions they are for, whatever the response holds."""

    def __init__(self, script: list[int], prompt_len: int) -> None:
        super().__init__("ngram", len(script))
        self.script, self.prompt_len = script, prompt_len

    def propose(self, req_id: int, k: int) -> list[int]:
        n = len(self.own[req_id].tokens) - self.prompt_len
        return self.script[n:n + min(k, self.k)]


def chi2_homogeneity(a: list[int], b: list[int], min_expected: float = 5.0) -> tuple[float, int]:
    """Two samples of tokens: (p-value, degrees of freedom) of Pearson's chi-squared test that they come from
    one distribution; tokens expected fewer than ``min_expected`` times in either sample are pooled."""
    cats = sorted(set(a) | set(b))
    ca, cb = ({t: xs.count(t) for t in cats} for xs in (a, b))
    na, nb = len(a), len(b)
    big = [t for t in cats if (ca[t] + cb[t]) * min(na, nb) / (na + nb) >= min_expected]
    rows = [(ca[t], cb[t]) for t in big] + [(na - sum(ca[t] for t in big), nb - sum(cb[t] for t in big))]
    rows = [r for r in rows if sum(r)]
    stat = sum((o - (x + y) * n / (na + nb)) ** 2 / ((x + y) * n / (na + nb))
               for x, y in rows for o, n in ((x, na), (y, nb)))
    df = len(rows) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64))), df


def test_drafted_tokens_are_accepted_with_their_probability_and_the_samples_keep_the_target_distribution(tiny):
    """4,000 samples of 4 tokens from one prompt at temperature 0.05 (the tiny model's top token then has
    p ~ 0.5): with a draft of the greedy continuation at every position, and without drafts under other noise.
    Each position's tokens pass a chi-squared homogeneity test against the plain samples at alpha 1e-3 (three
    positions: a false alarm in at most 0.3% of seeds), and the first drafted token is accepted as often as
    its probability says (within 4 standard deviations)."""
    prompt, n = [5, 9, 11, 3, 7], 4000
    params = SamplingParams(temperature=0.05, max_tokens=4, ignore_eos=True)
    greedy = engine(tiny)
    greedy.add(0, prompt, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), 0)
    script = run_all(greedy)[0].response
    samples = {}
    for name, seed in (("plain", 1), ("drafted", 2)):
        e = engine(tiny, seed=seed, kv_blocks=4 * 256, max_num_seqs=256, max_batched_tokens=2048)
        if name == "drafted":  # every step drafts the whole script (no measured budget: draft.py Budget)
            e.drafter, e.budget = Scripted(script, len(prompt)), None
        for i in range(n):
            e.add(i, prompt, params, 0)
        samples[name], stats = [f.response for f in run_all(e).values()], e.stats()
    assert stats["drafted_tokens"] > n and stats["accepted_tokens"] > n // 4, stats
    for pos in (1, 2, 3):
        p, df = chi2_homogeneity([r[pos] for r in samples["plain"]], [r[pos] for r in samples["drafted"]])
        assert df >= 2 and p > 1e-3, (pos, p, df)
    # p(script[1] | prompt, script[0]): the share of the samples that start with script[0] whose next token
    # is script[1] is the draft's acceptance there
    first = [r for r in samples["drafted"] if r[0] == script[0]]
    p1 = math.exp(forced_logprobs(tiny, prompt, script[:2], temperature=0.05)[1])
    got = sum(r[1] == script[1] for r in first) / len(first)
    assert abs(got - p1) < 4 * math.sqrt(p1 * (1 - p1) / len(first)), (got, p1, len(first))


def test_a_migrated_request_rebuilds_its_drafts_and_continues_as_it_would_have(tiny):
    """Export mid-response from a drafting engine, import into another: the same tokens as never moving."""
    prompt, params = [4, 8, 15, 16, 23, 42], SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    still = engine(tiny, "group")
    still.add(0, prompt, params, 0)
    want = run_all(still)[0].response
    a, b = engine(tiny, "group"), engine(tiny, "group")
    a.add(0, prompt, params, 0)
    for _ in range(10):
        a.step()
    meta, kv = a.export(0)
    b.import_(meta, kv)
    assert run_all(b)[0].response == want and b.stats()["accepted_tokens"] > 0
    assert not a.drafter.own and b.drafter.own == {}  # neither keeps a request that left it


def test_group_drafts_come_from_live_siblings_then_the_prompts_history_own_version_first():
    d = Drafter("group", 3)
    prompt = [1, 2]
    d.track(0, prompt, [7, 8, 9, 10, 11], version=3)  # a sibling ahead
    d.track(1, prompt, [7, 8], version=3)
    assert d.propose(1, 4) == [9, 10, 11]  # the sibling's next tokens, at most draft_tokens
    d.track(2, prompt, [7, 8], version=2)  # another version's request: the v3 sibling is not its sibling
    assert d.propose(2, 4) == []
    d.finish(0, len(prompt))  # v3's response joins the prompt's history, which any version may draft from
    assert d.propose(2, 4) == [9, 10, 11]
    d.track(3, prompt, [5, 7, 8, 6, 6], version=2)
    d.finish(3, len(prompt))  # v2's own history comes first for a v2 request
    assert d.propose(2, 4) == [6, 6]
    assert d.propose(1, 4) == [9, 10, 11]  # and v3's for a v3 request
    d.track(4, [9, 9], [1, 2, 3, 1, 2], version=3)  # its own text: the match that ends before its last token
    assert d.propose(4, 4) == [3, 1, 2]
    for i in range(HISTORY + 5):  # bounded: HISTORY texts a prompt and version
        d.track(10 + i, prompt, [i], version=3)
        d.finish(10 + i, len(prompt))
    assert len(d.done[hash(tuple(prompt))][3]) == HISTORY
    d.forget(1)
    d.forget(2)
    d.forget(4)
    assert not d.own and not d.live and not d.siblings


def test_the_draft_budget_drafts_where_the_measured_step_times_say_it_pays():
    """Steps measured at 10 ms + 1 ms a token and 60% acceptance: at a batch of 1, 3 drafted tokens make the
    most tokens a second (tau(3) = 2.18 tokens in 14 ms: 155/s, against 4's 154/s and none's 91/s); at a batch
    of 64, none (1 token in 74 ms against tau(1) = 1.6 in 138 ms); every EXPLORE-th call drafts fully anyway."""
    b = Budget(4)
    assert b.limit(64) == 4  # nothing measured yet
    for i in range(Budget.WARMUP):
        n = 1 + i % 8
        b.observe(n * 3, 0.010 + 0.001 * n * 3, drafted=n * 2, accepted=round(n * 2 * 0.6))
    b.calls = 1
    assert b.limit(1) == 3 and b.limit(64) == 0
    while (b.calls + 1) % Budget.EXPLORE:
        b.limit(64)
    assert b.limit(64) == 4


def test_a_draft_follows_what_most_matching_texts_continue_with_while_they_agree():
    d = Drafter("group", 4)
    for i, resp in enumerate(([5, 6, 7, 8], [5, 6, 7, 9], [5, 6, 3, 3])):
        d.track(i, [1], resp, version=0)
    d.track(9, [1], [5, 6], version=0)
    # three siblings match its last tokens: two go on with 7 (share 2/3), then split 8 / 9 (1/2 of those)
    assert d.propose(9, 4) == ([7, 8] if 2 / 3 * 1 / 2 >= MIN_PATH_P else [7])
