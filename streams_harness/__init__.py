"""The test and measurement harness of generation-streams: everything a team does NOT deploy.

* :mod:`streams_harness.simulator` - the provider simulator (the remote generation API, with faults);
* :mod:`streams_harness.mainjob` - the main job (simulator + workers + trace replay + report);
* :mod:`streams_harness.soak` - random faults under load, then an audit;
* :mod:`streams_harness.run` - the steps the main job and the soak share (isolation, replay, report);
* :mod:`streams_harness.fleet`, :mod:`streams_harness.toxiproxy` - child processes, ports, the fault proxy;
* :mod:`streams_harness.replay`, :mod:`streams_harness.trace` - the real trace and its replay;
* :mod:`streams_harness.report` - the run report from independent records;
* :mod:`streams_harness.faults` - fault-injection hooks for worker processes.
* :mod:`streams_harness.services` - a run's own database, waiting for its consumer group to settle.

It needs the ``harness`` extra (``pip install 'generation-streams[harness]'``). The product (:mod:`streams`)
never imports it; its commands (``streams run``, ``soak``, ``simulator``, ``replay``) reach the ``streams``
command line through the ``streams.commands`` entry-point group.
"""

from importlib.util import find_spec

#: Modules of the ``harness`` extra: without them no harness command can run, so none loads.
REQUIRED_MODULES = ("aiohttp", "honcho")

for _module in REQUIRED_MODULES:
    if find_spec(_module) is None:
        raise ImportError(f"No module named {_module!r} (extra 'harness' of generation-streams)", name=_module)
