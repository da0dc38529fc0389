"""The benchmark's chart (PNG, matplotlib): the summary's throughput, the GETs per operation (what the lease
saves against the peers) and the calls and CPU per operation (what the pipeline pays for its promises)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display

import matplotlib.pyplot as plt

COLOURS = {
    "floor": "#4c956c",
    "naive": "#d1495b",
    "procrastinate": "#edae49",
    "pipeline": "#2e86ab",
    "paced": "#8d99ae",
    "callbacks": "#6a4c93",
}


def draw(summary: dict[str, dict[str, Any]], comparison: Any, path: Path, title: str) -> Path:
    """Draw the chart of ``summary`` (see :func:`streams_harness.bench.runner.summarize_runs`) into ``path``."""
    labels = list(summary)
    colours = [COLOURS[summary[label]["kind"]] for label in labels]
    fig, axes = plt.subplots(1, 3, figsize=(18, 6.5), gridspec_kw={"width_ratios": [1.4, 1, 1.2]})
    fig.suptitle(title, fontsize=11)

    ax = axes[0]
    values = [summary[label]["operations_per_s"] for label in labels]
    bars = ax.barh(labels, values, color=colours)
    for bar, label in zip(bars, labels, strict=True):
        ratio = comparison.ratio_to_floor.get(label)
        note = f"{bar.get_width():.0f}" + (f"  ({ratio:.2f}x floor)" if ratio is not None else "")
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, " " + note, va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("operations per second (first acceptance to last final state)")
    ax.set_title("Throughput (median of repeats)")
    ax.set_xlim(0, max(values, default=1) * 1.35)

    ax = axes[1]
    shown = [label for label in labels if summary[label]["kind"] != "floor"]
    gets = [summary[label]["gets_per_operation"] for label in shown]
    in_flight = [summary[label]["max_gets_in_flight_per_job"] for label in shown]
    positions = range(len(shown))
    ax.barh([p - 0.2 for p in positions], gets, height=0.4, color=[COLOURS[summary[s]["kind"]] for s in shown])
    ax.barh([p + 0.2 for p in positions], in_flight, height=0.4, color="#bbbbbb", label="most GETs in flight, one job")
    for p, g in zip(positions, gets, strict=True):
        ax.text(g, p - 0.2, f" {g:.2f}", va="center", fontsize=8)
    ax.set_yticks(list(positions), shown)
    ax.invert_yaxis()
    ax.set_xlabel("GETs per operation (simulator's record)")
    ax.set_title("GETs the lease saves")
    ax.legend(loc="lower right", fontsize=8)

    ax = axes[2]
    metrics = [
        ("redis_round_trips_per_observation", "Redis\nround trips\nper observation"),
        ("postgres_round_trips_per_operation", "PostgreSQL\nround trips\nper operation"),
        ("kafka_messages_per_operation", "Kafka\nmessages\nper operation"),
        ("cpu_ms_per_operation", "CPU ms\nper operation\n(its processes)"),
        ("postgres_backends_cpu_ms_per_operation", "CPU ms\nper operation\n(PostgreSQL's\nbackends)"),
    ]
    picked = _representatives(summary)
    width = 0.8 / max(1, len(picked))
    for i, label in enumerate(picked):
        xs = [m + i * width for m in range(len(metrics))]
        ys = [summary[label].get(key) or 0.0 for key, _ in metrics]
        ax.bar(xs, ys, width=width, color=COLOURS[summary[label]["kind"]], alpha=1.0 - 0.25 * (i % 3), label=label)
        for x, y in zip(xs, ys, strict=True):
            ax.text(x, y, f"{y:.1f}", ha="center", va="bottom", fontsize=7)
    ax.set_xticks([m + 0.4 - width / 2 for m in range(len(metrics))], [name for _, name in metrics], fontsize=8)
    ax.set_title("What the promises cost (services' counters)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))

    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _representatives(summary: dict[str, dict[str, Any]]) -> list[str]:
    """The floor, the naive peer and the first pipeline configuration of each worker count."""
    picked: list[str] = []
    seen_workers: set[tuple[int, str]] = set()
    for label, entry in summary.items():
        if entry["kind"] != "pipeline":
            picked.append(label)
        elif (entry["processes"], entry["transport"]) not in seen_workers:
            seen_workers.add((entry["processes"], entry["transport"]))
            picked.append(label)
    return picked
