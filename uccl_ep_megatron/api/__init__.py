"""The DeepEP-compatible API: ``Buffer`` (buffer.py) with its argument checks (validation.py),
per-call agreement (calls.py) and placement detection (topology.py), and the autograd ops
(ops.py)."""
