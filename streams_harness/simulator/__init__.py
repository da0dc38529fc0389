"""Provider simulator: a standalone aiohttp server playing the remote generation API.

Run it with ``python -m streams_harness.simulator --port 8900 --compression 60 ...`` (see
:mod:`streams_harness.simulator.cli`), or build the app in-process with :func:`make_app`.
Its in-memory records (``GET /_sim/*``) are the independent source of truth for
tests and reports.
"""

from streams_harness.simulator.app import JobRecord, JobRegistry, Simulator, get_simulator, make_app
from streams_harness.simulator.cli import command, run, serve
from streams_harness.simulator.config import SimulatorConfig
from streams_harness.simulator.faults import FaultDecider, FaultRates, PostFault
from streams_harness.simulator.model import JobDurations, job_durations

__all__ = [
    "FaultDecider",
    "FaultRates",
    "JobDurations",
    "JobRecord",
    "JobRegistry",
    "PostFault",
    "Simulator",
    "SimulatorConfig",
    "command",
    "get_simulator",
    "job_durations",
    "make_app",
    "run",
    "serve",
]
