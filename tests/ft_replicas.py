"""Fault-tolerant trainer replicas (train/ft.py) as separate processes, each printing one JSON line per
committed step: its step, the quorum's size and its index in it, the loss and the weights' checksum.

    python tests/ft_replicas.py lighthouse                     # prints its address, serves until killed
    python tests/ft_replicas.py replica MODEL_DIR ADDR ID STEPS [--die-in STEP] [--pace S] [--after PID] [--lora R]
    mpiexec -n G python tests/ft_replicas.py replica ... [--backend megatron]  # a group of G ranks: FSDP2 or TP
    python tests/ft_replicas.py single MODEL_DIR STEPS [--lora R]  # one plain trainer, the reference
    python tests/ft_replicas.py overwrite MODEL_DIR             # one FSDP2 rank loads another's replica state

Every replica takes the whole batch of ``dp_equivalence.batch(step)`` and trains on its share of the groups
(``Replicas.share``), as the runtime's trainer does. ``--die-in STEP`` SIGKILLs the replica (the first rank of a
group) inside that step's gradient sum over the replicas (after its forward and backward); ``--pace S`` sleeps S
seconds after each step (so a late replica can join while the others still train); ``--after PID`` starts the
replica once process PID is gone (a replacement that has imported everything already). A group's first rank
prints. ``--lora R`` trains a rank-R LoRA adapter (train/lora.py) instead of every weight; ``--backend megatron``
makes a group of G ranks one megatron-core tensor-parallel group instead of FSDP2's shards.
"""

import json
import os
import signal
import sys
import time

import torch
from dp_equivalence import batch

from dora_hpc.train.dp import DataParallel, StepAborted
from dora_hpc.train.grpo import GRPOConfig, GRPOTrainer
from dora_hpc.train.lora import LoraSpec
from dora_hpc.train.publish import checksum_of

CFG = GRPOConfig(lr=1e-2, micro_batch=3, loss_agg="token")


def line(**kw) -> None:
    print(json.dumps(kw), flush=True)


def lora(rank: str | None) -> LoraSpec | None:
    return LoraSpec(int(rank), 16.0, "all-linear") if rank else None


def replica(model_dir: str, lighthouse: str, rid: str, steps: int, die_in: int | None, pace: float,
            after: int | None = None, adapter: LoraSpec | None = None, sharded: str = "fsdp") -> None:
    from dora_hpc.train.ft import Replicas

    while after is not None and os.path.exists(f"/proc/{after}"):
        time.sleep(0.05)
    holder: dict = {}
    group = None
    if "OMPI_COMM_WORLD_SIZE" in os.environ or "PMI_SIZE" in os.environ:  # under mpiexec: a group of its ranks
        from mpi4py import MPI

        group = DataParallel(MPI.COMM_WORLD) if MPI.COMM_WORLD.Get_size() > 1 else None

    def load_state(sd: dict) -> None:
        holder["trainer"].load_replica_state(sd)
        say(healed=holder["trainer"].step)

    dp = Replicas(lighthouse, rid, timeout_s=10.0, state=lambda: holder["trainer"].replica_state(),
                  load_state=load_state, group=group)
    say = line if dp.shard_rank == 0 else (lambda **_: None)
    trainer = holder["trainer"] = GRPOTrainer(model_dir, CFG, seed=0, dp=dp, backend=sharded if group else "torch",
                                              lora=adapter)
    if die_in is not None:
        name = "sum_shards_" if group else "sum_grads_"
        summed = getattr(dp, name)

        def dying(*args):
            if trainer.step == die_in and dp.size > 1 and dp.shard_rank == 0:
                os.kill(os.getpid(), signal.SIGKILL)
            summed(*args)
        setattr(dp, name, dying)
    while trainer.step < steps:
        dp.start_step()  # a replica new to the quorum takes the step counter with the weights
        samples = batch(trainer.step)
        groups = list(dict.fromkeys(s.group_id for s in samples))
        mine = set(dp.share(groups))
        try:
            m = trainer.train_step([s for s in samples if s.group_id in mine], groups)
        except StepAborted:
            say(aborted=trainer.step)
            continue
        checksum = checksum_of(trainer.state_dict(), 1, torch.float32)  # a collective within a group
        say(step=trainer.step - 1, size=dp.size, rank=dp.rank, loss=m["loss"], grad_norm=m["grad_norm"],
            checksum=checksum)
        time.sleep(pace)
    dp.close()


def single(model_dir: str, steps: int, adapter: LoraSpec | None = None) -> None:
    trainer = GRPOTrainer(model_dir, CFG, seed=0, lora=adapter)
    for step in range(steps):
        m = trainer.train_step(batch(step))
        line(step=step, size=1, rank=0, loss=m["loss"], grad_norm=m["grad_norm"],
             checksum=checksum_of(trainer.state_dict(), 1, torch.float32))


def overwrite(model_dir: str) -> None:
    """Trainer b (two steps) loads trainer a's replica state (one step) less one parameter's Adam moments, as
    from a source that has none for it: b then holds exactly a's weights and moments, none of its own."""
    a = GRPOTrainer(model_dir, CFG, seed=0, backend="fsdp")
    b = GRPOTrainer(model_dir, CFG, seed=0, backend="fsdp", dp=a.dp)
    a.train_step(batch(0))
    b.train_step(batch(0))
    b.train_step(batch(1))
    state = a.replica_state()
    gone = next(iter(state["optimizer"]))
    del state["optimizer"][gone]
    b.load_replica_state(state)
    names = {p: n for n, p in b.backend.model.named_parameters()}
    moments = {names[p]: v for p, v in b.opt.state.items()}
    line(step=b.step, moments=sorted(moments) == sorted(state["optimizer"]),
         equal=all(torch.equal(v.full_tensor(), state["optimizer"][n]["exp_avg"]) for n, v in
                   ((n, m["exp_avg"]) for n, m in moments.items())),
         checksum=checksum_of(b.state_dict(), 1, torch.float32) == checksum_of(a.state_dict(), 1, torch.float32))


def main(argv: list[str]) -> None:
    torch.set_num_threads(1)
    if argv[0] == "lighthouse":
        from dora_hpc.train.ft import serve_lighthouse

        lh = serve_lighthouse(2.0)  # a replica that starts later recovers the first one's state
        line(address=lh.address())
        signal.sigwait({signal.SIGTERM, signal.SIGINT})
    elif argv[0] == "overwrite":
        overwrite(argv[1])
    elif argv[0] == "single":
        single(argv[1], int(argv[2]), lora(argv[4] if argv[3:4] == ["--lora"] else None))
    else:
        opts = dict(zip(argv[5::2], argv[6::2], strict=True))
        replica(argv[1], argv[2], argv[3], int(argv[4]), int(opts["--die-in"]) if "--die-in" in opts else None,
                float(opts.get("--pace", 0)), int(opts["--after"]) if "--after" in opts else None,
                lora(opts.get("--lora")), opts.get("--backend", "fsdp"))


if __name__ == "__main__":
    main(sys.argv[1:])
