"""`inferx call MODEL PROMPT`: one model call of a dynamic program over `Router.CallModel`,
the text streamed as it is generated (each tool call on a line of its own as soon as it
has been read), then its usage, worker and program record."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from rich.console import Console

from inferx.cli import argtypes, connect
from inferx.errors import InferxError

TIERS = {"realtime": 1, "standard": 2, "batch": 3}

err = Console(stderr=True, highlight=False, soft_wrap=True)  # a summary line stays one line when piped


def read_tools(path: str) -> list[dict[str, Any]]:
    """--tools FILE: a JSON array of OpenAI tool specs (InferxError saying what is wrong;
    the router checks each spec, as it does the HTTP front's)."""
    try:
        tools = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise InferxError(f"--tools {path}: no such file") from None
    except OSError as exc:
        raise InferxError(f"--tools {path}: {exc.strerror}") from None
    except ValueError as exc:
        raise InferxError(f"--tools {path}: not JSON ({exc})") from None
    except RecursionError:
        raise InferxError(f"--tools {path}: JSON nested too deeply") from None
    if not isinstance(tools, list) or not all(isinstance(tool, dict) for tool in tools):
        raise InferxError(f"--tools {path}: expected a JSON array of tool specs")
    return tools


def tool_choice(value: str | None) -> str | dict[str, Any] | None:
    """--tool-choice: auto, none, required, or the name of the function to call."""
    if value is None or value in ("auto", "none", "required"):
        return value
    return {"type": "function", "function": {"name": value}}


async def cmd_call(args: argparse.Namespace) -> int:
    from google.protobuf import json_format

    if args.tool_choice is not None and not args.tools:
        raise InferxError("--tool-choice: only with --tools")
    tools = read_tools(args.tools) if args.tools else []
    messages = []
    if args.system is not None or tools:  # tools need a chat: PROMPT is the user's message
        system = [{"role": "system", "content": args.system}] if args.system is not None else []
        messages = [*system, {"role": "user", "content": args.prompt}]
    finished = None
    async with connect.client(args) as client:
        async for event in client.call_model(
            args.model,
            "" if messages else args.prompt,
            messages=messages,
            tools=tools,
            tool_choice=tool_choice(args.tool_choice),
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            stop=args.stop,
            program_id=args.program or "",
            program_name=args.name or "",
            tier=TIERS.get(args.tier or "", 0),  # type: ignore[arg-type]
            deadline_ms=args.deadline_ms,
            program_end=args.end,
            kv_retention_s=args.kv_retention_s,
        ):
            kind = event.WhichOneof("event")
            if kind == "finished":
                finished = event.finished
            elif args.json:
                continue
            elif kind == "text":
                sys.stdout.write(event.text)
                sys.stdout.flush()
            elif kind == "reasoning":  # a reasoning model's thinking: on stderr, dimmed
                err.print(event.reasoning, style="dim", end="", markup=False)
            elif kind == "tool_call":  # as soon as it was read, before the reply ends
                call = event.tool_call
                sys.stdout.write(
                    f"\n[tool call {call.index}] {call.name} {call.arguments_json} ({call.id})\n"
                )
                sys.stdout.flush()
    if finished is None:
        err.print("the router ended the call without a result")
        return 1
    if args.json:
        print(json.dumps(json_format.MessageToDict(finished, preserving_proto_field_name=True), indent=2))
        return 0
    usage = finished.usage
    program = f"program {finished.program_id} call {finished.call_index} · " if finished.program_id else ""
    sys.stdout.write("\n")
    err.print(
        f"{finished.finish_reason} · tokens {usage.prompt_tokens} in ({usage.cached_prompt_tokens} cached) / "
        f"{usage.completion_tokens} out · {finished.worker_id} · {finished.latency_ms:,.0f} ms · "
        f"{program}run {finished.run_id} (inferx trace {finished.run_id[:8]})",
        style="dim",
        markup=False,
    )
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    call = sub.add_parser(
        "call", help="one model call of a dynamic program (Router.CallModel), streamed; see `inferx trace`"
    )
    connect.add_router_flags(call)
    call.add_argument("--json", action="store_true", help="print the final event as JSON (no text)")
    call.add_argument("model")
    call.add_argument("prompt")
    call.add_argument("--system", help="send a chat (this system message, then PROMPT as the user's)")
    call.add_argument(
        "--tools",
        metavar="FILE",
        help="offer tools (a JSON array of OpenAI tool specs; sends a chat): the model's tool calls "
        "are printed as they are read, one line each",
    )
    call.add_argument(
        "--tool-choice",
        metavar="CHOICE",
        help="with --tools: auto (default), none, required, or a function's name",
    )
    call.add_argument("--program", metavar="ID", help="program id: calls with one id are hops of one program")
    call.add_argument("--name", metavar="NAME", help="the program's kind: its chain in `inferx stats`")
    call.add_argument("--end", action="store_true", help="the program ends after this call")
    call.add_argument("--tier", choices=sorted(TIERS))
    call.add_argument("--deadline-ms", type=argtypes.count, default=0, metavar="MS")
    call.add_argument(
        "--kv-retention-s",
        type=float,
        metavar="S",
        help="keep the program's KV this long after the call (0: let it go at once; "
        "at most the scheduler's --max-hold-s)",
    )
    call.add_argument(
        "--max-tokens",
        type=argtypes.count,
        default=0,
        metavar="N",
        help="at most N completion tokens (default: not set, up to the model's context room)",
    )
    call.add_argument("--temperature", type=float)
    call.add_argument(
        "--stop",
        action="append",
        default=[],
        metavar="S",
        help="end the reply before the model writes S (repeatable; OpenAI's stop)",
    )
    call.set_defaults(handler=cmd_call)
