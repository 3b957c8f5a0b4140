"""SIGTERM stops an `inferx` command as Ctrl-C does, also when it was started with
SIGINT ignored -- as a shell starts its background jobs (`inferx bench ... &` in a
script), the case in which SIGTERM, turned into a SIGINT, used to stop nothing: the
command ran to its end."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path


def test_sigterm_stops_a_command_started_with_sigint_ignored(tmp_path: Path) -> None:
    # A simulator capacity search: a minute of work, no stack to start.
    command = [sys.executable, "-m", "inferx.cli.main", "sim", "--capacity", "--compare", "chain-aware"]
    command += ["--workload", "mix", "--seed", "2", "--workers", "2", "--programs", "--json"]
    command += ["--results", str(tmp_path / "results.json")]

    def ignore_sigint() -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    started = subprocess.Popen(
        command,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=ignore_sigint,
    )
    try:
        time.sleep(3)  # past the imports, into the search
        assert started.poll() is None, started.stderr.read() if started.stderr else ""
        started.send_signal(signal.SIGTERM)
        assert started.wait(timeout=20) == 130  # interrupted, as by Ctrl-C (before: ran to its end)
    finally:
        if started.poll() is None:
            started.kill()
