"""Cost model of a rollout instance and the trainer, as an accelerator sees them.

Rules (every constant comes from SimConfig; see configs/sim/*.yaml for sources):
* decode is memory-bound: one engine step reads all weights once plus the KV of every sequence in
  the batch, so step(n, kv) = overhead + (weights/TP + kv * bytes_per_token/TP) / (HBM bw * eff);
  nearly flat in batch size until the KV term dominates;
* prefill is compute-bound: (2 * params * T + 2 * layers * hidden * T^2) FLOPs for a context of T
  tokens (linear layers + causal attention) / (TP * peak * prefill_mfu);
* training costs 8 * params * tokens FLOPs (forward + backward = 6, plus 2 for recomputing
  old-policy logprobs) on the trainer's accelerators at train_mfu: time scales as 1/accelerators,
  i.e. perfect data-parallel scaling at a constant MFU (documented in results/sim/README.md);
* a mixture of experts: prefill and training FLOPs count the active parameters; a decode step, a
  weight load and memory count all of them (a decode batch of n sequences routes n x top-k tokens, so
  nearly every expert is read each step);
* a re-prefill stalls the instance's decodes for its whole prefill (``reprefill: blocking``), or runs in
  chunks beside them (``chunked``: each chunk at ``prefill_mfu`` less ``chunked_prefill_loss``, its decodes
  piggybacking, the stall only what the chunks take beyond one decode step's fixed part each);
* KV transfers (instance to instance, device to host) and weight loads cost bytes / link bandwidth;
* a borrowed instance (cluster.elastic) runs at the same speed on the trainer's accelerators, with the
  KV room their resident training state leaves.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import SimConfig


@dataclass(frozen=True)
class CostModel:
    a: float              # seconds per decode step, fixed part (weights + overhead)
    b: float              # seconds per decode step per KV token in the batch
    prefill_per_token: float
    prefill_per_token2: float
    train_flops_per_token: float
    train_flops_per_accel: float
    kv_bytes_per_token: float
    kv_link: float
    host_link: float
    weight_load_s: float
    colocated_switch_s: float
    kv_capacity_tokens: float
    chunk_tokens: int = 0       # reprefill: chunked: tokens a chunk (0: blocking)
    chunk_slowdown: float = 1.0  # ... and a chunk's prefill time over its share of a whole prefill

    @classmethod
    def build(cls, sim: SimConfig, tp: int, reserved_bytes: float = 0.0) -> CostModel:
        """``reserved_bytes``: memory of the instance's accelerators that its KV cannot use (a borrowed
        instance shares them with the trainer's resident state)."""
        m, h = sim.model, sim.hardware
        bw = tp * h.hbm_gbps * 1e9 * h.decode_bw_efficiency
        free_hbm = max(tp * h.hbm_gb * 1e9 * 0.9 - m.weight_bytes - reserved_bytes, 0.0)
        return cls(
            a=h.step_overhead_ms / 1e3 + m.weight_bytes / bw,
            b=m.kv_bytes_per_token / bw,
            prefill_per_token=2 * m.flops_params / (tp * h.peak_tflops * 1e12 * h.prefill_mfu),
            prefill_per_token2=2 * m.layers * m.hidden / (tp * h.peak_tflops * 1e12 * h.prefill_mfu),
            train_flops_per_token=8 * m.flops_params,
            train_flops_per_accel=h.peak_tflops * 1e12 * h.train_mfu,
            kv_bytes_per_token=m.kv_bytes_per_token,
            kv_link=h.kv_link_gbps * 1e9,
            host_link=tp * h.host_link_gbps * 1e9,
            weight_load_s=m.weight_bytes / tp / (h.weight_link_gbps * 1e9),
            colocated_switch_s=h.colocated_switch_s,
            kv_capacity_tokens=free_hbm / m.kv_bytes_per_token,
            chunk_tokens=h.prefill_chunk_tokens if h.reprefill == "chunked" else 0,
            chunk_slowdown=1 / (1 - h.chunked_prefill_loss),
        )

    def decode_time(self, k: int, n: int, kv0: float) -> float:
        """Seconds for k decode steps of a batch of n sequences holding kv0 KV tokens at the start."""
        return k * self.a + self.b * (k * kv0 + n * k * (k - 1) / 2)

    def decode_steps_within(self, t: float, n: int, kv0: float) -> int:
        """The largest k with decode_time(k, n, kv0) <= t (up to float rounding)."""
        if t <= 0:
            return 0
        t += 1e-9 * max(1.0, t)  # a run scheduled to end exactly at step k must count k steps
        qa, qb = self.b * n / 2, self.a + self.b * kv0 - self.b * n / 2
        k = int(t / qb) if qa == 0 else int((-qb + (qb * qb + 4 * qa * t) ** 0.5) / (2 * qa))
        while k > 0 and self.decode_time(k, n, kv0) > t:
            k -= 1
        while self.decode_time(k + 1, n, kv0) <= t:
            k += 1
        return k

    def prefill_time(self, tokens: float) -> float:
        return tokens * self.prefill_per_token + tokens * tokens * self.prefill_per_token2

    def reprefill_stall(self, tokens: float, blocking_s: float) -> float:
        """Seconds a re-prefill of ``tokens`` (``blocking_s`` as one whole prefill) holds back the instance's
        decodes: all of it when blocking; chunked, its chunks' time less one decode step's fixed part per
        chunk (the decodes of that iteration ride along), never below 0."""
        if not self.chunk_tokens:
            return blocking_s
        chunks = -(-int(tokens) // self.chunk_tokens)
        return max(0.0, blocking_s * self.chunk_slowdown - chunks * self.a)

    def train_time(self, tokens: float, accelerators: int) -> float:
        return tokens * self.train_flops_per_token / (accelerators * self.train_flops_per_accel)

    def host_copy_time(self, tokens: float) -> float:
        """Copy a request's KV between device and host memory (offload or restore)."""
        return tokens * self.kv_bytes_per_token / self.host_link

    def kv_transfer_time(self, tokens: float) -> float:
        return tokens * self.kv_bytes_per_token / self.kv_link
