"""Many real process deaths, cheaply: a zygote that imports the pipeline once and forks a child
per run.

Starting `mtplx-batch` costs ~3 s of imports (MLX, transformers, pyarrow), so a test that kills
the CLI 50 times would spend minutes importing. The zygote (`python tests/faultkit.py --zygote`)
imports everything once and then, per request, forks a child that runs the real CLI entry point
(`pipelines.cli.commands.main(["run", JOB, ...])`) with its own environment (e.g. MTPLX_FAULT_POINT) and
its stdout/stderr in a log file. The child is a real process: it is SIGKILLed / SIGTERMed like
any other, the kernel drops its file lock, and only what reached the disk survives.

The zygote never evaluates anything in MLX before forking: MLX's worker threads do not survive a
fork, so the first evaluation happens in each child (the model loads there too; it is tiny).

    z = Zygote()
    res = z.run(["run", "job.yaml", "-q"], env={"MTPLX_FAULT_POINT": "shard.renamed:2"})
    res.exit   # -9: killed by SIGKILL; 0/1/2: the CLI's exit code
    z.close()
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

REPO = Path(__file__).resolve().parent.parent


@dataclass
class ChildResult:
    exit: int  # the CLI's exit code, or -N when signal N ended it
    seconds: float
    signalled: bool  # the zygote sent the requested signal before the child ended
    log: str  # the child's stdout + stderr

    @property
    def killed(self) -> bool:
        return self.exit == -signal.SIGKILL


class Zygote:
    def __init__(self, env: Optional[Dict[str, str]] = None, start_timeout: float = 120.0):
        env = dict(os.environ if env is None else env)
        env.pop("MTPLX_FAULT_POINT", None)
        env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        self._err = tempfile.NamedTemporaryFile(prefix="zygote-", suffix=".log", delete=False)
        self.proc = subprocess.Popen([sys.executable, __file__, "--zygote"], cwd=REPO, env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err)
        ready = self._read(start_timeout)
        if not ready.get("ready"):
            raise RuntimeError(f"zygote did not start: {ready}")
        self.logs = Path(tempfile.mkdtemp(prefix="zygote-logs-"))
        self.n = 0

    def _read(self, timeout: float) -> dict:
        import select

        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.proc.kill()
            raise RuntimeError("zygote died or timed out: " + Path(self._err.name).read_text()[-3000:])
        return json.loads(line)

    def run(self, args: Sequence[str], env: Optional[Dict[str, str]] = None, kill_after: Optional[float] = None,
            sig: str = "KILL", timeout: float = 120.0) -> ChildResult:
        """Fork a child running `mtplx-batch ARGS`; with `kill_after`, send SIG that many seconds
        after the fork unless the child ended first."""
        self.n += 1
        log = self.logs / f"child-{self.n}.log"
        task = {"args": [str(a) for a in args], "env": env or {}, "kill_after": kill_after, "signal": sig,
                "timeout": timeout, "log": str(log)}
        self.proc.stdin.write(json.dumps(task) + "\n")
        self.proc.stdin.flush()
        res = self._read(timeout + 30)
        text = log.read_text(errors="replace") if log.exists() else ""
        if res.get("hung"):
            raise AssertionError(f"child {args} hung for {timeout}s and was killed; log:\n{text[-3000:]}")
        return ChildResult(res["exit"], res["seconds"], res["signalled"], text)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self._err.close()


# ---------------------------------------------------------------------------- the zygote side


def _child(task: dict) -> None:
    code = 3
    try:
        fd = os.open(task["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        os.environ.update(task["env"])
        from pipelines.cli.commands import main

        main(task["args"], prog_name="mtplx-batch")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 3
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _serve() -> None:
    # Everything a run imports, imported once here; nothing evaluated.
    import mtplx.generation  # noqa: F401
    import mtplx.models.loading  # noqa: F401
    import pipelines.cli.commands  # noqa: F401
    import pipelines.execution.session  # noqa: F401
    import pipelines.cli.validate  # noqa: F401
    import pyarrow.parquet  # noqa: F401

    try:
        import pandas  # noqa: F401  (pyarrow imports it lazily on the first parquet write: ~0.7 s)
    except ImportError:
        pass

    out = sys.stdout
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    for line in sys.stdin:
        task = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        started = time.monotonic()
        pid = os.fork()
        if pid == 0:
            _child(task)
        sig = getattr(signal, "SIG" + task["signal"])
        kill_at = None if task["kill_after"] is None else started + task["kill_after"]
        deadline = started + task["timeout"]
        sent = hung = False
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            now = time.monotonic()
            if kill_at is not None and not sent and now >= kill_at:
                os.kill(pid, sig)
                sent = True
            if now > deadline:
                os.kill(pid, signal.SIGKILL)
                _, status = os.waitpid(pid, 0)
                hung = True
                break
            wake = min(x for x in (kill_at if not sent else None, now + 0.002) if x is not None)
            time.sleep(max(0.0, wake - now))
        out.write(json.dumps({"exit": os.waitstatus_to_exitcode(status), "seconds": time.monotonic() - started,
                              "signalled": sent, "hung": hung}) + "\n")
        out.flush()


if __name__ == "__main__":
    if sys.argv[1:] == ["--zygote"]:
        sys.path.insert(0, str(REPO))
        _serve()
