"""The ledger's SQL migrations (yoyo-migrations), installed as the package ``streams.migrations``
(``pyproject.toml``) and read with :mod:`importlib.resources` by :func:`streams.setup.admin.migrate`; only the
``*.sql`` files are migrations."""
