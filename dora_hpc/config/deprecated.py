"""Config keys renamed to the glossary's names (docs/glossary.md): the old ones keep working for one
release, with a message naming the new key; a saved run's config (launch.json) of an older release reads
as the run ran.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from .base import ConfigError

# deprecated key -> (its new key, the old value as a new one, whether a run used the old key): they keep
# working for one release, with a message naming the new key (issue 20's renames, docs/glossary.md)
DEPRECATED: dict[str, tuple[str, Callable[[Any], Any], bool]] = {
    "cluster.rollout_ranks": ("cluster.rollout_instances", lambda v: v, True),
    "dora.kv_offload": ("engine.on_kv_full", lambda v: "offload" if v else "recompute", False),
}
_told: set[str] = set()


def _deprecation(old: str) -> None:
    if old not in _told:
        _told.add(old)
        print(f"dora-hpc: config key {old} is deprecated: use {DEPRECATED[old][0]}", file=sys.stderr, flush=True)


def renamed(key: str, value: Any) -> tuple[str, Any]:
    """A ``--set`` key and value in today's names."""
    if key not in DEPRECATED:
        return key, value
    _deprecation(key)
    new, convert, _ = DEPRECATED[key]
    return new, convert(value)


def undeprecate(tree: dict[str, Any], saved: bool) -> dict[str, Any]:
    """``tree`` in today's names. Both names with different values: an error, unless the tree is a saved
    run's (launch.json of an older release, which had both): then the key its runtime used wins."""
    for old, (new, convert, runtime_used_old) in DEPRECATED.items():
        sec, key = old.split(".")
        section = tree.get(sec)
        if not isinstance(section, dict) or key not in section:
            continue
        value = convert(section.pop(key))
        nsec, nkey = new.split(".")
        target = tree.setdefault(nsec, {})
        if not isinstance(target, dict):
            continue
        if not saved:
            _deprecation(old)
        if nkey in target and target[nkey] != value:
            if not saved:
                raise ConfigError(f"{old} (deprecated) says {value!r} but {new} says {target[nkey]!r}: give {new} "
                                  "only")
            if not runtime_used_old:
                continue
        target[nkey] = value
    return tree
