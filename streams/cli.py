"""The ``streams`` command line.

::

    streams migrate                  apply migrations and create topics
    streams ready [--service NAME]   wait until PostgreSQL, Redis and Kafka answer real commands
    streams worker [--web-port N]    run one Faust worker process (dispatcher, observer, scheduler, relay)
    streams submit FILE.jsonl        publish submissions from JSONL (one {"operation_id", "request"} a line)
    streams follow                   print delivered outputs, each once
    streams teardown --run-id RUN    remove a run's (or a prefix's) database, topics and consumer groups
    streams operations list|show     operations by state and age; one operation in full (read-only)
    streams operations adopt|abandon|repoll|fail|cancel
                                     an operator's fenced decision on an uncertain or stalled operation

Logs: ``--log-format json|text`` (or ``STREAMS_LOG_FORMAT``); ``streams worker`` writes JSON lines to stdout by
default, the other commands readable lines to stderr (:mod:`streams.logs`).

Installed packages add commands through the ``streams.commands`` entry-point group, loaded only when one of
them is invoked (or listed by ``--help``): the harness (``generation-streams[harness]``) adds ``streams run``,
``streams soak``, ``streams simulator`` and ``streams replay``. The product's own commands import none of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import logging.config
import sys
from collections.abc import Awaitable, Callable
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click
from click.core import ParameterSource

from streams import logs
from streams.config import Settings
from streams.errors import (
    EXIT_CONFIG,
    EXIT_UNAVAILABLE,
    ConfigError,
    LedgerUnavailableError,
    StreamsError,
    error_summary,
)
from streams.model.states import OperationState
from streams.wire import exactjson

if TYPE_CHECKING:
    import asyncpg

    from streams.ledger.records import OperatorMove
    from streams.ledger.store import Ledger

T = TypeVar("T")

#: Entry-point group through which installed packages add commands to ``streams``.
COMMANDS_GROUP = "streams.commands"

#: Longest summary of a command in ``streams --help`` (its first sentence, cut with "..." past this).
SUMMARY_CHARS = 160

#: The installed distribution whose version ``streams --version`` prints (``pyproject.toml`` ``[project] name``).
DISTRIBUTION = "generation-streams"


class PluginGroup(click.Group):
    """A click group that also offers the commands of the ``streams.commands`` entry-point group, importing
    each only when it is asked for (click's lazy-loading pattern:
    https://click.palletsprojects.com/en/stable/complex/#lazily-loading-subcommands).

    A command whose module cannot be imported (its extra is not installed) is replaced by one that fails
    with what to install.
    """

    @staticmethod
    def plugin_entry_points() -> dict[str, EntryPoint]:
        """Name -> entry point of every command registered under :data:`COMMANDS_GROUP`."""
        return {ep.name: ep for ep in entry_points(group=COMMANDS_GROUP)}

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *self.plugin_entry_points()})

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """The Commands section: each command's first sentence up to :data:`SUMMARY_CHARS`, wrapped (click's own
        cuts it to what fits on one line of the terminal, most of them after a few words)."""
        rows = []
        for name in self.list_commands(ctx):
            command = self.get_command(ctx, name)
            if command is not None and not command.hidden:
                rows.append((name, command.get_short_help_str(limit=SUMMARY_CHARS)))
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)

    def invoke(self, ctx: click.Context) -> Any:
        """Run the command; a service that did not answer (:func:`service_exit`) ends it with one message and
        EXIT_UNAVAILABLE instead of a traceback. Any other error propagates as click handles it."""
        try:
            return super().invoke(ctx)
        except click.ClickException:
            raise
        except Exception as exc:
            failed = service_exit(exc, f"streams {ctx.invoked_subcommand or ctx.info_name}")
            if failed is None:
                raise
            raise failed from exc

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        command = super().get_command(ctx, cmd_name)
        if command is not None:
            return command
        entry_point = self.plugin_entry_points().get(cmd_name)
        if entry_point is None:
            return None
        try:
            loaded = entry_point.load()
        except ImportError as exc:
            return _unavailable(cmd_name, entry_point, exc)
        if not isinstance(loaded, click.Command):
            raise click.ClickException(f"entry point {entry_point.value!r} of {cmd_name!r} is not a click command")
        return loaded


def _unavailable(name: str, entry_point: EntryPoint, exc: ImportError) -> click.Command:
    """A stand-in for a plugin command whose imports fail: it exits non-zero saying what to install."""
    dist = entry_point.dist.name if entry_point.dist is not None else "generation-streams"
    message = (
        f"'streams {name}' is not available: {exc}. It belongs to the harness; install it with "
        f"pip install '{dist}[harness]'"
    )

    def fail(args: tuple[str, ...]) -> None:
        raise click.ClickException(message)

    return click.Command(
        name,
        callback=fail,
        params=[click.Argument(["args"], nargs=-1, type=click.UNPROCESSED)],
        help=f"(not available: {exc}; needs the harness extra)",
        context_settings={"ignore_unknown_options": True, "allow_extra_args": True, "help_option_names": []},
        add_help_option=False,
    )


#: Exit statuses (1 is click's for other errors, 2 for bad usage); docs/operations.md.
EXIT_REFUSED = 3  # the decision does not apply to the operation in its current state; nothing written
EXIT_UNKNOWN_OPERATION = 4  # the ledger does not hold the operation
# EXIT_UNAVAILABLE (5, streams.errors): a service (PostgreSQL, Redis, Kafka) did not answer or broke the connection;
# the worker exits with it too
# EXIT_CONFIG (6, streams.errors): a setting is wrong: malformed, or PostgreSQL refused the login or has no such
# database; the worker exits with it too


class CommandExit(click.ClickException):
    """A command's failure with its own exit status (message on stderr, as click prints it)."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


#: What to do when a service did not answer, by :class:`streams.outages.Failure` service name.
_WHAT_TO_DO = {
    "Kafka": "check that the brokers of STREAMS_KAFKA_BOOTSTRAP are up (`streams ready --service kafka`)",
    "PostgreSQL": "check that the server of STREAMS_DATABASE_URL is up (`streams ready --service postgres`)",
    "Redis": "check that the server of STREAMS_REDIS_URL is up (`streams ready --service redis`)",
    "network": "check the network and the addresses of the STREAMS_* settings (`streams ready`)",
}

#: Links of an exception's chain (``__cause__``, or a ``cause`` attribute) :func:`service_exit` follows.
_CHAIN_DEPTH = 6


def unanswered_service(exc: BaseException) -> tuple[str, BaseException] | None:
    """``(service, link)`` when ``exc`` or an exception it chains (``__cause__``, or the ``cause`` attribute of
    :class:`~streams.errors.KafkaAdminError`) is an outage by :func:`streams.outages.classify`: the service
    (``Kafka``, ``PostgreSQL``, ``Redis``, ``network``) and the link so classified; None otherwise (a refusal, a
    bug). A :class:`~streams.errors.ServiceNotReadyError` names its service itself."""
    from streams.errors import ServiceNotReadyError
    from streams.outages import FailureKind, classify

    link: BaseException | None = exc
    for _ in range(_CHAIN_DEPTH):
        if link is None:
            return None
        if isinstance(link, ServiceNotReadyError):
            return {"kafka": "Kafka", "postgres": "PostgreSQL", "redis": "Redis"}.get(link.service, "network"), link
        failure = classify(link)
        if failure.kind is FailureKind.OUTAGE:
            return failure.service, link
        cause = getattr(link, "cause", None)
        link = cause if isinstance(cause, BaseException) else link.__cause__
    return None


def service_exit(exc: BaseException, what: str) -> CommandExit | None:
    """The exit of ``what`` (a command, ``streams run`` in its phase) stopped by ``exc`` when a service did not
    answer (:func:`unanswered_service`): one paragraph, what failed, the service, what to do, with
    EXIT_UNAVAILABLE; None when ``exc`` is not an outage. The message carries the exceptions' own text (addresses,
    error codes; never a payload nor a password)."""
    found = unanswered_service(exc)
    if found is None:
        return None
    service, link = found
    from streams.errors import KafkaAdminError

    if isinstance(exc, KafkaAdminError):
        detail = exc.failure  # its own advice is the one below
    else:
        detail = str(exc) if isinstance(exc, StreamsError) else error_summary(exc)
    if link is not exc and not isinstance(exc, StreamsError):
        detail += f" (from {error_summary(link)})"
    message = (
        f"{what} stopped: {service} did not answer: {detail.rstrip('. ')}. What to do: {_WHAT_TO_DO[service]}, "
        "then run it again"
    )
    return CommandExit(" ".join(message.split()), EXIT_UNAVAILABLE)


def ledger_unavailable(exc: StreamsError) -> CommandExit:
    """The exit of the running command when PostgreSQL did not answer: :func:`service_exit`'s message, naming the
    command (its click path), the service and what to do."""
    ctx = click.get_current_context(silent=True)
    what = ctx.command_path if ctx is not None else "streams"
    return service_exit(exc, what) or CommandExit(str(exc), EXIT_UNAVAILABLE)


def command_failed(exc: StreamsError, what: str) -> click.ClickException:
    """The exit of ``what`` stopped by ``exc``: :func:`service_exit`'s when a service did not answer, else exit 1
    with the error's message."""
    return service_exit(exc, what) or click.ClickException(str(exc))


def _settings() -> Settings:
    """Settings from the environment; a bad value ends the command with the message (exit EXIT_CONFIG), not a
    traceback."""
    try:
        return Settings.from_env()
    except ConfigError as exc:
        raise CommandExit(str(exc), EXIT_CONFIG) from exc


@click.group(cls=PluginGroup)
@click.version_option(package_name=DISTRIBUTION, message="%(prog)s (%(package)s) %(version)s")
@click.option("--log-level", default="INFO", show_default=True, help="Python logging level.")
@click.option(
    "--log-format",
    type=click.Choice(logs.FORMATS),
    envvar=logs.FORMAT_ENV,
    default=None,
    help="json (one object a line, with operation id, job id and fencing value) or text; "
    f"default json for 'worker', text otherwise [env {logs.FORMAT_ENV}].",
)
@click.pass_context
def main(ctx: click.Context, log_level: str, log_format: str | None) -> None:
    """Generation operations through Kafka, Redis and PostgreSQL."""
    worker_process = ctx.invoked_subcommand == "worker"
    fmt = log_format or ("json" if worker_process else "text")
    try:
        config = logs.dict_config(fmt, log_level, "ext://sys.stdout" if worker_process else "ext://sys.stderr")
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--log-level") from exc
    logging.config.dictConfig(config)
    ctx.obj = {"log_format": fmt, "log_level": log_level}


@main.command()
@click.option(
    "--strict-topics",
    is_flag=True,
    help="Refuse (exit 6) when an existing topic's partitions, replication factor or min.insync.replicas differ "
    "from the settings; without it, each difference is a warning.",
)
def migrate(strict_topics: bool) -> None:
    """Apply pending SQL migrations (yoyo) and create the Kafka topics."""
    from streams.setup.admin import RETENTION_MS, create_topics, migrations_line, set_dead_letter_retention
    from streams.setup.admin import migrate as apply

    settings = _settings()
    try:
        applied = apply(settings.database_url.get_secret_value())
    except ConfigError as exc:  # DatabaseConfigError: a refused login, no such database, a URL that does not parse
        raise CommandExit(str(exc), EXIT_CONFIG) from exc
    except LedgerUnavailableError as exc:
        raise CommandExit(str(exc), EXIT_UNAVAILABLE) from exc
    except StreamsError as exc:
        raise command_failed(exc, "streams migrate") from exc
    click.echo(migrations_line(applied))
    try:
        created = asyncio.run(create_topics(settings, strict=strict_topics))
    except ConfigError as exc:  # TopicLayoutError, KafkaSecurityError
        raise CommandExit(str(exc), EXIT_CONFIG) from exc
    click.echo(f"topics created: {', '.join(created) or 'none (all exist)'} ({settings.partitions} partitions)")
    retention_ms = asyncio.run(set_dead_letter_retention(settings))
    click.echo(f"dead-letter retention: {RETENTION_MS}={retention_ms} on {settings.topic('dead_letter')}")


@main.command()
@click.option(
    "--service",
    "services",
    multiple=True,
    type=click.Choice(["postgres", "redis", "kafka"]),
    help="Check only this service (repeatable; default: all three).",
)
@click.option("--timeout-s", default=120.0, show_default=True, help="Give up on a service after this long.")
@click.option(
    "--pid",
    "pids",
    multiple=True,
    metavar="SERVICE=PID",
    help="The service's server process: fail at once if it exits while waiting (repeatable).",
)
def ready(services: tuple[str, ...], timeout_s: float, pids: tuple[str, ...]) -> None:
    """Wait until the services answer real commands: PostgreSQL a query (STREAMS_DATABASE_URL), Redis SET/GET
    (STREAMS_REDIS_URL), Kafka a group coordinator look-up and describe of a throwaway consumer group
    (STREAMS_KAFKA_BOOTSTRAP). Exits 1 with the reason when one does not within --timeout-s, 6 when PostgreSQL's
    settings are wrong."""
    from streams.setup.readiness import SERVICES, wait_ready

    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)  # refused connections while waiting are expected
    watched: dict[str, int] = {}
    for item in pids:
        name, sep, value = item.partition("=")
        if not sep or name not in SERVICES or not value.isdigit():
            raise click.BadParameter(f"{item!r}: expected SERVICE=PID with SERVICE in {SERVICES}", param_hint="--pid")
        watched[name] = int(value)
    try:
        answers = asyncio.run(wait_ready(_settings(), list(services or SERVICES), timeout_s, watched))
    except ConfigError as exc:  # DatabaseConfigError: a refused login, no such database, a URL that does not parse
        raise CommandExit(str(exc), EXIT_CONFIG) from exc
    except StreamsError as exc:
        raise click.ClickException(str(exc)) from exc
    for name, (answer, elapsed_s) in answers.items():
        click.echo(f"{name:<9} ready    {answer} ({elapsed_s:.1f}s)")


@main.command()
@click.option(
    "--web-port",
    type=click.IntRange(1, 65535),
    default=None,
    help="Port of the live view, /metrics and the probes /livez and /readyz (default STREAMS_WEB_PORT).",
)
@click.pass_obj
def worker(obj: dict[str, str], web_port: int | None) -> None:
    """Run one worker process (Faust): dispatcher and observer agents, poll scheduler and outbox relay timers,
    and a web server with the live view (/), one operation (/operations/OP), /metrics, /livez and /readyz.

    Waits first for PostgreSQL, Redis and Kafka (up to STREAMS_STARTUP_TIMEOUT_S). Logs are JSON lines on stdout
    unless --log-format text."""
    import mode.loop

    from streams.worker.app import create_app
    from streams.worker.process import run_worker

    settings = _settings()
    if settings.event_loop == "uvloop":
        mode.loop.use("uvloop")  # sets asyncio's loop policy; before anything creates a loop
    if web_port is not None:
        settings = settings.replace(web_port=web_port)
    app = create_app(settings)
    run_worker(
        app,
        settings,
        loglevel=logging.getLevelName(logging.getLogger().level),
        # mode's Worker replaces the logging set-up; give it ours (a fresh dict: dictConfig consumes it)
        logging_config=logs.dict_config(obj["log_format"], obj["log_level"], "ext://sys.stdout"),
    )


@main.command()
@click.argument("path", type=click.Path(exists=True, dir_okay=False, path_type=Path))
def submit(path: Path) -> None:
    """Publish submissions from a JSONL file: one {"operation_id", "request", "source"?, "submitted_at_ms"?}
    object per line.

    "request" is the provider's request body, e.g. {"model": "genace-1", "input": {"prompt": "...", "max_tokens":
    32}}; it is sent as written. "submitted_at_ms" (the application's epoch ms) is kept as given, else stamped with
    the current time. Every line is checked before any is published: a bad line publishes nothing (exit 1).
    """
    from streams.clients.submit import SubmissionProducer, submissions_from_jsonl
    from streams.errors import InvalidEventError

    settings = _settings()
    try:
        values = submissions_from_jsonl(path.read_text(encoding="utf-8"), settings.max_value_bytes)
    except InvalidEventError as exc:
        raise click.ClickException(f"{path}: {exc}; nothing was published") from exc

    async def run() -> int:
        async with SubmissionProducer(settings) as producer:
            await asyncio.gather(*[await producer.publish(operation_id, value) for operation_id, value in values])
        return len(values)

    try:
        published = asyncio.run(run())
    except ConfigError as exc:  # KafkaSecurityError: a wrong security setting
        raise CommandExit(str(exc), EXIT_CONFIG) from exc
    click.echo(f"published {published} submissions")


@main.command()
@click.option(
    "--group-id",
    default=None,
    help="Consumer group: commits the offsets of what was printed, so a restart resumes after it (and knows the event "
    "ids of the 10,000 records before, so a repeat among them is not printed again).",
)
@click.option(
    "--from-beginning/--from-now",
    default=True,
    show_default=True,
    help="Where to start without committed offsets: the topic's first output or the next one (a --group-id with "
    "committed offsets resumes there either way).",
)
@click.option("--count", type=click.IntRange(min=1), default=None, help="Stop after this many outputs.")
@click.option("--operation-prefix", default="", help="Only outputs of operations whose id starts with this.")
def follow(group_id: str | None, from_beginning: bool, count: int | None, operation_prefix: str) -> None:
    """Print each delivered output once, as JSON lines."""
    from streams.clients.follow import follow_outputs

    async def run() -> None:
        seen = 0
        # closed here, not at the loop's shutdown: its last commit (with a group) is of what was printed
        async with contextlib.aclosing(
            follow_outputs(_settings(), group_id=group_id, from_beginning=from_beginning)
        ) as outputs:
            async for value in outputs:
                if not value["operation_id"].startswith(operation_prefix):
                    continue
                sys.stdout.write(exactjson.dumps(value).decode() + "\n")
                sys.stdout.flush()
                seen += 1
                if count is not None and seen >= count:
                    return

    try:
        asyncio.run(run())
    except KeyboardInterrupt:
        pass
    except ConfigError as exc:  # KafkaSecurityError: a wrong security setting
        raise CommandExit(str(exc), EXIT_CONFIG) from exc


# --- operators' commands -----------------------------------------------------------------------------------------


#: The most rows a listing command prints (``--limit``): a bigger number is refused as a usage error, not sent to
#: PostgreSQL (whose bigint it may not fit).
MAX_LIST_ROWS = 1_000_000


class Duration(click.ParamType):
    """A duration such as ``30s``, ``5m``, ``2h``, ``1d`` or ``1h30m``
    (:func:`streams.oncall.operations.parse_duration`),
    converted to seconds."""

    name = "duration"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        if isinstance(value, float):
            return value
        from streams.oncall.operations import parse_duration

        try:
            return parse_duration(str(value))
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


async def _with_pool(settings: Settings, work: Callable[[asyncpg.Pool], Awaitable[T]]) -> T:
    """Run ``work(pool)`` on a small pool of the ledger; PostgreSQL not answering exits with EXIT_UNAVAILABLE,
    a refused login, a missing database or a URL that does not parse with EXIT_CONFIG."""
    from asyncpg import exceptions as asyncpg_errors

    from streams.errors import DatabaseConfigError, LedgerUnavailableError
    from streams.ledger.pool import create_pool

    try:
        pool = await create_pool(
            settings.database_url.get_secret_value(),
            min_size=1,
            max_size=2,
            statement_cache_size=settings.database_statement_cache_size,
        )
        try:
            return await work(pool)
        finally:
            await pool.close()
    except LedgerUnavailableError as exc:
        raise ledger_unavailable(exc) from exc
    except DatabaseConfigError as exc:
        raise CommandExit(str(exc), EXIT_CONFIG) from exc
    except (asyncpg_errors.UndefinedTableError, asyncpg_errors.UndefinedColumnError) as exc:
        raise click.ClickException(
            f"the ledger's schema does not match this version ({exc}); apply the migrations: streams migrate"
        ) from exc


def _echo_json(value: Any) -> None:
    from streams.oncall.operations import to_json

    click.echo(to_json(value))


_JSON_OPTION = click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")


@main.group()
def operations() -> None:
    """Read the ledger's operations and take an operator's decision on one.

    \b
    Exit statuses: 0 done; 2 bad usage; 3 the decision does not apply to the operation's state (nothing
    written); 4 no such operation; 5 PostgreSQL (or another service) did not answer; 6 a wrong setting
    (PostgreSQL refused the user or password, no such database, a URL that does not parse); 1 any other error.
    """


@operations.command("list", short_help="Operations by state and age, oldest first.")
@click.option(
    "--state",
    "states",
    multiple=True,
    type=click.Choice([s.value for s in OperationState]),
    help="Only operations in this state (repeatable).",
)
@click.option(
    "--older-than",
    type=Duration(),
    default=None,
    help="Only operations in their state longer than this (30s, 5m, 2h, 1d, 1h30m).",
)
@click.option(
    "--limit", type=click.IntRange(1, MAX_LIST_ROWS), default=100, show_default=True, help="At most this many rows."
)
@_JSON_OPTION
def list_operations(states: tuple[str, ...], older_than: float | None, limit: int, as_json: bool) -> None:
    """Operations, oldest in their state first: id, state, age in that state, job id, fencing value, reason.

    \b
    streams operations list --state uncertain --older-than 10m
    """
    from streams.oncall import operations as operators

    result = asyncio.run(
        _with_pool(
            _settings(),
            lambda pool: operators.list_operations(pool, states=states, older_than_s=older_than, limit=limit),
        )
    )
    if as_json:
        _echo_json({"matched": result.matched, "operations": result.rows})
    else:
        click.echo(operators.format_list(result))


@operations.command("show", short_help="One operation in full, with its leases.")
@click.argument("operation_id")
@_JSON_OPTION
def show_operation(operation_id: str, as_json: bool) -> None:
    """One operation in full: state, job id, fencing value, transition history, outputs with their outbox rows,
    remote calls, and the Redis leases held on it now (owner token, TTL left)."""
    from streams.coordination.lease import redis_for
    from streams.oncall import operations as operators

    settings = _settings()

    async def read(pool: asyncpg.Pool) -> dict[str, Any] | None:
        redis = redis_for(settings, settings.redis_socket_timeout_s, connect_timeout_s=settings.redis_connect_timeout_s)
        try:
            return await operators.operation_detail(pool, redis, settings, operation_id)
        finally:
            await redis.aclose()

    detail = asyncio.run(_with_pool(settings, read))
    if detail is None:
        raise CommandExit(f"operation {operation_id!r} is not in the ledger", EXIT_UNKNOWN_OPERATION)
    if as_json:
        _echo_json(detail)
    else:
        click.echo(operators.format_detail(detail))


_ACTOR_OPTION = click.option(
    "--actor",
    default=None,
    help="Who you are, recorded beside the database role and the OS user, never instead of them (default: "
    "STREAMS_ACTOR, else only the role and the user: e.g. streams@postgres-role/alice@os).",
)


async def _actor(pool: asyncpg.Pool, given: str | None) -> str:
    """The actor of an operator's command: the pool's login role and the OS user, with ``given`` (``--actor``,
    else ``STREAMS_ACTOR``) beside them (:func:`streams.oncall.operations.actor`)."""
    from streams.ledger.retention import database_role
    from streams.oncall import operations as operators

    return operators.actor(await database_role(pool), operators.os_user(), operators.given_actor(given))


def _as_operator(actor: str | None, act: Callable[[asyncpg.Pool, str], Awaitable[T]]) -> tuple[T, str]:
    """``act(pool, who)`` on a pool of the ledger, ``who`` the operator's actor (:func:`_actor`), and ``who``; an
    unknown operation exits with EXIT_UNKNOWN_OPERATION, a refused action with EXIT_REFUSED ("nothing was
    written")."""
    from streams.errors import OperatorActionRefusedError, UnknownOperationError

    async def run(pool: asyncpg.Pool) -> tuple[T, str]:
        who = await _actor(pool, actor)
        return await act(pool, who), who

    try:
        return asyncio.run(_with_pool(_settings(), run))
    except UnknownOperationError as exc:
        raise CommandExit(str(exc), EXIT_UNKNOWN_OPERATION) from exc
    except OperatorActionRefusedError as exc:
        raise CommandExit(f"{exc}; nothing was written", EXIT_REFUSED) from exc


def _decide(decide: Callable[[Ledger, str], Awaitable[OperatorMove]], actor: str | None, as_json: bool) -> None:
    """Run one operator's decision (a fenced ledger statement) and print what was written; a refusal exits with
    EXIT_REFUSED, an unknown operation with EXIT_UNKNOWN_OPERATION. Only ``adopt`` calls the remote API (one GET
    of the job, its provider check)."""
    from streams.ledger.store import Ledger
    from streams.oncall import operations as operators

    move, who = _as_operator(actor, lambda pool, who: decide(Ledger(pool, who), who))
    if as_json:
        _echo_json({**dataclasses.asdict(move), "actor": who})
    else:
        click.echo(f"{operators.format_move(move)}, by {who}")


@operations.command("adopt", short_help="uncertain -> submitted with the job found.")
@click.argument("operation_id")
@click.argument("job_id")
@click.option("--reason", required=True, help="Why, e.g. where the job was found (recorded).")
@click.option(
    "--without-provider-check",
    is_flag=True,
    help="Adopt without asking the provider for JOB_ID first (recorded in the reason).",
)
@_ACTOR_OPTION
@_JSON_OPTION
def adopt(
    operation_id: str, job_id: str, reason: str, without_provider_check: bool, actor: str | None, as_json: bool
) -> None:
    """An uncertain operation's job was found at the provider: uncertain -> submitted with JOB_ID, observed from
    now on. A rejected operation whose POST answer arrived after the decision: rejected -> submitted with that
    job only (streams accounting report lists them). JOB_ID is first asked for at the provider (one GET):
    refused (exit 3) when the provider answers 404 or cannot be asked, unless --without-provider-check.
    Refused (exit 3) in any other state, or when JOB_ID belongs to another operation. Corrections:
    docs/decisions.md."""
    settings = _settings()

    async def checked() -> str:  # imports the HTTP stack only once the ledger found the operation adoptable
        from streams.oncall.provider_check import SKIPPED, check_job_at_provider

        return SKIPPED if without_provider_check else await check_job_at_provider(settings, operation_id, job_id)

    _decide(lambda ledger, who: ledger.adopt(operation_id, job_id, reason, who, checked), actor, as_json)


@operations.command("abandon", short_help="uncertain -> rejected: checked, no job.")
@click.argument("operation_id")
@click.option("--reason", required=True, help="How it was checked that no job exists (recorded).")
@_ACTOR_OPTION
@_JSON_OPTION
def abandon(operation_id: str, reason: str, actor: str | None, as_json: bool) -> None:
    """The provider created no job for an uncertain operation (checked by a person): uncertain -> rejected.
    Refused (exit 3) in any other state. Nothing is resubmitted."""
    _decide(lambda ledger, who: ledger.abandon(operation_id, reason, who), actor, as_json)


@operations.command("repoll", short_help="stalled -> submitted: observe it again.")
@click.argument("operation_id")
@click.option("--reason", default="observe again", show_default=True, help="Why (recorded).")
@_ACTOR_OPTION
@_JSON_OPTION
def repoll(operation_id: str, reason: str, actor: str | None, as_json: bool) -> None:
    """Observe a stalled operation's job again: stalled -> submitted, polled from now on with a fresh observation
    window. Refused (exit 3) in any other state."""
    _decide(lambda ledger, who: ledger.repoll(operation_id, who, reason), actor, as_json)


@operations.command("fail", short_help="stalled -> failed: give it up.")
@click.argument("operation_id")
@click.option("--reason", required=True, help="Why it is given up (recorded).")
@_ACTOR_OPTION
@_JSON_OPTION
def fail(operation_id: str, reason: str, actor: str | None, as_json: bool) -> None:
    """Give up a stalled operation: stalled -> failed with the reason. Refused (exit 3) in any other state."""
    _decide(lambda ledger, who: ledger.fail(operation_id, reason, who), actor, as_json)


@operations.command("cancel", short_help="Cancel an operation (recorded; the provider's cancel route for a job).")
@click.argument("operation_id")
@click.option("--reason", required=True, help="Why it is canceled (recorded).")
@_ACTOR_OPTION
@_JSON_OPTION
def cancel(operation_id: str, reason: str, actor: str | None, as_json: bool) -> None:
    """Cancel an operation, as an application does on generation.cancellations (docs/cancellation.md): the
    cancellation is recorded (who, when, why; the first one per operation). Still accepted: it ends canceled and
    no POST is sent. With a job: the workers call the provider's cancel route and observe the job until the
    provider reports its end (a job that succeeded first stays succeeded). Uncertain or stalled: applied once a job
    is observed again. Terminal: nothing changes. Unknown operations are recorded too (the claim cancels them)."""
    from streams.ledger.records import CancelPath
    from streams.ledger.store import Ledger
    from streams.worker.stages.canceller import describe

    if not reason.strip():  # as the topic's schema and the ledger require (pattern \S, a CHECK)
        raise CommandExit(f"cancel operation {operation_id!r} refused: a reason is required", EXIT_REFUSED)

    async def run(pool: asyncpg.Pool) -> tuple[Any, str]:
        who = await _actor(pool, actor)
        return await Ledger(pool, who).request_cancel(operation_id, CancelPath.OPERATOR, who, reason), who

    ask, who = asyncio.run(_with_pool(_settings(), run))
    if as_json:
        _echo_json({**dataclasses.asdict(ask), "actor": who})
    else:
        click.echo(f"cancel: operation {operation_id}: {describe(ask)}, by {who}")


@operations.command("forget", short_help="Erase an operation's request, source and outputs (recorded).")
@click.argument("operation_id")
@click.option("--reason", required=True, help="Why, e.g. the erasure request's reference (recorded).")
@_ACTOR_OPTION
@_JSON_OPTION
def forget(operation_id: str, reason: str, actor: str | None, as_json: bool) -> None:
    """Erase a terminal operation's request body, source, last observation and outputs (in the ledger and its
    published outbox rows), recording who, when and why in the ledger's erasures. Its state, transition log and
    accounting stay. Refused (exit 3) while it is not terminal or an outbox row of it is unpublished. Copies
    already on Kafka topics (submissions, outputs, dead letters) go with the topics' retention."""
    from streams.ledger.retention import forget as erase

    erasure, who = _as_operator(actor, lambda pool, who: erase(pool, operation_id, reason, who))
    if as_json:
        _echo_json({**dataclasses.asdict(erasure), "actor": who})
    else:
        click.echo(
            f"forget: operation {operation_id}: request, source and {erasure.outputs_erased} outputs erased "
            f"(erasure {erasure.id}), by {who}"
        )


@main.command()
@click.option(
    "--older-than",
    type=Duration(),
    required=True,
    help="Purge operations terminal for longer than this (30s, 5m, 2h, 7d, 1h30m).",
)
@click.option(
    "--ids-older-than",
    type=Duration(),
    default=None,
    help="Then delete the kept row of each id purged (and last replayed) longer ago than this (at least 1d), freeing "
    "the id: a submission with it is then accepted as new. Refused (exit 3, after the purge; --dry-run too) unless "
    "the submissions, dead-letter and cancellations topics keep no record that long (retention.ms + segment.ms + 1 "
    "day) and the workers consumed what was written before (--catch-up-timeout-s).",
)
@click.option(
    "--skip-replay-check",
    is_flag=True,
    help="With --ids-older-than: do not read the topics' retention nor wait for the workers (you vouch that no record "
    "of those ids can come back, e.g. a topic bounded by retention.bytes).",
)
@click.option(
    "--catch-up-timeout-s",
    type=click.FloatRange(0, 3600),
    default=60.0,
    show_default=True,
    help="With --ids-older-than: how long to wait for the workers' consumer group to consume the submissions and "
    "cancels written before the command started (a replay among them must meet its id first); refused (exit 3) past "
    "it.",
)
@click.option(
    "--batch-size",
    type=click.IntRange(1, 10_000),
    default=500,
    show_default=True,
    help="Operations per transaction.",
)
@click.option("--dry-run", is_flag=True, help="Count what would be purged; change nothing.")
@_JSON_OPTION
def purge(
    older_than: float,
    ids_older_than: float | None,
    skip_replay_check: bool,
    catch_up_timeout_s: float,
    batch_size: int,
    dry_run: bool,
    as_json: bool,
) -> None:
    """Purge terminal operations (succeeded, failed, canceled, rejected) older than --older-than in their state, in
    batches of --batch-size, one transaction each: their transitions, outputs and outbox rows deleted, their request,
    source, last observation and reason text erased. Each operation's row of its id, state and times stays, so that a
    replay of its submission is refused, never POSTed again, until --ids-older-than deletes it (with its callback
    deliveries and cancellation), after the purge and only when no replay can come any more. The accounting
    (remote_calls, remote_jobs, refunds) and the records of erasures and re-drives are kept; an operation whose outbox
    row is not yet published is kept until the relay publishes it.

    \b
    streams purge --older-than 30d --dry-run
    streams purge --older-than 30d --ids-older-than 400d
    """
    from streams.ledger import retention
    from streams.ledger.records import FORMER_JOB_MARGIN_S

    given = click.get_current_context().get_parameter_source("catch_up_timeout_s") is not ParameterSource.DEFAULT
    if (skip_replay_check or given) and ids_older_than is None:
        raise click.UsageError("--skip-replay-check and --catch-up-timeout-s go with --ids-older-than")
    if ids_older_than is not None and ids_older_than < FORMER_JOB_MARGIN_S:
        raise click.BadParameter(
            f"at least {operators_age(FORMER_JOB_MARGIN_S)}: a freed id's former jobs are told from a new operation's "
            "by their creation times, a day apart at least (and no replay may come any more)",
            param_hint="--ids-older-than",
        )
    settings = _settings()

    async def run(pool: asyncpg.Pool) -> dict[str, Any]:
        if dry_run:
            return {"dry_run": True, **await retention.purge_preview(pool, older_than)}
        batches = _BatchLines(as_json, "operations purged")
        total = await retention.purge(pool, older_than, batch_size, on_batch=lambda c: batches.told(c.operations))
        return {"dry_run": False, "batches": batches.count, **dataclasses.asdict(total)}

    result = asyncio.run(_with_pool(settings, run))  # first, whatever the ids' check says: erasure never waits on it
    if not as_json:
        click.echo(_purge_line(result))
    if ids_older_than is None:
        if as_json:
            _echo_json(result)
        return

    async def run_ids(pool: asyncpg.Pool) -> dict[str, Any]:
        if dry_run:
            return await retention.forget_ids_preview(pool, ids_older_than)
        batches = _BatchLines(as_json, "purged ids deleted")
        ids = await retention.forget_ids(pool, ids_older_than, batch_size, on_batch=lambda c: batches.told(c.ids))
        return {"batches": batches.count, **dataclasses.asdict(ids)}

    try:
        refusal = None if skip_replay_check else _replayable_ids(settings, ids_older_than, catch_up_timeout_s)
        if refusal is not None:
            raise CommandExit(refusal, EXIT_REFUSED)
        ids = asyncio.run(_with_pool(settings, run_ids))
    except click.ClickException as exc:  # refused, or Kafka or PostgreSQL failed: the purge is done, say what it did
        if as_json:  # (the id batches committed before a failure stay deleted)
            outcome = "refused" if exc.exit_code == EXIT_REFUSED else "failed"
            _echo_json({**result, "ids": {outcome: exc.format_message()}})
        raise
    if as_json:
        _echo_json({**result, "ids": ids})
        return
    deleted = (
        f"{ids['ids']} purged ids with {ids['callback_deliveries']} callback deliveries and {ids['cancellations']}"
    )
    if dry_run:
        oldest = ids["oldest_age_s"]
        since = f" (the oldest purged or replayed {operators_age(oldest)} ago)" if oldest is not None else ""
        click.echo(f"would delete {deleted} cancellations{since}")
    else:
        click.echo(f"deleted {deleted} cancellations in {ids['batches']} batches")


def _purge_line(result: dict[str, Any]) -> str:
    """The summary line of ``streams purge`` (a dry run's or a purge's)."""
    if result["dry_run"]:
        return (
            f"would purge {result['operations']} operations with {result['transitions']} transitions, "
            f"{result['outputs']} outputs and {result['outbox']} outbox rows (oldest terminal for "
            f"{operators_age(result['oldest_age_s'])}); {result['held_by_outbox']} kept for their unpublished "
            "outbox rows"
        )
    return (
        f"purged {result['operations']} operations (their ids kept) with {result['transitions']} transitions, "
        f"{result['outputs']} outputs and {result['outbox']} outbox rows in {result['batches']} batches"
    )


class _BatchLines:
    """Counts the batches of a batched command and prints ``batch N: <rows> <what>`` for each (not with --json)."""

    def __init__(self, as_json: bool, what: str) -> None:
        self.as_json, self.what, self.count = as_json, what, 0

    def told(self, rows: int) -> None:
        self.count += 1
        if not self.as_json:
            click.echo(f"batch {self.count}: {rows} {self.what}")


def _replayable_ids(settings: Settings, horizon_s: float, catch_up_timeout_s: float) -> str | None:
    """Why deleting the ids purged ``horizon_s`` seconds ago is refused: a topic that can replay a submission may
    still hold a record that old (:func:`streams.setup.admin.replay_refusals`), or the workers' consumer group has not
    consumed, within ``catch_up_timeout_s``, every submission written before now (a replay among them would meet a
    freed id: :func:`streams.setup.admin.submissions_behind`); None when neither. A security setting Kafka refuses
    ends the command with EXIT_CONFIG, Kafka not answering with EXIT_UNAVAILABLE, another error Kafka answers (an
    authorization refused) with exit 1 and its message."""
    from streams.setup.admin import replay_refusals, replay_windows, submissions_behind

    what = "streams purge --ids-older-than (reading the topics' retention and the workers' offsets)"
    try:
        refusals = replay_refusals(asyncio.run(replay_windows(settings)), horizon_s, operators_age)
        if not refusals:
            behind = asyncio.run(submissions_behind(settings, catch_up_timeout_s))
            if behind:
                refusals = [
                    f"the workers' consumer group {settings.app_id} has not consumed, within "
                    f"{catch_up_timeout_s:g} s, every submission and cancel written before the check began ("
                    + ", ".join(behind[:8])
                    + (f", {len(behind) - 8} more" if len(behind) > 8 else "")
                    + "): a replay among them would meet a freed id"
                ]
    except ConfigError as exc:  # KafkaSecurityError: a wrong security setting
        raise CommandExit(str(exc), EXIT_CONFIG) from exc
    except StreamsError as exc:  # KafkaAdminError
        raise command_failed(exc, what) from exc
    if not refusals:
        return None
    return (
        f"purge --ids-older-than {operators_age(horizon_s)} refused, no id deleted: "
        + "; ".join(refusals)
        + ". A submission whose id is deleted is accepted as a new operation and POSTed again. Give a longer "
        "--ids-older-than, shorten the topics' retention.ms, run it when the workers have caught up, or pass "
        "--skip-replay-check if you know no record of those ids can come back"
    )


def operators_age(seconds: float | None) -> str:
    """An age as the operators' commands show it (:func:`streams.oncall.operations.format_age`)."""
    from streams.oncall.operations import format_age

    return format_age(seconds)


# --- dead letters --------------------------------------------------------------------------------------------------


@main.group("dead-letters")
def dead_letters() -> None:
    """The dead-letter topic's records: list them, show one decoded, re-drive them after a fix.

    \b
    A dead letter is named by its place in the dead-letter topic, PARTITION:OFFSET (as list prints it).
    Exit statuses: 0 done; 2 bad usage; 3 a re-drive refused (nothing published for it); 4 no such dead letter;
    5 Kafka or PostgreSQL did not answer; 6 a wrong setting; 1 any other error.
    """


def _record(ctx: click.Context, param: click.Parameter, values: tuple[str, ...]) -> frozenset[tuple[int, int]]:
    from streams.oncall.deadletters import parse_record

    try:
        return frozenset(parse_record(v) for v in values)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from exc


_DL_REASON = click.option("--reason", "reasons", multiple=True, help="Only dead letters with this reason (repeatable).")
_DL_OPERATION = click.option(
    "--operation-id", "operation_ids", multiple=True, help="Only dead letters of this operation (repeatable)."
)
_DL_LIMIT = click.option(
    "--limit",
    type=click.IntRange(1, MAX_LIST_ROWS),
    default=100,
    show_default=True,
    help="At most this many dead letters.",
)
_DL_TIMEOUT = click.option(
    "--timeout-s",
    type=click.FloatRange(0.1, 86400.0),
    default=30.0,
    show_default=True,
    help="Stop reading the topic after this long (what was read is shown, marked incomplete).",
)


def _scan(selection: Any, limit: int, timeout_s: float) -> Any:
    from streams.errors import DeadLetterReadError
    from streams.oncall.deadletters import scan

    try:
        return asyncio.run(scan(_settings(), selection, limit=limit, timeout_s=timeout_s))
    except DeadLetterReadError as exc:
        raise CommandExit(str(exc), EXIT_UNAVAILABLE) from exc


def _stopped_note(found: Any) -> str:
    if found.stopped == "limit":
        return "; stopped at --limit, more may follow"
    if found.stopped == "time budget":
        return "; stopped at --timeout-s before the end of the topic: INCOMPLETE"
    return ""


@dead_letters.command("list", short_help="Dead letters with reason and age, oldest first per partition.")
@_DL_REASON
@_DL_OPERATION
@_DL_LIMIT
@_DL_TIMEOUT
@_JSON_OPTION
def list_dead_letters(
    reasons: tuple[str, ...], operation_ids: tuple[str, ...], limit: int, timeout_s: float, as_json: bool
) -> None:
    """The dead letters the topic retains: PARTITION:OFFSET, reason, age, operation id, where the input came
    from, its size and the error (no payload). Reads at most --limit matching records within --timeout-s."""
    from streams.oncall import operations as operators
    from streams.oncall.deadletters import Filter, now_ms

    found = _scan(Filter(reasons=frozenset(reasons), operation_ids=frozenset(operation_ids)), limit, timeout_s)
    at_ms = now_ms()
    rows = [letter.summary(at_ms) for letter in found.letters]
    if as_json:
        _echo_json(
            {
                "topic": found.topic,
                "retained": found.retained,
                "read": found.read,
                "stopped": found.stopped,
                "dead_letters": rows,
            }
        )
        return
    if rows:
        click.echo(
            operators.table(
                ["RECORD", "REASON", "AGE", "OPERATION", "FROM", "BYTES", "ERROR"],
                (
                    [
                        r["record"],
                        r["reason"],
                        operators.format_age(r["age_s"]),
                        r["operation_id"],
                        r["source"],
                        r["original_size"],
                        operators.compact_json(r["error"])[:100],
                    ]
                    for r in rows
                ),
            )
        )
    click.echo(
        f"{len(rows)} dead letters shown of {found.read} read; {found.topic} retains {found.retained}"
        + _stopped_note(found)
    )


@dead_letters.command("show", short_help="One dead letter decoded.")
@click.argument("record", callback=lambda ctx, param, v: _record(ctx, param, (v,)))
@click.option("--show-payload", is_flag=True, help="Also print the original value (it holds the user's prompt).")
@_DL_TIMEOUT
@_JSON_OPTION
def show_dead_letter(record: frozenset[tuple[int, int]], show_payload: bool, timeout_s: float, as_json: bool) -> None:
    """One dead letter: its envelope decoded (reason, error, where it came from, key, size, SHA-256) and the
    re-drives recorded of it; the original value only with --show-payload."""
    from streams.ledger.redrives import redrives_of
    from streams.oncall import operations as operators
    from streams.oncall.deadletters import Filter, detail

    ((partition, offset),) = record
    found = _scan(Filter(records=record), 1, timeout_s)
    if not found.letters:
        raise CommandExit(
            f"no dead letter at {partition}:{offset} of {found.topic} (retention may have removed it)",
            EXIT_UNKNOWN_OPERATION,
        )
    letter = found.letters[0]
    settings = _settings()
    done = asyncio.run(_with_pool(settings, lambda pool: redrives_of(pool, found.topic, [(partition, offset)])))
    shown = detail(letter, show_payload=show_payload, redrives_done=done)
    if as_json:
        _echo_json(shown)
        return
    lines = [
        f"dead letter      {shown['record']} of {found.topic}",
        f"reason           {shown['reason']}",
        f"error            {shown['error']}",
        f"failed at        {operators.format_epoch_ms(shown['failed_at_ms'])} "
        f"(age {operators.format_age(shown['age_s'])}) by {shown['worker']}",
        f"from             {shown['source']}",
        f"key              {shown['key'] if shown['key'] is not None else '-'}",
        f"operation        {shown['operation_id'] or '-'}",
        f"original         {shown['original_size']} bytes, sha256 {shown['original_sha256']}"
        + (" (cut at 512 KiB)" if shown["original_truncated"] else ""),
    ]
    lines += [f"re-driven        {len(done)} times"]
    lines += [
        f"  {operators.format_time(r['at'])} to {r['target_topic']}[{r['target_partition']}]@{r['target_offset']} "
        f"({r['value_source']} value) by {r['actor']}: {r['why']}"
        for r in done
    ]
    lines.append("payload          " + (shown["payload"] if show_payload else "(hidden: --show-payload shows it)"))
    click.echo("\n".join(lines))


@dead_letters.command("redrive", short_help="Publish dead letters again after a fix (recorded).")
@click.argument("records", nargs=-1, callback=_record)
@_DL_REASON
@_DL_OPERATION
@click.option(
    "--value-file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="The fixed submission value (one JSON object) to publish instead of the original; one dead letter only.",
)
@click.option("--why", required=True, help="What was fixed, or why the original is good now (recorded).")
@_ACTOR_OPTION
@click.option("--dry-run", is_flag=True, help="Check each selected dead letter; publish nothing.")
@_DL_LIMIT
@_DL_TIMEOUT
@_JSON_OPTION
def redrive_dead_letters(
    records: frozenset[tuple[int, int]],
    reasons: tuple[str, ...],
    operation_ids: tuple[str, ...],
    value_file: Path | None,
    why: str,
    actor: str | None,
    dry_run: bool,
    limit: int,
    timeout_s: float,
    as_json: bool,
) -> None:
    """Publish the selected dead letters (RECORDS as PARTITION:OFFSET, and/or --reason, --operation-id: all must
    hold) to the submissions topic again, keyed by their operation id: the original value, or the fixed value of
    --value-file. Each is recorded in the ledger (dead_letter_redrives: the record, where it went, the value's
    SHA-256, --why, the actor).

    \b
    Refused (exit 3, nothing published for it): a value that is still invalid; an original cut at 512 KiB without
    --value-file; a dead letter that did not come from the submissions topic; an operation the ledger holds with
    another request (canonical comparison, as the dispatcher compares replays).
    \b
    streams dead-letters redrive 2:17 --value-file fixed.json --why "closed the prompt's JSON string"
    """
    from streams.errors import DeadLetterReadError, RedriveRefusedError
    from streams.oncall.deadletters import Filter, RedriveResult, redrive

    selection = Filter(records=records, reasons=frozenset(reasons), operation_ids=frozenset(operation_ids))
    if selection.empty:
        raise click.UsageError("select dead letters: give RECORDS, --reason or --operation-id")
    found = _scan(selection, limit, timeout_s)
    if found.stopped == "time budget":
        raise CommandExit(
            f"the dead-letter topic was not read to its end within --timeout-s {timeout_s}; nothing was "
            "published: raise --timeout-s or select fewer",
            EXIT_UNAVAILABLE,
        )
    if not found.letters:
        raise CommandExit(f"no dead letter of {found.topic} matches; nothing was published", EXIT_UNKNOWN_OPERATION)
    fixed = value_file.read_bytes() if value_file is not None else None
    settings = _settings()

    async def run(pool: asyncpg.Pool) -> tuple[list[RedriveResult], str]:
        who = await _actor(pool, actor)
        done = await redrive(
            settings, pool, found.letters, fixed_value=fixed, why=why, actor=who, dry_run=dry_run, timeout_s=timeout_s
        )
        return done, who

    try:
        results, who = asyncio.run(_with_pool(settings, run))
    except RedriveRefusedError as exc:
        raise CommandExit(str(exc), EXIT_REFUSED) from exc
    except DeadLetterReadError as exc:
        raise CommandExit(str(exc), EXIT_UNAVAILABLE) from exc
    rows: list[dict[str, Any]] = [
        {
            "record": r.letter.record,
            "reason": r.letter.reason,
            "operation_id": r.operation_id,
            "value_source": r.value_source,
            "refused": r.refused,
            "published": None
            if r.published is None
            else {"topic": r.published[0], "partition": r.published[1], "offset": r.published[2]},
            "redrive_id": r.redrive_id,
        }
        for r in results
    ]
    if as_json:
        _echo_json({"actor": who, "dry_run": dry_run, "stopped": found.stopped, "redrives": rows})
    else:
        for r in rows:
            if r["refused"]:
                outcome = f"refused: {r['refused']}"
            elif r["published"] is None:
                outcome = "would be re-driven (dry run)"
            else:
                p = r["published"]
                outcome = f"re-driven to {p['topic']}[{p['partition']}]@{p['offset']} (re-drive {r['redrive_id']})"
            click.echo(f"{r['record']} {r['reason']} operation {r['operation_id'] or '-'}: {outcome}")
        click.echo(f"by {who}" + _stopped_note(found))
    if any(r["refused"] for r in rows):
        raise CommandExit(f"{sum(1 for r in rows if r['refused'])} of {len(rows)} re-drives refused", EXIT_REFUSED)


@main.group()
def accounting() -> None:
    """What the provider was asked, what it created, what it charged and refunded (from the ledger)."""


@accounting.command("report", short_help="Jobs, charges, refunds, calls per operation.")
@click.option("--operation-prefix", default="", help="Only operations whose id starts with this (e.g. a run id).")
@_JSON_OPTION
def accounting_report(operation_prefix: str, as_json: bool) -> None:
    """Remote jobs by outcome and by how they were learned (only through a 502, duplicates), charges, refunds
    settled and pending, operations uncertain and stalled with the oldest age, POSTs per operation (at most one
    that may have created a job) and GETs per completed operation."""
    from streams.ledger.store import Ledger
    from streams.oncall import operations as operators

    pattern = operation_prefix.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"

    async def run(pool: asyncpg.Pool) -> dict[str, Any]:
        summary = await Ledger(pool, "accounting-report").accounting_summary(pattern)
        return await operators.accounting(pool, summary, pattern, operation_prefix)

    report = asyncio.run(_with_pool(_settings(), run))
    if as_json:
        _echo_json(report)
    else:
        click.echo(operators.format_accounting(report))


@main.group("config")
def config_group() -> None:
    """The settings (STREAMS_* environment variables)."""


@config_group.command("reference", short_help="Print docs/settings.md: every setting, generated.")
def config_reference() -> None:
    """Print the settings reference (Markdown) generated from the settings class: name, environment variable,
    type, default (secrets shown as secret) and description of every setting.

    \b
    streams config reference > docs/settings.md
    """
    from streams.config import settings_reference

    click.echo(settings_reference(), nl=False)


@main.command()
@click.option("--run-id", default=None, help="A harness run's id: its database, topics and consumer group.")
@click.option("--topic-prefix", default=None, help="Remove every topic whose name starts with this.")
@click.option("--database", default=None, help="Remove this database (on STREAMS_DATABASE_URL's server).")
@click.option("--group", "groups", multiple=True, help="Remove this consumer group (repeatable).")
@click.option(
    "--include-shared",
    is_flag=True,
    help="Allow a topic prefix reaching the unprefixed generation.* topics, or the database STREAMS_DATABASE_URL "
    "names.",
)
@click.option("--dry-run", is_flag=True, help="Print what would be removed; remove nothing.")
def teardown(
    run_id: str | None,
    topic_prefix: str | None,
    database: str | None,
    groups: tuple[str, ...],
    include_shared: bool,
    dry_run: bool,
) -> None:
    """Remove a run's or a prefix's leftovers: its consumer groups, topics and database, printing each name.

    \b
    streams teardown --run-id run1796029286              a run's id, as in reports/<run id>/
    streams teardown --topic-prefix ci-42. --database streams_ci42 --group generation-streams-ci42

    The run id is resolved with the current settings (STREAMS_DATABASE_URL, STREAMS_TOPIC_PREFIX,
    STREAMS_APP_ID), as the run derived it. Refused (exit 3, nothing removed) when it would reach the unprefixed
    generation.* topics or the ledger itself, unless --include-shared. The run's workers must have stopped.
    """
    from streams.errors import SharedResourceRefusedError
    from streams.setup.teardown import Selection, run_names
    from streams.setup.teardown import teardown as remove

    settings = _settings()
    if run_id is not None:
        if topic_prefix is not None or database is not None or groups:
            raise click.UsageError("--run-id names everything: give it alone, or --topic-prefix/--database/--group")
        selection = run_names(settings, run_id)
    elif topic_prefix is None and database is None and not groups:
        raise click.UsageError("give --run-id, or at least one of --topic-prefix, --database, --group")
    else:
        selection = Selection(database=database, topic_prefix=topic_prefix, groups=groups)
    try:
        removed = asyncio.run(
            remove(settings, selection, include_shared=include_shared, dry_run=dry_run, report=click.echo)
        )
    except SharedResourceRefusedError as exc:
        raise CommandExit(str(exc), EXIT_REFUSED) from exc
    except LedgerUnavailableError as exc:
        raise ledger_unavailable(exc) from exc
    except ConfigError as exc:
        raise CommandExit(str(exc), EXIT_CONFIG) from exc
    except StreamsError as exc:
        raise command_failed(exc, "streams teardown") from exc
    found = len(removed.topics) + len(removed.groups) + (removed.database is not None)
    click.echo(f"{'would remove' if dry_run else 'removed'} {found} (nothing else matched)")
