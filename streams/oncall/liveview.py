"""The live view for the people on call, served by each worker's web server (Faust web views).

* ``GET /`` — operations by state, throughput over the last minutes (from the transition log), the
  ``uncertain`` and ``stalled`` queues with their ages and reasons, lease contention (this worker's counters),
  the outbox backlog, the dead-letter topic's records (Kafka's offsets) and this worker's dead letters by reason;
  every operation links to its page. The figures are the worker's latest snapshot
  (:mod:`streams.oncall.snapshot`, taken every ``web_snapshot_interval_s`` by one background task; a request
  opens no client and runs no query); the page says when it was taken. Refreshes itself every
  :data:`REFRESH_S` seconds.
* ``GET /operations/{operation_id}`` — one operation, the same data as ``streams operations show``, without its
  payloads (``request``, ``source``, the last observation, the outputs' payloads: :data:`PAYLOAD_FIELDS`) unless
  ``web_show_payloads`` is set, and never with a lease's owner token.

Both answer ``?format=json`` with the data instead of the page. Server-rendered HTML, every value escaped, no
script. Read-only: the pages never write to the ledger and never call the remote API. No snapshot yet, or
PostgreSQL not answering for an operation's page, gives a 503 page saying so. Access (credentials, hosts,
headers): :mod:`streams.oncall.webaccess`.
"""

from __future__ import annotations

import html
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from streams.config import Settings
from streams.errors import LedgerUnavailableError
from streams.model.answers import OPERATION_ID
from streams.oncall import operations as operators
from streams.oncall.operations import format_age, format_time
from streams.oncall.snapshot import Snapshot

#: Seconds between the overview's automatic reloads.
REFRESH_S = 10
#: What an operation's page leaves out unless ``web_show_payloads`` is set: users' data.
PAYLOAD_FIELDS = ("operation.request", "operation.source", "operation.last_observation", "outputs.payload")
#: What a hidden payload reads as.
HIDDEN = "hidden (STREAMS_WEB_SHOW_PAYLOADS shows it)"

if TYPE_CHECKING:  # the worker serves these pages; on call imports nothing of it at run time
    from streams.worker.runtime import Runtime

RuntimeFn = Callable[[], Awaitable["Runtime"]]
SnapshotFn = Callable[[], Snapshot]

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
    *,
    stale: str | None = None,
) -> str:
    """The overview page from :func:`streams.oncall.operations.overview` data, this worker's counter samples and
    :func:`streams.oncall.operations.dead_letter_topic`; ``stale`` says why the figures may be old (None: they
    are the last snapshot's)."""
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
{f'<p class="warn" id="stale">{esc(stale)}</p>' if stale else ""}

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
    hidden = set(detail.get("hidden", ()))

    def payload(path: str, value: Any) -> str:
        if path in hidden:
            return f'<span class="muted hidden">{esc(HIDDEN)}</span>'
        return f"<code>{esc(operators.compact_json(value))}</code>"

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
        ("last observation", payload("operation.last_observation", op["last_observation"])),
        ("remote completed", esc(format_time(op["remote_completed_at"]))),
        ("request", payload("operation.request", op["request"])),
        ("submitted at", esc(operators.format_epoch_ms(op["submitted_at_ms"]))),
        ("source", payload("operation.source", op["source"])),
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
            ["action", "key", "TTL left (ms)"],
            ([esc(x["action"]), esc(x["key"]), esc(x["ttl_ms"])] for x in detail["leases"]),
            numeric=[2],
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


def shown_detail(detail: Mapping[str, Any], *, show_payloads: bool) -> dict[str, Any]:
    """``detail`` (:func:`streams.oncall.operations.operation_detail`) as the live view shows it: without the
    leases' owner tokens, and without :data:`PAYLOAD_FIELDS` (each None, named in ``hidden``) unless
    ``show_payloads``."""
    shown = dict(detail)
    shown["leases"] = [{k: v for k, v in x.items() if k != "owner_token"} for x in detail["leases"]]
    shown["hidden"] = []
    if not show_payloads:
        shown["operation"] = {
            **detail["operation"],
            **{f.partition(".")[2]: None for f in PAYLOAD_FIELDS if f.startswith("operation.")},
        }
        shown["outputs"] = [{**o, "payload": None} for o in detail["outputs"]]
        shown["hidden"] = list(PAYLOAD_FIELDS)
    return shown


def _snapshot_state(snap: Snapshot, now_s: float) -> str | None:
    """Why the snapshot's figures may be old, or None."""
    notes = []
    if snap.ledger_error:
        notes.append(f"the ledger did not answer the last snapshot ({snap.ledger_error})")
    if snap.kafka_error:
        notes.append(f"Kafka did not answer the last snapshot ({snap.kafka_error})")
    if not notes:
        return None
    return f"figures from {format_age(now_s - snap.ledger_at)} ago: " + "; ".join(notes)


def register_pages(app: Any, runtime: RuntimeFn, snapshot: SnapshotFn, settings: Settings) -> None:
    """Add the live view's pages to the Faust ``app``; ``runtime`` gives the worker's resources (its ledger pool
    and Redis client), ``snapshot`` the latest snapshot (:class:`streams.oncall.snapshot.Snapshot`)."""

    def wants_json(request: Any) -> bool:
        return bool(request.query.get("format") == "json")

    async def overview_page(web: Any, request: Any) -> Any:
        snap = snapshot()
        if snap.overview is None:
            message = "no snapshot of the ledger yet: " + (snap.ledger_error or "the first one is being taken")
            return web.html(_error_page("no figures yet", message), status=503)
        data = snap.overview
        counters = operators.worker_counters((*operators.CONTENTION_METRICS, *operators.DEAD_LETTER_METRICS))
        dead_letters = snap.dead_letter_topic or {
            "topic": settings.topic("dead_letter"),
            "retained": None,
            "by_partition": {},
            "error": snap.kafka_error or "not read yet",
        }
        stale = _snapshot_state(snap, time.time())
        worker = (await runtime()).worker  # there is a snapshot: the runtime exists
        if wants_json(request):
            payload = {
                **data,
                "worker": worker,
                "counters": counters,
                "dead_letter_topic": dead_letters,
                "consumer_lag": snap.consumer_lag,
                "partitions_blocked": snap.blocked,
                "snapshot": {
                    "ledger_at": snap.ledger_at,
                    "ledger_error": snap.ledger_error,
                    "kafka_at": snap.kafka_at,
                    "kafka_error": snap.kafka_error,
                },
            }
            return web.bytes(operators.to_json(payload).encode(), content_type="application/json")
        return web.html(render_overview(data, worker, counters, dead_letters, stale=stale))

    async def operation_page(web: Any, request: Any, operation_id: str) -> Any:
        if OPERATION_ID.fullmatch(operation_id) is None:  # no such id is in the ledger (nor may a NUL reach it)
            message = "not an operation id: letters, digits and . _ : - (at most 128), starting with a letter or digit"
            return web.html(_error_page("no such operation", message), status=404)
        rt = await runtime()
        try:
            found = await operators.operation_detail(rt.ledger_pool(), rt.leases.client, rt.settings, operation_id)
        except LedgerUnavailableError as exc:
            message = str(exc)
            return web.html(_error_page("ledger unavailable", message), status=503)
        if found is None:
            message = f"operation {operation_id!r} is not in the ledger"
            return web.html(_error_page("no such operation", message), status=404)
        detail = shown_detail(found, show_payloads=settings.web_show_payloads)
        if wants_json(request):
            return web.bytes(operators.to_json(detail).encode(), content_type="application/json")
        return web.html(render_operation(detail))

    app.page("/")(overview_page)
    app.page("/operations/{operation_id}")(operation_page)
