"""The harness's commands, mounted on the ``streams`` command line through the ``streams.commands``
entry-point group (``pyproject.toml``; ``streams simulator`` is :data:`streams_harness.simulator.cli.command`)::

    streams replay [--trace conv]    publish trace rows as submissions, time-compressed
    streams run [...]                the main job: simulator, workers, trace replay, report
    streams soak [...]               random faults under load, then an audit
    streams bench [...]              the pipeline against the floor and two peers, with profiles
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import click

from streams.cli import CommandExit, command_failed, service_exit
from streams.config import Settings
from streams.errors import EXIT_CONFIG, ConfigError, StreamsError

T = TypeVar("T")


#: Help of every ``--trace`` option.
TRACE_HELP = "conv, code, or a CSV path with the same columns."


@click.command("replay")
@click.option("--trace", default="conv", show_default=True, help=TRACE_HELP)
@click.option("--start", default=0, show_default=True, help="First data row.")
@click.option("--rows", default=100, show_default=True, help="Number of rows.")
@click.option("--compression", default=60.0, show_default=True, help="Replay speed-up of the arrival times.")
@click.option("--run-id", default=None, help="Operation id prefix (default: r<unix time>).")
def replay(trace: str, start: int, rows: int, compression: float, run_id: str | None) -> None:
    """Publish trace rows as submissions at their (compressed) arrival times."""
    from streams.clients.submit import SubmissionProducer
    from streams_harness.replay import replay_trace
    from streams_harness.trace import read_trace

    settings = Settings.from_env()
    try:
        selected = read_trace(trace, start=start, rows=rows)
    except (FileNotFoundError, StreamsError) as exc:
        raise click.ClickException(str(exc)) from exc
    rid = run_id or f"r{int(time.time())}"

    async def run() -> list[str]:
        async with SubmissionProducer(settings) as producer:
            return await replay_trace(
                producer,
                selected,
                trace=Path(trace).stem,
                run_id=rid,
                compression=compression,
                model=settings.remote_model,
            )

    ids = asyncio.run(run())
    click.echo(f"published {len(ids)} submissions, run id {rid}")


def _check_trace(ctx: click.Context, param: click.Parameter, value: str) -> str:
    from streams_harness.trace import trace_path

    try:
        trace_path(value)
    except FileNotFoundError as exc:
        raise click.BadParameter(str(exc)) from None
    return value


async def _until_sigterm(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro``, cancelling it on SIGTERM so its clean-up (stopping child processes) runs."""
    task = asyncio.ensure_future(coro)
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
    return await task


def _run_job(coro: Coroutine[Any, Any, T], command: str) -> T:
    """Run a harness job (``command``: main job, soak, bench) to completion; SIGTERM and project errors become
    clean exits with one message naming the step the run was in (:class:`streams_harness.run.RunStoppedError`):
    a service that did not answer exits 5 (EXIT_UNAVAILABLE, what failed and what to do), a wrong setting 6, any
    other project error 1. Anything else is a bug and keeps its traceback."""
    from streams_harness.run import RunStoppedError

    try:
        return asyncio.run(_until_sigterm(coro))
    except asyncio.CancelledError:
        raise click.ClickException("terminated (SIGTERM); the simulator and workers were stopped") from None
    except RunStoppedError as exc:
        what = f"{command} in step {exc.step!r}"
        failed = service_exit(exc.cause, what)
        if failed is not None:
            raise failed from exc
        if isinstance(exc.cause, ConfigError):
            raise CommandExit(f"{what}: {exc.cause}", EXIT_CONFIG) from exc
        if isinstance(exc.cause, StreamsError):
            raise click.ClickException(f"{what}: {exc.cause}") from exc
        raise exc.cause from None  # a bug: its own traceback
    except ConfigError as exc:  # DatabaseConfigError: a refused login, no such database: as the product's commands
        raise CommandExit(str(exc), EXIT_CONFIG) from exc
    except StreamsError as exc:
        raise command_failed(exc, command) from exc


def _run_options(
    *,
    rows: int,
    workers: int,
    min_workers: int,
    seed: int,
    seed_help: str,
    timeout_s: float,
    lookup_help: str,
    cancel_fraction: float,
) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """The options of every harness run (:class:`streams_harness.run.RunOptions`'s fields), with the command's
    defaults; the main job and the soak add their own."""
    options = [
        click.option("--trace", default="conv", show_default=True, callback=_check_trace, help=TRACE_HELP),
        click.option("--start", default=0, show_default=True, type=click.IntRange(min=0), help="First data row."),
        click.option("--rows", default=rows, show_default=True, type=click.IntRange(min=1), help="Rows to replay."),
        click.option(
            "--compression",
            default=15.0,
            show_default=True,
            type=click.FloatRange(min=0.001),
            help="Speed-up of arrivals and job durations.",
        ),
        click.option(
            "--workers",
            default=workers,
            show_default=True,
            type=click.IntRange(min_workers, 16),
            help="Worker processes.",
        ),
        click.option("--seed", default=seed, show_default=True, help=seed_help),
        click.option(
            "--keep",
            is_flag=True,
            help="Keep the run's database and topics (by default they are removed after the report).",
        ),
        click.option("--lookup/--no-lookup", default=False, show_default=True, help=lookup_help),
        click.option(
            "--dialect",
            default="seed-generations",
            show_default=True,
            type=click.Choice(["seed-generations", "replicate-predictions"]),
            help="Provider API shape the simulator serves and the workers speak (docs/provider-dialects.md).",
        ),
        click.option(
            "--report",
            "report_path",
            type=click.Path(dir_okay=False, path_type=Path),
            default=None,
            help="Write the JSON report here (default reports/<run id>/report.json).",
        ),
        click.option("--timeout-s", default=timeout_s, show_default=True, help="Give up waiting after this long."),
        click.option(
            "--cancel-fraction",
            default=cancel_fraction,
            show_default=True,
            type=click.FloatRange(0.0, 1.0),
            help="Share of the operations canceled during the run on its generation.cancellations topic, some "
            "before their POST, some while running (docs/cancellation.md); 0: none.",
        ),
        click.option(
            "--callbacks/--no-callbacks",
            default=True,
            show_default=True,
            help="Workers serve completion callbacks (a test secret) and the simulator sends them, with lost, "
            "duplicated, reordered and badly signed ones (docs/callbacks.md).",
        ),
    ]

    def decorate(command: Callable[..., None]) -> Callable[..., None]:
        for option in reversed(options):
            command = option(command)
        return command

    return decorate


@click.command("run")
@_run_options(
    rows=2000,
    workers=2,
    min_workers=1,
    seed=7,
    seed_help="Seed of the simulator's fault decisions.",
    timeout_s=900.0,
    lookup_help="Reconcile uncertain operations by lookup of the client reference (the simulator offers it).",
    cancel_fraction=0.05,
)
@click.option("--partitions", default=8, show_default=True, type=click.IntRange(1, 256), help="Partitions per topic.")
@click.option(
    "--faults/--no-faults",
    default=True,
    show_default=True,
    help="Inject the default fault rates (the callbacks' too, with --callbacks).",
)
@click.option(
    "--fault",
    "fault_overrides",
    multiple=True,
    metavar="NAME=RATE",
    help="Override one fault rate, e.g. --fault 429=0.05 (names: 429, 502_job_id, 5xx, drop_after_create, slow, "
    "job_failed, not_found, unknown_status, never_finishes, status_regression).",
)
def run_command(faults: bool, fault_overrides: tuple[str, ...], **options: Any) -> None:
    """The main job: simulator + workers, trace replay, progress, and the report (terminal and JSON)."""
    from streams_harness.mainjob import MainJobOptions, run_main_job
    from streams_harness.report import broken_promises
    from streams_harness.run import DEFAULT_CALLBACK_FAULTS, DEFAULT_FAULTS

    _check_lookup(options)

    rates = dict(DEFAULT_FAULTS) if faults else {}
    for item in fault_overrides:
        name, sep, value = item.partition("=")
        key = f"fault_{name.strip()}"
        if not sep or key not in DEFAULT_FAULTS:
            raise click.BadParameter(
                f"{item!r}: expected NAME=RATE with NAME in {[k.removeprefix('fault_') for k in DEFAULT_FAULTS]}",
                param_hint="--fault",
            )
        try:
            rate = float(value)
        except ValueError:
            rate = -1.0
        if not 0.0 <= rate <= 1.0:
            raise click.BadParameter(f"{item!r}: RATE must be a number from 0 to 1", param_hint="--fault")
        rates[key] = rate
    callback_faults = dict(DEFAULT_CALLBACK_FAULTS) if faults else {}
    report = _run_job(
        run_main_job(MainJobOptions(faults=rates, callback_faults=callback_faults, **options)), "streams run"
    )
    problems = broken_promises(report, repeats_allowed=False)
    if problems:
        raise click.ClickException("the run broke a promise: " + ", ".join(problems))


@click.command("soak")
@_run_options(
    rows=10_000,
    workers=3,
    min_workers=2,
    seed=1,
    seed_help="Seed of the fault plan and the simulator.",
    timeout_s=1800.0,
    lookup_help="Reconcile uncertain operations by lookup; the audit then requires none left whose job exists.",
    cancel_fraction=0.03,
)
@click.option("--faults", default=20, show_default=True, type=click.IntRange(min=0), help="Faults to inject.")
def soak_command(**options: Any) -> None:
    """Replay trace rows through several workers while injecting seeded random faults, then audit."""
    from streams_harness.report import broken_promises
    from streams_harness.soak import SoakOptions, run_soak

    _check_lookup(options)

    problems = broken_promises(_run_job(run_soak(SoakOptions(**options)), "streams soak"), repeats_allowed=True)
    if problems:
        raise click.ClickException("the soak broke a promise: " + ", ".join(problems))


def _check_lookup(options: dict[str, Any]) -> None:
    """Refuse ``--lookup`` with a dialect that declares no lookup by client reference (its workers would refuse
    to start: docs/provider-dialects.md)."""
    from streams.remote.dialect import DEFAULT_DIALECT, load_dialect

    dialect = options.get("dialect", DEFAULT_DIALECT)
    if options.get("lookup") and load_dialect(dialect).lookup is None:
        raise click.BadParameter(
            f"the provider dialect {dialect} declares no lookup by client reference; run without --lookup "
            "(its uncertain operations wait for an operator's decision)",
            param_hint="--lookup",
        )


def _int_list(ctx: click.Context, param: click.Parameter, value: str) -> tuple[int, ...]:
    try:
        items = tuple(int(v) for v in value.split(",") if v.strip())
    except ValueError:
        raise click.BadParameter(f"{value!r}: expected comma-separated integers, e.g. 1,2,4") from None
    if not items or min(items) < 1:
        raise click.BadParameter(f"{value!r}: expected at least one integer, each at least 1")
    return items


def _worker_counts(ctx: click.Context, param: click.Parameter, value: str) -> tuple[int, ...]:
    """``--workers``: comma-separated worker counts, or empty for no pipeline run (the other runs alone)."""
    return _int_list(ctx, param, value) if value.strip() else ()


def _transport_list(ctx: click.Context, param: click.Parameter, value: str) -> tuple[str, ...]:
    from streams.config import HTTP_TRANSPORTS

    items = tuple(v.strip() for v in value.split(",") if v.strip())
    if not items or any(v not in HTTP_TRANSPORTS for v in items):
        raise click.BadParameter(f"{value!r}: expected a comma-separated list of {', '.join(HTTP_TRANSPORTS)}")
    return items


@click.command("bench")
@click.option("--operations", default=3000, show_default=True, type=click.IntRange(min=10), help="Per run.")
@click.option(
    "--workers",
    default="1,2,4",
    show_default=True,
    callback=_worker_counts,
    help="Worker counts of the pipeline runs; '' for none (e.g. the callbacks comparison alone).",
)
@click.option("--partitions", default="4,16", show_default=True, callback=_int_list, help="Partition counts.")
@click.option(
    "--transports",
    default="aiohttp",
    show_default=True,
    callback=_transport_list,
    help="STREAMS_HTTP_TRANSPORT values to compare, e.g. aiohttp,httpx.",
)
@click.option("--repeats", default=1, show_default=True, type=click.IntRange(1, 20), help="Runs per configuration.")
@click.option(
    "--naive-processes",
    default=2,
    show_default=True,
    type=click.IntRange(1, 16),
    help="Processes of the naive peer and of the job-queue peer.",
)
@click.option("--floor/--no-floor", default=True, show_default=True, help="Run the floor.")
@click.option(
    "--floor-processes",
    default="1,2",
    show_default=True,
    callback=_int_list,
    help="Process counts of the floor (ratio_to_floor divides by the one-process floor).",
)
@click.option("--naive/--no-naive", default=True, show_default=True, help="Run the naive peer.")
@click.option(
    "--procrastinate/--no-procrastinate",
    default=True,
    show_default=True,
    help="Run the job-queue peer (procrastinate, --naive-processes processes).",
)
@click.option(
    "--sim-latency-ms",
    "sim_get_latency_ms",
    default=0.0,
    show_default=True,
    type=click.FloatRange(min=0),
    help="Per GET.",
)
@click.option(
    "--job-duration-ms", default=0.0, show_default=True, type=click.FloatRange(min=0), help="Creation to completion."
)
@click.option(
    "--profile/--no-profile",
    default=True,
    show_default=True,
    help="Run one worker and the floor once more under py-spy (left out of the figures).",
)
@click.option(
    "--report",
    "report_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Write the JSON report here (default: report.json in the run's directory, printed at the end).",
)
@click.option(
    "--chart",
    "chart_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Write the PNG chart here (default: beside the report).",
)
@click.option("--run-timeout-s", default=300.0, show_default=True, help="Give up on one run after this long.")
@click.option(
    "--keep", is_flag=True, help="Keep each run's database and topics (by default they are removed after each run)."
)
@click.option(
    "--paced-rate",
    "paced_rate_per_s",
    default=50.0,
    show_default=True,
    type=click.FloatRange(min=0),
    help="Also run 2 workers at this many submissions a second (open loop, delivery latency while not "
    "saturated); 0: no paced run.",
)
@click.option(
    "--paced-operations",
    default=1000,
    show_default=True,
    type=click.IntRange(min=10),
    help="Operations submitted in the paced run.",
)
@click.option(
    "--callbacks-comparison/--no-callbacks-comparison",
    default=False,
    show_default=True,
    help="Also run 1 worker on long jobs with completion callbacks off, then on: GETs per completed operation, "
    "delivery latency, callbacks sent, received and refused.",
)
@click.option(
    "--callbacks-operations",
    default=300,
    show_default=True,
    type=click.IntRange(min=10),
    help="Operations of each callbacks run.",
)
@click.option(
    "--callbacks-rate",
    "callbacks_rate_per_s",
    default=20.0,
    show_default=True,
    type=click.FloatRange(min=0, min_open=True),
    help="Submissions a second of the callbacks runs.",
)
@click.option(
    "--callbacks-job-duration-ms",
    default=1000.0,
    show_default=True,
    type=click.FloatRange(min=0),
    help="Creation to completion of each job in the callbacks runs.",
)
@click.option(
    "--callbacks-poll-interval-ms",
    default=200,
    show_default=True,
    type=click.IntRange(min=50),
    help="The simulator's longest poll hint in the callbacks runs.",
)
def bench_command(**options: Any) -> None:
    """The benchmark: the pipeline (1, 2, 4 workers; two partition counts) against the floor (the same calls,
    batched, no logic), a naive peer (several processes polling PostgreSQL, no lease) and a job-queue peer
    (procrastinate), N operations submitted at once per run; a JSON report, a PNG chart and profiles of one
    worker and of the floor (docs/benchmark.md)."""
    from streams_harness.bench import BenchOptions, run_bench

    opts = BenchOptions(**options)
    report = _run_job(run_bench(opts), "streams bench")
    broken = {
        label: s["broken_promises"]
        for label, s in report["summary"].items()
        if s["kind"] in ("pipeline", "paced", "callbacks")
    }
    broken = {label: problems for label, problems in broken.items() if problems}
    if broken:
        raise click.ClickException(f"the pipeline broke a promise: {broken}")
