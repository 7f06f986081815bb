"""The ``uccl-ep-megatron`` command line: ``app`` (the parser and ``main``) and one module per
subcommand (``train``, ``launch``, ``report``, ``bench``, ``doctor``).

``python -m uccl_ep_megatron.cli`` and the ``uccl-ep-megatron`` entry point
(``uccl_ep_megatron.cli:main``) both run :func:`main`.
"""

from uccl_ep_megatron.cli.app import COMMAND_MODULES, build_parser, main

__all__ = ["COMMAND_MODULES", "build_parser", "main"]
