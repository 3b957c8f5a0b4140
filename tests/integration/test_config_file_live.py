"""`--config FILE` on a real service process (the cache): what the file sets takes
effect (its port, its size bound), a flag wins over the file, and a file with a key the
service does not take stops the start with that key and the file named, no traceback."""

from __future__ import annotations

import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from inferx.devstack import LocalStack, ManagedProcess, free_port, wait_serving
from inferx.tls import Transport
from inferx.v1 import cache_pb2, cache_pb2_grpc
from tests.conftest import dump_logs, make_stack, started

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    """etcd alone (plaintext); the tests start the cache themselves."""

    def start(stack: LocalStack) -> None:
        stack.start_etcd()

    with started(make_stack(tmp_path_factory.mktemp("config") / ".inferx"), start) as stack:
        yield stack


def test_the_cache_serves_with_the_settings_of_its_config_file(stack: LocalStack, tmp_path: Path) -> None:
    port, file_metrics_port, flag_metrics_port = free_port(), free_port(), free_port()
    config = tmp_path / "cache.yaml"
    config.write_text(
        f"etcd: {stack.etcd_endpoint}\n"
        "insecure: true\n"
        f"port: {port}\n"
        f"metrics-port: {file_metrics_port}\n"  # the flag below wins
        "lease_ttl_s: 3\n"
        "max_bytes: 123456\n"
        "drain_timeout_s: 1\n"
        "deregister_grace_s: 0\n"
    )
    proc = ManagedProcess(
        "cache-config",
        [
            sys.executable,
            "-m",
            "inferx_cache",
            "--config",
            str(config),
            "--metrics-port",
            str(flag_metrics_port),
        ],
        tmp_path / "cache.log",
        address=f"127.0.0.1:{port}",  # the file's port: nothing else names it
    )
    proc.start()
    try:
        wait_serving(proc, 60)
        with Transport.plaintext().channel(proc.address) as channel:
            stats = cache_pb2_grpc.CacheStub(channel).GetCacheStats(cache_pb2.CacheStatsRequest(), timeout=5)
        assert stats.max_bytes == 123456  # the file's --max-bytes
        with urllib.request.urlopen(f"http://127.0.0.1:{flag_metrics_port}/metrics", timeout=5) as reply:
            assert b"inferx_cache_entries" in reply.read()  # the flag's metrics port, not the file's
    except BaseException:
        dump_logs(stack)
        print(f"----- {proc.name} -----\n{proc.log_tail(40)}")
        raise
    finally:
        proc.stop()


def test_an_unknown_key_stops_the_start_naming_it(stack: LocalStack, tmp_path: Path) -> None:
    config = tmp_path / "cache.yaml"
    config.write_text(f"etcd: {stack.etcd_endpoint}\ninsecure: true\nmax_byts: 1024\n")
    done = subprocess.run(
        [sys.executable, "-m", "inferx_cache", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == (
        f"inferx-cache: error: config file {config}: unknown key 'max_byts' (did you mean 'max_bytes'?)"
    )
    assert "Traceback" not in done.stderr and done.stdout == ""
