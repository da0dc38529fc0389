"""The benchmark (``streams bench``): the pipeline against the floor, a naive peer and a job-queue peer, on the
same closed-loop workload against the real services and the simulator, with profiles of one worker and of the
floor under load.

* :mod:`~streams_harness.bench.runner`: the plan of runs, one run measured end to end, the summary;
* :mod:`~streams_harness.bench.counters`: what a run cost, from Redis', PostgreSQL's and Kafka's own counters;
* :mod:`~streams_harness.bench.floor`: the floor (the same calls, batched, no logic);
* :mod:`~streams_harness.bench.naive`: the naive peer (polling from PostgreSQL, no lease, no fencing);
* :mod:`~streams_harness.bench.procrastinate_peer`: the job-queue peer (procrastinate's jobs on PostgreSQL);
* :mod:`~streams_harness.bench.peers`: the peers' bounded consume loop;
* :mod:`~streams_harness.bench.server_cpu`: the CPU of PostgreSQL's backends, Redis and Kafka during a run;
* :mod:`~streams_harness.bench.statements`: PostgreSQL's statement profile (``pg_stat_statements``) of a run;
* :mod:`~streams_harness.bench.profile`: py-spy, the profiles' summary and their CPU per operation by component;
* :mod:`~streams_harness.bench.chart`: the PNG chart.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import asdict
from typing import Any

from streams_harness.bench.profile import render_profiles
from streams_harness.bench.runner import (
    Bench,
    BenchOptions,
    callbacks_comparison,
    compare,
    render_callbacks,
    render_scaling,
    render_summary,
    scaling,
    summarize_runs,
    write_report,
)
from streams_harness.bench.statements import render_statements

__all__ = ["BenchOptions", "run_bench"]


async def run_bench(opts: BenchOptions, out: Any = sys.stdout) -> dict[str, Any]:
    """Run the benchmark; prints the table, writes the JSON report and the chart, returns the report."""
    from streams_harness.bench.chart import draw

    started = time.monotonic()
    bench = Bench(opts, out)
    records = await bench.run()
    measured = [r for r in records if not r["profiled"]]  # the profiled runs: their profiles only
    summary = summarize_runs(measured)
    comparison = compare(summary)
    scaling_rows = scaling(summary)
    pipelines = {k: v for k, v in summary.items() if v["kind"] == "pipeline"}  # closed loop: paced runs excluded
    best = max(pipelines, key=lambda k: pipelines[k]["operations_per_s"], default=None)
    same_size = next(
        (
            k
            for k, v in pipelines.items()
            if v["processes"] == opts.naive_processes and v["partitions"] == opts.partitions[0]
        ),
        best,
    )
    report_path = opts.report_path or (bench.dir / "report.json")
    chart_path = opts.chart_path or report_path.with_suffix(".png")
    cpus = os.cpu_count()
    paced = f"paced {opts.paced_operations} at {opts.paced_rate_per_s:g}/s" if opts.paced_rate_per_s else "no paced run"
    title = (
        f"streams bench {bench.bench_id}: {opts.operations} operations per run, closed loop, {opts.repeats} repeat(s), "
        f"{paced}; GET latency {opts.sim_get_latency_ms:g} ms, job duration {opts.job_duration_ms:g} ms; "
        f"{cpus} CPUs shared with every service"
    )
    callbacks = callbacks_comparison(summary, opts.callbacks_job_duration_ms, opts.callbacks_poll_interval_ms)
    profiles = [{"label": r["label"], "run_id": r["run_id"], **r["profile"]} for r in records if "profile" in r]
    report: dict[str, Any] = {
        "bench_id": bench.bench_id,
        "options": {k: (str(v) if k.endswith("_path") and v is not None else v) for k, v in asdict(opts).items()},
        "machine": {"cpus": cpus, "services_on_same_host": True, "redis_isolated": bench.redis is not None},
        "best_pipeline": best,
        "ratio_to_floor": comparison.ratio_to_floor.get(best) if best else None,
        "gets_ratio_to_naive": comparison.gets_ratio_to_naive.get(same_size) if same_size else None,
        "ratio_to_floor_by_configuration": comparison.ratio_to_floor,
        "gets_ratio_to_naive_by_configuration": comparison.gets_ratio_to_naive,
        "summary": summary,
        "scaling": scaling_rows,
        "callbacks_comparison": callbacks,
        "profiles": profiles,
        "runs": records,
        "chart": str(chart_path),
        "wall_clock_s": round(time.monotonic() - started, 1),
    }
    draw(summary, comparison, chart_path, title)
    write_report(report_path, report)
    print(render_summary(summary, comparison), file=out)
    if scaling_rows:
        print(render_scaling(scaling_rows), file=out)
    statements = render_statements(measured)
    if statements:
        print(statements, file=out)
    if callbacks is not None:
        print(render_callbacks(callbacks), file=out)
    for profile in profiles:
        top = ", ".join(f"{k} {v}%" for k, v in list(profile["by_component"].items())[:8]) or "(no samples)"
        print(f"profile of one process ({profile['label']}, {profile['samples']} samples): {top}", file=out)
        print(f"  {profile['path']}", file=out)
    costs = render_profiles(profiles)
    if costs:
        print(costs, file=out)
    print(f"report: {report_path}\nchart:  {chart_path}", file=out)
    return report
