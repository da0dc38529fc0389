"""A profile of one process under load (a pipeline worker's and the floor's, each in an extra run of the
benchmark): py-spy (``py-spy record --pid --gil``, sampling from outside, no change to the process) writes
collapsed stacks;
:func:`summarize` says which component the samples were spent in, :func:`component_times` how long each took per
operation (on a core or waiting for one), and :func:`render_profiles` sets the floor's beside the worker's.

Only a thread holding the GIL is sampled (``--gil``): a thread waiting in C with the GIL released (faust's
consumer thread in ``epoll_wait``, an event loop with nothing to run) costs no CPU and is not counted. Without
it, py-spy took such a thread for a running one: faust's idle consumer thread (0.7% of a core measured from
``/proc``) showed as 8-11% of the samples.

A sample is charged to the innermost frame that belongs to a third-party package or to the project
(``streams``), among the frames the event loop called (below its innermost loop frame: asyncio's ``_run_once``,
or the frame that entered a loop written in C, uvloop's, which shows no frame of its own: the callback or task
step it was running); samples with no such frame are the event loop's and the interpreter's own (``event loop +
stdlib``: scheduling, socket writes of its own). So time a library spends inside ``asyncio`` or ``ssl`` counts
for that library, and the loop is not charged to whoever started it.
"""

from __future__ import annotations

import asyncio
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

#: Packages reported under one component name (a library and the packages it is built on).
COMPONENTS: dict[str, str] = {
    "httpx": "httpx",
    "httpcore": "httpx",
    "h11": "httpx",
    "anyio": "httpx",
    "sniffio": "httpx",
    "aiohttp": "aiohttp",
    "yarl": "aiohttp",
    "multidict": "aiohttp",
    "aiohappyeyeballs": "aiohttp",
    "propcache": "aiohttp",
    "faust": "faust",
    "mode": "faust",
    "venusian": "faust",
    "croniter": "faust",
    "jsonschema": "jsonschema",
    "referencing": "jsonschema",
    "rpds": "jsonschema",
    "jsonschema_specifications": "jsonschema",
    "redis": "redis",
    "asyncpg": "asyncpg",
    "aiokafka": "aiokafka",
    "kafka": "aiokafka",
    "tenacity": "tenacity",
    "prometheus_client": "prometheus_client",
    "streams": "streams (own code)",
    "streams_harness": "streams_harness (the floor's code)",
}

EVENT_LOOP = "event loop + stdlib"

_FRAME = re.compile(r"^(?P<function>.*) \((?P<path>[^()]*?)(?::(?P<line>\d+))?\)$")
_SITE = re.compile(r"[/\\]site-packages[/\\](?P<package>[A-Za-z0-9_]+)")
#: The innermost frame of a running event loop: asyncio's step, or (uvloop, a loop in C showing no frame) the frame
#: that entered the loop: ``run_forever``/``run_until_complete``, mode's worker and service-thread entry points.
_LOOP_STEP = re.compile(
    r"^(?:\w+\.)?(?:_run_once|run_forever|run_until_complete|execute_from_commandline|_start_thread) \("
)
_OWN = re.compile(r"(?:^|[/\\])streams(?:[/\\][A-Za-z0-9_]+)*[/\\][^/\\]+\.py$")
#: The benchmark's own code: the floor's logic (and its peers'), in the repository, never in the product's wheel.
_HARNESS = re.compile(r"(?:^|[/\\])streams_harness(?:[/\\][A-Za-z0-9_]+)*[/\\][^/\\]+\.py$")


def py_spy() -> str | None:
    """The ``py-spy`` executable (next to this interpreter, else on PATH), or None when not installed."""
    beside = Path(sys.executable).with_name("py-spy")
    return str(beside) if beside.exists() else shutil.which("py-spy")


class Profiler:
    """``py-spy record`` of one process into ``path`` (collapsed stacks) until :meth:`stop`."""

    def __init__(self, pid: int, path: Path, rate_hz: int = 100) -> None:
        self.pid = pid
        self.path = path
        self.rate_hz = rate_hz
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = path.with_suffix(".log")

    def start(self) -> bool:
        """Start sampling; False when py-spy is not installed (nothing is recorded then)."""
        binary = py_spy()
        if binary is None:
            return False
        command = [binary, "record", "--pid", str(self.pid), "--rate", str(self.rate_hz), "--format", "raw", "--gil"]
        self.proc = subprocess.Popen(
            [*command, "--full-filenames", "--output", str(self.path)],
            stdout=self.log_path.open("wb"),
            stderr=subprocess.STDOUT,
        )
        return True

    async def sampling(self, timeout_s: float = 10.0) -> bool:
        """Wait until py-spy says it samples (``Sampling process`` in its log: it has attached), at most
        ``timeout_s`` seconds; False when it did not say so in time or exited."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                return False
            if self.log_path.exists() and b"Sampling process" in self.log_path.read_bytes():
                return True
            await asyncio.sleep(0.05)
        return False

    def stop(self, timeout_s: float = 30.0) -> bool:
        """Stop sampling (SIGINT: py-spy writes its file); True when the file was written."""
        if self.proc is None:
            return False
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.path.exists() and self.path.stat().st_size > 0


def component_of(frame: str) -> str | None:
    """The component of one collapsed-stack frame ``function (path:line)``; None for the standard library."""
    match = _FRAME.match(frame)
    path = match.group("path") if match else frame
    site = _SITE.search(path)
    if site is not None:
        package = site.group("package")
        return COMPONENTS.get(package, package)
    if _HARNESS.search(path):  # first: a checkout in a directory named streams would match _OWN too
        return COMPONENTS["streams_harness"]
    if _OWN.search(path):
        return COMPONENTS["streams"]
    return None


def _short(frame: str) -> str:
    match = _FRAME.match(frame)
    if match is None:
        return frame
    path = match.group("path")
    site = _SITE.search(path)
    where = path[site.start() + len("/site-packages/") :] if site else Path(path).name
    return f"{match.group('function')} ({where})"


def summarize(path: Path, top: int = 15) -> dict[str, Any]:
    """Read py-spy's collapsed stacks at ``path`` (``frame;frame;...;leaf count`` per line).

    Returns ``samples``, ``by_component`` (component -> percent of samples, see the module docstring),
    ``top_functions`` (the ``top`` leaf frames by percent of samples, "self" time) and
    ``top_own_functions`` (the project's frames by percent of samples spent in them or below, "total" time).
    """
    by_component: Counter[str] = Counter()
    leaves: Counter[str] = Counter()
    own_total: Counter[str] = Counter()
    samples = 0
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = stack.split(";")
        samples += count
        loop_at = max((i for i, frame in enumerate(frames) if _LOOP_STEP.match(frame)), default=-1)
        called = frames[loop_at + 1 :]
        charged = EVENT_LOOP
        for frame in reversed(called):
            component = component_of(frame)
            if component is not None:
                charged = component
                break
        by_component[charged] += count
        leaves[_short(frames[-1])] += count
        for frame in set(called):
            if component_of(frame) == COMPONENTS["streams"]:
                own_total[_short(frame)] += count

    def percent(counter: Counter[str], n: int | None = None) -> dict[str, float]:
        return {k: round(100.0 * v / samples, 1) for k, v in counter.most_common(n)} if samples else {}

    return {
        "samples": samples,
        "by_component": percent(by_component),
        "top_functions": percent(leaves, top),
        "top_own_functions": percent(own_total, top),
    }


def component_times(profile: dict[str, Any], active_ms_per_operation: float) -> dict[str, float]:
    """The profiled process's time per operation (ms) on a core or waiting for one, split by component: each
    component's share of the samples (``profile["by_component"]``, percent) times ``active_ms_per_operation`` (the
    process's CPU plus its threads' run-queue wait over the run, from ``/proc``, divided by the run's operations).

    Why both: py-spy samples a thread whose state is ``R``, which the kernel gives a thread running on a core and
    one ready to run while no core is free alike, so its samples count both, and a wait is charged to whatever the
    thread was running when it lost its core. On a machine whose cores the services share, the wait is large (a
    lone process here waits 0.4-0.9 of the time it runs; docs/benchmark.md sets a native on-core profile beside
    py-spy's). Time a thread spends with the GIL released (a system call) is spread over the GIL-held shares.
    Where the kernel keeps no ``schedstat`` the runner passes the CPU alone."""
    return {k: round(v * active_ms_per_operation / 100.0, 3) for k, v in profile["by_component"].items()}


def render_profiles(profiles: list[dict[str, Any]]) -> str:
    """The profiled processes side by side (the floor's beside one pipeline worker's, in the same run): CPU and
    run-queue wait ms per operation of each process, then the time on a core or waiting for one by component
    (:func:`component_times`; CPU alone for a process whose wait is unknown, ``-``), components in order of the
    largest; a process of a run of several is named ``(1 of N)``: its figures are its own share of the run's
    operations. Empty when no profile has the process's CPU figure."""
    timed = [p for p in profiles if p.get("active_ms_per_operation_by_component")]
    if not timed:
        return ""
    names = [p["label"] + (f" (1 of {p['processes']})" if p.get("processes", 1) > 1 else "") for p in timed]
    width = max(20, *(len(name) for name in names))
    header = f"{'profiled process: ms/op':<36}" + "".join(f" {name:>{width}}" for name in names)
    components: dict[str, float] = {}
    for p in timed:
        for name, ms in p["active_ms_per_operation_by_component"].items():
            components[name] = max(components.get(name, 0.0), ms)
    waits = [p.get("runqueue_wait_ms_per_operation") for p in timed]
    lines = [
        f"{'CPU (from /proc)':<36}" + "".join(f" {p['cpu_ms_per_operation']:>{width}.3f}" for p in timed),
        f"{'waiting for a core (schedstat)':<36}"
        + "".join(f" {'-' if w is None else format(w, '.3f'):>{width}}" for w in waits),
        "on a core or waiting, by component:"
        if None not in waits
        else "by component (CPU alone where the wait is -: this kernel keeps no schedstat):",
    ]
    for name in sorted(components, key=lambda n: -components[n]):
        lines.append(
            f"  {name:<34}"
            + "".join(f" {p['active_ms_per_operation_by_component'].get(name, 0.0):>{width}.3f}" for p in timed)
        )
    return "\n".join([header, "-" * len(header), *lines])
