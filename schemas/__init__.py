"""The JSON Schema of every topic's value, installed as the package ``streams.schemas`` (``pyproject.toml``)
and read with :mod:`importlib.resources` by :mod:`streams.wire.contracts`."""
