"""``advise``: the optimal checkpoint interval (Young/Daly) from the save timings recorded in
the manifests, or from a given cost per checkpoint."""

from __future__ import annotations

import argparse

from shardkeeper.core.cli.common import EXIT_OK, open_root, print_json
from shardkeeper.core.cli.display import say
from shardkeeper.core.errors import UsageError


def cmd_advise(args: argparse.Namespace) -> int:
    from shardkeeper.core.tools import advisor

    try:
        if args.mtbf is not None:
            mtbf = advisor.parse_duration(args.mtbf)
        elif args.restarts is not None and args.elapsed is not None:
            mtbf = advisor.mtbf_from_restarts(args.restarts, advisor.parse_duration(args.elapsed))
        else:
            raise UsageError("give --mtbf DURATION, or the job's restart history: --restarts N --elapsed DURATION")
        interval = advisor.parse_duration(args.interval) if args.interval is not None else None
        restart = advisor.parse_duration(args.restart_cost) if args.restart_cost is not None else 0.0
        if args.cost is not None:
            advice = advisor.advise(
                mtbf_s=mtbf,
                interval_s=interval,
                cost_s=advisor.parse_duration(args.cost),
                durable_s=advisor.parse_duration(args.durable or "0"),
                sync=args.sync,
                restart_s=restart,
            )
        else:
            storage = open_root(args)
            advice = advisor.advise_root(storage, mtbf_s=mtbf, interval_s=interval, last=args.last, restart_s=restart)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.json:
        print_json(advice.to_json())
    else:
        say(*advice.summary().splitlines())
    return EXIT_OK


def add_advise(sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser) -> None:
    """``advise ROOT --mtbf DURATION [--interval DURATION]``."""
    p = sub.add_parser(
        "advise", parents=[common], help="the optimal checkpoint interval (Young/Daly) from recorded save timings"
    )
    p.add_argument("--mtbf", metavar="DURATION", help="mean time between failures, e.g. 3h, 45m, 2d")
    p.add_argument(
        "--restarts", type=int, metavar="N", help="instead of --mtbf: failures (restarts) the job had in --elapsed"
    )
    p.add_argument("--elapsed", metavar="DURATION", help="wall time over which --restarts happened")
    p.add_argument("--interval", metavar="DURATION", help="the current interval, to compare")
    p.add_argument("--restart-cost", metavar="DURATION", help="time to restart after a failure")
    p.add_argument(
        "--last", type=int, default=10, metavar="N", help="use the timings of the newest N steps (default 10)"
    )
    p.add_argument(
        "--cost", metavar="DURATION", help="instead of the recorded timings: training time lost per checkpoint"
    )
    p.add_argument(
        "--durable", metavar="DURATION", help="with --cost: how long after the stall a checkpoint is committed"
    )
    p.add_argument("--sync", action="store_true", default=None, help="with --cost: synchronous saves")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_advise)


__all__ = ["add_advise", "cmd_advise"]
