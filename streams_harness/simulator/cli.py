"""Command line entry of the provider simulator (``python -m streams_harness.simulator``).

Every :class:`~streams_harness.simulator.config.SimulatorConfig` field is an option
``--field-name``; unset options fall back to ``SIM_FIELD_NAME`` environment
variables, then to the defaults.  The project CLI can mount :data:`command`
(e.g. as ``streams simulator``) or call :func:`run` directly.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Callable
from typing import Any

import click
from aiohttp import web

from streams_harness.simulator.app import make_app
from streams_harness.simulator.config import SimulatorConfig, field_help, field_types

logger = logging.getLogger("streams_harness.simulator")


async def serve(config: SimulatorConfig, stop: asyncio.Event | None = None) -> None:
    """Serve the simulator until ``stop`` is set (or SIGINT/SIGTERM when ``stop`` is None).

    Logs one line ``provider simulator listening on http://HOST:PORT ...`` once bound
    (with the real port when ``config.port`` is 0).
    """
    app = make_app(config)
    runner = web.AppRunner(app, access_log=logger if config.access_log else None, shutdown_timeout=2.0)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port, backlog=1024)
    await site.start()
    try:
        host, port = runner.addresses[0][:2]
        logger.info(
            "provider simulator listening on http://%s:%s (seed=%s compression=%s faults: 429=%s "
            "502_job_id=%s 5xx=%s drop_after_create=%s slow=%s job_failed=%s; get_latency_ms=%s)",
            host,
            port,
            config.seed,
            config.compression,
            config.fault_429,
            config.fault_502_job_id,
            config.fault_5xx,
            config.fault_drop_after_create,
            config.fault_slow,
            config.fault_job_failed,
            config.get_latency_ms,
        )
        if stop is None:
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                with contextlib.suppress(NotImplementedError):
                    loop.add_signal_handler(sig, stop.set)
        await stop.wait()
    finally:
        await runner.cleanup()


def run(config: SimulatorConfig) -> None:
    """Run the simulator in the foreground until SIGINT/SIGTERM (blocking).

    Configures basic INFO logging if the root logger has no handler yet.
    """
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(serve(config))


def _with_config_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """Add one ``--field-name`` option per config field (default None = env/default)."""
    helps = field_help()
    click_types: dict[type, Any] = {str: click.STRING, int: click.INT, float: click.FLOAT}
    defaults = SimulatorConfig()
    for name, typ in reversed(list(field_types().items())):
        flag = "--" + name.replace("_", "-")
        help_text = f"{helps[name]} [env SIM_{name.upper()}; default {getattr(defaults, name)!r}]"
        if typ is bool:
            decl = f"{flag}/--no-{flag[2:]}"
            func = click.option(decl, name, default=None, help=help_text)(func)
        else:
            func = click.option(flag, name, type=click_types[typ], default=None, help=help_text)(func)
    return func


@click.command(name="simulator", context_settings={"max_content_width": 120})
@_with_config_options
def command(**options: Any) -> None:
    """Run the provider simulator (fake remote generation API) over HTTP."""
    changes = {k: v for k, v in options.items() if v is not None}
    try:
        config = SimulatorConfig.from_env().updated(changes)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    run(config)
