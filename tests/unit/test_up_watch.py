"""`inferx up`'s watch over its processes (`devstack.report_exits`): a process that exits
is reported once, with how it ended and its log's end, and the others keep running --
a worker killed under `inferx up` must not take the stack down with it."""

from __future__ import annotations

import io
import signal
import subprocess
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


def test_a_stack_process_stops_when_what_started_it_is_killed(tmp_path: Path) -> None:
    """`inferx up` (or a benchmark) killed with SIGKILL, or by a lost terminal's SIGHUP,
    runs no clean-up: its processes get SIGTERM from the kernel and stop, instead of
    living on orphaned with the stack's ports (the next `inferx up`: "port 2379 is in
    use")."""
    pid_file = tmp_path / "child.pid"
    supervisor = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time, pathlib\n"
            "from inferx.devstack import ManagedProcess\n"
            f"p = ManagedProcess('worker-0', [sys.executable, '-c', 'import time; time.sleep(120)'], "
            f"pathlib.Path({str(tmp_path / 'w.log')!r}))\n"
            "p.start()\n"
            f"pathlib.Path({str(pid_file)!r}).write_text(str(p.pid))\n"
            "time.sleep(120)\n",
        ]
    )
    try:
        deadline = time.monotonic() + 30
        while not pid_file.exists() or not pid_file.read_text():
            assert supervisor.poll() is None and time.monotonic() < deadline, (
                "the supervisor did not start it"
            )
            time.sleep(0.05)
        child = int(pid_file.read_text())
        assert _running(child)
        supervisor.kill()
        supervisor.wait(10)
        deadline = time.monotonic() + 10
        while _running(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _running(child), "the stack's process outlived the one that started it"
    finally:
        if supervisor.poll() is None:
            supervisor.kill()


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's exit is reaped by init, maybe later)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False
