"""``python -m uccl_ep_megatron.cli``."""

import sys

from uccl_ep_megatron.cli.app import main

sys.exit(main())
