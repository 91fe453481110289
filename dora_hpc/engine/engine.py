"""The built-in rollout engine: one instance (DP group) hosting one policy version, or under LoRA several.

Continuous batching with chunked prefill over a paged KV pool; per-token logprobs; KV export/import
for zero-re-prefill migration; host offload/restore; versioned weights.

Invariants:
* the engine hosts one version; ``add``/``import_`` refuse a request tagged with any other, so
  every token of a trajectory is sampled under its tag. With ``lora_scale`` (train.lora) a version is an adapter
  (lora.py): the engine keeps the base weights once and each loaded version's adapter, hosts every one of them
  at once (``versions``), and batches their requests in one forward, each row under its request's adapter;
  ``retire`` drops a version no request holds;
* a step schedules each running sequence at most once: a decode (1 token) or a prefill chunk;
  ``max_num_seqs`` sequences run at most, ``max_batched_tokens`` tokens per step at most;
* when KV blocks run out the newest running sequence is preempted: with ``on_kv_full="offload"``
  (DORA's hierarchical memory) its KV is copied to host memory and restored, bit-exact, once blocks
  free up -- nothing is recomputed (``offloads``, ``free_cache_s`` count it); with "recompute" its
  blocks are dropped and rebuilt when it resumes (``recompute_tokens``);
* a migrated (exported then imported) sequence continues exactly as it would have in place, with
  zero re-prefilled tokens; sampling noise depends on (seed, request id, position) only;
* a bad request (unknown version, too long for the pool) raises before touching engine state;
* a request added with ``hold`` is a multi-turn episode: when a turn finishes it leaves the decode batch
  (``held``) but keeps its KV; ``extend`` appends the environment's tokens, which are prefilled (counted in
  ``env_prefill_tokens``, apart from re-prefill) before the next turn decodes; ``abort`` ends it. Under KV
  pressure held episodes are offloaded first (they use no compute); migration carries them like any other;
* with ``prefix_caching`` a sequence that starts (or starts again) takes the longest prefix of its tokens
  whose KV the pool holds under this version (kv.py), all but its last token, and prefills the rest
  (``prefix_hit_tokens`` counts what it did not); every block a sequence fills, and its prompt's last
  partial block, become matchable. An imported sequence shares the cached prefix whose values equal its
  own bit for bit (``dedup_tokens``). Loading weights forgets the cache; under LoRA the cache is keyed by version
  (KV computed under one adapter is not another's) and loading an adapter forgets nothing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from enum import Enum
from pathlib import Path

import torch

from ..train.lora import is_adapter
from .draft import Budget, Drafter
from .kv import KVFull, KVPool, common_prefix, digest
from .lora import Adapters
from .model import Batch, DecoderLM, check_state, load_model
from .sampling import SamplingParams, sample_batch, uniform


class RequestError(ValueError):
    """A request this engine refuses (wrong version, too long, duplicate or unknown id)."""


COUNTERS = ("steps", "prefill_tokens", "decode_tokens", "recompute_tokens", "reprefill_tokens", "preemptions",
            "offloads", "offloaded_tokens", "free_cache_s", "env_prefill_tokens", "prefix_hit_tokens", "dedup_tokens",
            "decodes", "drafted_tokens", "accepted_tokens")


def check_new(hosted: int | set[int], live, req_id: int, version: int, max_len: int, capacity_tokens: int) -> None:
    """The admission rule every backend applies before touching its state (``hosted``: the version, or under LoRA
    the versions, it serves)."""
    if version not in (hosted if isinstance(hosted, set) else {hosted}):
        raise RequestError(f"request {req_id} is tagged v{version}; this engine hosts "
                           f"{'v' + str(hosted) if isinstance(hosted, int) else sorted(hosted)}")
    if req_id in live:
        raise RequestError(f"request {req_id} is already on this engine")
    if max_len > capacity_tokens:
        raise RequestError(f"request {req_id} may reach {max_len} tokens; the KV pool holds {capacity_tokens}")


def pace(t0: float, min_step_time_s: float, prefill_s_per_token: float, prefilled: int) -> None:
    """Roofline pacing: a step lasts at least min_step_time_s (memory-bound decode: about the same for
    1 or 64 sequences) plus prefill_s_per_token per prefilled token (compute-bound prefill)."""
    floor = min_step_time_s + prefill_s_per_token * prefilled
    if floor > 0:
        time.sleep(max(0.0, floor - (time.perf_counter() - t0)))


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    OFFLOADED = "offloaded"


@dataclass
class Sequence:
    req_id: int
    version: int
    prompt: list[int]
    params: SamplingParams
    response: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    table: list[int] = field(default_factory=list)
    n_cached: int = 0                 # tokens whose KV is in the pool
    status: Status = Status.WAITING
    host_kv: torch.Tensor | None = None
    auto_restore: bool = False        # imported without room yet: restore as soon as KV frees up
    hold: bool = False                # a multi-turn episode: its KV stays when a turn finishes
    held: bool = False                # between turns: out of the batch, waiting for ``extend``
    turn_start: int = 0               # where the current turn begins in ``response`` (its max_tokens counts from here)
    digests: list[bytes] = field(default_factory=list)  # chain digests of its first full blocks (kv.digest)
    head: bytes | None = None         # with prefix caching: the digest of its prompt's first block, if it has one

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.response

    def __len__(self) -> int:
        return len(self.prompt) + len(self.response)


@dataclass(frozen=True)
class Finished:
    req_id: int
    version: int
    prompt: list[int]
    response: list[int]
    logprobs: list[float]
    finish_reason: str


class Engine:
    def __init__(self, model: DecoderLM | str | Path, *, kv_blocks: int = 256, block_size: int = 16,
                 max_num_seqs: int = 64, max_batched_tokens: int = 1024, seed: int = 0, version: int = 0,
                 min_step_time_s: float = 0.0, prefill_s_per_token: float = 0.0,
                 on_kv_full: str = "offload", prefix_caching: bool = True, lora_scale: float | None = None,
                 speculation: str = "none", draft_tokens: int = 4) -> None:
        if on_kv_full not in ("offload", "recompute"):
            raise ValueError(f"on_kv_full must be 'offload' or 'recompute', not {on_kv_full!r}")
        self.model = load_model(model) if isinstance(model, str | Path) else model
        s = self.model.spec
        weight = next(self.model.parameters())  # the pool lives where the model does (CPU or a GPU)
        self.kv = KVPool(s.num_layers, s.num_kv_heads, s.head_dim, kv_blocks, block_size, dtype=weight.dtype,
                         device=weight.device)
        self.max_num_seqs, self.max_batched_tokens = max_num_seqs, max_batched_tokens
        self.seed = seed
        self.min_step_time_s, self.prefill_s_per_token = min_step_time_s, prefill_s_per_token
        self.on_kv_full, self.prefix_caching = on_kv_full, prefix_caching
        self.seqs: dict[int, Sequence] = {}
        self.counts = dict.fromkeys(COUNTERS, 0)
        self.adapters = Adapters(self.model, lora_scale) if lora_scale is not None else None
        self._version, self._hosted = version, {version}
        self.batch_versions = 0  # versions among the last step's requests
        self.drafter = Drafter(speculation, draft_tokens) if speculation != "none" else None
        self.budget = Budget(draft_tokens) if self.drafter else None

    @property
    def version(self) -> int:
        """The newest version hosted (-1 before the first load)."""
        return self._version

    @version.setter
    def version(self, v: int) -> None:
        """The engine's weights are version ``v`` (the model folder's v0, taken at start): it hosts that alone."""
        self._version, self._hosted = v, {v}

    @property
    def versions(self) -> set[int]:
        """Every version a request may be tagged with here: the one hosted, or under LoRA each one loaded beside
        the others (``add``) and not retired."""
        return set(self._hosted)

    # -- requests ----------------------------------------------------------------------------------
    def add(self, req_id: int, prompt: list[int], params: SamplingParams, version: int, hold: bool = False) -> None:
        self._check_new(req_id, version, len(prompt) + params.max_tokens)
        if not prompt:
            raise RequestError(f"request {req_id}: empty prompt")
        self.seqs[req_id] = Sequence(req_id, version, list(prompt), params, hold=hold, head=self._head(prompt, version))
        if self.drafter:
            self.drafter.track(req_id, list(prompt), [], version)

    def extend(self, req_id: int, tokens: list[int], max_tokens: int) -> None:
        """The next turn of a held episode: ``tokens`` (the environment's) join its context, then up to
        ``max_tokens`` are sampled. Environment tokens get logprob 0 (they are not sampled)."""
        seq = self._get(req_id)
        if not seq.held:
            raise RequestError(f"request {req_id} is not between turns")
        cap = self.kv.num_blocks * self.kv.block_size
        if len(seq) + len(tokens) + max_tokens > cap:
            raise RequestError(f"request {req_id} may reach {len(seq) + len(tokens) + max_tokens} tokens; the KV "
                               f"pool holds {cap}")
        seq.response += tokens
        seq.logprobs += [0.0] * len(tokens)
        if self.drafter:
            self.drafter.grow(req_id, tokens)
        seq.turn_start, seq.params, seq.held = len(seq.response), replace(seq.params, max_tokens=max_tokens), False
        seq.auto_restore = seq.status is Status.OFFLOADED
        self.counts["env_prefill_tokens"] += len(tokens)

    def has_request(self, req_id: int) -> bool:
        return req_id in self.seqs

    def progress(self, req_id: int) -> tuple[int, int]:
        """(prompt tokens, generated tokens) of a live request."""
        seq = self._get(req_id)
        return len(seq.prompt), len(seq.response)

    def weights(self, version: int | None = None) -> dict[str, torch.Tensor]:
        """A hosted version's weights (default the newest; Hugging Face names): under LoRA its adapter (lora.py's
        names), or the base weights for a version with none (v0, the model folder's: a fresh adapter is the
        identity)."""
        v = self.version if version is None else version
        if self.adapters is not None and self.adapters.by_version.get(v):
            return self.adapters.state(v)
        return self.model.state_dict()

    def abort(self, req_id: int) -> None:
        seq = self._get(req_id)
        self.kv.release(seq.table)
        del self.seqs[req_id]
        if self.drafter:
            self.drafter.forget(req_id)

    def _check_new(self, req_id: int, version: int, max_len: int) -> None:
        hosted = self.versions if self.adapters is not None else self.version
        check_new(hosted, self.seqs, req_id, version, max_len, self.kv.num_blocks * self.kv.block_size)

    def _get(self, req_id: int) -> Sequence:
        try:
            return self.seqs[req_id]
        except KeyError:
            raise RequestError(f"request {req_id} is not on this engine") from None

    # -- migration and offload ---------------------------------------------------------------------
    def export(self, req_id: int) -> tuple[dict, torch.Tensor]:
        """Remove a request and return (metadata, KV [layers, 2, tokens, kvh, d] in host memory) for import_."""
        seq = self._get(req_id)
        kv = seq.host_kv if seq.status is Status.OFFLOADED else self.kv.export(seq.table, seq.n_cached).cpu()
        meta = {"req_id": seq.req_id, "version": seq.version, "prompt": seq.prompt, "response": seq.response,
                "logprobs": seq.logprobs, "n_cached": seq.n_cached, "params": seq.params.__dict__,
                "hold": seq.hold, "held": seq.held, "turn_start": seq.turn_start}
        self.kv.release(seq.table)
        del self.seqs[req_id]
        if self.drafter:  # its draft state is rebuilt where it goes (import_)
            self.drafter.forget(req_id)
        return meta, kv

    def import_(self, meta: dict, kv: torch.Tensor | None) -> None:
        """Continue an exported request; ``kv`` None: rebuild its KV here by re-prefill (counted)."""
        params = SamplingParams(**meta["params"])
        self._check_new(meta["req_id"], meta["version"], len(meta["prompt"]) + params.max_tokens)
        if kv is None:
            s = self.model.spec
            kv = torch.zeros(s.num_layers, 2, 0, s.num_kv_heads, s.head_dim)
            meta = {**meta, "n_cached": 0}
            self.counts["reprefill_tokens"] += len(meta["prompt"]) + len(meta["response"])
        if kv.shape[2] != meta["n_cached"]:
            raise RequestError(f"request {meta['req_id']}: KV holds {kv.shape[2]} tokens, metadata says "
                               f"{meta['n_cached']}")
        held, carried = meta.get("held", False), meta["n_cached"] > 0
        # with no KV it waits like a new request (and takes what the cache holds); else it is restored
        seq = Sequence(meta["req_id"], meta["version"], list(meta["prompt"]), params, list(meta["response"]),
                       list(meta["logprobs"]), status=Status.OFFLOADED if carried else Status.WAITING,
                       host_kv=kv if carried else None, n_cached=meta["n_cached"], auto_restore=not held and carried,
                       hold=meta.get("hold", False), held=held, turn_start=meta.get("turn_start", 0),
                       head=self._head(meta["prompt"], meta["version"]))
        self.seqs[seq.req_id] = seq
        if self.drafter:
            self.drafter.track(seq.req_id, seq.prompt, seq.response, seq.version)
        if carried:
            self._try_restore(seq)

    def offload(self, req_id: int) -> None:
        """Copy a request's KV to host memory and free its blocks; it waits until restore()."""
        seq = self._get(req_id)
        if seq.status is Status.OFFLOADED:
            return
        seq.host_kv = self.kv.export(seq.table, seq.n_cached).to("cpu", copy=True)
        self.kv.release(seq.table)
        seq.table, seq.status = [], Status.OFFLOADED

    def restore(self, req_id: int) -> None:
        seq = self._get(req_id)
        if seq.status is Status.OFFLOADED and not self._try_restore(seq):
            raise KVFull(f"request {req_id}: not enough free KV blocks to restore {seq.n_cached} tokens")

    def _try_restore(self, seq: Sequence) -> bool:
        if self.kv.blocks_for(seq.n_cached) > self.kv.free_blocks:
            return False
        t = time.perf_counter()
        try:
            seq.table, dedup = self.kv.import_(seq.host_kv, seq.tokens if self.prefix_caching else None,
                                               self._root(seq.version)) if seq.n_cached else ([], 0)
        except KVFull:  # sharing a cached full block in part costs its copy, one block more: import it whole
            seq.table, dedup = self.kv.import_(seq.host_kv)
        self.counts["dedup_tokens"] += dedup
        if self.prefix_caching:
            self._register(seq, dedup)
        seq.host_kv, seq.status, seq.auto_restore = None, Status.RUNNING, False  # a held one stays out of the batch
        self.counts["free_cache_s"] += time.perf_counter() - t
        return True

    # -- weights -----------------------------------------------------------------------------------
    def load_weights(self, state: dict[str, torch.Tensor], version: int, keep_requests: bool = False,
                     add: bool = False) -> None:
        """Swap in the weights of ``version``. Live requests must be gone unless ``keep_requests``
        (partial rollout), in which case their KV is dropped and re-prefilled under the new weights. Under LoRA a
        version is an adapter (lora.py's names; none: the base weights' own version), and with ``add`` it joins
        the versions hosted, the others' requests and cache untouched; without, it replaces them."""
        adapter = self.adapters is not None and (is_adapter(state) or not state)
        if self.adapters is not None and add and not adapter:  # the base's own version (v0), beside the adapters
            state = check_state(self.model, state, f"weights of v{version}")
            if any(not torch.equal(t, state[k].to(t)) for k, t in self.model.state_dict().items() if k in state):
                raise RequestError(f"v{version}'s weights are not the base this engine holds: under LoRA the base "
                                   "never changes")
            state, adapter = {}, True
        if self.seqs and not (keep_requests or (adapter and add)):
            raise RequestError(f"cannot load v{version}: {len(self.seqs)} live requests of v{self.version}")
        if adapter:
            if not add:
                self.adapters.by_version.clear()
                self.kv.clear_cache()
            if state:
                self.adapters.load(version, state)
        else:
            self.model.load_state_dict(check_state(self.model, state, f"weights of v{version}"), strict=False)
            self.kv.clear_cache()  # KV of the old weights is matched no more
            if self.adapters is not None:
                self.adapters.by_version.clear()
        self.kv.allocate_memory()  # a slept engine wakes with its new weights
        for seq in self.seqs.values() if keep_requests else ():
            self.counts["reprefill_tokens"] += seq.n_cached
            self.kv.release(seq.table)
            seq.table, seq.n_cached, seq.host_kv = [], 0, None
            seq.status, seq.version = Status.WAITING, version
            seq.head = self._head(seq.prompt, version)
            if self.drafter:
                self.drafter.track(seq.req_id, seq.prompt, seq.response, version)
        if add and adapter:
            self._hosted.add(version)
            self._version = max(self._version, version)
        else:
            self._version, self._hosted = version, {version}

    def retire(self, version: int) -> None:
        """Under LoRA: stop hosting ``version`` (its adapter leaves); no request of it may be live."""
        if any(s.version == version for s in self.seqs.values()):
            raise RequestError(f"cannot retire v{version}: requests of it are live")
        if self.adapters is not None and version != self.version:
            self.adapters.drop(version)
            self._hosted.discard(version)

    def sleep(self) -> int:
        """Free the KV pool for the trainer that hosts this engine (cluster.elastic) until the next
        ``load_weights``; no request may hold KV on the device. Returns the bytes freed."""
        if any(seq.table for seq in self.seqs.values()):
            raise RequestError("cannot sleep: requests hold KV on the device")
        return self.kv.free_memory()

    # -- stepping ----------------------------------------------------------------------------------
    def has_work(self) -> bool:
        return any(not s.held and (s.status is not Status.OFFLOADED or s.auto_restore) for s in self.seqs.values())

    def step(self) -> list[Finished]:
        t0, prefilled = time.perf_counter(), self.counts["prefill_tokens"]
        self.batch_versions = 0
        plan = self._schedule()
        if plan and not self.kv.resident:
            raise RequestError("the engine sleeps (its KV pool is freed): load weights to wake it")
        before = (self.counts["drafted_tokens"], self.counts["accepted_tokens"])
        finished = self._run(plan) if plan else []
        self.counts["steps"] += 1
        pace(t0, self.min_step_time_s, self.prefill_s_per_token, self.counts["prefill_tokens"] - prefilled)
        if self.budget is not None and plan:  # the step's seconds (paced: the roofline's) against its tokens
            self.budget.observe(self._step_tokens, time.perf_counter() - t0, self.counts["drafted_tokens"] - before[0],
                                self.counts["accepted_tokens"] - before[1])
        return finished

    def _schedule(self) -> list[tuple[Sequence, int]]:
        """(sequence, new tokens) for this step: running sequences first, then offloaded ones whose KV
        fits again (restored from host), then new prefill chunks, each FIFO."""
        # candidates as the pass starts: a sequence preempted during this pass waits for the next one
        # (re-admitting it now would put it in the plan twice)
        running = [s for s in self.seqs.values() if s.status is Status.RUNNING and not s.held]
        offloaded = [s for s in self.seqs.values() if s.status is Status.OFFLOADED and s.auto_restore]
        waiting = [s for s in self.seqs.values() if s.status is Status.WAITING and not s.held]
        plan: list[tuple[Sequence, int]] = []
        budget = self.max_batched_tokens
        for seq in running:
            if seq.status is not Status.RUNNING:  # preempted by an earlier one's growth in this loop
                continue
            n = min(len(seq) - seq.n_cached, budget)
            if n <= 0 or not self._reserve(seq, n, running):
                continue
            plan.append((seq, n))
            budget -= n
        for seq in offloaded:
            if budget <= 0 or len(plan) >= self.max_num_seqs or not self._try_restore(seq):
                break
            n = min(len(seq) - seq.n_cached, budget)
            try:
                self.kv.prepare(seq.table, seq.n_cached, seq.n_cached + n)
            except KVFull:
                break  # restored; it runs when the next step has room
            plan.append((seq, n))
            budget -= n
        # sequences prefilling a block or more of their prompt in this step, by their prompt's first block: a
        # sequence that would take a block or more of that prompt from the cache once they are done waits
        prefilling: dict[bytes, list[Sequence]] = {}
        for s, _ in plan:
            if self._prefills_a_block(s):
                prefilling.setdefault(s.head, []).append(s)
        for seq in waiting:
            if budget <= 0 or len(plan) >= self.max_num_seqs:
                break
            fresh = self.prefix_caching and not seq.table
            matched = fresh and self._match(seq)
            if fresh and seq.head in prefilling and self._gains_by_waiting(seq, prefilling[seq.head]):
                self._unmatch(seq)
                continue
            n = min(len(seq) - seq.n_cached, budget)
            if not self._grow_past_held(seq, n):
                if matched:  # it waits holding nothing
                    self._unmatch(seq)
                break
            self.counts["prefix_hit_tokens"] += seq.n_cached if matched else 0
            if self._prefills_a_block(seq):
                prefilling.setdefault(seq.head, []).append(seq)
            seq.status = Status.RUNNING
            plan.append((seq, n))
            budget -= n
        return [(s, n) for s, n in plan if s.status is Status.RUNNING]

    def _reserve(self, seq: Sequence, n: int, running: list[Sequence]) -> bool:
        """Grow ``seq``'s blocks by n tokens, preempting held episodes first, then the newest running
        sequences, if needed."""
        while not self._grow_past_held(seq, n):
            victim = next((s for s in reversed(running) if s.status is Status.RUNNING and s is not seq), None)
            if victim is None:
                return False
            self._preempt(victim)
        return True

    def _grow_past_held(self, seq: Sequence, n: int) -> bool:
        """Grow ``seq``'s blocks by n tokens, moving held episodes to host memory if that makes room."""
        while True:
            try:
                self.kv.prepare(seq.table, seq.n_cached, seq.n_cached + n)
                return True
            except KVFull:
                victim = next((s for s in self.seqs.values() if s.held and s.table), None)
                if victim is None:
                    return False
                self._preempt(victim)

    def _preempt(self, seq: Sequence) -> None:
        self.counts["preemptions"] += 1
        if self.on_kv_full == "offload" and seq.n_cached:  # to host, back when blocks free up
            t = time.perf_counter()
            self.offload(seq.req_id)
            seq.auto_restore = not seq.held  # a held episode comes back with its next turn
            self.counts["offloads"] += 1
            self.counts["offloaded_tokens"] += seq.n_cached
            self.counts["free_cache_s"] += time.perf_counter() - t
            return
        self.kv.release(seq.table)
        self.counts["recompute_tokens"] += seq.n_cached
        seq.table, seq.n_cached, seq.status = [], 0, Status.WAITING

    def _run(self, plan: list[tuple[Sequence, int]]) -> list[Finished]:
        # a decode computes the one token sampled last; any other token (prompt, environment) is prefill
        decoding = [n == 1 and s.n_cached + 1 == len(s) and len(s.response) > s.turn_start for s, n in plan]
        drafts = self._draft(plan, decoding)
        ids: list[int] = []
        rows: list[range] = []  # per sequence, the flat rows whose logits it samples from: its last token's,
        for i, (seq, n) in enumerate(plan):  # then each drafted token's
            ids.extend(seq.tokens[seq.n_cached:seq.n_cached + n] + drafts.get(i, []))
            rows.append(range(len(ids) - 1 - len(drafts.get(i, [])), len(ids)))
        q = [len(r) - 1 + n for r, (_, n) in zip(rows, plan, strict=True)]
        self._step_tokens = sum(q)
        batch = Batch.build(q, [s.n_cached + k for (s, _), k in zip(plan, q, strict=True)], [s.table for s, _ in plan],
                            self.kv.block_size, self.kv.k.device)
        self.batch_versions = len({s.version for s, _ in plan})
        if self.adapters is not None:
            self.adapters.set_batch([s.version for (s, _), k in zip(plan, q, strict=True) for _ in range(k)])
        done = [i for i, (seq, n) in enumerate(plan) if seq.n_cached + n == len(seq)]  # its last token computed
        flat = torch.tensor([r for i in done for r in rows[i]], dtype=torch.long, device=self.kv.k.device)
        logits = self.model(torch.tensor(ids, device=self.kv.k.device), batch, self.kv, rows=flat)
        for (seq, n), decode in zip(plan, decoding, strict=True):
            seq.n_cached += n
            if self.prefix_caching:
                self._register(seq, seq.n_cached - n)
            self.counts["decode_tokens" if decode else "prefill_tokens"] += n
            self.counts["decodes"] += decode
        if not done:
            return []
        seqs = [plan[i][0] for i in done]
        toks, lps = sample_batch(logits.cpu(), [s.params for i, s in zip(done, seqs, strict=True) for _ in rows[i]],
                                 [uniform(self.seed, s.req_id, len(s.response) + j)
                                  for i, s in zip(done, seqs, strict=True) for j in range(len(rows[i]))])
        finished, at = [], 0
        for i, seq in zip(done, seqs, strict=True):
            m = len(rows[i])
            reason = self._accept(seq, drafts.get(i, []), toks[at:at + m], lps[at:at + m])
            at += m
            if reason:
                finished.append(Finished(seq.req_id, seq.version, list(seq.prompt), list(seq.response),
                                         list(seq.logprobs), reason))
                if seq.hold:  # between turns: out of the batch, its KV kept
                    seq.held = True
                else:
                    self.kv.release(seq.table)
                    del self.seqs[seq.req_id]
                    if self.drafter:
                        self.drafter.finish(seq.req_id, len(seq.prompt))
        return finished

    def _draft(self, plan: list[tuple[Sequence, int]], decoding: list[bool]) -> dict[int, list[int]]:
        """With speculation: a draft for each decoding sequence of the plan that has one (plan index -> tokens),
        at most the length that pays at this batch by the engine's measurements (draft.py Budget), within the
        step's token budget, each with KV room for its tokens (taken from free blocks only: a draft never
        preempts)."""
        if self.drafter is None:
            return {}
        if not (k := self.budget.limit(sum(decoding)) if self.budget else self.drafter.k):
            return {}
        budget, out = self.max_batched_tokens - sum(n for _, n in plan), {}
        for i, (seq, _) in enumerate(plan):
            if budget <= 0:
                break
            if not decoding[i]:
                continue
            left = seq.params.max_tokens - (len(seq.response) - seq.turn_start) - 1  # the token after the draft
            if not (draft := self.drafter.propose(seq.req_id, min(left, budget, k))):
                continue
            try:
                self.kv.prepare(seq.table, seq.n_cached, seq.n_cached + 1 + len(draft))
            except KVFull:
                continue
            out[i], budget = draft, budget - len(draft)
        return out

    def _accept(self, seq: Sequence, draft: list[int], toks: list[int], lps: list[float]) -> str | None:
        """Append a decode's tokens: ``toks[j]`` was sampled from the logits after the draft's first j tokens,
        with position ``len(response) + j``'s noise, as decoding without a draft samples it. Draft token j is
        accepted when the sample there is that token -- with probability p(token), and a rejection's sample
        follows p without it, renormalised: exact speculative sampling for a deterministic draft -- so the
        tokens are the ones decoding without the draft samples (the same noise, the same distributions). Stops
        at the first rejection, at the end of the draft (one token past it) or where the sequence finishes.
        Returns the finish reason, if any."""
        reason, kept = None, seq.n_cached
        for j, (tok, lp) in enumerate(zip(toks, lps, strict=True)):
            seq.response.append(tok)
            seq.logprobs.append(lp)
            reason = self._finish_reason(seq, tok)
            if reason or j == len(draft) or tok != draft[j]:
                break
            seq.n_cached += 1  # the drafted token's KV, computed in this forward, is the sampled token's
        emitted = j + 1
        if draft:
            accepted = sum(1 for a, b in zip(toks[:emitted], draft, strict=False) if a == b)
            self.counts["drafted_tokens"] += len(draft)
            self.counts["accepted_tokens"] += accepted
            self.counts["decode_tokens"] += accepted
            if self.prefix_caching:
                self._register(seq, kept)
            extra = seq.table[self.kv.blocks_for(len(seq)):]  # room taken for drafted tokens rejected
            del seq.table[len(seq.table) - len(extra):]
            self.kv.release(extra)
        if self.drafter:
            self.drafter.grow(seq.req_id, toks[:emitted])
        return reason

    def _match(self, seq: Sequence) -> bool:
        """Take the longest cached prefix of a sequence that holds no KV (all but its last token)."""
        seq.table, seq.n_cached, seq.digests = self.kv.match(seq.tokens, len(seq) - 1, self._root(seq.version))
        return seq.n_cached > 0

    def _root(self, version: int) -> bytes:
        """The prefix cache's root for a request of ``version``: one root, but one per version under LoRA."""
        return b"" if self.adapters is None else f"v{version}".encode()

    def _head(self, prompt: list[int], version: int) -> bytes | None:
        """With prefix caching, the digest of a prompt's first block (None for a prompt of a block or less)."""
        bs = self.kv.block_size
        return digest(self._root(version), prompt[:bs]) if self.prefix_caching and len(prompt) > bs else None

    def _prefills_a_block(self, seq: Sequence) -> bool:
        return seq.head is not None and len(seq.prompt) - seq.n_cached >= self.kv.block_size

    def _unmatch(self, seq: Sequence) -> None:
        self.kv.release(seq.table)
        seq.table, seq.n_cached = [], 0

    def _gains_by_waiting(self, seq: Sequence, leaders: list[Sequence]) -> bool:
        """Whether a block or more of ``seq``'s prompt, beyond what it matched, is being prefilled now."""
        shared = max(common_prefix(s.prompt, seq.prompt) for s in leaders)
        return min(shared, len(seq) - 1) - seq.n_cached >= self.kv.block_size

    def _register(self, seq: Sequence, old: int) -> None:
        """Make the blocks ``seq`` filled since it held ``old`` tokens of KV matchable, and its prompt's last
        partial block once the prompt is in."""
        bs, tokens, root = self.kv.block_size, seq.tokens, self._root(seq.version)
        for i in range(min(old // bs, len(seq.digests)), seq.n_cached // bs):
            parent = seq.digests[i - 1] if i else root
            block = tuple(tokens[i * bs:(i + 1) * bs])
            if i == len(seq.digests):
                seq.digests.append(digest(parent, block))
            if i >= old // bs:
                self.kv.register(seq.table[i], parent, block, seq.digests[i])
        p = len(seq.prompt)
        if old < p <= seq.n_cached and p % bs:
            i = p // bs
            self.kv.register(seq.table[i], seq.digests[i - 1] if i else root, tuple(seq.prompt[i * bs:p]))

    def _finish_reason(self, seq: Sequence, tok: int) -> str | None:
        p = seq.params
        if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.model.spec.eos_token_id):
            return "stop"
        if len(seq.response) - seq.turn_start >= p.max_tokens:
            return "length"
        return None

    # -- introspection -----------------------------------------------------------------------------
    def stats(self) -> dict:
        by = {st: sum(1 for s in self.seqs.values() if s.status is st and not s.held) for st in Status}
        used = self.kv.num_blocks - self.kv.free_blocks
        return {"version": self.version, "versions": sorted(self.versions),
                "batch_versions": self.batch_versions, "running": by[Status.RUNNING],
                "waiting": by[Status.WAITING],
                "offloaded": by[Status.OFFLOADED], "held": sum(1 for s in self.seqs.values() if s.held),
                "kv_blocks_used": used, "kv_blocks_free": self.kv.free_blocks,
                "kv_used_fraction": used / self.kv.num_blocks, "kv_blocks_cached": self.kv.cached_blocks,
                "kv_copies": self.kv.copies, **self.counts}

    def close(self) -> None:
        """Nothing to release: the pool and the model are this object's."""
