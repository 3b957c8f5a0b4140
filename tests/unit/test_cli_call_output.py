"""`inferx call` writes its summary (finish reason, tokens, worker, program, run) as one
line, whatever the terminal's width: scripts and tests read it from a pipe."""

import io

from inferx.cli import call


def test_the_call_summary_stays_on_one_line_when_piped() -> None:
    summary = (
        "length · tokens 5 in (0 cached) / 6 out · worker-vm-953-f242b0 · 15 ms · "
        "program cli-71b41e71 call 0 · run a753890d861446ef (inferx trace a753890d)"
    )
    piped = io.StringIO()
    saved = call.err.file
    call.err.file = piped
    try:
        call.err.print(summary, style="dim", markup=False)
    finally:
        call.err.file = saved
    assert piped.getvalue() == summary + "\n"
