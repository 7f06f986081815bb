"""Subcommands of the ``uccl-ep-megatron`` CLI, one module each (see ``cli.py``)."""
