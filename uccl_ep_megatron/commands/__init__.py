"""Old home of the subcommands, kept as aliases: they live in ``uccl_ep_megatron.cli``."""
