"""The `inferx sim`, `inferx bench` and `inferx workload` command lines: the parser
only, cheap to import (`inferx --help` builds every parser). What runs a command is
in `inferx.cli.bench`, imported when that command runs."""

from __future__ import annotations

import argparse

from inferx.cli import argtypes, connect

# inferx.bench.results.RESULTS_DIR, spelled out: importing that module costs pydantic.
RESULTS_DIR = ".inferx/bench-results"


def _handler(name: str, *, defaults: bool = True):
    """The command `inferx.cli.bench.<name>`, imported when it runs (after the defaults
    that depend on other flags are filled in, for sim and bench)."""

    def run(args: argparse.Namespace):
        from inferx.cli import bench

        if defaults:
            _defaults(args)
        return getattr(bench, name)(args)

    return run


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", help="JSONL trace (default: benchmarks/default_trace.jsonl)")
    parser.add_argument(
        "--results",
        metavar="FILE",
        help="write the raw results here, as they come in and before any table "
        f"(default: {RESULTS_DIR}/<UTC time>-<kind>.json)",
    )
    parser.add_argument(
        "--compare",
        nargs="+",
        metavar="POLICY",
        default=None,
        help="policies to run on the same trace (default: round-robin chain-aware; `baseline` "
        "is accepted for round-robin); with --scenario seed-agent, configurations "
        "(default: reference on; also no-affinity)",
    )
    parser.add_argument("--policy", help="run one policy instead of comparing")
    parser.add_argument(
        "--workers", type=argtypes.at_least_one, default=None, help="model workers (default 4; seed-agent 2)"
    )
    load = parser.add_mutually_exclusive_group()
    load.add_argument("--rate", type=float, help="chain arrivals per second (virtual time)")
    load.add_argument(
        "--load",
        type=float,
        default=0.8,
        help="fraction of round-robin's saturation rate (default 0.8)",
    )
    parser.add_argument("--duration", type=float, help="only chains arriving in the first S s")
    parser.add_argument(
        "--profile",
        help="engine calibration file (YAML/JSON): the simulated engines, and what chain-aware is told "
        "of them (as inferx-scheduler --engine-profile tells it live; taken as given, not learned, "
        "unless --option learn_engine=true)",
    )
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument(
        "--capacity",
        action="store_true",
        help="simulator: find each policy's sustained capacity at SLO (>= 99%% realtime and >= 95%% "
        "of all chains meet their SLO over a steady-state window) by bisecting the arrival rate; "
        "--rate sets where the search starts",
    )
    parser.add_argument(
        "--window-s",
        type=float,
        default=None,
        metavar="S",
        help="--capacity, --peer: seconds of arrivals measured at every probed rate (trace time), "
        "after a warm-up and before a drain that are not counted (default: at least 20 median chain "
        "SLOs and at least 1800 s; shorter windows are reported as not steady state)",
    )
    parser.add_argument(
        "--burst",
        type=argtypes.at_least_one,
        default=None,
        metavar="N",
        help="--capacity: instead of steady state, N chains as fast as the rate says, all counted: "
        "how well a policy absorbs one burst (labelled as such; not a sustained capacity)",
    )
    parser.add_argument(
        "--bound",
        action="store_true",
        help="--capacity: also measure the engines' bound on the workload: what the workers, all busy, "
        "complete per second with more offered than any policy sustained (the 3 policies of highest "
        "capacity, same window), "
        "and each capacity as a share of the best",
    )
    parser.add_argument(
        "--jobs",
        type=argtypes.at_least_one,
        default=None,
        metavar="N",
        help="--capacity: run N searches (policy x seed) at once in separate processes "
        "(default: one per CPU; 1 shows a progress bar per probe)",
    )
    parser.add_argument(
        "--seeds",
        type=argtypes.at_least_one,
        default=1,
        help="--capacity: repeat on N traces (seeds from --seed, or from the trace's own) and "
        "report the median and spread (default 1)",
    )
    parser.add_argument(
        "--workload",
        choices=("mix", "coding", "research"),
        help="--capacity: generate the trace (mix = chat/bfcl/swe; coding = long-context coding "
        "agent; research = deep-research agent, parallel branches joined by a report) instead of --trace",
    )
    parser.add_argument(
        "--seed",
        type=argtypes.count,
        default=None,
        help="--capacity/--peer: the first trace seed, of --workload (default 1) or of a --trace "
        "`inferx workload` wrote, regenerated with it (default: the trace's own)",
    )
    parser.add_argument(
        "--option",
        action="append",
        metavar="KEY=VALUE",
        help="a policy option (e.g. realtime_guard=false for an ablation), given to the compared "
        "policies that take it: in the simulator any option, live (--engine sim) those the "
        "scheduler has a flag for (exact_prefix=true: --exact-prefix)",
    )
    parser.add_argument(
        "--programs",
        action="store_true",
        help="--capacity: replay each chain as a dynamic program, as the OpenAI front sees an "
        "agent (the scheduler is told neither the calls left nor when the program ends)",
    )
    parser.add_argument(
        "--plot",
        metavar="FILE",
        help="--capacity: draw SLO attainment and P99 latency against arrival rate, per policy, "
        "capacity marked (PNG/SVG/PDF by the file's extension; first seed)",
    )


def _defaults(args: argparse.Namespace) -> None:
    args.workers_given = args.workers is not None
    args.compare_given = bool(args.compare)
    args.speed_given = getattr(args, "speed", None) is not None
    if not args.speed_given:
        args.speed = 4.0
    if args.workers is None:
        args.workers = 4
    if getattr(args, "scenario", None):
        return  # cmd_seed_agent resolves its configuration names
    if args.policy:
        args.compare = None
    elif not args.compare:
        args.compare = ["round-robin", "chain-aware"]


def _seed_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("--scenario seed-agent")
    group.add_argument(
        "--chains", type=argtypes.at_least_one, default=60, help="chains to run per configuration (60)"
    )
    group.add_argument(
        "--max-tokens", type=argtypes.at_least_one, default=16, help="completion tokens per model call (16)"
    )
    group.add_argument(
        "--tool-median-ms", type=float, default=300.0, help="knowledge-tool latency median (300 ms)"
    )
    group.add_argument(
        "--model-path", default=".inferx/models/tiny-llama", help="vLLM model (the tiny local model)"
    )


def _overhead_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("--overhead")
    group.add_argument(
        "--overhead",
        action="store_true",
        help="start a local stack with one SIMULATED sim worker (--speed, default 10000: engine "
        "time ~0) and measure side by side a direct worker Generate, a 1-hop and an N-hop chain "
        "through the router (and the N-hop chain with its events batched, batch_events, and "
        "asking for its result alone, final_only): "
        "latency, added latency per hop, throughput",
    )
    group.add_argument("--hops", type=int, default=4, help="--overhead: hops of the long chain (4)")
    group.add_argument(
        "--count", type=int, default=300, help="--overhead: sequential calls measured per path (300)"
    )
    group.add_argument(
        "--warmup", type=int, default=30, help="--overhead: sequential calls before those, not measured (30)"
    )
    group.add_argument(
        "--concurrency", type=int, default=16, help="--overhead: closed-loop callers for throughput (16)"
    )
    group.add_argument(
        "--load-calls", type=int, default=1000, help="--overhead: closed-loop calls per path (1000)"
    )
    group.add_argument(
        "--embedded-scheduler",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="--overhead, --peer: InferX's router runs the scheduler in its own process (inferx-router "
        "--embedded-scheduler) instead of a scheduler process; default: with --overhead, as `inferx up` "
        "(embedded), with --peer, a scheduler process",
    )
    group.add_argument(
        "--outside",
        action="store_true",
        help="--overhead: also measure from a plain outside client in its own process (a grpc.aio "
        "stub of inferx.v1.Router, batch_events, no SDK): direct, 1-hop and N-hop, --count "
        "sequential calls then --concurrency callers for --outside-duration seconds each",
    )
    group.add_argument(
        "--outside-duration",
        type=float,
        default=8.0,
        metavar="S",
        help="--overhead --outside: closed-loop seconds per path (8)",
    )
    group.add_argument(
        "--insecure",
        action="store_true",
        help="--overhead: the stack runs plaintext with no tokens (as `inferx up --insecure`); "
        "default: TLS and the admin token, as `inferx up`",
    )


def _peer_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("--peer")
    group.add_argument(
        "--peer",
        choices=("vllm-router",),
        help="InferX's OpenAI-compatible front against vllm-router, each in front of identical "
        "SIMULATED sim workers serving HTTP: the same agent programs over HTTP through both; capacity "
        "at SLO, P99 chain latency, TTFT and the added latency per call of each front (vs calling a "
        "worker directly), in one run. Uses --workload (mix) or --trace, --workers (2), --speed (4), "
        "--rate (where the rate ladder starts), --seeds, --count/--warmup (calls per path for the "
        "added latency), --window-s or --probe-chains (what a probe replays), --timeout (wall "
        "seconds a probe may run after its last arrival)",
    )
    group.add_argument(
        "--peer-modes",
        nargs="+",
        metavar="MODE",
        help="--peer: vllm-router modes to measure (default: consistent_hash program; also "
        "cache_aware, power_of_two, round_robin, sticky_least_loaded, random)",
    )
    group.add_argument(
        "--probe-chains",
        type=int,
        default=None,
        metavar="N",
        help="--peer: instead of steady state, replay a BURST of N agent programs per probe at the "
        "probed rate, all counted (quick, but how a front absorbs one burst, not a capacity). "
        "Default: steady-state probes as `inferx sim --capacity` (--window-s of arrivals measured "
        "after a warm-up; default at least 20 median chain SLOs and 30 min of trace time, so "
        "~10 min of wall time per probe at --speed 4)",
    )
    group.add_argument(
        "--max-probes", type=int, default=4, help="--peer: probes (arrival rates) per front and seed (4)"
    )
    group.add_argument(
        "--inferx-diagnostics",
        action="store_true",
        help="--peer: after the ladder, probe InferX once more at the best vllm-router mode's capacity "
        "with an end mark on each program's last call (an ORACLE) and with no deadline header: what "
        "each costs; reported apart, never in the capacity ratio",
    )
    group.add_argument(
        "--rate-step",
        type=float,
        default=1.5**0.5,
        help="--peer: ratio of successive rates of the ladder (sqrt(1.5): two steps are 1.5x)",
    )


def _decision_cost_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--pools",
        type=argtypes.at_least_one,
        default=1,
        help="model pools: worker i and chain i of the trace go to pool i mod N (default 1)",
    )
    group = parser.add_argument_group("--decision-cost")
    group.add_argument(
        "--decision-cost",
        action="store_true",
        help="time the scheduler's decisions (queue + policy calls only, not the SIMULATED engines) "
        "per hop: a replay of the trace at each --cost-workers size, then a pool held at each "
        "--cost-depths queue depth; p50/p99 per hop and hops/s one scheduler partition decides",
    )
    group.add_argument(
        "--cost-workers", type=int, nargs="+", default=[4, 32, 128], help="cluster sizes (4 32 128)"
    )
    group.add_argument(
        "--cost-depths", type=int, nargs="+", default=[10, 100, 1000], help="queued hops (10 100 1000)"
    )
    group.add_argument(
        "--cost-rate-per-worker",
        type=float,
        default=0.25,
        help="replay: chain arrivals per second per worker (0.25); --duration (60 s) of them",
    )
    group.add_argument(
        "--cost-cycles", type=int, default=500, help="steady state: finish+submit+assign rounds timed (500)"
    )
    group.add_argument(
        "--cost-scan",
        action="store_true",
        help="also time each run with the policy scanning the pool (no indexes): the same "
        "decisions (tested), the cost before the indexes",
    )


def register(sub: argparse._SubParsersAction) -> None:
    sim = sub.add_parser("sim", help="replay a trace through the policies in virtual time")
    _common(sim)
    _decision_cost_arguments(sim)
    sim.set_defaults(handler=_handler("cmd_sim"), simulate=True)

    bench = sub.add_parser("bench", help="benchmark the scheduling policies on a trace")
    _common(bench)
    bench.add_argument("--simulate", action="store_true", help="same as `inferx sim`")
    bench.add_argument(
        "--engine",
        choices=("sim", "vllm"),
        help="live: start a local stack with this engine per policy",
    )
    bench.add_argument(
        "--router",
        help="replay the trace against a running stack (HOST:PORT of its router), once, with the "
        "policy its scheduler runs",
    )
    bench.add_argument(
        "--model", help="--router: the model to send the trace's hops to (default: its only pool)"
    )
    # --token, --tls-ca: for --router (INFERX_TLS_CERT/INFERX_TLS_KEY: the certificate the
    # replay calls the stack's scheduler with; default: the local stack's)
    connect.add_router_flags(bench, router=False)
    bench.add_argument(
        "--speed",
        type=float,
        help="live: engines and the trace run this many times faster than real time "
        "(default 4 with --engine sim; 1 with --router, unless its workers run faster; "
        "10000 with --overhead)",
    )
    bench.add_argument("--timeout", type=float, default=900.0, help="live: give up after S wall seconds")
    bench.add_argument(
        "--max-chains", type=argtypes.at_least_one, help="live: only the first N chains of the trace"
    )
    bench.add_argument("--state-dir", help="live: keep each stack's state and logs under DIR/<name>")
    bench.add_argument(
        "--scenario",
        choices=("seed-agent",),
        help="seed-agent: an 8-call agent chain with knowledge-tool calls on real vLLM, "
        "InferX (affinity + tool cache) vs the reference: round-robin in front of stock "
        "vLLM, prefix caching on (see docs/benchmarks.md)",
    )
    _seed_arguments(bench)
    _overhead_arguments(bench)
    _peer_arguments(bench)
    bench.set_defaults(handler=_handler("cmd_bench"))

    trace = sub.add_parser("workload", help="generate a JSONL agent-chain workload trace")
    trace.add_argument("-o", "--out", required=True, help="output file")
    trace.add_argument("--seed", type=argtypes.count, default=4)
    trace.add_argument("--duration", type=float, default=900.0, help="arrival window (s)")
    trace.add_argument("--rate", type=float, default=1.0, help="chains per second")
    trace.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 = Poisson")
    trace.add_argument(
        "--mix",
        default="chat=0.45,bfcl=0.4,swe=0.15",
        help="KIND=WEIGHT,... (kinds: chat, bfcl, swe, coding, research)",
    )
    trace.add_argument("--profile", help="engine calibration used to set SLOs")
    trace.set_defaults(handler=_handler("cmd_trace", defaults=False))
