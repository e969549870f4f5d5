"""The `journeys` command line. Thin: parse arguments, load config, call one stage.

Heavy libraries (torch, Lightning, MLflow, Prefect) are imported inside the command that
needs them, so `journeys --help` and `journeys ingest` start in well under a second.
Errors the user can fix (`JourneysError`) print one line and exit 2, with no traceback.
"""

from __future__ import annotations

import argparse
import gc
import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from journeys.config import Config, load_config, redact_uri
from journeys.errors import STOP_SIGNALS, Interrupted, JourneysError
from journeys.pipeline_lock import stage_lock

EXIT_BAD_INPUT = 2
EXIT_ALERTS = 3  # `journeys monitor`: some check alerted (docs/monitoring.md)
# The garbage collector of a `journeys` console-script process (`run`; `main`, which tests,
# flows and `python -m journeys.cli` call, keeps Python's defaults). Importing torch,
# MLflow and scikit-learn builds millions of objects that live until the process ends: at
# the default young-generation threshold (700) the collector walks them again and again,
# and once more at exit, 1.1-1.3 s of a nightly `journeys score` that finds no garbage
# (benchmarks/daily.py, docs/nightly.md).
GC_YOUNG_THRESHOLD = 10_000


def _add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        type=Path,
        action="append",
        default=[],
        help="YAML file (default conf/default.yaml); repeatable: later files override earlier ones",
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one key, e.g. --set train.max_epochs=3 (repeatable)",
    )


def _config(args: argparse.Namespace) -> Config:
    return load_config(args.config, args.overrides)


def cmd_simulate(args: argparse.Namespace) -> None:
    from journeys.simulate import simulate

    config = _config(args)
    settings = config.simulate.model_dump()
    if args.users is not None:
        settings["users"] = args.users
    if args.seed is not None:
        settings["seed"] = args.seed
    result = simulate(Path(args.out), **settings)
    print(
        f"wrote {result.n_events:,} events of {result.n_users:,} users "
        f"({result.n_journeys:,} journeys) to {result.events_path}"
    )


def cmd_ingest(args: argparse.Namespace) -> None:
    from journeys.events import resolve_sources
    from journeys.ingest import run_ingest
    from journeys.ingest_report import print_report

    config = _config(args)
    resolve_sources(config.paths.raw)  # a missing input fails before any lock or folder
    with stage_lock(config, "ingest"):
        report = run_ingest(config, full=args.full).report
    print_report(report)


def cmd_train(args: argparse.Namespace) -> None:
    from journeys.datasets import check_trainable, dataset_features
    from journeys.tracking import check_tracking_uri, tracking_uri

    config = dataset_features(_config(args))
    # Fail fast, before torch and Lightning are even imported, and before any store or
    # run is created: a dataset that cannot be trained or evaluated registers nothing.
    sizes = check_trainable(
        config.paths.journeys, config.data.features, config.split.fractions,
        config.train.window_delta,
    )  # fmt: skip
    # torchrun and SLURM start this command once per rank: rank 0 alone touches the
    # tracking store (two ranks creating a new store's tables at once collide) and the lock.
    if launcher_rank() == 0:
        check_tracking_uri(tracking_uri(config))
    from journeys.train import train_command

    if launcher_rank() != 0:
        train_command(config, resume=args.resume, sizes=sizes)
        return
    with stage_lock(config, "train"):
        train_command(config, resume=args.resume, sizes=sizes)


# Where launchers put a process's rank, in the order Lightning reads them.
RANK_VARIABLES = ("RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK")


def launcher_rank() -> int:
    """This process's rank as torchrun, SLURM or Lightning's DDP launcher set it (0 when
    started alone), read from the environment: known before torch is imported."""
    for name in RANK_VARIABLES:
        if os.environ.get(name):
            return int(os.environ[name])
    return 0


def cmd_score(args: argparse.Namespace) -> None:
    """Score, then build the attribution report from the scores, as the flow does.

    The report goes to `--report`, or to `paths.reports` when the scores went to the
    default `paths.scores`: scores written elsewhere never overwrite the main report.
    """
    from journeys.attribution import attribute_command, report_dimensions
    from journeys.datasets import require_input
    from journeys.score import score_command

    config = _config(args)
    require_input(
        args.input or config.paths.journeys, "input", "run `journeys ingest` or pass --input"
    )
    # A breakdown that cannot be built fails before the scores are replaced, not after.
    report_dimensions(config.data.features, config.attribution.by)
    with stage_lock(config, "score"):
        result = score_command(
            config, model_uri=args.model, input_path=args.input, out=args.out, as_of=args.as_of
        )
        report = args.report or (None if args.out else config.paths.reports)
        if report and result.rows:
            attribute_command(config, scores=result.out, out=report, trained=result.trained)
        elif report:
            print(f"journeys score: no journeys scored: the report in {report} is not rebuilt",
                  file=sys.stderr)  # fmt: skip


def cmd_attribute(args: argparse.Namespace) -> None:
    from journeys.attribution import attribute_command
    from journeys.datasets import require_input

    config = _config(args)
    require_input(args.scores or config.paths.scores, "scores", "run `journeys score` first")
    with stage_lock(config, "attribute"):
        attribute_command(config, scores=args.scores, out=args.out)


def cmd_monitor(args: argparse.Namespace) -> int:
    """Exit 3 when any check alerts (docs/monitoring.md), 0 otherwise."""
    from journeys.datasets import require_input
    from journeys.monitor import monitor_command

    config = _config(args)
    require_input(config.paths.journeys, "journeys", "run `journeys ingest` first")
    require_input(config.paths.scores, "scores", "run `journeys score` first")
    with stage_lock(config, "monitor"):
        result = monitor_command(config)
    return EXIT_ALERTS if result.alerts else 0


def cmd_pipeline(args: argparse.Namespace) -> None:
    from flows.pipeline import pipeline_command

    pipeline_command(_config(args))


def cmd_serve(args: argparse.Namespace) -> None:
    from flows.deployments import serve_command

    serve_command(_config(args))


def cmd_ui(args: argparse.Namespace) -> None:
    from journeys.tracking import ui_command

    ui_command(_config(args), host=args.host, port=args.port)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="journeys", description="Model user journeys: ingest, train, score, attribute."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, handler: Callable[[argparse.Namespace], int | None], text: str):
        sub = commands.add_parser(name, help=text, description=text)
        _add_config_args(sub)
        sub.set_defaults(handler=handler)
        return sub

    sim = command("simulate", cmd_simulate, "write a synthetic event log with ground truth")
    sim.add_argument("--out", required=True, help="folder for the event log")
    sim.add_argument("--users", type=int, default=None)
    sim.add_argument("--seed", type=int, default=None)

    ingest = command("ingest", cmd_ingest, "raw event logs -> validated, labelled, split journeys")
    ingest.add_argument(
        "--full",
        action="store_true",
        help="rebuild from every raw file (default: read only the files not ingested yet)",
    )

    train = command("train", cmd_train, "train the transformer and baselines, log to MLflow")
    train.add_argument("--resume", action="store_true", help="continue the last interrupted run")

    score = command("score", cmd_score, "batch-score journeys to Parquet with attention")
    score.add_argument("--model", default=None, help="MLflow model URI (default: champion)")
    score.add_argument("--input", default=None, help="raw log or journeys folder")
    score.add_argument("--out", default=None, help="scores folder (default paths.scores)")
    score.add_argument(
        "--as-of",
        default=None,
        help="score the journeys as they stood then: ISO 8601 (no zone: data.timezone) or "
        "now (default: the end of the data)",
    )
    score.add_argument(
        "--report",
        default=None,
        help="attribution report folder (default paths.reports, only when --out is not given)",
    )

    attr = command("attribute", cmd_attribute, "attribution report from scores")
    attr.add_argument("--scores", default=None, help="scores folder (default paths.scores)")
    attr.add_argument("--out", default=None, help="report folder (default paths.reports)")

    command("monitor", cmd_monitor, "tonight's drift, scores and arrived labels; exit 3 on alerts")
    command("pipeline", cmd_pipeline, "the end-to-end Prefect flow")
    command("serve", cmd_serve, "serve the scheduled Prefect deployments")
    ui = command("ui", cmd_ui, "open the MLflow UI on 127.0.0.1")
    ui.add_argument("--host", default="127.0.0.1")
    ui.add_argument("--port", type=int, default=5000)
    return parser


def _stop(signum: int, _frame: object) -> None:
    raise Interrupted(signum)


def main(argv: list[str] | None = None) -> int:
    """Run one command; exit 0, 2 (bad input or configuration, one line), or 128 + the
    signal that stopped it (143 for SIGTERM, 130 for Ctrl+C)."""
    args = build_parser().parse_args(argv)
    # SIGTERM (a scheduler, `kill`) and Ctrl+C stop a command the same way: an exception
    # that unwinds it (outputs are atomic, MLflow runs end KILLED) and a non-zero exit.
    # Lightning's own SIGTERM handling would end a fit with exit status 0.
    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {signum: signal.signal(signum, _stop) for signum in STOP_SIGNALS}
    try:
        code = args.handler(args)
    except JourneysError as err:
        print(f"journeys {args.command}: error: {redact_uri(str(err))}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except (Interrupted, KeyboardInterrupt) as stop:
        code = stop.exit_code if isinstance(stop, Interrupted) else 128 + signal.SIGINT
        print(
            f"journeys {args.command}: stopped ({signal.Signals(code - 128).name})", file=sys.stderr
        )
        return code
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return code or 0


def run() -> None:
    """The `journeys` console script: `main` in a process of its own, with the collector
    set for a short-lived process (`GC_YOUNG_THRESHOLD`) and no collection at exit."""
    gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])
    code = main()
    gc.freeze()  # every object lives until the process ends: the exit has nothing to find
    sys.exit(code)


if __name__ == "__main__":  # `python -m journeys.cli` (the pipeline's training child): defaults
    sys.exit(main())
