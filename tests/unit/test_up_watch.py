"""`inferx up`'s watch over its processes (`devstack.report_exits`): a process that exits
is reported once, with how it ended and its log's end, and the others keep running --
a worker killed under `inferx up` must not take the stack down with it."""

from __future__ import annotations

import io
import signal
import sys
import time
from pathlib import Path

from inferx.devstack import ManagedProcess, report_exits


def started(tmp_path: Path, name: str, code: str) -> ManagedProcess:
    proc = ManagedProcess(name, [sys.executable, "-c", code], tmp_path / f"{name}.log")
    proc.start()
    return proc


def test_an_exited_process_is_reported_once_and_the_others_keep_running(tmp_path: Path) -> None:
    quitter = started(tmp_path, "worker-0", "print('loading the model'); raise SystemExit(3)")
    killed = started(tmp_path, "worker-1", "import time; time.sleep(60)")
    steady = started(tmp_path, "router", "import time; time.sleep(60)")
    processes = [steady, quitter, killed]
    try:
        quitter.wait(30)
        killed.signal(signal.SIGKILL)
        killed.wait(30)
        out = io.StringIO()
        exited: set[str] = set()
        assert report_exits(processes, exited, out) is True  # the router still runs
        said = out.getvalue()
        assert "worker-0 exited (3); the other processes keep running" in said
        assert "loading the model" in said  # its log's end
        assert "worker-1 was killed by signal 9" in said
        assert "router" not in said and steady.alive()
        again = io.StringIO()
        assert report_exits(processes, exited, again) is True
        assert again.getvalue() == ""  # each exit is said once
        steady.stop()
        last = io.StringIO()
        assert report_exits(processes, exited, last) is False  # nothing left running
        assert "router was killed by signal 15" in last.getvalue()
    finally:
        for proc in processes:
            proc.stop(timeout_s=5)


def test_a_process_still_running_is_not_reported(tmp_path: Path) -> None:
    proc = started(tmp_path, "etcd", "import time; time.sleep(60)")
    try:
        time.sleep(0.1)
        out = io.StringIO()
        assert report_exits([proc], set(), out) is True and out.getvalue() == ""
    finally:
        proc.stop(timeout_s=5)
