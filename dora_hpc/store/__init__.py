"""Run storage: HDF5 shards (trajectories, engine events, training) and checkpoints."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

FULL_BELOW = 16 << 20  # a write that failed with less room than this left ran out of space


class DiskFull(OSError):
    """A write ran out of space (or quota); the message names the path. What was being written is removed,
    so nothing half-written looks whole; what was complete before stays as it was."""


def _out_of_space(e: BaseException, where: Path) -> bool:
    if getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT):
        return True
    if "No space left on device" in str(e) or "Disk quota exceeded" in str(e):  # safetensors' message
        return True
    try:  # torch.save reports only "unexpected pos": look at the filesystem itself
        st = os.statvfs(where)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < FULL_BELOW


@contextlib.contextmanager
def writing(path: Path, partial: Path) -> Iterator[None]:
    """Write ``path`` by way of ``partial`` (a ``.tmp`` file or folder): if the write fails, the partial is
    removed; if it failed for want of space, DiskFull naming ``path`` is raised instead."""
    try:
        yield
    except Exception as e:
        full = _out_of_space(e, path.parent)
        if partial.is_dir():
            shutil.rmtree(partial, ignore_errors=True)
        else:
            partial.unlink(missing_ok=True)
        if full:
            raise DiskFull(errno.ENOSPC, f"no space left on device writing {path}") from None
        raise
