"""The protocol between drivers (runtime, simulator, tests) and the pure scheduling core.

Invariant: a policy sees the world only through these Events and acts on it only through these
Commands. Both are small frozen dataclasses (picklable, hashable, no tensors), so the same policy runs
under MPI, in the simulator and in property tests unchanged.

Identifiers are plain ints: ``group_id`` is the index of a prompt in the data stream (the data cursor),
``traj_id = group_id * group_size + sample_idx`` names one sample of that GRPO group, and instances
are numbered ``0..n_instances-1``, then the borrowed ones (``cluster.elastic``: hosted on the trainer's
accelerators) ``n_instances..n_instances+borrowed-1``. Versions count train steps: v0 = initial weights,
vn = after n steps.
"""

from __future__ import annotations

from dataclasses import dataclass

TRAINER = -1
"""``AssignVersion.source`` value meaning: take the weights from the trainer (or initial checkpoint)."""
FOLDER = -2
"""``AssignVersion.source`` value meaning: version 0 is the model folder every instance starts from: nothing
is sent; the instance takes what it loaded at start (the driver checks it equals the trainer's version 0)."""


# ----------------------------------------------------------------------------------------- events in
@dataclass(frozen=True)
class Start:
    """The run begins; every instance is empty and holds no weights."""


@dataclass(frozen=True)
class InstanceReady:
    """Instance finished loading ``version`` (the effect of an AssignVersion) and can take requests."""

    instance: int
    version: int


@dataclass(frozen=True)
class RequestFinished:
    """Trajectory ``traj_id`` finished generating on ``instance`` (EOS, stop, or max_tokens) and was
    rewarded ``reward`` (read only by dynamic sampling: PolicyConfig.filter_groups)."""

    traj_id: int
    instance: int
    reward: float = 0.0
    tokens: int = 0  # response tokens it generated (0: not reported): the work planner's length distribution


@dataclass(frozen=True)
class VersionPublished:
    """Train step ``version - 1`` is done: the trainer holds weights of ``version`` and is free again."""

    version: int


@dataclass(frozen=True)
class KvPressure:
    """An instance reports its KV-cache use (fraction of its block pool in use)."""

    instance: int
    used_fraction: float


@dataclass(frozen=True)
class Tick:
    """Periodic wake-up from the driver (the temporal rebalancing trigger)."""


@dataclass(frozen=True)
class InstanceLost:
    """The driver fenced ``instance`` (hung or dead): it never runs anything again. Its trajectories, and
    those migrating away from it (``in_transit``: their requests may never arrive), start again from
    their prompts under their own tag, elsewhere."""

    instance: int
    in_transit: tuple[int, ...] = ()


@dataclass(frozen=True)
class Progress:
    """Instance ``instance`` reports the tokens its live requests have decoded so far, as (traj_id, tokens):
    what the work planner (core/work.py) estimates their remaining decode from."""

    instance: int
    decoded: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class InstanceJoined:
    """A replacement takes lost ``instance``'s place (a new process, on a node Slurm gave back or a spare): it
    holds no weights and runs nothing. The policy gives it a version (a borrowed one joins asleep)."""

    instance: int


Event = (Start | InstanceReady | RequestFinished | VersionPublished | KvPressure | Tick | InstanceLost
         | InstanceJoined | Progress)


# -------------------------------------------------------------------------------------- commands out
@dataclass(frozen=True)
class AssignVersion:
    """Load ``version`` on ``instance``, from a peer instance that holds it, from TRAINER, or (version 0 at
    the start of a run) from FOLDER.

    With ``keep_requests=False`` (every policy but PartialRollout) the instance holds no live request
    when this command is issued: the policy has migrated them away first. With ``keep_requests=True``
    (PartialRollout only) its live requests continue under the new weights after a re-prefill. With ``add``
    (versions share instances: a version is an adapter) the version joins those the instance hosts; its live
    requests of other versions continue untouched.
    The driver answers with InstanceReady once the weights are loaded.
    """

    instance: int
    version: int
    source: int = TRAINER
    keep_requests: bool = False
    add: bool = False


@dataclass(frozen=True)
class Retire:
    """Versions share instances: ``instance`` stops hosting ``version`` (its adapter leaves); no request of that
    version is live there. The driver answers nothing."""

    instance: int
    version: int


@dataclass(frozen=True)
class Dispatch:
    """Start trajectory ``traj_id`` (sample ``sample_idx`` of prompt group ``group_id``) on ``instance``.

    ``version`` is the tag the group received at admission; the instance hosts that version (among others when
    versions share instances).
    """

    traj_id: int
    group_id: int
    sample_idx: int
    version: int
    instance: int


@dataclass(frozen=True)
class Migrate:
    """Move live trajectory ``traj_id`` from ``src`` to ``dst`` (both host its version).

    ``carry_kv=True`` moves its KV cache (zero re-prefill); False re-prefills it at ``dst``.
    """

    traj_id: int
    src: int
    dst: int
    carry_kv: bool = True


@dataclass(frozen=True)
class Offload:
    """Move a live trajectory's KV cache to host memory on ``instance``'s node (it stops decoding): a
    borrowed instance parks what no dedicated instance has room for before it sleeps."""

    traj_id: int
    instance: int


@dataclass(frozen=True)
class Restore:
    """Bring an offloaded trajectory's KV cache from the host where it was parked to ``instance`` (which
    hosts its version; over the network when it is another node's) and let it decode on; nothing is
    re-prefilled. ``source``: the borrowed instance whose host memory holds it."""

    traj_id: int
    instance: int
    source: int


@dataclass(frozen=True)
class Sleep:
    """Borrowed ``instance`` (on the trainer's accelerators, ``cluster.elastic``) gives them back for a
    train step: it holds no live request (the policy migrated or offloaded them first), frees its weights
    and KV pool (vLLM's sleep mode), cancels a weight load in flight (no InstanceReady follows it) and
    stays asleep until an AssignVersion wakes it. A StartTrain after Sleep commands in the same list
    starts only once each of them is done: the trainer waits for the drain."""

    instance: int


@dataclass(frozen=True)
class Abort:
    """Stop trajectory ``traj_id`` on ``instance`` and free its KV (its group is dropped)."""

    traj_id: int
    instance: int


@dataclass(frozen=True)
class Drop:
    """Prompt group ``group_id`` is dropped and will never be trained on (recorded, not lost)."""

    group_id: int
    reason: str


@dataclass(frozen=True)
class Filter:
    """Dynamic sampling (DAPO): group ``group_id`` is complete and every sample has the same reward, so its
    advantages are all zero and it carries no gradient; it is not trained on (the ledger says FILTERED)."""

    group_id: int


@dataclass(frozen=True)
class StartTrain:
    """Run train step ``step`` on exactly these complete groups; ends with VersionPublished(step+1)."""

    step: int
    group_ids: tuple[int, ...]


Command = AssignVersion | Retire | Dispatch | Migrate | Offload | Restore | Sleep | Abort | Drop | Filter | StartTrain
