"""Raw addresses that cross into ``_C``'s GPU entry points are checked before any CUDA call.

Runs wherever ``_C`` was built with the GPU kernels (CI builds them when nvcc is present), GPU
or not: every case here must raise ``InvalidInputError`` from the binding's own checks, which
come before the driver is touched (``host_status_read(0)`` used to segfault). The lifecycle
cases that need real allocations are in ``tests/gpu/test_bindings_checks.py``.
"""

from __future__ import annotations

import pytest
import torch

from uccl_ep_megatron import _C
from uccl_ep_megatron.core.errors import InvalidInputError

pytestmark = pytest.mark.skipif(
    not _C.kernels_built(), reason="_C was built without the GPU kernels (no nvcc/hipcc)"
)

MADE_UP = 0x7F00_0000_1000


@pytest.mark.parametrize(
    "call, needle",
    [
        (lambda: _C.host_status_read(0), "host_status_read is a null pointer"),
        (lambda: _C.host_status_read(MADE_UP), "lies in no live allocation"),
        (lambda: _C.host_status_free(MADE_UP), "not the start of a live status words"),
        (lambda: _C.device_free(MADE_UP), "not the start of a live device buffer"),
        (lambda: _C.device_copy(MADE_UP, MADE_UP + 64, 8), "device_copy: dst"),
        (lambda: _C.ipc_get_handle(MADE_UP), "ipc_get_handle"),
        (lambda: _C.ipc_close_handle(MADE_UP), "not the start of a live IPC mapping"),
        (lambda: _C.ipc_open_handle(b"12"), "IPC handle has 2 bytes"),
        (lambda: _C.post_abort([MADE_UP, MADE_UP + 4096], 0, 1, "x"), r"post_abort: buffers\[0\]"),
        (lambda: _C.post_abort([MADE_UP], 3, 1, "x"), "post_abort: rank=3"),
        (lambda: _C.read_abort(MADE_UP, 0), r"read_abort: buffers\[0\]"),
        (lambda: _C.internode.status_read(0), "internode.status_read is a null pointer"),
        (lambda: _C.internode.status_free(MADE_UP), "not the start of a live status words"),
    ],
)
def test_made_up_addresses_raise(call, needle):
    with pytest.raises(InvalidInputError, match=needle):
        call()


def _context(buffers, buffer_bytes, rank, num_ranks):
    return _C.IntranodeContext(
        buffers=buffers,
        buffer_bytes=buffer_bytes,
        rank=rank,
        num_ranks=num_ranks,
        status=0,
        timeout_ns=1,
        use_tma=False,
    )


def test_kernel_launches_check_their_buffers_first():
    with pytest.raises(InvalidInputError, match=r"IntranodeContext: buffers\[0\]"):
        _context([MADE_UP, MADE_UP + 4096], 1 << 20, 0, 2)
    with pytest.raises(InvalidInputError, match="IntranodeContext: rank=2 num_ranks=2"):
        _context([MADE_UP, MADE_UP + 4096], 1 << 20, 2, 2)
    with pytest.raises(InvalidInputError, match="buffer_bytes=0 must be positive"):
        _context([MADE_UP], 0, 0, 1)


def test_launch_arguments_are_named_and_checked_when_built():
    # Every field of the typed launch arguments is a keyword: positional ints, which could
    # trade places unnoticed, are refused.
    for cls, values in (
        (_C.IntranodeContext, ([MADE_UP], 1 << 20, 0, 1, 0, 1, False)),
        (_C.DispatchLaunch, (24, 2, 16, 0)),
        (_C.DispatchRows, (8, 8)),
        (_C.CombineLaunch, (24, 0)),
    ):
        with pytest.raises(TypeError):
            cls(*values)
    launch = _C.DispatchLaunch(num_sms=24, experts_per_rank=2, num_experts=16, header=7)
    assert (launch.num_sms, launch.experts_per_rank, launch.num_experts, launch.header) == (
        24,
        2,
        16,
        7,
    )
    assert (launch.expert_alignment, launch.num_worst_tokens, launch.cached) == (1, 0, False)
    with pytest.raises(AttributeError):
        launch.num_sms = 12  # built once per layout and shared by calls: read-only
    for change, needle in (
        ({"num_sms": 0}, "DispatchLaunch: num_sms=0"),
        ({"expert_alignment": 0}, "expert_alignment=0"),
        ({"num_worst_tokens": -1}, "num_worst_tokens=-1"),
        ({"experts_per_rank": int(_C.KERNELS_MAX_LOCAL_EXPERTS) + 1}, "at most"),
        ({"cached": True}, "a cached dispatch has no experts"),
    ):
        kw = dict(num_sms=24, experts_per_rank=2, num_experts=16, header=0) | change
        with pytest.raises(InvalidInputError, match=needle):
            _C.DispatchLaunch(**kw)
    bound = _C.DispatchRows.of_bound(96)
    assert (bound.num_recv, bound.staging_rows, bound.own_rows, bound.send_rows) == (96, 96, -1, -1)
    assert (bound.combine_rows, bound.bound) == (96, True)
    with pytest.raises(InvalidInputError, match="DispatchRows: rows num_recv=-1"):
        _C.DispatchRows(num_recv=-1, staging_rows=0)
    with pytest.raises(InvalidInputError, match="CombineLaunch: num_sms=0 must be positive"):
        _C.CombineLaunch(num_sms=0, header=0)


def _internode_context(**change):
    """``_C.internode.Context`` arguments of a 2-node group (one rank per node), changed by
    ``change``; the region is made up, so only checks that come before it can pass."""
    num_fifos = 8
    handle_bytes = 64  # sizeof(FifoDeviceHandle)
    kw = dict(
        rank=0,
        num_ranks=2,
        ranks_per_node=1,
        fifo_handles=torch.zeros(num_fifos * handle_bytes, dtype=torch.uint8),
        num_fifos=num_fifos,
        counters=0,
        state=torch.zeros(int(_C.internode.STATE_WORDS), dtype=torch.int64),
        region=MADE_UP,
        region_bytes=1 << 20,
        nvl=[MADE_UP],
        stage_offset=4096,
        status=0,
        timeout_ns=10**9,
    )
    kw.update(change)
    return _C.internode.Context(**kw)


@pytest.mark.parametrize(
    "change, needle",
    [
        ({}, "internode Context: region"),
        ({"rank": 2}, "internode Context: rank=2 num_ranks=2 ranks_per_node=1"),
        ({"ranks_per_node": 3}, "num_ranks=2 ranks_per_node=3"),
        ({"nvl": [MADE_UP, MADE_UP]}, "got 2 NVLink buffers for 1 ranks per node"),
        ({"region_bytes": 0}, "region_bytes=0 must be positive"),
        ({"num_fifos": 0}, "num_fifos=0 must be positive"),
        (
            {"fifo_handles": torch.zeros(3, dtype=torch.uint8)},
            r"fifo_handles has shape \[3\]; expected 1-D with 512 rows",
        ),
        (
            {"state": torch.zeros(int(_C.internode.STATE_WORDS), dtype=torch.int32)},
            "internode Context: state has dtype int32",
        ),
        ({"state": None}, "internode Context: state is None"),
        ({"stage_offset": 1024}, r"stage_offset=1024 \(at least 1600: the control area\)"),
        ({"arenas": [MADE_UP]}, "1 receive arenas of arena_bytes=0"),
        (
            {"arenas": [MADE_UP, MADE_UP], "arena_bytes": 1 << 20},
            "got 2 receive arenas for 1 ranks per node",
        ),
    ],
)
def test_internode_context_checks_its_fields(change, needle):
    with pytest.raises(InvalidInputError, match=needle):
        _internode_context(**change)
