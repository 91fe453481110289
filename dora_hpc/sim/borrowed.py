"""The simulator's borrowed instances (cluster.elastic): a drained instance's requests go to host memory
(``Offload``) and come back (``Restore``), it sleeps before a train step, and the train step waits for its
drain. Part of ``Simulator`` (sim/cluster.py), which it extends."""

from __future__ import annotations

from .instance import OWES_HOST, SimError


class Borrowing:
    def _offload(self, t: int, i: int) -> None:
        if t in self.in_transit:  # still on its way to i (a migration or a restore): it lands in i's host memory
            _, req, _ = self.in_transit.pop(t)
        else:
            req = self._stopped(i).remove(t)
            self._start(self.inst[i])
        self.log.offloaded(t)
        dt = self.inst[i].cost.host_copy_time(req.prompt + req.gen_at_join)
        self.ops["offload"] += dt
        self.counts["drain_offloads"] += 1
        req.owes = OWES_HOST
        self.parked[t] = (i, req)
        self._drain(i, dt)

    def _restore(self, t: int, i: int) -> None:
        src, req = self.parked.pop(t)
        inst = self.inst[i]
        if not inst.hosts(self.trajs[t].segments[-1]):
            raise SimError(f"Restore({t}, {i}): instance {i} does not host the trajectory's version")
        # from that node's host memory over the network (if another node's), then the host->device copy
        # it pays when it runs (OWES_HOST)
        dt = 0.0 if src == i else inst.cost.kv_transfer_time(req.prompt + req.gen_at_join)
        self.ops["migration"] += dt
        self.counts["restores"] += 1
        self.log.restoring(self.now, t, src, i)
        self._send(t, i, req, dt)

    def _sleep(self, i: int) -> None:
        inst = self._stopped(i)
        if inst.has_work():
            raise SimError(f"Sleep({i}) on an instance with live requests")
        inst.asleep, inst.loading, inst.version, inst.resident = True, False, None, set()
        inst.load_epoch += 1
        self.log.slept(i)
        self._start(inst)
        self._drain(i, self.cfg.sim.hardware.engine_sleep_s)

    def _drain(self, i: int, seconds: float) -> None:
        """Borrowed instance ``i`` needs ``seconds`` more, after what it already does, before training."""
        self.drain_end[i] = max(self.drain_end.get(i, self.now), self.now) + seconds
