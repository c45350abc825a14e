"""The ``kvflow`` command: ``demo``, ``bench``, ``store`` and ``mooncake-master``."""

from __future__ import annotations

import argparse
import logging
import sys

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvflow", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="store a prefix-sharing workload, retrieve it and verify it")
    demo.add_argument("--backend", default="memory://", help="backend URL (default: memory://)")
    demo.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    demo.add_argument("--keep", action="store_true", help="keep the blocks the demo stored (default: remove)")
    demo.add_argument(
        "--staged", action="store_true", help="move blocks through host staging buffers, as device caches do"
    )
    demo.add_argument(
        "--device", default="cpu", help="where the KV caches live: cpu, cuda, npu (default: cpu)"
    )

    bench = sub.add_parser("bench", help="store/retrieve/lookup throughput as ratios to memcpy")
    bench.add_argument("--backend", default="memory://", help="backend URL (default: memory://)")
    bench.add_argument("--json", action="store_true", help="print the results as one JSON object")
    bench.add_argument("--quick", action="store_true", help="fewer sizes and repetitions")
    bench.add_argument("--layerwise", action="store_true", help="layerwise retrieve overlapped with compute")
    bench.add_argument(
        "--staged",
        action="store_true",
        help="the host staging path against the direct path (or copy_ on a GPU)",
    )
    bench.add_argument(
        "--scale", action="store_true", help="cost per block as the store grows, and many concurrent requests"
    )
    bench.add_argument(
        "--plot", metavar="FILE", help="also draw throughput against object size (PNG; needs matplotlib)"
    )
    bench.add_argument(
        "--topology",
        action="store_true",
        help="loading KV an engine split differently stored (TP, layout) beside the matched load",
    )
    bench.add_argument(
        "--device", default=None, help="with --staged: where the caches live (cpu, cuda, npu; default: cpu)"
    )

    from kvflow.tools.store_admin import add_store_parser  # no torch: `kvflow --help` stays fast

    add_store_parser(sub)

    sub.add_parser(
        "mooncake-master", help="run a local Mooncake master (private network namespace only)", add_help=False
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args_list = sys.argv[1:] if argv is None else argv
    at = _command_at(args_list)
    if at is not None and args_list[at] == "mooncake-master":  # its own flags follow it, as they are
        before = _parser_top().parse_args(args_list[:at])
        logging.basicConfig(level=logging.DEBUG if before.verbose else logging.WARNING)
        from kvflow.tools.mooncake_master import main as master_main

        return int(master_main(args_list[at + 1 :]))
    parser = _parser()
    args = parser.parse_args(args_list)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING)
    from kvflow.errors import KVFlowError

    try:
        return _run(parser, args)
    except KVFlowError as exc:  # a bad URL or option, a store that cannot be reached: say so, no traceback
        print(f"kvflow {args.command}: {exc}", file=sys.stderr)
        return 2


def _command_at(argv: list[str]) -> int | None:
    """Where the command is: the first word that is no option (the top-level options take no
    values), so that a later word (an option's value, say) is never taken for a command."""
    return next((i for i, word in enumerate(argv) if not word.startswith("-")), None)


def _parser_top() -> argparse.ArgumentParser:
    """The options that may come before a command that parses its own (``mooncake-master``)."""
    parser = argparse.ArgumentParser(prog="kvflow")
    parser.add_argument("-v", "--verbose", action="store_true")
    return parser


def _run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    if args.command == "demo":
        from kvflow.tools.demo import demo_main

        return demo_main(args.backend, args.json, keep=args.keep, staged=args.staged, device=args.device)
    if args.command == "bench":
        in_memory = [flag for flag in ("layerwise", "staged", "topology") if getattr(args, flag)]
        if in_memory and args.backend != "memory://":
            parser.error(f"--{in_memory[0]} runs on an in-process store of its own; drop --backend")
        if args.plot and (in_memory or args.scale):
            parser.error("--plot draws the default bench's sizes only: drop the other mode")
        if args.device is not None and not args.staged:
            parser.error(
                "--device says where --staged's caches live: add --staged (the other benches run on cpu)"
            )
        if args.scale:
            from kvflow.tools.bench_scale import scale_main

            return scale_main(args.backend, as_json=args.json, quick=args.quick)
        if args.topology:
            from kvflow.tools.bench_topology import topology_main

            return topology_main(as_json=args.json, quick=args.quick)
        if args.staged:
            from kvflow.tools.bench_staged import staged_main

            return staged_main(as_json=args.json, quick=args.quick, device=args.device or "cpu")
        from kvflow.tools.bench import bench_main

        return int(
            bench_main(
                args.backend, as_json=args.json, quick=args.quick, layerwise=args.layerwise, plot=args.plot
            )
        )
    if args.command == "store":
        from kvflow.tools.store_admin import store_main

        return store_main(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
