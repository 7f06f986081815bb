"""Which megatron-core releases the plugin accepts (``TESTED_VERSIONS``), and the error that
names a missing API."""

from __future__ import annotations

import re
import warnings

from uccl_ep_megatron.core.errors import UnsupportedError

TESTED_VERSIONS = ("0.14", "0.15", "0.16", "0.17", "0.18", "0.19", "0.20")
_INSTALL_HINT = "pip install 'megatron-core>=0.14'"


class UntestedVersionWarning(UserWarning):
    """megatron-core is newer than the newest release in ``TESTED_VERSIONS``."""


def megatron_core_version() -> str:
    """The installed megatron-core version string.

    Raises:
        UnsupportedError: megatron-core cannot be imported.
    """
    try:
        from megatron.core import package_info
    except ImportError as exc:
        raise UnsupportedError(
            f"megatron-core is not importable: `{_INSTALL_HINT}` (or put Megatron-LM's "
            f"directory on PYTHONPATH); the uccl_ep plugin needs it ({exc})"
        ) from exc
    return str(package_info.__version__)


def _major_minor(version: str) -> tuple[int, int]:
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        raise UnsupportedError(
            f"megatron-core version {version!r} is not of the form MAJOR.MINOR[...]; "
            f"reinstall it ({_INSTALL_HINT})"
        )
    return int(match.group(1)), int(match.group(2))


def check_version(version: str) -> str:
    """``major.minor`` of ``version``; warns when it is newer than every tested release.

    Raises:
        UnsupportedError: older than the oldest tested release (the message names them).
    """
    got = _major_minor(version)
    tested = [_major_minor(v) for v in TESTED_VERSIONS]
    minor = f"{got[0]}.{got[1]}"
    if got < tested[0]:
        raise UnsupportedError(
            f"megatron-core {version} is older than the uccl_ep plugin supports; tested: "
            f"{', '.join(TESTED_VERSIONS)} ({_INSTALL_HINT})"
        )
    if got > tested[-1]:
        warnings.warn(
            f"megatron-core {version} is newer than the newest release the uccl_ep plugin was "
            f"tested with ({TESTED_VERSIONS[-1]}); trying it. Report problems with the version.",
            UntestedVersionWarning,
            stacklevel=3,
        )
    return minor


def _missing(what: str, version: str) -> UnsupportedError:
    return UnsupportedError(
        f"megatron-core {version} has no {what}, which the uccl_ep plugin needs; it was tested "
        f"with {', '.join(TESTED_VERSIONS)}. Use one of those, or "
        "--moe-token-dispatcher-type flex with --moe-flex-dispatcher-backend deepep and "
        "`python -m uccl_ep_megatron.run --deep-ep-compat`"
    )
