"""The benchmark's pure pieces: the plan of runs, the counters' differences, the summary and its ratios, and the
profile's attribution of samples to components."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from streams_harness.bench.counters import Counters
from streams_harness.bench.peers import consume_bounded
from streams_harness.bench.procrastinate_peer import queue_database_url
from streams_harness.bench.profile import (
    EVENT_LOOP,
    Profiler,
    component_of,
    component_times,
    render_profiles,
    summarize,
)
from streams_harness.bench.runner import (
    CALLBACKS,
    FLOOR,
    NAIVE,
    PACED,
    PIPELINE,
    PROCRASTINATE,
    BenchOptions,
    RunSpec,
    _waited_s,
    _waits_ns,
    callback_figures,
    callbacks_comparison,
    compare,
    figures,
    plan,
    render_callbacks,
    render_scaling,
    render_summary,
    scaling,
    server_cpu_figures,
    summarize_runs,
)
from streams_harness.bench.server_cpu import (
    ServerCpu,
    cpu_delta_s,
    host_cpu_s,
    kafka_broker_pids,
    schedstat_run_ns,
    schedstat_wait_ns,
    stat_busy_ticks,
    stat_cpu_ticks,
    thread_cpu_ns,
    thread_wait_ns,
    threads_delta_s,
)

SITE = "/venv/lib/python3.11/site-packages"
STDLIB = "/usr/lib/python3.11"


def test_plan_alternates_repeats_then_profiles_the_floor_and_the_smallest_pipeline_in_extra_runs() -> None:
    opts = BenchOptions(workers=(1, 2), partitions=(4, 16), transports=("aiohttp", "httpx"), repeats=2)
    runs = plan(opts)
    measured, profiled = [r for r in runs if not r.profile], [r for r in runs if r.profile]
    assert runs[len(measured) :] == profiled  # after every measured run: py-spy pauses what it samples
    first, second = measured[: len(measured) // 2], measured[len(measured) // 2 :]
    assert [r.label for r in first] == [r.label for r in reversed(second)]
    assert [(r.kind, r.label, r.processes) for r in first[:3]] == [
        (FLOOR, "floor", 1),
        (FLOOR, "floor x2", 2),
        (NAIVE, "naive x2 p4 aiohttp", 2),
    ]
    assert [(r.label, r.repeat) for r in profiled] == [
        ("floor", 0),
        ("pipeline w1 p4 aiohttp", 0),
        ("pipeline w1 p4 httpx", 0),
    ]
    assert len([r for r in first if r.kind == PIPELINE]) == 2 * 2 * 2
    paced = [r for r in first if r.kind == PACED]
    assert [(r.label, r.processes, r.rate_per_s, r.profile) for r in paced] == [("paced 50/s w2 p4", 2, 50.0, False)]
    only_two = plan(BenchOptions(workers=(2, 4), partitions=(4,), floor_processes=(2,), paced_rate_per_s=0))
    assert [r.label for r in only_two if r.profile] == ["floor x2", "pipeline w2 p4 aiohttp"]
    unprofiled = plan(BenchOptions(workers=(1,), partitions=(4,), profile=False, paced_rate_per_s=0))
    assert not any(r.profile for r in unprofiled)
    callbacks_alone = plan(BenchOptions(workers=(), floor=False, naive=False, procrastinate=False, paced_rate_per_s=0))
    assert [r.profile for r in callbacks_alone] == []


def test_plan_without_references() -> None:
    opts = BenchOptions(
        workers=(4,), partitions=(8,), floor=False, naive=False, procrastinate=False, profile=False, paced_rate_per_s=0
    )
    runs = plan(opts)
    assert [(r.label, r.profile) for r in runs] == [("pipeline w4 p8 aiohttp", False)]


def test_paced_run_uses_the_largest_worker_count_without_two() -> None:
    runs = plan(
        BenchOptions(
            workers=(1, 4), partitions=(8,), floor=False, naive=False, procrastinate=False, paced_rate_per_s=120
        )
    )
    assert [r.label for r in runs if r.kind == PACED] == ["paced 120/s w4 p8"]


def test_counter_differences_leave_out_what_readings_add() -> None:
    before = Counters(100, {"set": 10, "info": 4, "hello": 2}, 50, {"polls": 0, "submissions": 5})
    after = Counters(180, {"set": 40, "info": 6, "hello": 3, "evalsha": 20}, 120, {"polls": 30, "submissions": 35})
    reading = Counters(5, {"info": 2, "hello": 1}, 0)
    cost = after.minus(before, reading)
    assert cost.redis_reads == 75
    assert cost.redis_calls == {"set": 30, "evalsha": 20}
    assert cost.postgres_transactions == 70
    assert cost.kafka_messages == {"polls": 30, "submissions": 30}


def record(label: str, kind: str, ops: float, gets: float, p50: float | None = 100.0, **extra: Any) -> dict[str, Any]:
    return {
        "label": label,
        "kind": kind,
        "processes": extra.get("processes", 1),
        "partitions": 4,
        "transport": "aiohttp",
        "operations_per_s": ops,
        "cpu_ms_per_operation": 2.0,
        "idle_cpu_percent": 3.0,
        "idle_cpu_percent_per_process": 3.0 / extra.get("processes", 1),
        "simulator_cpu_ms_per_operation": 0.5,
        "observations_per_s": ops * gets,
        "posts_per_operation": 1.0,
        "gets_per_operation": gets,
        "max_gets_in_flight_per_job": 1,
        "redis_round_trips_per_observation": 7.0,
        "redis_round_trips_per_operation": 7.0,
        "postgres_round_trips_per_operation": 7.0,
        "kafka_messages_per_operation": 7.0,
        "completion_to_delivery_ms": {"p50": p50, "p99": None if p50 is None else 2 * p50},
        "broken_promises": extra.get("broken", []),
    }


def test_summary_takes_medians_and_ratios_compare_with_floor_and_naive() -> None:
    records = [
        record("floor x2", FLOOR, 1500.0, 1.0, processes=2),  # not the reference: the one-process floor is
        record("floor", FLOOR, 1000.0, 1.0),
        record("floor", FLOOR, 1200.0, 1.0),
        record("floor", FLOOR, 900.0, 1.0),
        record("naive x2 p4 aiohttp", NAIVE, 100.0, 2.0, processes=2),
        record("pipeline w1 p4 aiohttp", PIPELINE, 150.0, 1.0),
        record("pipeline w1 p4 aiohttp", PIPELINE, 250.0, 1.0, p50=None),
        record("pipeline w1 p4 aiohttp", PIPELINE, 200.0, 1.0, p50=300.0, broken=["orphan_jobs=1"]),
    ]
    summary = summarize_runs(records)
    assert summary["floor"]["operations_per_s"] == 1000.0
    pipeline = summary["pipeline w1 p4 aiohttp"]
    assert (pipeline["runs"], pipeline["operations_per_s"], pipeline["operations_per_s_runs"]) == (
        3,
        200.0,
        [150, 250, 200],
    )
    assert pipeline["completion_to_delivery_ms"] == {"p50": 200.0, "p99": 400.0}  # the run without figures left out
    assert pipeline["broken_promises"] == ["orphan_jobs=1"]
    comparison = compare(summary)
    assert comparison.ratio_to_floor == {"pipeline w1 p4 aiohttp": 0.2}
    assert comparison.gets_ratio_to_naive == {"pipeline w1 p4 aiohttp": 0.5}
    table = render_summary(summary, comparison)
    assert table.splitlines()[4].startswith("naive x2 p4 aiohttp")
    assert table.splitlines()[5].split()[-1] == "0.200"
    header = table.splitlines()[0]
    assert header.split()[4:7] == ["wait", "ms/op", "PG"]  # beside the processes' CPU
    wait_column = header.index("wait ms/op") + len("wait ms/op")  # right-aligned under its header
    assert [line[:wait_column].split()[-1] for line in table.splitlines()[2:6]] == ["-", "-", "-", "-"]


def test_the_run_queue_wait_is_a_median_of_the_runs_that_measured_it_and_a_column() -> None:
    """A run on a kernel without schedstat has no wait (None): the median is of the others, and the column shows
    the figure right-aligned under its header even when it takes six characters."""
    records = [
        record("floor", FLOOR, 1000.0, 1.0) | {"runqueue_wait_ms_per_operation": 0.4},
        record("pipeline w4 p4 aiohttp", PIPELINE, 150.0, 1.0) | {"runqueue_wait_ms_per_operation": 120.25},
        record("pipeline w4 p4 aiohttp", PIPELINE, 250.0, 1.0) | {"runqueue_wait_ms_per_operation": None},
        record("pipeline w4 p4 aiohttp", PIPELINE, 200.0, 1.0) | {"runqueue_wait_ms_per_operation": 100.75},
    ]
    summary = summarize_runs(records)
    assert summary["floor"]["runqueue_wait_ms_per_operation"] == 0.4
    assert summary["pipeline w4 p4 aiohttp"]["runqueue_wait_ms_per_operation"] == 110.5
    lines = render_summary(summary, compare(summary)).splitlines()
    wait_column = lines[0].index("wait ms/op") + len("wait ms/op")
    assert [line[:wait_column].split()[-1] for line in lines[2:4]] == ["0.40", "110.50"]
    assert [line[wait_column] for line in lines[2:4]] == [" ", " "]  # the next column starts after a space


def test_run_labels() -> None:
    assert RunSpec(FLOOR, 1, 4, "aiohttp", 0).label == "floor"
    assert RunSpec(FLOOR, 2, 4, "aiohttp", 0).label == "floor x2"
    assert RunSpec(NAIVE, 3, 4, "httpx", 0).label == "naive x3 p4 httpx"
    assert RunSpec(PIPELINE, 2, 16, "aiohttp", 1).label == "pipeline w2 p16 aiohttp"


def frame(function: str, path: str, line: int = 1) -> str:
    return f"{function} ({path}:{line})"


def test_components_of_frames() -> None:
    assert component_of(frame("AsyncClient.send", f"{SITE}/httpx/_client.py")) == "httpx"
    assert component_of(frame("AsyncConnectionPool.handle", f"{SITE}/httpcore/_async/pool.py")) == "httpx"
    assert component_of(frame("Connection.fetchval", f"{SITE}/asyncpg/connection.py")) == "asyncpg"
    observer = frame("Observer.handle", "/work/repo/streams/worker/stages/observer.py")
    assert component_of(observer) == "streams (own code)"
    assert component_of(frame("Something.run", f"{SITE}/unknownpkg/x.py")) == "unknownpkg"
    assert component_of(frame("BaseEventLoop._run_once", f"{STDLIB}/asyncio/base_events.py")) is None
    floor = frame("Floor.observe", "/work/repo/streams_harness/bench/floor.py")
    assert component_of(floor) == "streams_harness (the floor's code)"
    in_a_streams_directory = frame("Floor.observe", "/home/me/streams/streams_harness/bench/floor.py")
    assert component_of(in_a_streams_directory) == "streams_harness (the floor's code)"
    assert component_of(frame("worker", "/work/repo/streams_harness_extra/cli.py")) is None


def test_samples_are_charged_below_the_event_loop(tmp_path: Path) -> None:
    outer = ";".join(
        [
            frame("worker", "/work/repo/streams/cli.py"),
            frame("Worker.execute_from_commandline", f"{SITE}/mode/worker.py"),
            frame("BaseEventLoop.run_forever", f"{STDLIB}/asyncio/base_events.py"),
            frame("BaseEventLoop._run_once", f"{STDLIB}/asyncio/base_events.py"),
        ]
    )
    select = outer + ";" + frame("EpollSelector.select", f"{STDLIB}/selectors.py")
    task = (
        outer
        + ";"
        + ";".join(
            [
                frame("Handle._run", f"{STDLIB}/asyncio/events.py"),
                frame("Observer.handle", "/work/repo/streams/worker/stages/observer.py"),
                frame("Redis.execute_command", f"{SITE}/redis/asyncio/client.py"),
                frame("_SelectorSocketTransport.write", f"{STDLIB}/asyncio/selector_events.py"),
            ]
        )
    )
    own = (
        outer
        + ";"
        + frame("Handle._run", f"{STDLIB}/asyncio/events.py")
        + ";"
        + frame("Observer._delay", "/work/repo/streams/worker/stages/observer.py")
    )
    path = tmp_path / "profile.txt"
    path.write_text(f"{select} 30\n{task} 60\n{own} 10\nnot a sample line\n")
    result = summarize(path)
    assert result["samples"] == 100
    assert result["by_component"] == {"redis": 60.0, EVENT_LOOP: 30.0, "streams (own code)": 10.0}
    assert result["top_functions"]["_SelectorSocketTransport.write (selector_events.py)"] == 60.0
    assert result["top_own_functions"] == {"Observer.handle (observer.py)": 60.0, "Observer._delay (observer.py)": 10.0}


def test_under_uvloop_samples_are_charged_below_the_frame_that_entered_the_loop(tmp_path: Path) -> None:
    """uvloop runs the loop in C: a task's frames sit right below the frame that entered the loop (mode's worker),
    and a sample whose innermost frame is that one is the loop's own time, not faust's."""
    entry = ";".join(
        [
            frame("worker", "/work/repo/streams/cli.py"),
            frame("Worker.execute_from_commandline", f"{SITE}/mode/worker.py"),
        ]
    )
    thread = ";".join(
        [
            frame("Thread._bootstrap", f"{STDLIB}/threading.py"),
            frame("ServiceThread._start_thread", f"{SITE}/mode/threads.py"),
        ]
    )
    task = entry + ";" + frame("Connection._do_execute", f"{SITE}/asyncpg/connection.py")
    consumer = thread + ";" + frame("Consumer._drain_messages", f"{SITE}/faust/transport/consumer.py")
    path = tmp_path / "profile.txt"
    path.write_text(f"{entry} 20\n{thread} 10\n{task} 50\n{consumer} 20\n")
    assert summarize(path)["by_component"] == {"asyncpg": 50.0, EVENT_LOOP: 30.0, "faust": 20.0}


def test_the_profiles_give_each_component_its_share_of_the_time_on_a_core_or_waiting_side_by_side() -> None:
    """py-spy samples a thread running or ready to run alike, so the shares split CPU plus run-queue wait."""
    worker: dict[str, Any] = {
        "label": "pipeline w1 p4 aiohttp",
        "by_component": {"streams (own code)": 40.0, "asyncpg": 25.0},
    }
    floor: dict[str, Any] = {
        "label": "floor",
        "by_component": {"asyncpg": 50.0, "streams_harness (the floor's code)": 10.0},
    }
    worker_times = component_times(worker, 1.5 + 1.0)
    assert worker_times == {"streams (own code)": 1.0, "asyncpg": 0.625}
    assert component_times(floor, 0.8 + 0.2) == {"asyncpg": 0.5, "streams_harness (the floor's code)": 0.1}
    assert render_profiles([worker, floor]) == ""  # no process CPU and wait figures: nothing to set side by side
    worker |= {
        "cpu_ms_per_operation": 1.5,
        "runqueue_wait_ms_per_operation": 1.0,
        "active_ms_per_operation_by_component": worker_times,
    }
    floor |= {
        "cpu_ms_per_operation": 0.8,
        "runqueue_wait_ms_per_operation": 0.2,
        "active_ms_per_operation_by_component": component_times(floor, 1.0),
    }
    assert render_profiles([worker | {"processes": 2}]).splitlines()[0].split()[-4:] == ["aiohttp", "(1", "of", "2)"]
    lines = render_profiles([floor, worker]).splitlines()
    assert lines[0].split() == ["profiled", "process:", "ms/op", "floor", "pipeline", "w1", "p4", "aiohttp"]
    assert lines[2].split() == ["CPU", "(from", "/proc)", "0.800", "1.500"]
    assert lines[3].split() == ["waiting", "for", "a", "core", "(schedstat)", "0.200", "1.000"]
    assert lines[4] == "on a core or waiting, by component:"
    assert [line.split()[-2:] for line in lines[5:]] == [["0.000", "1.000"], ["0.500", "0.625"], ["0.100", "0.000"]]
    assert [line.split()[0] for line in lines[5:]] == ["streams", "asyncpg", "streams_harness"]
    unmeasured = floor | {"runqueue_wait_ms_per_operation": None}  # a kernel without schedstat: CPU alone
    lines = render_profiles([unmeasured, worker]).splitlines()
    assert lines[3].split()[-2:] == ["-", "1.000"]
    assert lines[4].startswith("by component (CPU alone where the wait is -")


def test_the_pipeline_and_the_peers_are_held_to_the_promises_and_the_floor_is_not() -> None:
    """The floor records no charges and promises nothing, so it carries none (None); the pipeline's and the
    peers' reports are checked alike (the peers' broken promises are what a team would give up)."""
    report = {
        "throughput_ops_per_s": 100.0,
        "operations_final": 10,
        "operations_submitted": 10,
        "operations_missing": 0,
        "completion_to_delivery_ms": {"p50": 100.0, "p99": 200.0},
        "max_jobs_per_operation": 1,
        "orphan_jobs": 0,
        "max_gets_in_flight_per_job": 1,
        "state_regressions": 0,
        "output_duplicates": 0,
        "output_duplicates_after_dedupe": 0,
        "outputs_undelivered": 0,
        "charges_total": {"recorded": "0", "provider_seen_ending": "0.25"},  # no charge recorded
    }
    sim = {"gets": 10, "posts": 10, "max_gets_in_flight_per_job": 1, "max_jobs_per_operation": 1}
    cost = Counters(5, {"set": 5}, 10, {"polls": 10})
    floor = figures(RunSpec(FLOOR, 2, 4, "aiohttp", 0), report, sim, cost, 10)
    pipeline = figures(RunSpec(PIPELINE, 1, 4, "aiohttp", 0), report, sim, cost, 10)
    assert floor["broken_promises"] is None
    for peer in (NAIVE, PROCRASTINATE):
        checked = figures(RunSpec(peer, 2, 4, "aiohttp", 0), report | {"output_duplicates": 3}, sim, cost, 10)
        assert checked["broken_promises"] == [
            "charges recorded minus the provider's for the jobs seen ending=-0.25",
            "output_duplicates=3",
        ]
    assert pipeline["broken_promises"] == ["charges recorded minus the provider's for the jobs seen ending=-0.25"]
    measured = {
        "cpu_ms_per_operation": 1.0,
        "idle_cpu_percent": 1.0,
        "idle_cpu_percent_per_process": 0.5,
        "simulator_cpu_ms_per_operation": 0.5,
    }
    summary = summarize_runs([floor | measured, pipeline | measured])
    assert summary["floor x2"]["broken_promises"] is None
    assert summary["pipeline w1 p4 aiohttp"]["broken_promises"] == pipeline["broken_promises"]


def test_a_threads_run_time_is_the_first_field_of_its_schedstat() -> None:
    assert schedstat_run_ns("197004537 19156113 528\n") == 197_004_537  # run ns, wait ns, time slices
    assert schedstat_wait_ns("197004537 19156113 528\n") == 19_156_113


def test_processes_ready_to_run_while_others_hold_their_only_core_show_the_wait() -> None:
    """Three processes spinning on the same single core each wait on the run queue while the other two run, so
    each one's wait grows by more than its run time (about twice as much; other load on that core only adds to
    the wait): :func:`thread_wait_ns` reads the kernel's account of it, not the run time."""
    spin = (
        "import sys, time\n"
        "sys.stdin.readline()\n"  # go: every child is on the core by then
        "start = time.process_time()\n"
        "while time.process_time() - start < 0.2: pass\n"
        "print('spun', flush=True)\n"
        "sys.stdin.read()\n"  # alive until told: an ended process takes its schedstat with it
    )
    children = [
        subprocess.Popen([sys.executable, "-c", spin], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    try:
        core = min(os.sched_getaffinity(0))
        for child in children:
            os.sched_setaffinity(child.pid, {core})
        try:
            before = [(thread_cpu_ns(child.pid), thread_wait_ns(child.pid)) for child in children]
        except FileNotFoundError:
            pytest.skip("this kernel keeps no schedstat")
        for child in children:
            assert child.stdin is not None
            child.stdin.write("go\n")
            child.stdin.flush()
        for child in children:
            assert child.stdout is not None and child.stdout.readline() == "spun\n"
        ran = [threads_delta_s(run, thread_cpu_ns(child.pid)) for (run, _), child in zip(before, children, strict=True)]
        waited = [
            threads_delta_s(wait, thread_wait_ns(child.pid)) for (_, wait), child in zip(before, children, strict=True)
        ]
    finally:
        for child in children:
            child.communicate("")
    assert all(r >= 0.19 for r in ran)  # each spun its 200 ms in the window
    assert all(w > r for w, r in zip(waited, ran, strict=True)), (waited, ran)
    assert thread_wait_ns(2**22 + 1) == {}  # no such process


def test_the_wait_of_processes_gone_or_unmeasured_is_unknown_not_zero() -> None:
    """A process that exited took its threads' waits with it, and a kernel without schedstat gives none: either
    way the run's wait is None, never a smaller figure."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    alive = os.getpid()
    before = _waits_ns([alive])
    assert before is not None and before[0]
    waited = _waited_s(before, [alive])
    assert waited is not None and waited >= 0.0
    assert _waited_s([*before, {}], [alive, child.pid]) is None  # one of them gone
    assert _waited_s(None, [alive]) is None  # no reading before it (no schedstat)


def test_the_threads_cpu_of_a_process_is_read_to_below_a_tick() -> None:
    """A thread's spin of 30 ms of CPU shows in this process's threads' CPU (every thread's schedstat) within 5 ms,
    and never more than the process's own CPU clock says it used (``/proc/<pid>/stat`` tells 10 ms ticks only)."""
    spun: list[float] = []
    done, release = threading.Event(), threading.Event()

    def spin() -> None:
        start = time.thread_time()
        while time.thread_time() - start < 0.03:
            pass
        spun.append(time.thread_time() - start)
        done.set()
        release.wait()  # alive while it is read: an ended thread takes its schedstat with it

    worker = threading.Thread(target=spin)
    process_before = time.process_time()
    before = thread_cpu_ns(os.getpid())
    worker.start()
    done.wait()
    after = thread_cpu_ns(os.getpid())
    process_used = time.process_time() - process_before
    release.set()
    worker.join()
    used = threads_delta_s(before, after)
    assert spun[0] - 0.005 <= used <= process_used + 0.002
    assert worker.native_id in after and worker.native_id not in before
    assert thread_cpu_ns(2**22 + 1) == {}  # no such process (above the kernel's largest pid)


def test_a_thread_that_ended_between_two_readings_is_left_out_and_a_new_one_counted_from_zero() -> None:
    before = {10: 5_000_000, 11: 50_000_000}
    after = {10: 7_000_000, 12: 1_000_000}  # 11 ended (its 50 ms gone with it), 12 started
    assert threads_delta_s(before, after) == pytest.approx(0.003)  # not 0.003 - 0.050


def test_cpu_ticks_of_a_stat_line_whose_command_holds_spaces_and_parentheses() -> None:
    stat = "4242 (postgres: streams db (x)) S 1 4242 4242 0 -1 4194304 100 0 0 0 7 3 5 9 20 0 1 0 100 2000 50"
    assert stat_cpu_ticks(stat) == 10  # utime 7 + stime 3, the children's 5 and 9 not counted


def test_the_hosts_busy_ticks_leave_idle_iowait_and_steal_out(tmp_path: Path) -> None:
    # user nice system idle iowait irq softirq steal guest guest_nice
    stat = "cpu  61473 1 16075 178014 1016 7 1146 1342 0 0\ncpu0 1 2 3 4 5 6 7 8 0 0\nintr 1\n"
    assert stat_busy_ticks(stat) == 61473 + 1 + 16075 + 7 + 1146
    path = tmp_path / "stat"
    path.write_text(stat)
    assert host_cpu_s(path) == pytest.approx(stat_busy_ticks(stat) / os.sysconf("SC_CLK_TCK"))


def test_cpu_delta_counts_new_processes_whole_and_gone_ones_not() -> None:
    before = {10: 1.0, 11: 2.0, 12: 5.0}
    after = {10: 1.5, 11: 2.0, 13: 0.25}  # 12 ended, 13 started during the run
    assert cpu_delta_s(before, after) == 0.75
    assert cpu_delta_s({10: 3.0}, {10: 2.0}) == 0.0  # a reused pid never subtracts


TCP_HEADER = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"


def fake_process(proc: Path, pid: int, cmdline: bytes, sockets: list[str]) -> None:
    """``<proc>/<pid>`` with a command line and file descriptors linked to ``socket:[inode]`` names."""
    (proc / str(pid) / "fd").mkdir(parents=True)
    (proc / str(pid) / "cmdline").write_bytes(cmdline)
    for fd, inode in enumerate(sockets):
        (proc / str(pid) / "fd" / str(fd)).symlink_to(f"socket:[{inode}]")


def test_the_brokers_measured_are_those_listening_on_the_bootstrap_ports(tmp_path: Path) -> None:
    """Another broker of the host (a second cluster, a TLS broker of the tests) is not counted: the first process
    named kafka.Kafka was, whichever it was."""
    java = b"/usr/bin/java\0-Xmx1g\0kafka.Kafka\0config/server.properties\0"
    fake_process(tmp_path, 120, java, ["5001"])  # a broker on 19094: not the run's
    fake_process(tmp_path, 321, java, ["5002", "5009"])  # listens on 9092
    fake_process(tmp_path, 322, java, ["5003"])  # a second broker of the address, on 9093
    fake_process(tmp_path, 99, b"python\0-c\0print('kafka.Kafka')\0", ["5004"])  # listens on 9094, no broker
    (tmp_path / "net").mkdir()
    rows = [
        ("0100007F:4A96", "0A", "5001"),  # 127.0.0.1:19094 listening
        ("0100007F:2384", "0A", "5002"),  # 127.0.0.1:9092 listening
        ("0100007F:2384", "01", "5009"),  # 9092, an established connection
        ("0100007F:2386", "0A", "5004"),  # 9094 listening
    ]
    (tmp_path / "net" / "tcp").write_text(
        TCP_HEADER + "".join(f"  0: {a} 00000000:0000 {st} 0:0 00:0 0 0 0 {i}\n" for a, st, i in rows)
    )
    any6 = "0" * 32
    (tmp_path / "net" / "tcp6").write_text(TCP_HEADER + f"  0: {any6}:2385 {any6}:0000 0A 0:0 00:0 0 0 0 5003\n")
    assert kafka_broker_pids("127.0.0.1:9092", tmp_path) == [321]
    assert kafka_broker_pids("localhost:9092,127.0.0.1:9093,127.0.0.1:9094", tmp_path) == [321, 322]
    assert kafka_broker_pids("kafka.example:9092", tmp_path) == []  # another host's broker: not measured here
    assert kafka_broker_pids("127.0.0.1:9095", tmp_path) == []


def test_services_cpu_per_operation(tmp_path: Path) -> None:
    before = ServerCpu(postgres={1: 1.0}, redis={2: 1.0}, kafka={3: 10.0})
    after = ServerCpu(postgres={1: 1.5, 4: 0.5}, redis={2: 1.2}, kafka={3: 12.0})
    spent = after.minus(before)
    assert spent == {"postgres": 1.0, "redis": pytest.approx(0.2), "kafka": 2.0}
    assert server_cpu_figures(spent, 500, redis_counted=True) == {
        "postgres_backends_cpu_ms_per_operation": 2.0,
        "redis_server_cpu_ms_per_operation": 0.4,
        "kafka_broker_cpu_ms_per_operation": 4.0,
    }
    assert server_cpu_figures(spent, 500, redis_counted=False)["redis_server_cpu_ms_per_operation"] is None
    no_broker = server_cpu_figures(spent, 500, redis_counted=True, kafka_counted=False)
    assert no_broker["kafka_broker_cpu_ms_per_operation"] is None  # none found: unknown, not 0


def test_plan_runs_the_job_queue_peer_beside_the_naive_one() -> None:
    runs = plan(BenchOptions(workers=(1,), partitions=(4,), floor=False, profile=False, paced_rate_per_s=0))
    assert [(r.kind, r.label, r.processes) for r in runs] == [
        (NAIVE, "naive x2 p4 aiohttp", 2),
        (PROCRASTINATE, "procrastinate x2 p4 aiohttp", 2),
        (PIPELINE, "pipeline w1 p4 aiohttp", 1),
    ]
    assert [
        (r.kind, r.profile) for r in plan(BenchOptions(workers=(1,), floor=False, naive=False, procrastinate=False))
    ] == [(PIPELINE, False), (PIPELINE, False), (PACED, False), (PIPELINE, True)]


def test_queue_database_sits_next_to_the_ledger() -> None:
    url = "postgresql://streams:pw@127.0.0.1:5432/streams_bench1r2?sslmode=disable"
    assert queue_database_url(url) == "postgresql://streams:pw@127.0.0.1:5432/streams_bench1r2_queue?sslmode=disable"


def scaled(workers: int, cpu: float, pg_cpu: float | None, pg_rt: float, redis_rt: float) -> dict[str, Any]:
    entry = record(f"pipeline w{workers} p4 aiohttp", PIPELINE, 100.0, 1.0, processes=workers)
    entry["cpu_ms_per_operation"] = cpu
    entry["postgres_backends_cpu_ms_per_operation"] = pg_cpu
    entry["redis_server_cpu_ms_per_operation"] = None  # no private Redis
    entry["kafka_broker_cpu_ms_per_operation"] = 0.5
    entry["postgres_round_trips_per_operation"] = pg_rt
    entry["redis_round_trips_per_operation"] = redis_rt
    # figures beside the CPU that are not a process's CPU: never in the total
    entry["host_cpu_ms_per_operation"] = 9.0
    entry["host_busy_cores"] = 1.7
    entry["postgres_statements_per_operation"] = 1.1
    entry["postgres_exec_ms_per_operation"] = 1.6
    return entry


def test_scaling_divides_cpu_and_round_trips_by_the_one_worker_run() -> None:
    records = [
        scaled(4, 3.0, 1.5, 1.5, 0.5),
        scaled(1, 2.0, 1.0, 0.8, 0.2),
        scaled(2, 2.0, None, 1.0, 0.5),
        record("naive x2 p4 aiohttp", NAIVE, 100.0, 2.0, processes=2),
    ]
    summary = summarize_runs(records)
    assert summary["pipeline w2 p4 aiohttp"]["postgres_backends_cpu_ms_per_operation"] is None
    rows = scaling(summary)
    assert [(r["workers"], r["total_cpu_ms_per_operation"], r["total_cpu_ratio_to_one_worker"]) for r in rows] == [
        (1, 3.5, 1.0),
        (2, 2.5, 0.714),  # PostgreSQL's CPU not measured: counted 0
        (4, 5.0, 1.429),
    ]
    assert [(r["round_trips_per_operation"], r["round_trips_ratio_to_one_worker"]) for r in rows] == [
        (1.0, 1.0),
        (1.5, 1.5),
        (2.0, 2.0),
    ]
    table = render_scaling(rows).splitlines()
    cells = ["2.00", "1.00", "-", "0.50", "3.50", "1.00", "1.00", "1.00"]
    assert table[2].split() == ["pipeline", "w1", "p4", "aiohttp", *cells]
    assert table[4].split()[-4:] == ["5.00", "1.43", "2.00", "2.00"]


def test_the_peers_report_which_promises_they_break() -> None:
    summary = summarize_runs(
        [
            record("procrastinate x2 p4 aiohttp", PROCRASTINATE, 90.0, 1.0, processes=2),
            record("naive x2 p4 aiohttp", NAIVE, 100.0, 2.0, processes=2, broken=["output_duplicates=3"]),
        ]
    )
    lines = render_summary(summary, compare(summary)).splitlines()
    assert lines[-2:] == [
        "kept every promise checked: procrastinate x2 p4 aiohttp",
        "broke: naive x2 p4 aiohttp: output_duplicates=3",
    ]


def test_the_callbacks_comparison_runs_one_worker_off_then_on_after_the_paced_run() -> None:
    opts = BenchOptions(
        workers=(2,),
        partitions=(8,),
        floor=False,
        naive=False,
        procrastinate=False,
        profile=False,
        repeats=2,
        callbacks_comparison=True,
    )
    runs = plan(opts)
    first = [(r.kind, r.label, r.processes, r.rate_per_s, r.callbacks) for r in runs[:4]]
    assert first == [
        (PIPELINE, "pipeline w2 p8 aiohttp", 2, 0.0, False),
        (PACED, "paced 50/s w2 p8", 2, 50.0, False),
        (CALLBACKS, "callbacks off w1 p8", 1, 20.0, False),
        (CALLBACKS, "callbacks on w1 p8", 1, 20.0, True),
    ]
    assert [r.label for r in runs[4:]] == [label for _, label, *_ in reversed(first)]  # the second repeat reversed
    assert not any(r.kind == CALLBACKS for r in plan(BenchOptions(workers=(2,))))  # off by default


def test_callback_figures_come_from_the_simulator_the_ledger_and_the_workers() -> None:
    sim = {"scheduled": 300, "attempts": 302, "acknowledged": 299, "statuses": {"204": 298, "200": 1, "404": 3}}
    recorded = {"scheduled": 300, "received": 299, "made_due": 290, "replays": 1}
    assert callback_figures(sim, recorded, {"unknown_job": 3, "replay": 1}) == {
        "sent": 302,
        "acknowledged": 299,
        "received": 299,
        "made_due": 290,
        "refused": 4,
    }
    assert callback_figures(None, None, {}) == {
        "sent": 0,
        "acknowledged": 0,
        "received": 0,
        "made_due": 0,
        "refused": 0,
    }


def callbacks_record(on: bool, gets_done: float, p50: float, sent: int) -> dict[str, Any]:
    label = f"callbacks {'on' if on else 'off'} w1 p4"
    figures = {"sent": sent, "acknowledged": sent, "received": sent, "made_due": sent, "refused": 0}
    return record(label, CALLBACKS, 50.0, gets_done, p50) | {
        "gets_per_completed_operation": gets_done,
        "callbacks_enabled": on,
        "callbacks": figures,
    }


def test_the_callbacks_comparison_sets_the_runs_with_callbacks_beside_those_without() -> None:
    records = [
        callbacks_record(False, 6.0, 120.0, 0),
        callbacks_record(True, 2.0, 30.0, 300),
        callbacks_record(True, 2.2, 50.0, 296),
        callbacks_record(True, 2.1, 40.0, 298),
    ]
    summary = summarize_runs(records)
    comparison = callbacks_comparison(summary, 1000.0, 200)
    assert comparison == {
        "job_duration_ms": 1000.0,
        "poll_interval_ms": 200,
        "off": {
            "label": "callbacks off w1 p4",
            "gets_per_completed_operation": 6.0,
            "gets_per_operation": 6.0,
            "completion_to_delivery_ms": {"p50": 120.0, "p99": 240.0},
            "callbacks": {"sent": 0.0, "acknowledged": 0.0, "received": 0.0, "made_due": 0.0, "refused": 0.0},
        },
        "on": {
            "label": "callbacks on w1 p4",
            "gets_per_completed_operation": 2.1,
            "gets_per_operation": 2.1,
            "completion_to_delivery_ms": {"p50": 40.0, "p99": 80.0},
            "callbacks": {"sent": 298.0, "acknowledged": 298.0, "received": 298.0, "made_due": 298.0, "refused": 0.0},
        },
        "gets_ratio_on_to_off": 0.35,
    }
    lines = render_callbacks(comparison).splitlines()
    assert lines[0] == "callbacks: jobs of 1000 ms, poll hints of at most 200 ms"
    assert lines[3].split() == ["callbacks", "off", "w1", "p4", "6.00", "120", "240", "0", "0", "0"]
    assert lines[4].split() == ["callbacks", "on", "w1", "p4", "2.10", "40", "80", "298", "298", "0"]
    assert lines[5] == "GETs per completed operation, callbacks on over off: 0.350"
    assert callbacks_comparison(summarize_runs(records[:1]), 1000.0, 200) == {
        "job_duration_ms": 1000.0,
        "poll_interval_ms": 200,
        "off": comparison["off"],
    }
    assert callbacks_comparison(summarize_runs([record("floor", FLOOR, 1.0, 1.0)]), 1000.0, 200) is None


def test_the_chart_has_a_colour_for_every_kind_of_run(tmp_path: Path) -> None:
    from streams_harness.bench.chart import draw

    kinds = (FLOOR, NAIVE, PROCRASTINATE, PIPELINE, PACED, CALLBACKS)
    records = [record(f"{kind} run", kind, 100.0, 1.0) for kind in kinds]
    summary = summarize_runs(records)
    path = draw(summary, compare(summary), tmp_path / "chart.png", "every kind")
    assert path.read_bytes().startswith(b"\x89PNG")


async def test_the_peers_consume_loop_handles_every_record_at_most_concurrency_at_once() -> None:
    @dataclass
    class Rec:
        value: bytes | None

    async def records() -> AsyncIterator[Rec]:
        for value in (b'{"n": 1}', b"not json", None, b'{"n": 2}', b'{"n": 3}', b'{"n": 4}', b'{"n": 5}'):
            yield Rec(value)

    running, peak = 0, 0
    seen: list[int] = []
    release = asyncio.Event()  # set once two handlings run together: the loop held the third record back

    async def handle(event: dict[str, int]) -> None:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        if event["n"] == 2:
            running -= 1
            raise RuntimeError("a handling that raises is skipped")
        if running == 2:
            release.set()
        await release.wait()
        seen.append(event["n"])
        running -= 1

    await consume_bounded(records(), handle, concurrency=2)
    assert sorted(seen) == [1, 3, 4, 5]
    assert peak == 2


def test_with_no_worker_counts_the_plan_has_only_the_other_runs_and_the_paced_run_takes_two_workers() -> None:
    opts = BenchOptions(workers=(), partitions=(4,), floor=False, naive=False, procrastinate=False)
    assert [(r.kind, r.processes) for r in plan(opts)] == [(PACED, 2)]
    opts = BenchOptions(
        workers=(),
        partitions=(4,),
        floor=False,
        naive=False,
        procrastinate=False,
        paced_rate_per_s=0,
        callbacks_comparison=True,
    )
    assert [(r.label, r.callbacks) for r in plan(opts)] == [
        ("callbacks off w1 p4", False),
        ("callbacks on w1 p4", True),
    ]


@pytest.fixture
def stand_in() -> Iterator[subprocess.Popen[bytes]]:
    """A live process standing for py-spy (the profiler only watches whether it lives and what its log says)."""
    proc = subprocess.Popen(["sleep", "30"])
    yield proc
    proc.kill()
    proc.wait()


async def test_the_profiler_is_sampling_once_py_spy_says_so_and_not_when_it_exited(
    tmp_path: Path, stand_in: subprocess.Popen[bytes]
) -> None:
    """The run's readings wait for py-spy's ``Sampling process`` line (it has attached); a py-spy that exited (it
    could not attach) is no wait at all."""
    profiler = Profiler(os.getpid(), tmp_path / "profile.txt")
    profiler.proc = stand_in
    profiler.log_path.write_bytes(b"")
    assert not await profiler.sampling(timeout_s=0.2)
    profiler.log_path.write_bytes(b"py-spy> Sampling process 100 times a second. Press Control-C to exit.\n")
    assert await profiler.sampling(timeout_s=5.0)
    stand_in.kill()
    await asyncio.to_thread(stand_in.wait)
    assert not await profiler.sampling(timeout_s=5.0)  # exited: False at once, whatever its log says
