"""The control-plane messages: small picklable dataclasses every rank sends over ``Comm.send`` (TAG_CTRL).
Each says who sends it to whom; a message that announces a buffer (WeightsHeader, MigrateIn) is followed by
that buffer on the data plane, from the same sender."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Generate:           # orchestrator -> rollout
    traj_id: int
    group_id: int
    sample_idx: int
    version: int
    prompt: list[int]
    max_tokens: int
    epoch: int = 1        # which dispatch of this trajectory (one lost with its instance is dispatched again)


@dataclass(frozen=True)
class Park:               # orchestrator -> a borrowed instance: export this request's KV and keep it in host memory
    traj_id: int          # (a MigrateOut later sends it on, or imports it back here)


@dataclass(frozen=True)
class SleepEngine:        # orchestrator -> a borrowed instance: it runs nothing until its next LoadVersion
    pass


@dataclass(frozen=True)
class LoadVersion:        # orchestrator -> rollout: weights of `version` come from `source` (a rank, or
    version: int          # roles.TRAINERS: every trainer rank, each its shard); `add`: beside the versions
    source: int           # hosted (an adapter), whose requests continue
    keep_requests: bool
    add: bool = False


@dataclass(frozen=True)
class RetireVersion:      # orchestrator -> rollout: stop hosting `version` (an adapter no request there has)
    version: int


@dataclass(frozen=True)
class SendWeights:        # orchestrator -> trainer or rollout: send `version` to rank `dst`, which holds
    version: int          # `base` (-1: nothing a delta could be made against)
    dst: int
    base: int = -1


@dataclass(frozen=True)
class WeightsHeader:      # sender -> receiver, right before the buckets on TAG_WEIGHTS
    version: int
    names: list[str]
    shapes: list[tuple[int, ...]]  # each piece's (a rollout peer sends whole tensors)
    checksum: str         # the version's (train/publish.py): the receiver checks its engine against it
    buckets: list[int]    # pieces per bucket, in name order: one flat byte buffer per bucket
    dtype: str = "float32"  # the publish dtype
    shard: int = 0        # whose pieces: trainer `shard` of `shards` (a rollout peer: 0 of 1, the whole)
    shards: int = 1
    base: int = -1        # the version the deltas are against (-1: every piece whole)
    changed: list[int] = field(default_factory=list)  # per piece: the values its delta carries; -1: whole


@dataclass(frozen=True)
class MigrateOut:         # orchestrator -> source rollout rank
    traj_id: int
    dst: int
    carry_kv: bool


@dataclass(frozen=True)
class MigrateIn:          # source rollout -> destination rollout; KV buffer follows on TAG_KV if any
    meta: dict
    kv_shape: tuple[int, ...] | None


@dataclass(frozen=True)
class Pause:              # orchestrator -> rollout, colocated placement: the trainer has the devices
    step: int


@dataclass(frozen=True)
class Resume:             # orchestrator -> rollout, colocated placement: train step done, weights sent
    step: int


@dataclass(frozen=True)
class AbortTraj:          # orchestrator -> rollout
    traj_id: int


@dataclass(frozen=True)
class Train:              # orchestrator -> trainers
    step: int
    group_ids: tuple[int, ...]


@dataclass(frozen=True)
class Forget:             # orchestrator -> the trainer owning the group: it is never trained on (drop, filter)
    group_id: int


# rollout -> lead trainer: core/trajectory.py's Trajectory, the record itself


@dataclass(frozen=True)
class Ready:              # rollout -> orchestrator: loaded `version`
    instance: int
    version: int
    checksum: str
    load_s: float = 0.0   # from its LoadVersion to the weights in the engine (waiting for them included)


@dataclass(frozen=True)
class Done:               # rollout -> orchestrator: a trajectory finished
    traj_id: int
    instance: int
    response_len: int
    reward: float
    kv_used_fraction: float
    epoch: int = 1        # its Generate's: a Done of an earlier dispatch is stale
    kv_transfer_s: float = 0.0  # time its migrations spent exporting, sending and importing KV
    turns: int = 1        # a multi-turn episode's model turns
    env_s: float = 0.0    # seconds its environment steps took
    episode_s: float = 0.0  # dispatch to finish on its rollout ranks (the share env_s is of it)
    env_error: bool = False
    prompt_len: int = 0   # its prompt's tokens: with response_len, what a train step trains on it


@dataclass(frozen=True)
class Initial:            # lead trainer -> orchestrator, once at start: the checksum of the version it starts from
    version: int
    checksum: str


@dataclass(frozen=True)
class Holds:              # trainer replica -> orchestrator: it holds this version now (recovered from a peer)
    version: int
    checksum: str


@dataclass(frozen=True)
class Published:          # lead trainer -> orchestrator: step version-1 finished
    version: int
    checksum: str
    metrics: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Checkpoint:         # orchestrator -> every trainer: the lead writes step-{version}.tmp with this state
    version: int
    state: dict | None    # None for the other trainer ranks (they only join the backend's gathers)


@dataclass(frozen=True)
class Commit:             # orchestrator -> lead trainer: every rollout rank flushed; rename it
    version: int


@dataclass(frozen=True)
class Checkpointed:       # lead trainer -> orchestrator
    version: int
    path: str


@dataclass(frozen=True)
class NotCheckpointed:    # a trainer replica asked to write a version it no longer holds -> orchestrator
    version: int
    holds: int


@dataclass(frozen=True)
class Flush:              # orchestrator -> rollout: put every trajectory row so far into a complete shard
    version: int


@dataclass(frozen=True)
class Flushed:            # rollout -> orchestrator
    instance: int
    version: int


@dataclass(frozen=True)
class EnvWaiting:         # rollout -> orchestrator: its episodes waiting on their environment (dashboard only)
    instance: int
    waiting: int


@dataclass(frozen=True)
class DecodeProgress:     # rollout -> orchestrator, every runtime.tick_s under dora.planner: work: the tokens each
    instance: int         # live request has decoded (core's Progress: what the work planner weighs)
    decoded: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Heartbeat:          # any rank -> orchestrator, when it has sent rank 0 nothing for heartbeat_s
    rank: int


@dataclass(frozen=True)
class Fenced:             # orchestrator -> every live rank, on TAG_FENCE: rank 0 gave up on ``rank``
    rank: int


@dataclass(frozen=True)
class Joined:             # orchestrator -> every live rank, on TAG_FENCE: link to fenced ``rank``'s replacement
    rank: int             # (runtime/join.py), whose store is at ``addr`` (host:port); ``rank`` is live again
    addr: str             # from then on


@dataclass(frozen=True)
class Linked:             # a live rank -> orchestrator, after a Joined: its link to ``rank``'s replacement is made
    rank: int             # (ok), or failed (the replacement is gone). Rank 0 tells the next peer only then:
    ok: bool = True       # the replacement builds its links one after another, in its JoinPlan's order


@dataclass(frozen=True)
class JoinPlan:           # orchestrator -> a replacement, in its store: who it is and who else connects
    rank: int             # the fenced rank it replaces (its instance: roles.instance_of_rank)
    size: int             # the world's ranks
    peers: tuple[int, ...] = ()  # every other live rank, each connecting in turn, one at a time
    refused: str = ""     # why it may not join (a wrong model or config, nothing to replace): it exits
    lighthouse: str | None = None  # a trainer replica's replacement: torchft's lighthouse, where it joins the quorum


@dataclass(frozen=True)
class Hello:              # a replacement -> orchestrator: every peer connected and its engine loaded
    rank: int


@dataclass(frozen=True)
class StopRequest:        # any rank -> orchestrator: a signal asked this rank to stop
    rank: int


@dataclass(frozen=True)
class Shutdown:
    reason: str = ""
    fenced: tuple[int, ...] = ()  # ranks rank 0 gave up on: the others close without them


# -- agent episodes (env.name: openai_agent; runtime/agent_episodes.py): between an episode's home rank, which
# runs its agent and serves its calls, and the rank holding its request (home itself, or where it migrated)
@dataclass(frozen=True)
class AgentCall:          # home -> holder: call `turn` of the episode, as the tokens that extend it
    traj_id: int
    turn: int             # 0: the first call (`tokens` is the prompt)
    tokens: list[int]
    max_tokens: int
    agent_s: float = 0.0  # the agent's own time since its last reply (its "environment step")


@dataclass(frozen=True)
class AgentTurn:          # holder -> home: the answer to call `turn`
    traj_id: int
    turn: int
    tokens: list[int]
    logprobs: list[float]
    finish_reason: str    # the engine's; "episode_cap": nothing was generated (env.max_episode_tokens)
    prompt_tokens: int    # the context the answer was sampled after


@dataclass(frozen=True)
class AgentHere:          # holder -> home: the episode is held here now (it migrated), waiting on call `turn`
    traj_id: int          # (None: mid-generation)
    turn: int | None
    hops: int             # its migrations so far: orders AgentHere from different holders


@dataclass(frozen=True)
class AgentEnd:           # home -> holder: the agent returned (its reward) or failed (the error): end the episode
    traj_id: int
    reward: float
    error: str
    agent_s: float = 0.0


@dataclass(frozen=True)
class AgentEnded:         # holder -> home: the episode ended here; the home forgets it
    traj_id: int
