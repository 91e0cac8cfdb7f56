# SPDX-License-Identifier: MIT
"""`applianctl judge` (hidden; appliance-judge.service runs it): the progress judge of every
replica, its /health and its HAProxy agent (daemon.py, endpoints.py). `--once` judges one round
without acting on it and prints it (`--json`: the JudgeState record)."""

from __future__ import annotations

import argparse
import json

from appliance import cli_help, paths
from appliance.schema import dump_record


def main(args: argparse.Namespace) -> int:
    from appliance.host_settings import load_device
    from applianctl.judge import daemon, hive

    config = load_device()
    if args.once:
        judge = daemon.Judge(config, act=False)
        try:
            state = judge.round()
        finally:
            judge.close()
        if args.json:
            print(json.dumps(dump_record(state), indent=2, sort_keys=True))
        else:
            for r in state.replicas:
                print(f"replica {r.replica}: {r.state}" + (f" ({r.reason})" if r.reason else ""))
            print(f"alive: {state.alive} of {len(state.replicas)}; canaries in the last hour: {state.canaries_last_hour}")
        return 0 if state.alive else 1
    ladder = hive.Ladder(config.engine.remediation)
    judge = daemon.Judge(config, state_path=paths.JUDGE_STATE, ladder=ladder,
                         kernel_log=lambda since: hive.read_kernel_log(since))
    daemon.run_forever(judge, args.health, args.agent)
    return 0


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    # hidden (not listed): appliance-judge.service's ExecStart
    p = cli_help.verb_parser(
        sub, "judge", "judge every engine replica by its progress; serve the judge's /health and HAProxy agent",
        examples=["applianctl judge", "applianctl judge --once --json"],
        exit_codes=[(0, "the service stopped; with --once: at least one replica is alive"),
                    (1, "with --once: no replica is alive"), cli_help.BAD_INPUT],
        details="A replica is alive while its token counters move, or a one-token canary answers when they do not "
                "(engine.progress); a stalled one is taken out of the balancer, killed and restarted.",
        hidden=True,
    )
    p.add_argument("--once", action="store_true", help="judge one round, act on nothing, print it")
    p.add_argument("--json", action="store_true", help="with --once: print the round as JSON")
    p.add_argument("--health", default=paths.JUDGE_HEALTH, metavar="HOST:PORT", help="where /health is served")
    p.add_argument("--agent", default=paths.JUDGE_AGENT, metavar="HOST:PORT", help="where the HAProxy agent is served")
    p.set_defaults(func=main)
