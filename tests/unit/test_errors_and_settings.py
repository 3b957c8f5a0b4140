"""One mapping of errors to status codes, and typed service settings."""

import grpc
import pytest

from inferx.errors import (
    RETRY_AFTER_KEY,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
    from_rpc_error,
)
from inferx.settings import load_settings
from inferx_worker.config import WorkerSettings


class FakeRpcError(grpc.RpcError):
    def __init__(self, code, details, trailing=()):
        self._code, self._details, self._trailing = code, details, trailing

    def code(self):
        return self._code

    def details(self):
        return self._details

    def trailing_metadata(self):
        return self._trailing


@pytest.mark.parametrize(
    ("code", "cls"),
    [
        (grpc.StatusCode.INVALID_ARGUMENT, InvalidArgument),
        (grpc.StatusCode.NOT_FOUND, NotFound),
        (grpc.StatusCode.FAILED_PRECONDITION, FailedPrecondition),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, ResourceExhausted),
        (grpc.StatusCode.UNAVAILABLE, Unavailable),
        (grpc.StatusCode.UNKNOWN, Internal),
    ],
)
def test_status_codes_map_to_typed_errors(code, cls) -> None:
    error = from_rpc_error(FakeRpcError(code, "boom"))
    assert type(error) is cls and error.message == "boom" and error.code in (code, grpc.StatusCode.INTERNAL)


def test_retry_hint_travels_in_trailing_metadata() -> None:
    error = from_rpc_error(
        FakeRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, "full", ((RETRY_AFTER_KEY, "1.5"),))
    )
    assert error.retry_after_s == 1.5


def test_settings_from_flags_and_env(monkeypatch) -> None:
    monkeypatch.setenv("INFERX_ETCD", "10.0.0.1:2379")
    monkeypatch.setenv("INFERX_MAX_NUM_SEQS", "7")
    settings = load_settings(
        WorkerSettings, "inferx-worker", ["--model", "qwen-7b", "--engine", "sim", "--port", "9"]
    )
    assert settings.etcd == "10.0.0.1:2379" and settings.max_num_seqs == 7 and settings.port == 9
    assert settings.engine == "sim"


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--model", "qwen-7b", "--engine", "tgi"], "--engine"),
        (["--model", "a/b"], "--model"),
        (["--model", "m", "--etcd", "nohost"], "--etcd"),
        (["--model", "m", "--port", "70000"], "--port"),
    ],
)
def test_bad_settings_exit_2_with_the_flag_named(argv, needle, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        load_settings(WorkerSettings, "inferx-worker", argv)
    assert exc.value.code == 2
    assert needle in capsys.readouterr().err


def test_engine_rejections_are_told_apart_from_engine_failures() -> None:
    from inferx_worker.servicer import _rejected_request

    class VLLMClientError(Exception):
        pass

    class VLLMValidationError(VLLMClientError):
        pass

    assert _rejected_request(ValueError("too long"))
    assert _rejected_request(VLLMValidationError("prompt exceeds max length"))
    assert not _rejected_request(RuntimeError("engine core died"))
    assert not _rejected_request(None)
