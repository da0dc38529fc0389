"""The test and measurement harness of generation-streams: everything a team does NOT deploy.

* :mod:`streams_harness.simulator` - the provider simulator (the remote generation API, with faults);
* :mod:`streams_harness.mainjob` - the main job (simulator + workers + trace replay + report);
* :mod:`streams_harness.soak` - random faults under load, then an audit;
* :mod:`streams_harness.replay`, :mod:`streams_harness.trace` - the real trace and its replay;
* :mod:`streams_harness.report` - the run report from independent records;
* :mod:`streams_harness.faults` - fault-injection hooks for worker processes.

It needs the ``harness`` extra (``pip install 'generation-streams[harness]'``). The product (:mod:`streams`)
never imports it; its commands (``streams run``, ``soak``, ``simulator``, ``replay``) reach the ``streams``
command line through the ``streams.commands`` entry-point group.
"""
