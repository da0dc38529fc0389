"""CPU the services spend for a benchmark run, read from ``/proc/<pid>/stat`` of their processes on this host:

* PostgreSQL: the backends serving the run's databases (their pids from ``pg_stat_activity``), so other
  databases' clients are not counted; the server's shared processes (WAL writer, checkpointer, autovacuum) are
  not counted either;
* Redis: the benchmark's own ``redis-server`` (every command it serves is the run's), when it runs one;
* Kafka: the whole process of each broker of the run's bootstrap address that listens on this host (``kafka.Kafka``
  owning the listening socket of its port: another broker of the host, a second cluster's, is not counted); it
  serves every client, the run's and others';
* the host: every process's CPU (``/proc/stat``), the measured and the rest (the simulator, the benchmark itself,
  the services' shared processes, other users): whether the machine's cores were the limit.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import asyncpg

from streams_harness.bench.counters import BENCH

#: The Kafka broker's main class, looked for in ``/proc/<pid>/cmdline``.
KAFKA_MAIN_CLASS = b"kafka.Kafka"


def stat_cpu_ticks(stat: str) -> int:
    """User + system clock ticks (all threads) of one ``/proc/<pid>/stat`` text (``utime`` and ``stime``, the
    14th and 15th fields; the command name in parentheses may hold spaces and parentheses)."""
    fields = stat.rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system, all threads) process ``pid`` has used so far; 0.0 when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return 0.0
    return stat_cpu_ticks(text) / os.sysconf("SC_CLK_TCK")


def schedstat_run_ns(schedstat: str) -> int:
    """Nanoseconds a thread has run on a CPU, from its ``/proc/<pid>/task/<tid>/schedstat`` text (the first of
    its three fields: run time, wait time, time slices; the kernel's ``Documentation/scheduler/sched-stats.rst``)."""
    return int(schedstat.split()[0])


def schedstat_wait_ns(schedstat: str) -> int:
    """Nanoseconds a thread has waited on a run queue (ready to run, no core free), from its ``schedstat`` text
    (the second of its three fields, as :func:`schedstat_run_ns`)."""
    return int(schedstat.split()[1])


def _thread_schedstat_ns(pid: int, field: Callable[[str], int]) -> dict[int, int]:
    """``field`` of each live thread's ``schedstat`` of process ``pid``, by thread id; empty when it is gone.

    Raises:
        FileNotFoundError: the kernel keeps no ``schedstat`` (no file, or every thread's run time reads 0: an older
            kernel with schedstats off reads ``0 0 0``).
    """
    tasks = Path(f"/proc/{pid}/task")
    try:
        tids = os.listdir(tasks)
    except (FileNotFoundError, ProcessLookupError):
        return {}
    readings: dict[int, int] = {}
    ran_ns = 0
    for tid in tids:
        try:
            text = (tasks / tid / "schedstat").read_text()
        except (FileNotFoundError, ProcessLookupError):
            if (tasks / tid).exists():
                raise FileNotFoundError(f"{tasks / tid / 'schedstat'}: this kernel keeps no schedstat") from None
            continue  # the thread ended between the listing and the reading
        readings[int(tid)] = field(text)
        ran_ns += schedstat_run_ns(text)
    if readings and not ran_ns:  # schedstats off in an older kernel: every thread reads 0 0 0
        raise FileNotFoundError(f"{tasks}/*/schedstat: every thread reads 0 (this kernel keeps no run times)")
    return readings


def thread_cpu_ns(pid: int) -> dict[int, int]:
    """Nanoseconds each live thread of process ``pid`` has run so far, by thread id (each thread's ``schedstat``:
    ``/proc/<pid>/stat`` counts clock ticks, 10 ms each, too coarse for a process that is nearly idle); empty
    when the process is gone.

    Raises:
        FileNotFoundError: the kernel keeps no ``schedstat`` (built without ``CONFIG_SCHED_INFO``, or an older one
            with schedstats off, where every thread reads 0).
    """
    return _thread_schedstat_ns(pid, schedstat_run_ns)


def thread_wait_ns(pid: int) -> dict[int, int]:
    """Nanoseconds each live thread of process ``pid`` has waited for a core so far (:func:`schedstat_wait_ns`),
    by thread id; empty when the process is gone.

    Raises:
        FileNotFoundError: the kernel keeps no ``schedstat`` (as :func:`thread_cpu_ns`).
    """
    return _thread_schedstat_ns(pid, schedstat_wait_ns)


def threads_delta_s(before: Mapping[int, int], after: Mapping[int, int]) -> float:
    """Seconds between two readings of one process (:func:`thread_cpu_ns` or :func:`thread_wait_ns`): each
    thread's own difference, a thread started in between counted from 0; a thread that ended in between is not
    counted at all (its time went with it), so the figure never goes below 0 and misses what such a thread spent
    in the window."""
    return sum(ns - before.get(tid, 0) for tid, ns in after.items()) / 1e9


#: The busy fields of ``/proc/stat``'s ``cpu`` line (user, nice, system, irq, softirq), by position after the label;
#: idle and iowait are not busy, steal is time the hypervisor gave no process of this host, guest time is in user.
_BUSY_FIELDS = (0, 1, 2, 5, 6)


def stat_busy_ticks(stat: str) -> int:
    """Busy clock ticks of all CPUs since boot, from a ``/proc/stat`` text (its first line, ``cpu ...``)."""
    fields = stat.split("\n", 1)[0].split()[1:]
    return sum(int(fields[i]) for i in _BUSY_FIELDS if i < len(fields))


def host_cpu_s(stat: Path = Path("/proc/stat")) -> float:
    """CPU seconds every process of the host has used since boot (all CPUs, busy time only)."""
    return stat_busy_ticks(stat.read_text()) / os.sysconf("SC_CLK_TCK")


def cpu_delta_s(before: Mapping[int, float], after: Mapping[int, float]) -> float:
    """CPU seconds spent between two readings ``pid -> CPU s``: for each process of ``after``, its increase since
    ``before`` (all of it when it started in between). A process gone by ``after`` adds nothing: what it spent
    after ``before`` is lost, so readings are taken while the measured clients still hold their connections."""
    return sum(max(0.0, cpu - before.get(pid, 0.0)) for pid, cpu in after.items())


#: Host names of a bootstrap address that mean this host.
LOCAL_HOSTS = frozenset({"127.0.0.1", "localhost", "::1", "[::1]", "0.0.0.0"})

#: ``st`` of a listening socket in ``/proc/net/tcp`` and ``tcp6``.
TCP_LISTEN = "0A"


def bootstrap_local_ports(bootstrap: str) -> set[int]:
    """The ports of ``bootstrap`` (``host:port``, comma-separated) whose host is this one (loopback, or this host's
    name)."""
    local = LOCAL_HOSTS | {os.uname().nodename}
    ports = set()
    for address in bootstrap.split(","):
        host, _, port = address.strip().rpartition(":")
        if host in local and port.isdigit():
            ports.add(int(port))
    return ports


def listening_socket_inodes(ports: set[int], proc: Path = Path("/proc")) -> set[str]:
    """The inodes of the TCP sockets listening on ``ports`` in this process's network namespace
    (``<proc>/net/tcp`` and ``tcp6``)."""
    inodes = set()
    for table in ("tcp", "tcp6"):
        try:
            lines = (proc / "net" / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[3] == TCP_LISTEN and int(fields[1].rsplit(":", 1)[1], 16) in ports:
                inodes.add(fields[9])
    return inodes


def kafka_broker_pids(bootstrap: str, proc: Path = Path("/proc")) -> list[int]:
    """The pids of the Kafka brokers of ``bootstrap`` on this host: each process whose command line holds
    :data:`KAFKA_MAIN_CLASS` as one argument and that owns a socket listening on one of the address's local ports
    (:func:`bootstrap_local_ports`); empty when none is found (a remote cluster, or the other processes' file
    descriptors not readable)."""
    inodes = {f"socket:[{inode}]" for inode in listening_socket_inodes(bootstrap_local_ports(bootstrap), proc)}
    if not inodes:
        return []
    pids = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if KAFKA_MAIN_CLASS not in (entry / "cmdline").read_bytes().split(b"\0"):
                continue
            if any(os.readlink(fd) in inodes for fd in (entry / "fd").iterdir()):
                pids.append(int(entry.name))
        except OSError:
            continue
    return sorted(pids)


@dataclass(frozen=True)
class ServerCpu:
    """One reading of the services' CPU (see the module docstring): ``pid -> CPU s`` of each."""

    postgres: dict[int, float]
    redis: dict[int, float]
    kafka: dict[int, float]

    def minus(self, before: ServerCpu) -> dict[str, float]:
        """CPU seconds each service spent since ``before`` (``postgres``, ``redis``, ``kafka``)."""
        return {
            "postgres": cpu_delta_s(before.postgres, self.postgres),
            "redis": cpu_delta_s(before.redis, self.redis),
            "kafka": cpu_delta_s(before.kafka, self.kafka),
        }


async def backend_pids(admin_url: str, databases: Iterable[str]) -> list[int]:
    """The pids of PostgreSQL's backends connected to ``databases``, read over a connection to ``admin_url``."""
    conn = await asyncpg.connect(admin_url)
    try:
        rows = await BENCH.database_backends.fetch(conn, databases=list(databases))
    finally:
        await conn.close()
    return [int(r["pid"]) for r in rows]


async def read_server_cpu(
    admin_url: str, databases: Iterable[str], redis_pid: int | None, kafka_pids: Iterable[int]
) -> ServerCpu:
    """The services' CPU now: the backends of ``databases``, the Redis server ``redis_pid`` (None: not counted) and
    the brokers ``kafka_pids``."""
    pids = await backend_pids(admin_url, databases)
    return ServerCpu(
        postgres={pid: process_cpu_s(pid) for pid in pids},
        redis={} if redis_pid is None else {redis_pid: process_cpu_s(redis_pid)},
        kafka={pid: process_cpu_s(pid) for pid in kafka_pids},
    )
