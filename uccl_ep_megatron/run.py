"""``python -m uccl_ep_megatron.run [OPTIONS] SCRIPT.py [SCRIPT ARGS...]``

Installs the ``uccl_ep`` plugin (``megatron_plugin.install``) and then runs an unmodified
entry script (Megatron-LM's ``pretrain_gpt.py``, Primus' trainer, your own) as ``__main__``,
exactly as ``python SCRIPT.py ARGS`` would: ``sys.argv`` is ``[SCRIPT.py, ARGS...]`` and the
script's directory is first on ``sys.path``. Works under ``torchrun -m uccl_ep_megatron.run``.

Options (before the script path):
    --deep-ep-compat           also serve ``import deep_ep`` from uccl_ep_megatron
    --deep-ep-compat-replace   the same, shadowing a real DeepEP installation

With either option, a megatron-core the plugin cannot patch (its ``UnsupportedError``) is
reported on stderr and the script still runs: the drop-in does not need the plugin.
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys

from uccl_ep_megatron.core.errors import InvalidInputError, UnsupportedError
from uccl_ep_megatron.proxy.loading import eager_loading_env


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m uccl_ep_megatron.run",
        description="Install the uccl_ep Megatron plugin, then run SCRIPT as __main__.",
    )
    p.add_argument(
        "--deep-ep-compat",
        action="store_true",
        help="serve `import deep_ep` from uccl_ep_megatron (Megatron flex+deepep, Primus-Turbo)",
    )
    p.add_argument(
        "--deep-ep-compat-replace",
        action="store_true",
        help="like --deep-ep-compat, also shadowing a real DeepEP installation",
    )
    p.add_argument("script", help="entry script, e.g. Megatron-LM/pretrain_gpt.py")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments of the script")
    return p


def main(argv: list[str] | None = None) -> None:
    """Parse our options, install the plugin, run the script (its exit status is ours)."""
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    script = os.path.abspath(args.script)
    if not os.path.isfile(script):
        raise InvalidInputError(
            f"entry script {args.script!r} does not exist; pass the path of e.g. "
            "Megatron-LM/pretrain_gpt.py"
        )
    # Before anything starts CUDA: ranks split into virtual nodes run the ipc transport, which
    # needs eager module loading (proxy/loading.py says why).
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    os.environ.update(eager_loading_env(os.environ, local_ranks))
    if args.deep_ep_compat or args.deep_ep_compat_replace:
        # Before megatron.core is imported: fused_a2a binds deep_ep at import time.
        import uccl_ep_megatron.deep_ep_compat as deep_ep_compat

        deep_ep_compat.install(replace_real=args.deep_ep_compat_replace)

    import uccl_ep_megatron.megatron_plugin as megatron_plugin

    try:
        megatron_plugin.install()
    except UnsupportedError as exc:
        if not (args.deep_ep_compat or args.deep_ep_compat_replace):
            raise
        # The drop-in needs none of the plugin's megatron-core hooks: flex + deepep still runs.
        print(
            f"uccl_ep_megatron.run: --moe-token-dispatcher-type uccl_ep is unavailable ({exc}); "
            "the deep_ep drop-in is installed, so --moe-token-dispatcher-type flex "
            "--moe-flex-dispatcher-backend deepep runs on uccl_ep_megatron.Buffer",
            file=sys.stderr,
        )
    sys.argv = [script, *args.script_args]
    sys.path.insert(0, os.path.dirname(script))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
