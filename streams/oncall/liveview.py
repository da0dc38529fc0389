"""The live view for the people on call, served by each worker's web server (Faust web views).

* ``GET /`` — operations by state, throughput over the last minutes (from the transition log), the
  ``uncertain`` and ``stalled`` queues with their ages and reasons, lease contention (this worker's counters),
  the outbox backlog, the dead-letter topic's records (Kafka's offsets) and this worker's dead letters by reason;
  every operation links to its page. ``?minutes=N`` (1..120, default 10)
  sets the throughput window. Refreshes itself every :data:`REFRESH_S` seconds.
* ``GET /operations/{operation_id}`` — one operation, the same data as ``streams operations show``.

Both answer ``?format=json`` with the data instead of the page. Server-rendered HTML, every value escaped, no
script. Read-only: the pages never write to the ledger and never call the remote API. PostgreSQL not answering
gives a 503 page saying so.
"""

from __future__ import annotations

import html
import urllib.parse
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from streams.errors import LedgerUnavailableError
from streams.oncall import operations as operators
from streams.oncall.operations import format_age, format_time

#: Seconds between the overview's automatic reloads.
REFRESH_S = 10
#: Default and largest throughput window of the overview (minutes).
WINDOW_MIN = 10
MAX_WINDOW_MIN = 120
#: Rows shown per on-call queue.
QUEUE_ROWS = 50

if TYPE_CHECKING:  # the worker serves these pages; on call imports nothing of it at run time
    from streams.worker.runtime import Runtime

RuntimeFn = Callable[[], Awaitable["Runtime"]]

_STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em;color:#222}
h1{font-size:1.4em;margin:0 0 .2em}h2{font-size:1.1em;margin:1.4em 0 .4em}
table{border-collapse:collapse}th,td{padding:.15em .7em;text-align:left;vertical-align:top;border-bottom:1px solid #ddd}
td.n,th.n{text-align:right;font-variant-numeric:tabular-nums}
.muted{color:#777}.warn{color:#a40}.bar{background:#4a7;height:.8em;display:inline-block}
code,.mono{font-family:ui-monospace,monospace;font-size:.95em}td{white-space:nowrap}
.reason,code{white-space:normal;overflow-wrap:anywhere}
"""


def esc(value: Any) -> str:
    """HTML-escaped text of ``value`` (``-`` for None)."""
    return html.escape("-" if value is None else str(value), quote=True)


def operation_path(operation_id: str) -> str:
    """The path of an operation's page (the id percent-encoded)."""
    return "/operations/" + urllib.parse.quote(operation_id, safe="")


def _link(operation_id: str) -> str:
    return f'<a class="op mono" href="{esc(operation_path(operation_id))}">{esc(operation_id)}</a>'


def _table(headers: Sequence[str], rows: Iterable[Sequence[str]], *, numeric: Sequence[int] = (), **attrs: str) -> str:
    """A table; cells are HTML already escaped by the caller; ``numeric`` column indexes are right-aligned."""
    attr = "".join(f' {k.replace("_", "-")}="{esc(v)}"' for k, v in attrs.items())
    head = "".join(f"<th{' class=n' if i in numeric else ''}>{esc(h)}</th>" for i, h in enumerate(headers))
    body = "".join(
        "<tr>" + "".join(f"<td{' class=n' if i in numeric else ''}>{c}</td>" for i, c in enumerate(r)) + "</tr>"
        for r in rows
    )
    return f"<table{attr}><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _page(title: str, body: str, *, refresh_s: int | None = None) -> str:
    refresh = f'<meta http-equiv="refresh" content="{refresh_s}">' if refresh_s else ""
    return (
        f'<!doctype html><html lang="en"><head><meta charset="utf-8">{refresh}<title>{esc(title)}</title>'
        f"<style>{_STYLE}</style></head><body>{body}</body></html>"
    )


def render_overview(
    data: Mapping[str, Any],
    worker: str,
    counters: Sequence[Mapping[str, Any]],
    dead_letters: Mapping[str, Any],
) -> str:
    """The overview page from :func:`streams.oncall.operations.overview` data, this worker's counter samples and
    :func:`streams.oncall.operations.dead_letter_topic`."""
    states = data["states"]
    state_rows = (
        [f'<span class="mono">{esc(s)}</span>', f'<span class="count" data-state="{esc(s)}">{esc(n)}</span>']
        for s, n in states.items()
    )
    tp = data["throughput"]
    peak = max([m["finished"] for m in tp["minutes"]] + [1])
    minute_rows = (
        [
            esc(format_time(m["minute"])[11:16]),
            f'<span data-minute-accepted="{esc(m["accepted"])}">{esc(m["accepted"])}</span>',
            f'<span data-minute-finished="{esc(m["finished"])}">{esc(m["finished"])}</span>',
            f'<span class="bar" style="width:{200 * m["finished"] // peak}px"></span>',
        ]
        for m in tp["minutes"]
    )
    queues = "".join(_queue_section(state, q) for state, q in data["queues"].items())
    outbox = data["outbox"]
    backlog_rows = (
        [
            esc(role),
            f'<span data-unpublished="{esc(role)}">{esc(b["unpublished"])}</span>',
            esc(format_age(b["oldest_age_s"])),
        ]
        for role, b in outbox["by_topic_role"].items()
    )
    contention = [c for c in counters if c["name"] in operators.CONTENTION_METRICS]
    dead = [c for c in counters if c["name"] in operators.DEAD_LETTER_METRICS]
    body = f"""
<h1>generation-streams: live view</h1>
<p class="muted">worker <span class="mono" id="worker">{esc(worker)}</span> &middot; database clock
<span id="now">{esc(format_time(data["now"]))}</span> &middot; reloads every {REFRESH_S} s &middot;
<a href="?format=json">JSON</a></p>

<section id="states"><h2>Operations by state
(<span id="total">{esc(sum(states.values()))}</span>)</h2>
{_table(["state", "operations"], state_rows, numeric=[1])}</section>

<section id="throughput"><h2>Throughput, last {esc(tp["window_min"])} minutes</h2>
<p><span id="finished">{esc(tp["finished"])}</span> operations finished
(<span id="finished-per-s">{esc(f"{tp['finished_per_s']:.2f}")}</span>/s); per minute (UTC), from the
transition log:</p>
{_table(["minute", "accepted", "finished", ""], minute_rows, numeric=[1, 2])}</section>

{queues}

{_late_jobs_section(data["late_jobs"])}

<section id="contention"><h2>Lease contention and fencing (this worker, since it started)</h2>
{_counters(contention, "no contention counted yet")}</section>

<section id="outbox"><h2>Outbox backlog</h2>
<p><span id="outbox-unpublished">{esc(outbox["unpublished"])}</span> rows not yet published
(oldest {esc(format_age(outbox["oldest_age_s"]))})</p>
{_table(["topic role", "unpublished", "oldest"], backlog_rows, numeric=[1]) if outbox["by_topic_role"] else ""}
<h2>Dead letters</h2>
{_dead_letter_topic(dead_letters)}
<p>Sent by this worker since it started, by reason:</p>
{_counters(dead, "none sent")}</section>
"""
    return _page("generation-streams: live view", body, refresh_s=REFRESH_S)


def _queue_section(state: str, queue: Mapping[str, Any]) -> str:
    rows = (
        [
            _link(r["operation_id"]),
            f'<span data-age-s="{esc(round(r["state_age_s"], 3))}">{esc(format_age(r["state_age_s"]))}</span>',
            f'<span class="mono">{esc(r["remote_job_id"])}</span>',
            f'<span class="reason">{esc(r["reason"])}</span>',
        ]
        for r in queue["rows"]
    )
    shown = len(queue["rows"])
    more = f'<p class="muted">{esc(queue["matched"] - shown)} more not shown</p>' if queue["matched"] > shown else ""
    oldest = format_age(queue["oldest_age_s"])
    table = _table(["operation", "age", "job id", "reason"], rows, numeric=[1], data_queue=state) if shown else ""
    return (
        f'<section id="queue-{esc(state)}"><h2 class="{"warn" if shown else ""}">{esc(state)}: '
        f'<span class="queue-count">{esc(queue["matched"])}</span> waiting for a decision'
        f"{f' (oldest {esc(oldest)})' if shown else ''}</h2>{table}{more}</section>"
    )


def _late_jobs_section(late: Mapping[str, Any]) -> str:
    """Jobs created after an operator's decision and not observed (docs/decisions.md)."""
    rows = (
        [
            _link(r["operation_id"]),
            f'<span class="mono">{esc(r["state"])}</span>',
            f'<span class="mono" data-late-job="{esc(r["remote_job_id"])}">{esc(r["remote_job_id"])}</span>',
            esc(format_age(r["learned_age_s"])),
        ]
        for r in late["rows"]
    )
    shown = len(late["rows"])
    more = f'<p class="muted">{esc(late["matched"] - shown)} more not shown</p>' if late["matched"] > shown else ""
    table = _table(["operation", "state", "job id", "learned"], rows, numeric=[3]) if shown else ""
    return (
        f'<section id="late-jobs"><h2 class="{"warn" if shown else ""}">created after a decision: '
        f'<span id="late-jobs-count">{esc(late["matched"])}</span> jobs not observed (adopt or cancel each: '
        f"docs/decisions.md)</h2>{table}{more}</section>"
    )


def _dead_letter_topic(topic: Mapping[str, Any]) -> str:
    if topic["error"]:
        return f'<p class="warn">Kafka did not answer for {esc(topic["topic"])}: {esc(topic["error"])}</p>'
    return (
        f'<p><span id="dead-letters-retained">{esc(topic["retained"])}</span> records on '
        f'<span class="mono">{esc(topic["topic"])}</span> (every worker\'s, as retained by Kafka)</p>'
    )


def _counters(samples: Sequence[Mapping[str, Any]], empty: str) -> str:
    if not samples:
        return f'<p class="muted">{esc(empty)}</p>'
    rows = (
        [
            f'<span class="mono">{esc(s["name"])}</span>',
            esc(", ".join(f"{k}={v}" for k, v in sorted(s["labels"].items())) or "-"),
            f"{esc(int(s['value']))}",
        ]
        for s in samples
    )
    return _table(["counter", "labels", "value"], rows, numeric=[2])


def render_operation(detail: Mapping[str, Any]) -> str:
    """One operation's page from :func:`streams.oncall.operations.operation_detail` data."""
    op = detail["operation"]
    facts = [
        ("operation", f'<span class="mono" id="operation-id">{esc(op["operation_id"])}</span>'),
        (
            "state",
            f'<span id="state">{esc(op["state"])}</span> (for {esc(format_age(op["state_age_s"]))}, '
            f"transition {esc(op['transition_seq'])})",
        ),
        (
            "reason",
            f'<span id="reason" class="reason">{esc(op["reason"])}</span> '
            f'<span class="mono muted" id="reason-code">{esc(op["reason_code"])}</span>',
        ),
        ("remote job id", f'<span class="mono" id="remote-job-id">{esc(op["remote_job_id"])}</span>'),
        ("fencing value", f'<span id="fencing-token">{esc(op["fencing_token"])}</span>'),
        ("accepted at", esc(format_time(op["accepted_at"]))),
        ("last change", f"{esc(format_time(op['updated_at']))} by {esc(op['updated_by'])}"),
        (
            "polls",
            f"{esc(op['poll_count'])} (next due {esc(format_time(op['next_poll_at']))}; observing since "
            f"{esc(format_time(op['observing_since']))}; unknown statuses in a row {esc(op['unknown_status_count'])})",
        ),
        (
            "lookups",
            f"{esc(op['lookup_count'])} (next due {esc(format_time(op['next_lookup_at']))}; gave up "
            f"{esc(format_time(op['lookup_gave_up_at']))})",
        ),
        ("last observed", esc(format_time(op["last_observed_at"]))),
        ("last observation", f"<code>{esc(operators.compact_json(op['last_observation']))}</code>"),
        ("remote completed", esc(format_time(op["remote_completed_at"]))),
        ("request", f"<code>{esc(operators.compact_json(op['request']))}</code>"),
        ("submitted at", esc(operators.format_epoch_ms(op["submitted_at_ms"]))),
        ("source", f"<code>{esc(operators.compact_json(op['source']))}</code>"),
    ]
    fact_rows = "".join(f"<tr><th>{esc(k)}</th><td>{v}</td></tr>" for k, v in facts)
    transitions = _table(
        ["#", "at", "from", "to", "fencing", "by", "reason"],
        (
            [
                esc(t["seq"]),
                esc(format_time(t["at"])),
                esc(t["from_state"]),
                esc(t["to_state"]),
                esc(t["fencing_token"]),
                f'<span class="mono">{esc(t["worker"])}</span>',
                f'<span class="reason">{esc(t["reason"])}</span>',
            ]
            for t in detail["transitions"]
        ),
        numeric=[0, 4],
        id="transitions",
    )
    outputs = _table(
        ["position", "output id", "recorded", "outbox event", "published"],
        (
            [
                esc(o["position"]),
                f'<span class="mono">{esc(o["output_id"])}</span>',
                esc(format_time(o["recorded_at"])),
                f'<span class="mono">{esc(o["event_id"])}</span>',
                esc(format_time(o["published_at"]) if o["event_id"] else "no outbox row"),
            ]
            for o in detail["outputs"]
        ),
        numeric=[0],
        id="outputs",
    )
    calls = _table(
        ["at", "method", "status", "outcome", "job id", "fencing", "ms", "worker"],
        (
            [
                esc(format_time(c["at"])),
                esc(c["method"]),
                esc(c["status_code"]),
                esc(c["outcome"]),
                f'<span class="mono">{esc(c["remote_job_id"])}</span>',
                esc(c["fencing_token"]),
                esc(f"{c['duration_ms']:.1f}"),
                f'<span class="mono">{esc(c["worker"])}</span>',
            ]
            for c in detail["remote_calls"]
        ),
        numeric=[2, 5, 6],
        id="remote-calls",
    )
    jobs = _table(
        ["job id", "learned via", "by", "at", "last status", "outcome", "charge", "refunds"],
        (
            [
                f'<span class="mono">{esc(j["remote_job_id"])}</span>',
                esc(j["learned_via"]),
                f'<span class="mono">{esc(j["learned_by"])}</span>',
                esc(format_time(j["learned_at"])),
                esc(j["last_status"]),
                esc(j["outcome"]),
                f"<code>{esc(operators.compact_json(j['charge']))}</code>",
                f"<code>{esc(operators.compact_json(j['refunds']) if j['refunds'] else None)}</code>",
            ]
            for j in detail["remote_jobs"]
        ),
        id="remote-jobs",
    )
    if detail["leases_error"]:
        leases = f'<p class="warn">{esc(detail["leases_error"])}</p>'
    elif not detail["leases"]:
        leases = '<p class="muted" id="leases">none held</p>'
    else:
        leases = _table(
            ["action", "key", "owner token", "TTL left (ms)"],
            ([esc(x["action"]), esc(x["key"]), esc(x["owner_token"]), esc(x["ttl_ms"])] for x in detail["leases"]),
            numeric=[3],
            id="leases",
        )
    body = f"""
<p><a href="/">&larr; live view</a> &middot; <a href="?format=json">JSON</a></p>
<h1>Operation <span class="mono">{esc(op["operation_id"])}</span></h1>
<table id="facts">{fact_rows}</table>
<h2>Transitions ({esc(len(detail["transitions"]))})</h2>{transitions}
<h2>Outputs ({esc(len(detail["outputs"]))})</h2>{outputs}
<h2>Remote calls ({esc(len(detail["remote_calls"]))})</h2>{calls}
<h2>Remote jobs, accounting ({esc(len(detail["remote_jobs"]))})</h2>{jobs}
<h2>Redis leases</h2>{leases}
"""
    return _page(f"operation {op['operation_id']}", body)


def _error_page(title: str, message: str) -> str:
    return _page(title, f'<p><a href="/">&larr; live view</a></p><h1>{esc(title)}</h1><p>{esc(message)}</p>')


def _pool(rt: Runtime) -> Any:
    """The worker's ledger pool (a worker always has one; an in-memory ledger has none)."""
    if rt.pool is None:
        raise LedgerUnavailableError("the live view needs the worker's PostgreSQL pool; this runtime has none")
    return rt.pool


def register_pages(app: Any, runtime: RuntimeFn) -> None:
    """Add the live view's pages to the Faust ``app``; ``runtime`` gives the worker's resources (its ledger pool
    and Redis client)."""

    def wants_json(request: Any) -> bool:
        return bool(request.query.get("format") == "json")

    async def overview_page(web: Any, request: Any) -> Any:
        try:
            minutes = int(request.query.get("minutes", WINDOW_MIN))
        except ValueError:
            minutes = WINDOW_MIN
        minutes = min(max(minutes, 1), MAX_WINDOW_MIN)
        rt = await runtime()
        try:
            data = await operators.overview(_pool(rt), window_min=minutes, queue_limit=QUEUE_ROWS)
        except LedgerUnavailableError as exc:
            message = str(exc)
            return web.html(_error_page("ledger unavailable", message), status=503)
        counters = operators.worker_counters((*operators.CONTENTION_METRICS, *operators.DEAD_LETTER_METRICS))
        dead_letters = await operators.dead_letter_topic(rt.settings)
        if wants_json(request):
            payload = {**data, "worker": rt.worker, "counters": counters, "dead_letter_topic": dead_letters}
            return web.bytes(operators.to_json(payload).encode(), content_type="application/json")
        return web.html(render_overview(data, rt.worker, counters, dead_letters))

    async def operation_page(web: Any, request: Any, operation_id: str) -> Any:
        rt = await runtime()
        try:
            detail = await operators.operation_detail(_pool(rt), rt.leases.client, rt.settings, operation_id)
        except LedgerUnavailableError as exc:
            message = str(exc)
            return web.html(_error_page("ledger unavailable", message), status=503)
        if detail is None:
            message = f"operation {operation_id!r} is not in the ledger"
            return web.html(_error_page("no such operation", message), status=404)
        if wants_json(request):
            return web.bytes(operators.to_json(detail).encode(), content_type="application/json")
        return web.html(render_operation(detail))

    app.page("/")(overview_page)
    app.page("/operations/{operation_id}")(operation_page)
