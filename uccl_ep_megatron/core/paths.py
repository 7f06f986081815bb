"""Where the package's data folders are: in an installed wheel, or in a source checkout."""

from __future__ import annotations

from pathlib import Path

#: ``uccl_ep_megatron/`` itself, wherever it was imported from.
PACKAGE_DIR = Path(__file__).resolve().parent.parent


def data_dirs(kind: str) -> list[Path]:
    """Candidate folders of ``kind`` (``recipes``, ``launch``), installed copy first.

    The wheel installs the top-level ``recipes/`` and ``launch/`` under
    ``uccl_ep_megatron/data/`` (CMakeLists.txt); a source checkout has them beside the package.
    """
    return [PACKAGE_DIR / "data" / kind, PACKAGE_DIR.parent / kind]


__all__ = ["PACKAGE_DIR", "data_dirs"]
