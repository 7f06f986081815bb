"""The DeepEP-compatible API: ``Buffer`` (buffer.py) with its argument checks (validation.py),
per-call agreement (calls.py), placement detection (topology.py) and communication stream
(streams.py), and the autograd ops (ops.py)."""
