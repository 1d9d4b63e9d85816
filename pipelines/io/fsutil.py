"""Durable file writes: what makes a shard or manifest either fully there or not there at all."""

from __future__ import annotations

import os
from typing import Optional

from . import faults


def fsync_path(path: str) -> None:
    """fsync a file's contents, or a directory's entries (a rename or a new entry is durable only
    once its directory reaches the disk)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_dirs(path: str) -> None:
    """`os.makedirs`, durably: each directory it creates is recorded in its parent on the disk
    (a directory entry, like a rename, survives a power cut only once its parent is fsynced)."""
    path = os.path.abspath(path)
    created = []
    while not os.path.isdir(path):
        created.append(path)
        path = os.path.dirname(path)
    for d in reversed(created):
        os.makedirs(d, exist_ok=True)
        fsync_path(os.path.dirname(d))


def publish(tmp: str, final: str, fault: Optional[str] = None) -> None:
    """fsync `tmp`, rename it to `final`, fsync the directory. `fault`: fault points' prefix."""
    if fault:
        faults.hit(fault + ".tmp_written")
    fsync_path(tmp)
    if fault:
        faults.hit(fault + ".fsynced")
    os.replace(tmp, final)
    fsync_path(os.path.dirname(os.path.abspath(final)))


def remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


def atomic_write(path: str, data: bytes, fault: Optional[str] = None) -> None:
    """`path` holds either its old content or `data`, whatever happens. On an error (a full disk)
    the temp file is removed and the error raised; the old content stays."""
    tmp = path + ".tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if fault:
            faults.hit(fault + ".tmp_written")
        os.replace(tmp, path)
    except BaseException:
        remove_quietly(tmp)
        raise
    if fault:
        faults.hit(fault + ".renamed")
    fsync_path(os.path.dirname(os.path.abspath(path)))
