"""One simulated rollout instance: continuous batching under a KV-cache budget, in macro steps.

Invariants:
* the running batch's KV never exceeds the instance's capacity at a step boundary: when the next
  step would overflow, the most recently joined request is preempted (vLLM's policy) -- its KV is
  dropped and later recomputed, or, with ``kv_offload`` (DORA's hierarchical memory), parked in
  host memory and copied back;
* waiting requests (new, preempted, or arrived without room) are admitted FIFO as KV frees up, each
  paying what it owes first: a prompt prefill, a recompute/re-prefill of prompt + generated tokens,
  or a host->device copy;
* time advances by the closed form of CostModel.decode_time between batch changes, so the cost of a
  simulation is O(batch changes), not O(decode steps);
* a multi-turn episode between turns is **held**: out of the batch (no compute; its KV is not read by
  decode steps) but its KV stays resident and counts against the capacity. Under KV pressure, and when a
  waiting request needs the room, held episodes leave first (to host memory with ``kv_offload``, else their
  KV is dropped and recomputed). Its next turn first prefills the environment's tokens (``env_owed``);
* with ``share`` (engine.prefix_caching) a prompt's parts -- the ``shared_prefix`` every prompt starts with,
  then its group's own -- are held once per instance while any request holding KV here has them: a request
  that joins prefills (or copies back) only the parts no resident request holds, and the resident KV counts
  each part once. A decode step still reads every sequence's whole context.
"""

from __future__ import annotations

import heapq
from collections import Counter, deque
from dataclasses import dataclass, field

from .costs import CostModel

# what a request must rebuild before it decodes again
OWES_PROMPT, OWES_RECOMPUTE, OWES_REPREFILL, OWES_HOST, OWES_NOTHING = "prompt", "recompute", "reprefill", "host", ""


class SimError(RuntimeError):
    """The policy asked for something physically impossible (a policy bug)."""


@dataclass(eq=False)
class Req:
    traj: int
    prompt: int
    target: int
    gen_at_join: int = 0
    join_step: int = 0
    owes: str = OWES_PROMPT
    env_owed: int = 0          # environment tokens at the end of its context without KV yet
    waiting_env: bool = False  # a multi-turn episode whose environment step is under way
    group: int = -1            # its prompt group (share: the group's prompt is held once per instance)

    @property
    def finish_step(self) -> int:
        return self.join_step + self.target - self.gen_at_join


@dataclass
class Instance:
    idx: int
    cost: CostModel
    kv_offload: bool = False
    share: bool = False             # prompt parts held once (engine.prefix_caching)
    shared_prefix: int = 0          # tokens every prompt starts with (workload.shared_prefix_tokens)
    version: int | None = None
    loading: bool = False
    resident: set[int] = field(default_factory=set)  # train.lora: every version (adapter) hosted
    paused: bool = False
    asleep: bool = False            # a borrowed instance while the trainer trains (cluster.elastic)
    load_epoch: int = 0             # a weight load in flight that a Sleep cancelled is ignored
    reqs: dict[int, Req] = field(default_factory=dict)      # running, in join order
    held: dict[int, Req] = field(default_factory=dict)      # episodes between turns (KV resident unless owed)
    held_kv: float = 0.0                                     # their resident KV tokens
    waiting: deque[Req] = field(default_factory=deque)
    env_free: list[float] = field(default_factory=list)      # when each busy environment worker is free (a heap)
    heap: list[tuple[int, int]] = field(default_factory=list)  # (finish step, traj), lazily cleaned
    steps: int = 0
    kv_base: float = 0.0            # sum(prompt + gen_at_join - join_step): kv = kv_base + n * steps
    offset: float = 0.0             # >0: time already spent into the next step; <0: prefill owed
    t_run: float | None = None
    epoch: int = 0
    counts: Counter = field(default_factory=Counter)
    ops: Counter = field(default_factory=Counter)  # seconds by kind
    refs: Counter = field(default_factory=Counter)  # share: a prompt part -> the resident requests holding it
    prompt_refs: float = 0.0        # share: the resident requests' prompt tokens, counted per request
    shared_kv: float = 0.0          # share: the same, each part counted once
    state: tuple[str, int | None, int] = ("idle", None, 0)
    since: float = 0.0

    # -- queries -----------------------------------------------------------------------------------
    def hosts(self, version: int) -> bool:
        """A request of ``version`` may run here (its weights, or under train.lora its adapter, are loaded)."""
        return not self.loading and (version == self.version or version in self.resident)

    def generated(self, r: Req) -> int:
        return r.gen_at_join + self.steps - r.join_step if r.traj in self.reqs else r.gen_at_join

    def batch_kv(self) -> float:
        """KV tokens of the running batch (what a decode step reads)."""
        return self.kv_base + len(self.reqs) * self.steps

    def kv_tokens(self) -> float:
        """Resident KV tokens: the running batch's and the held episodes', a shared prompt part once."""
        return self.batch_kv() + self.held_kv - (self.prompt_refs - self.shared_kv)

    def _parts(self, r: Req) -> list[tuple[tuple, int]]:
        """(part, tokens) of ``r``'s prompt: the shared prefix, then its group's own tokens."""
        head = min(self.shared_prefix, r.prompt)
        return ([(("prefix",), head)] if head else []) + [(("group", r.group), r.prompt - head)]

    def resident_prompt(self, r: Req) -> int:
        """Tokens of ``r``'s prompt whose KV a resident request holds here (share; else 0)."""
        return sum(n for part, n in self._parts(r) if self.refs[part]) if self.share else 0

    def _acquire(self, r: Req) -> None:
        if self.share:
            for part, n in self._parts(r):
                self.shared_kv += 0 if self.refs[part] else n
                self.refs[part] += 1
            self.prompt_refs += r.prompt

    def _release(self, r: Req) -> None:
        if self.share:
            for part, n in self._parts(r):
                self.refs[part] -= 1
                if not self.refs[part]:
                    del self.refs[part]
                    self.shared_kv -= n
            self.prompt_refs -= r.prompt

    def peek(self) -> tuple[int, int] | None:
        """The next (finish step, traj) of a running request, dropping stale heap entries."""
        while self.heap:
            step, t = self.heap[0]
            r = self.reqs.get(t)
            if r is not None and r.finish_step == step:
                return self.heap[0]
            heapq.heappop(self.heap)
        return None

    def has_work(self) -> bool:
        """Live requests: running, waiting, or held between turns."""
        return bool(self.reqs or self.waiting or self.held)

    # -- time --------------------------------------------------------------------------------------
    def advance(self, now: float) -> None:
        """Account for the decode steps done since the batch started running at ``t_run``."""
        dt = now - self.t_run
        avail = self.offset + dt
        n = len(self.reqs)
        if avail > 0 and n:
            kv0 = self.batch_kv()
            k = self.cost.decode_steps_within(avail, n, kv0)
            self.offset = avail - self.cost.decode_time(k, n, kv0)
            self.steps += k
        else:
            self.offset = avail
        self.t_run = None
        self.epoch += 1

    def run_length(self) -> float:
        """Seconds until the next batch change: a finish, or the step where KV would overflow."""
        n = len(self.reqs)
        k = self.peek()[0] - self.steps
        room = self.cost.kv_capacity_tokens - self.kv_tokens()
        if n > 1 and room < k * n:
            k = max(1, int(room // n))
        return max(self.cost.decode_time(k, n, self.batch_kv()) - self.offset, 0.0)

    # -- batch changes (the instance is stopped: t_run is None) ------------------------------------
    def admit(self, r: Req, front: bool = False) -> None:
        """Queue a request; it runs as soon as its KV fits."""
        (self.waiting.appendleft if front else self.waiting.append)(r)
        self.fill()

    def fill(self) -> None:
        while self.waiting and (self._fits(self.waiting[0]) or self._evict_held()):
            if self._fits(self.waiting[0]):
                self._run(self.waiting.popleft())

    def hold(self, r: Req) -> None:
        """An episode between turns: its KV stays (unless it owes it), it leaves the batch."""
        self.held[r.traj] = r
        if r.owes == OWES_NOTHING:
            self.held_kv += r.prompt + r.gen_at_join - r.env_owed
            self._acquire(r)

    def unhold(self, t: int) -> Req:
        r = self.held.pop(t)
        if r.owes == OWES_NOTHING:
            self.held_kv -= r.prompt + r.gen_at_join - r.env_owed
            self._release(r)
        return r

    def _evict_held(self) -> bool:
        """Make room by moving one held episode's KV out (to host, or dropped); False if none holds any."""
        r = next((x for x in self.held.values() if x.owes == OWES_NOTHING), None)
        if r is None:
            return False
        ctx = r.prompt + r.gen_at_join - r.env_owed
        self.held_kv -= ctx
        self._release(r)
        self._evict(r, ctx)
        return True

    def _evict(self, r: Req, ctx: int) -> None:
        """A preempted request's KV (``ctx`` tokens) goes to host memory (kv_offload) or is dropped."""
        self.counts["preemptions"] += 1
        if self.kv_offload:
            r.owes = OWES_HOST
            self.offset -= self.cost.host_copy_time(ctx)
            self.ops["offload"] += self.cost.host_copy_time(ctx)
        else:
            r.owes = OWES_RECOMPUTE

    def _fits(self, r: Req) -> bool:
        need = r.prompt + r.gen_at_join + 1 - self.resident_prompt(r)
        empty = not self.reqs and not self.held_kv  # an empty instance always takes one
        return empty or self.kv_tokens() + need + len(self.reqs) <= self.cost.kv_capacity_tokens

    def _run(self, r: Req) -> None:
        ctx = r.prompt + r.gen_at_join
        have = self.resident_prompt(r)  # share: computed (or copied back) by no one now
        saved = self.cost.prefill_time(have) if have else 0.0
        if have and r.owes in (OWES_PROMPT, OWES_RECOMPUTE, OWES_REPREFILL):
            self.counts["prefix_hit_tokens"] += have
        if r.owes == OWES_PROMPT:
            self.offset -= self.cost.prefill_time(r.prompt) - saved
        elif r.owes in (OWES_RECOMPUTE, OWES_REPREFILL):
            cost = self.cost.prefill_time(ctx) - saved
            if r.owes == OWES_REPREFILL:  # CostModel.reprefill_stall: blocking, or chunked beside the decodes
                cost = self.cost.reprefill_stall(ctx - have, cost)
            self.offset -= cost
            self.ops[r.owes] += cost
            if r.owes == OWES_RECOMPUTE:
                self.counts["preempt_recompute_tokens"] += ctx
            r.env_owed = 0  # rebuilt with the rest
        elif r.owes == OWES_HOST:
            self.offset -= self.cost.host_copy_time(ctx - r.env_owed - have)
            self.ops["offload"] += self.cost.host_copy_time(ctx - r.env_owed - have)
        if r.env_owed:  # the environment's tokens after a KV that is there: only they are prefilled
            self.offset -= self.cost.prefill_time(ctx) - self.cost.prefill_time(ctx - r.env_owed)
            self.counts["env_prefill_tokens"] += r.env_owed
            r.env_owed = 0
        r.owes = OWES_NOTHING
        r.join_step = self.steps
        self.reqs[r.traj] = r
        self._acquire(r)
        self.kv_base += r.prompt + r.gen_at_join - r.join_step
        heapq.heappush(self.heap, (r.finish_step, r.traj))

    def remove(self, t: int) -> Req:
        """Take a request off the instance, running, waiting or held; its heap entry goes stale."""
        if t in self.held:
            return self.unhold(t)
        r = self.reqs.pop(t, None)
        if r is None:
            r = next(x for x in self.waiting if x.traj == t)
            self.waiting.remove(r)
            return r
        r.gen_at_join = r.gen_at_join + self.steps - r.join_step
        self.kv_base -= r.prompt + r.gen_at_join - self.steps
        self._release(r)
        return r

    def pop_finished(self) -> list[Req]:
        """The requests whose turn (the whole trajectory, single-turn) ended, off the batch."""
        done = []
        while (top := self.peek()) is not None and top[0] <= self.steps:
            heapq.heappop(self.heap)
            done.append(self.remove(top[1]))
        return done

    def preempt(self) -> None:
        """Move held episodes' KV out, then preempt the newest running requests, until the next decode step
        fits in KV."""
        while self.kv_tokens() + len(self.reqs) > self.cost.kv_capacity_tokens and self._evict_held():
            pass
        while len(self.reqs) > 1 and self.kv_tokens() + len(self.reqs) > self.cost.kv_capacity_tokens:
            r = self.remove(next(reversed(self.reqs)))
            self._evict(r, r.prompt + r.gen_at_join)
            self.waiting.appendleft(r)

    def invalidate_kv(self) -> list[Req]:
        """New weights under live requests (partial rollout): every resident or parked KV is stale
        and must be re-prefilled; returns the requests that now owe a re-prefill."""
        running = [self.remove(t) for t in list(self.reqs)]
        parked = [r for r in self.waiting if r.owes in (OWES_HOST, OWES_RECOMPUTE)]
        held = [self.unhold(t) for t in list(self.held)]
        for r in running + parked + held:
            r.owes, r.env_owed = OWES_REPREFILL, 0
        for r in held:
            self.hold(r)
        self.waiting.extendleft(reversed(running))
        return running + parked + held
