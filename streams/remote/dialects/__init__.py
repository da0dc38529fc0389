"""The shipped provider API declarations (package data: ``<name>.json``; :mod:`streams.remote.dialect`)."""
