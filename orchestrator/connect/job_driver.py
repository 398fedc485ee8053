"""The driver that `submit --address` starts on the cluster runs from its own snapshot of the
shipped directory, never from the directory Ray unpacked.

Ray unpacks a job's `working_dir` under the session directory, and when the job's driver
connects every node's runtime-env agent installs the job's environment (eager install). An
agent meeting the package for the first time removes the directory and unpacks it again (Ray's
working_dir plugin downloads with `overwrite=True`). Nodes started on one host with `ray start`
share the session directory, so the second node's agent deletes the files under the running
driver, whose next import then fails (`ModuleNotFoundError: No module named
'orchestrator.control.driver'` four seconds into the job) and whose working directory is gone.

So the driver, before it connects, links the directory's files into a sibling directory of its
own and runs again there. Hard links keep the files whatever happens to the unpacked copy and
copy no bytes; the ranks still run from the directory Ray manages on their nodes, which is
complete before any of them starts.
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
from pathlib import Path

from .remote import REMOTE_RUN_ENV

SNAPSHOT_ENV = "ORCHESTRATOR_DRIVER_DIR"
"""Set in the driver once it runs from its snapshot (the snapshot's path)."""


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another filesystem, or links not allowed: a copy keeps the files too
        shutil.copy2(src, dst)


def snapshot(src: Path, dst: Path) -> Path:
    """`dst`: the tree under `src`, each file a hard link (a copy where linking fails)."""
    shutil.copytree(src, dst, symlinks=True, copy_function=_link_or_copy)
    return dst


def run_from_snapshot(argv: list[str]) -> None:
    """In a Jobs API driver not yet moved: snapshot the working directory beside it and run
    `python -m orchestrator *argv` there instead of this process (this call then never returns).
    In the moved driver: remove the snapshot at exit. Anywhere else: nothing."""
    moved = os.environ.get(SNAPSHOT_ENV)
    if moved:
        atexit.register(shutil.rmtree, moved, ignore_errors=True)
        return
    if not os.environ.get(REMOTE_RUN_ENV):
        return
    here = Path.cwd()
    try:
        there = snapshot(here, here.with_name(f"{here.name}.driver-{os.getpid()}"))
    except OSError as e:
        # Running in place is what Ray does by itself: the job still runs where nothing re-unpacks.
        print(f"warning: cannot snapshot the job's working directory ({e}); running in place", file=sys.stderr)
        return
    os.chdir(there)
    os.execve(sys.executable, [sys.executable, "-m", "orchestrator", *argv], {**os.environ, SNAPSHOT_ENV: str(there)})
