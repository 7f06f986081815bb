"""Benchmarks behind ``uccl-ep-megatron bench <name>``, one module each.

Every module exposes ``register(subparsers)`` (adds its parser, sets ``func``) and can also run
as ``python -m uccl_ep_megatron.bench.<name>`` (both through ``common.py``, which also writes
``--json``). ``cli/bench.py`` lists the module names.
"""
