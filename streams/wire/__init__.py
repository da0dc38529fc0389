"""What crosses the wire byte for byte: exact JSON (big integers, floats and key order kept), verbatim request
text, and the topic contracts (JSON Schemas in ``schemas/``, decoding and validation of events). May import
:mod:`streams.model` and the foundation modules (``errors``, ``metrics``).
"""
