"""Fault injection for the reliability tests: one environment variable, read here and nowhere else.

    MTPLX_FAULT_POINT="POINT:COUNT[:ACTION][,POINT:COUNT[:ACTION]...]"

fires ACTION the COUNT-th time (1-based) this process passes POINT. Actions:
    kill    SIGKILL this process, as a crash or an OOM killer would (the default)
    enospc  raise OSError(ENOSPC), as a full disk would
    eio     raise OSError(EIO), as a failing disk would
    term    send SIGTERM to this process (a scheduler stopping the job)
    int     send SIGINT to this process (Ctrl-C)
Unset (the normal case), a point costs one environment lookup. An unknown point or action is
refused loudly, so a test cannot silently inject nothing. See RELIABILITY.md.
"""

from __future__ import annotations

import errno
import os
import signal
from typing import Dict, List, Optional, Tuple

ENV = "MTPLX_FAULT_POINT"

# Every point the code passes, in the order a shard commit passes them.
POINTS: Dict[str, str] = {
    "job.tmp_written": "RUN_DIR/job.yaml.tmp written and fsynced, not yet renamed",
    "job.renamed": "RUN_DIR/job.yaml replaced, its directory not yet fsynced",
    "manifest.tmp_written": "manifest.json.tmp written and fsynced, not yet renamed over manifest.json",
    "manifest.renamed": "manifest.json replaced, its directory not yet fsynced",
    "row.emitted": "an output row handed to the shard writer (between rows)",
    "shard.tmp_written": "a shard's temp file written, not yet fsynced",
    "shard.fsynced": "a shard's temp file fsynced, not yet renamed to its final name",
    "shard.renamed": "a shard renamed to its final name, not yet recorded in commits.jsonl",
    "commit.appended": "a shard's line appended to commits.jsonl, not yet fsynced",
    "shard.recorded": "a shard's line in commits.jsonl fsynced (the commit is complete)",
    "log.listed": "manifest.json rewritten to list the log's shards, the log not yet emptied",
}
ACTIONS = ("kill", "enospc", "eio", "term", "int")

_spec: Optional[str] = None
_plan: Dict[str, List[Tuple[int, str]]] = {}
_seen: Dict[str, int] = {}


def parse(spec: str) -> Dict[str, List[Tuple[int, str]]]:
    plan: Dict[str, List[Tuple[int, str]]] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        fields = part.split(":")
        if len(fields) not in (2, 3):
            raise ValueError(f"{ENV}: {part!r} is not POINT:COUNT[:ACTION]")
        point, count, action = fields[0], fields[1], fields[2] if len(fields) == 3 else "kill"
        if point not in POINTS:
            raise ValueError(f"{ENV}: unknown point {point!r}; known: {', '.join(POINTS)}")
        if action not in ACTIONS:
            raise ValueError(f"{ENV}: unknown action {action!r}; known: {', '.join(ACTIONS)}")
        if not count.isdigit() or int(count) < 1:
            raise ValueError(f"{ENV}: count in {part!r} must be an integer >= 1")
        plan.setdefault(point, []).append((int(count), action))
    return plan


def hit(point: str) -> None:
    """Called by the code at each fault point; does nothing unless MTPLX_FAULT_POINT is set."""
    global _spec, _plan
    spec = os.environ.get(ENV)
    if not spec:
        _spec = None  # set again later (even to the same value): counting starts over
        return
    if spec != _spec:  # (re)read: a forked test child sets the variable after import
        _plan, _spec = parse(spec), spec
        _seen.clear()
    n = _seen[point] = _seen.get(point, 0) + 1
    for count, action in _plan.get(point, ()):
        if count == n:
            _fire(point, action)


def seen() -> Dict[str, int]:
    """How often each point was passed since MTPLX_FAULT_POINT was (last) set."""
    return dict(_seen)


def _fire(point: str, action: str) -> None:
    where = f"injected at fault point {point}"
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
        os._exit(137)  # not reached
    if action == "enospc":
        raise OSError(errno.ENOSPC, f"No space left on device ({where})")
    if action == "eio":
        raise OSError(errno.EIO, f"Input/output error ({where})")
    os.kill(os.getpid(), signal.SIGTERM if action == "term" else signal.SIGINT)
