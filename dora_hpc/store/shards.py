"""HDF5 shards: the contract between the runtime (writers) and analysis (readers): docs/hdf5-schema.md.

Invariants:
* one writer per rank and file prefix; a shard is written to ``*.h5.tmp``, flushed, fsync'd and
  renamed to ``*.h5`` -- a file named ``*.h5`` is always complete, a crash leaves only a ``.tmp``, a
  failed write (a full disk: DiskFull, naming the shard) none;
* every file carries attrs schema_version, run_id, rank, role, config_json, attempt; every row carries
  the ``attempt`` (0 for the first launch, +1 per resume) that wrote it, so readers can tell a resumed
  run's history from the future a preemption threw away;
* tables are column-oriented: ``/<table>/<column>``, one dataset per column, all the same length;
  variable-length columns (response, logprobs, segment_versions) are vlen int32/float32;
* readers skip ``.tmp`` files (and say how many), and name every shard they cannot read or whose
  schema_version differs, reading all the others.
"""

from __future__ import annotations

import io
import os
import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import h5py
import numpy as np

from . import writing

SCHEMA_VERSION = 11  # 2: every table has `attempt` (which launch of the run wrote the row); 3: train steps
READABLE = (2, 3, 4, 5, 6, 7, 8, 9, 10, 11)  # have logprob_gap/gap_tokens; 4: and the loss's statistics (entropy,
#   clip split, importance weights, response lengths); 5: trajectories name their tag `dispatch_version` (was
#   `dispatch_step`) and lose `prompt_id` (always group_id) and `t_first_token` (never measured);
#   6: a trajectory's tokens are its `response` (was `tokens`, the glossary's name); 7: train steps have
#   `dual_clip_frac`; 8: trajectories are episodes: `turns`, `env_spans` (the environment's tokens in
#   `response`, flat [start, end) pairs), `env_s`, `env_error`, `env_prefill_tokens`, `env_reruns`,
#   `segment_turns` (the turn each of `segment_versions` began at); 9: engine steps have `prefill_tokens`,
#   `prefix_hit_tokens` (prompt tokens taken from the prefix cache), `running` and `groups` (live on the engine);
#   10: engine steps have `batch_versions` (versions among the step's requests: 2+ under LoRA's shared instances);
#   11: engine steps have `decodes`, `drafted`, `accepted` (speculative decoding: measure/speculation.py).
#   An older shard reads a newer column as its default, or under its old name (RENAMED)
RENAMED = {("trajectories", "dispatch_version"): "dispatch_step",  # (table, column) -> its older name
           ("trajectories", "response"): "tokens"}


def stored_name(group: h5py.Group, table: str, column: str) -> str:
    """The name ``column`` of ``table`` has in this shard's group (an older schema's name, or its own)."""
    return column if column in group else RENAMED.get((table, column), column)


# column kinds: i8 / f8 / str / vlen_i4 / vlen_f4
TRAJECTORIES = {
    "traj_id": "i8", "group_id": "i8", "sample_idx": "i8", "version": "i8",
    "dispatch_version": "i8", "prompt_len": "i8", "response_len": "i8", "reward": "f8", "finish_reason": "str",
    "t_dispatch": "f8", "t_finish": "f8", "n_migrations": "i8", "reprefill_tokens": "i8",
    "instance_path": "str", "reward_error": "str", "response": "vlen_i4", "logprobs": "vlen_f4",
    "segment_versions": "vlen_i4", "attempt": "i8", "turns": "i8", "env_spans": "vlen_i4", "env_s": "f8",
    "env_error": "str", "env_prefill_tokens": "i8", "env_reruns": "i8", "segment_turns": "vlen_i4",
}
ENGINE_STEPS = {"t_start": "f8", "t_end": "f8", "batch_size": "i8", "capacity": "i8", "new_tokens": "i8",
                "kv_blocks_used": "i8", "version": "i8", "attempt": "i8", "prefill_tokens": "i8",
                "prefix_hit_tokens": "i8", "running": "i8", "groups": "i8", "batch_versions": "i8", "decodes": "i8",
                "drafted": "i8", "accepted": "i8"}
OPS = {"t_start": "f8", "t_end": "f8", "kind": "str", "traj_id": "i8", "peer": "i8", "bytes": "i8",
       "version": "i8", "detail": "str", "attempt": "i8"}
CONSUMED = {"traj_id": "i8", "group_id": "i8", "consume_step": "i8", "version": "i8", "staleness": "i8",
            "advantage": "f8", "reward": "f8", "attempt": "i8", "traj_attempt": "i8"}
TRAIN_STEPS = {"step": "i8", "t_start": "f8", "t_end": "f8", "loss": "f8", "reward_mean": "f8",
               "clip_frac": "f8", "kl": "f8", "tokens": "i8", "weights_checksum": "str", "attempt": "i8",
               "logprob_gap": "f8", "gap_tokens": "i8", "clip_frac_low": "f8", "clip_frac_high": "f8",
               "clip_band_frac": "f8", "entropy": "f8", "is_weight_mean": "f8", "is_weight_max": "f8",
               "is_truncated_frac": "f8", "is_masked_frac": "f8", "response_len_mean": "f8", "response_len_max": "i8",
               "dual_clip_frac": "f8"}

FILE_KINDS = {  # file prefix -> its tables
    "traj": {"trajectories": TRAJECTORIES},
    "events": {"steps": ENGINE_STEPS, "ops": OPS},
    "train": {"consumed": CONSUMED, "steps": TRAIN_STEPS},
}


class ShardError(RuntimeError):
    """A shard (or run directory) that cannot be read; the message names it, ``why`` says why alone."""

    def __init__(self, message: str, why: str = "") -> None:
        super().__init__(message)
        self.why = why or message


def _dtype(kind: str):
    return {"i8": np.int64, "f8": np.float64, "str": h5py.string_dtype(),
            "vlen_i4": h5py.vlen_dtype(np.int32), "vlen_f4": h5py.vlen_dtype(np.float32)}[kind]


def _default(kind: str):
    return {"i8": -1, "f8": float("nan"), "str": "", "vlen_i4": [], "vlen_f4": []}[kind]


def _column(kind: str, values: list) -> np.ndarray:
    if kind.startswith("vlen"):
        arr = np.empty(len(values), dtype=object)
        base = np.int32 if kind == "vlen_i4" else np.float32
        for i, v in enumerate(values):
            arr[i] = np.asarray(v, dtype=base)
        return arr
    if kind == "str":
        return np.array([str(v) for v in values], dtype=object)
    return np.asarray(values, dtype=_dtype(kind))


@dataclass
class ShardWriter:
    """Buffers rows per table; ``flush`` writes one complete shard; rotates every ``rows_per_shard``."""

    run_dir: Path
    kind: str                 # traj | events | train
    rank: int
    role: str
    run_id: str
    config_json: str = "{}"
    rows_per_shard: int = 4096
    attempt: int = 0
    seq: int = 0
    _rows: dict[str, list[dict]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.run_dir = Path(self.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.tables = FILE_KINDS[self.kind]
        self._rows = {t: [] for t in self.tables}
        # continue numbering after existing shards (resume never overwrites a complete file)
        pattern = re.compile(rf"{re.escape(self._stem())}-(\d{{5}})\.h5$")
        seqs = [int(m.group(1)) for p in self.run_dir.iterdir() if (m := pattern.match(p.name))]
        self.seq = max(seqs, default=-1) + 1

    def _stem(self) -> str:
        if self.kind == "train":  # the lead trainer (rank 1) writes train-*, other replicas train-r{rank}-*
            return "train" if self.rank <= 1 else f"train-r{self.rank}"
        return f"{self.kind}-r{self.rank}"

    def append(self, table: str, row: dict) -> None:
        unknown = set(row) - set(self.tables[table])
        if unknown:
            raise KeyError(f"{self.kind}/{table}: unknown columns {sorted(unknown)}")
        self._rows[table].append({"attempt": self.attempt, **row})
        if sum(len(r) for r in self._rows.values()) >= self.rows_per_shard:
            self.flush()

    def flush(self) -> Path | None:
        if not any(self._rows.values()):
            return None
        final = self.run_dir / f"{self._stem()}-{self.seq:05d}.h5"
        columns = {table: {col: _column(kind, [r.get(col, _default(kind)) for r in self._rows[table]])
                           for col, kind in schema.items()} for table, schema in self.tables.items()}
        write_shard(final, self.kind, {"schema_version": SCHEMA_VERSION, "run_id": self.run_id, "rank": self.rank,
                                       "role": self.role, "config_json": self.config_json,
                                       "attempt": self.attempt}, columns)
        self._rows = {t: [] for t in self.tables}
        self.seq += 1
        return final


def write_shard(final: Path, kind: str, attrs: dict, columns: dict[str, dict[str, np.ndarray | list]]) -> Path:
    """One complete shard of ``kind`` from whole columns (``columns[table][column]``, each table's the same
    length): built in memory, then written as ``*.h5.tmp``, fsync'd and renamed. A column the dict leaves out
    is absent from the file, and readers read it as its default (``iter_shard_columns``)."""
    tmp = final.with_suffix(".h5.tmp")
    image = io.BytesIO()  # the whole file in memory first: the disk sees one plain write
    with h5py.File(image, "w") as f:
        f.attrs.update(attrs)
        for table, schema in FILE_KINDS[kind].items():
            g = f.create_group(table)
            for col, values in columns.get(table, {}).items():
                data = values if isinstance(values, np.ndarray) else _column(schema[col], list(values))
                g.create_dataset(col, data=data, dtype=_dtype(schema[col]))
    with writing(final, tmp):
        with open(tmp, "wb") as fh:
            fh.write(image.getbuffer())
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, final)
    return final


@dataclass
class ShardScan:
    """What a reader found: complete shards, skipped .tmp files, and unreadable shards with reasons."""

    files: list[Path]
    tmp_skipped: int
    bad: dict[str, str]

    def read(self, table: str, cols: list[str]) -> Iterator[tuple[Path, dict[str, np.ndarray]]]:
        """Each readable shard's ``cols`` of ``table``, in file order. A shard that opens but cannot be read
        leaves ``files`` for ``bad`` (with a warning naming it); the others are still read."""
        for p in list(self.files):
            try:
                got = dict(iter_shard_columns(p, table, cols))
            except ShardError as e:
                self.files.remove(p)
                self.bad[str(p)] = e.why
                warnings.warn(f"skipping shard {p}: {e.why}", stacklevel=2)
                continue
            yield p, got


def scan(run_dir: Path, kind: str) -> ShardScan:
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ShardError(f"run directory {run_dir} does not exist")
    prefix = "train" if kind == "train" else f"{kind}-r"
    files, bad = [], {}
    for p in sorted(run_dir.glob(f"{prefix}*.h5")):
        try:
            with h5py.File(p, "r") as f:
                version = int(f.attrs.get("schema_version", -1))
                if version not in READABLE:
                    bad[str(p)] = f"schema_version {version}, expected one of {READABLE}"
                    continue
        except OSError as e:
            bad[str(p)] = f"unreadable HDF5 ({e})"
            continue
        files.append(p)
    tmp = len(list(run_dir.glob(f"{prefix}*.h5.tmp")))
    for name, why in bad.items():
        warnings.warn(f"skipping shard {name}: {why}", stacklevel=2)
    return ShardScan(files, tmp, bad)


# rows that fault-tolerant trainer replicas (train.replicas) each log for the step they all took: read once
# (the last key column is the most distinct: only rows that share it are compared whole)
ONE_PER = {("train", "consumed"): ("attempt", "consume_step", "traj_attempt", "traj_id"),
           ("train", "steps"): ("attempt", "step")}


def first_of_each(out: dict[str, np.ndarray], keys: tuple[str, ...]) -> np.ndarray | None:
    """The rows (in order) that keep the first of each ``keys`` tuple, or None when every row is unique. Only
    rows sharing a value of the last key are compared whole: a run without replicas costs one sort."""
    last = out[keys[-1]].astype(np.int64)
    order = np.argsort(last, kind="stable")
    same = last[order][1:] == last[order][:-1]
    if not same.any():
        return None
    shared = np.zeros(len(last), bool)  # the rows whose last key another row has too
    shared[order[1:][same]] = shared[order[:-1][same]] = True
    cand = np.flatnonzero(shared)
    cols = [out[k][cand].astype(np.int64) for k in keys]
    o = np.lexsort([cand, *cols])  # by the key tuple, then by row: each tuple's first row leads its run
    repeat = np.ones(len(cand), bool)
    repeat[0] = False
    repeat[1:] = np.all([c[o][1:] == c[o][:-1] for c in cols], axis=0)
    keep = np.ones(len(last), bool)
    keep[cand[o][repeat]] = False
    return np.flatnonzero(keep)


def read_table(run_dir: Path, kind: str, table: str, columns: list[str] | None = None,
               scan_result: ShardScan | None = None, with_rank: bool = False) -> dict[str, np.ndarray]:
    """Concatenate ``table`` across all complete shards of ``kind``; vlen columns stay object arrays.
    ``with_rank`` adds a ``rank`` column: the writing rank (its file's attr) of every row. A train step's
    rows that several replicas logged (``ONE_PER``'s key) come once, the first shard's."""
    keys = ONE_PER.get((kind, table), ())
    wanted = columns or list(FILE_KINDS[kind][table])
    out = _read_table(run_dir, kind, table, [*wanted, *(k for k in keys if k not in wanted)], scan_result, with_rank)
    if keys and (keep := first_of_each(out, keys)) is not None:
        out = {c: v[keep] for c, v in out.items()}
    return {c: out[c] for c in [*wanted, *(["rank"] if with_rank else [])]}


def _read_table(run_dir: Path, kind: str, table: str, cols: list[str], scan_result: ShardScan | None,
                with_rank: bool) -> dict[str, np.ndarray]:
    found = scan_result or scan(run_dir, kind)
    schema = FILE_KINDS[kind][table]
    parts: dict[str, list[np.ndarray]] = {c: [] for c in cols}
    ranks: list[np.ndarray] = []
    for p, got in found.read(table, cols):
        for c, arr in got.items():
            parts[c].append(arr)
        if with_rank:
            with h5py.File(p, "r") as f:
                ranks.append(np.full(len(parts[cols[0]][-1]), int(f.attrs["rank"]), dtype=np.int64))
    out = {c: (np.concatenate(v) if v else np.empty(0, dtype=object if schema[c] in ("str", "vlen_i4", "vlen_f4")
                                                    else _dtype(schema[c]))) for c, v in parts.items()}
    if with_rank:
        out["rank"] = np.concatenate(ranks) if ranks else np.empty(0, dtype=np.int64)
    return out


def rank_of(path: str | Path) -> int:
    """The writing rank in a rollout shard's name: traj-r3-00001.h5 and events-r3-00001.h5 -> 3."""
    return int(Path(path).name.split("-")[1][1:])


def _kind_of(path: Path) -> str:
    """A shard's kind from its name: traj-r3-00001.h5, events-r3-00001.h5, train-00001.h5."""
    return Path(path).name.split("-")[0]


def iter_shard_columns(path: Path, table: str, cols: list[str]) -> Iterator[tuple[str, np.ndarray]]:
    try:
        with h5py.File(path, "r") as f:
            g = f[table]
            rows = g[next(iter(g))].shape[0] if len(g) else 0
            for c in cols:
                stored = stored_name(g, table, c)
                if stored not in g:  # a column newer than the shard's schema version
                    kind = FILE_KINDS[_kind_of(path)][table][c]
                    yield c, _column(kind, [_default(kind)] * rows)
                    continue
                arr = g[stored][()]
                if arr.dtype.kind == "O" and len(arr) and isinstance(arr[0], bytes):
                    arr = np.array([x.decode() for x in arr], dtype=object)
                yield c, arr
    except (OSError, KeyError) as e:
        raise ShardError(f"{path}: cannot read /{table} ({e})", f"cannot read /{table} ({e})") from None
