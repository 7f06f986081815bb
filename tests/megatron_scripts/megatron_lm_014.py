"""What Megatron-LM 0.14/0.15's ``megatron/training/arguments.py`` does with the dispatcher
flag: hard-coded ``choices`` (0.16+ take them from the config's ``Literal``). Shared by the
stand-in entry scripts here and by tests/test_megatron_plugin.py."""

import argparse


def parser_014(**kwargs) -> tuple[argparse.ArgumentParser, argparse._ArgumentGroup]:
    """(parser, its "moe" group) with ``--moe-token-dispatcher-type`` as 0.14/0.15 define it."""
    parser = argparse.ArgumentParser(allow_abbrev=False, **kwargs)
    group = parser.add_argument_group(title="moe")
    group.add_argument(
        "--moe-token-dispatcher-type",
        type=str,
        choices=["allgather", "alltoall", "flex"],
        default="allgather",
    )
    return parser, group
