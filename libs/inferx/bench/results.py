"""Raw benchmark results on disk, written before anything is rendered.

A benchmark can run for many minutes (the seed-agent scenario on vLLM: ~3 minutes per
configuration); a bug in a table or a summary must never lose its figures. So every
`inferx bench` / `inferx sim` writes what it measured -- each replay's chain records,
then the summaries -- to a JSON file as soon as it has them, and renders afterwards.
The file is rewritten whole (atomically) as results come in; `"complete": false` marks
a file whose run has not finished (or died).

Default location: `.inferx/bench-results/<UTC time>-<kind>.json` under the current
directory (the same state directory as the local model); `--results FILE` overrides.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from inferx.errors import InferxError, InvalidArgument

RESULTS_DIR = Path(".inferx") / "bench-results"


def jsonable(value: Any) -> Any:
    """Plain JSON data: dataclasses and pydantic models as dicts, tuples as lists, and
    inf/nan as null (JSON has neither; a miss or an empty group is null)."""
    if isinstance(value, BaseModel):
        return jsonable(value.model_dump())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return jsonable(dataclasses.asdict(value))
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value


def default_path(kind: str) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    return RESULTS_DIR / f"{stamp}-{kind}.json"


class ResultsFile:
    """One benchmark's results file; `write` replaces its content atomically, so a crash
    mid-write leaves the previous version, never half a file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise InvalidArgument(f"--results {path}: cannot create {path.parent}: {exc.strerror}") from None
        if path.is_dir():
            raise InvalidArgument(f"--results {path}: is a directory; give a file name")
        if path.exists() and not path.is_file():  # /dev/null: replaced by the write, not written to
            raise InvalidArgument(f"--results {path}: not a regular file; give a file name")

    def write(self, data: dict[str, Any]) -> None:
        """Raises InferxError if the file cannot be written (the caller decides whether
        to stop: after a long run it should warn and still show the figures)."""
        text = json.dumps(jsonable(data), indent=2, allow_nan=False)
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:
            tmp.write_text(text + "\n")
            os.replace(tmp, self.path)
        except OSError as exc:
            raise InferxError(f"cannot write the results to {self.path}: {exc.strerror}") from None


def replay_data(run: Any, errors: dict[str, int] | None = None) -> dict[str, Any]:
    """One replay (`inferx.sim.records.ReplayResult`) as raw data, every chain included."""
    data = dataclasses.asdict(run)
    if errors is not None:
        data["errors"] = errors
    return data
