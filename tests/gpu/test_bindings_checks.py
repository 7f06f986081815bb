"""Raw addresses that cross into ``_C`` on a GPU: freed, interior, of the wrong kind or too
short must raise ``InvalidInputError``, and the CUDA context must still work afterwards
(nothing reached a kernel or the driver). Made-up addresses without any allocation are in
``tests/test_bindings_checks.py``, which needs no GPU."""

from __future__ import annotations

import pytest
import torch

from uccl_ep_megatron import _C
from uccl_ep_megatron.errors import InvalidInputError

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or not _C.kernels_built(),
        reason="needs a GPU and a GPU build of uccl_ep_megatron",
    ),
]


def _context_alive() -> None:
    t = torch.arange(1024, device="cuda")
    assert int(t.sum()) == 1024 * 1023 // 2
    torch.cuda.synchronize()


def test_status_words():
    buf = _C.device_alloc_zeroed(1 << 20)
    with pytest.raises(InvalidInputError, match="must lie inside one status words"):
        _C.host_status_read(buf)  # a device buffer is not a status block
    st = _C.host_status_alloc()
    assert _C.host_status_read(st) == [0, 0, 0, 0]
    with pytest.raises(InvalidInputError, match="non-zero code"):
        _C.host_status_record(st, [0, 1, 2, 3])
    _C.host_status_record(st, [1, 5, 6, 7])
    _C.host_status_record(st, [2, 8, 9, 10])  # the first failure wins
    assert _C.host_status_read(st) == [1, 5, 6, 7]
    _C.host_status_free(st)
    with pytest.raises(InvalidInputError, match="not the start of a live status words"):
        _C.host_status_free(st)  # a second free
    with pytest.raises(InvalidInputError):
        _C.host_status_read(st)  # use after free
    _C.device_free(buf)
    _context_alive()


def test_device_buffers_and_ipc():
    buf = _C.device_alloc_zeroed(4096)
    with pytest.raises(InvalidInputError, match="not the start"):
        _C.device_free(buf + 256)  # interior pointer
    other = _C.device_alloc_zeroed(4096)
    _C.device_copy(other, buf, 4096)
    with pytest.raises(InvalidInputError, match=r"\+4097\) must lie inside one"):
        _C.device_copy(other, buf, 4097)
    with pytest.raises(InvalidInputError, match="device_copy: dst"):
        _C.device_copy(other + 2048, buf, 4096)
    with pytest.raises(InvalidInputError, match="not the start"):
        _C.ipc_get_handle(buf + 16)
    with pytest.raises(InvalidInputError, match="not the start of a live IPC mapping"):
        _C.ipc_close_handle(buf)  # our own buffer is no mapping
    _C.device_free(other)
    _C.device_free(buf)
    with pytest.raises(InvalidInputError, match="not the start"):
        _C.device_free(buf)  # a second free
    _context_alive()


def test_kernel_launch_with_a_made_up_buffer_raises_before_launch():
    dev = torch.device("cuda")
    st = _C.host_status_alloc()
    per_rank = torch.zeros(2, dtype=torch.int32, device=dev)
    per_expert = torch.zeros(4, dtype=torch.int32, device=dev)
    info = torch.empty(4, dtype=torch.int32, device=dev)
    in_rank = torch.zeros(0, 2, dtype=torch.bool, device=dev)
    nbytes = int(_C.KERNELS_DATA_OFFSET)
    buf = _C.device_alloc_zeroed(nbytes)
    stream = torch.cuda.current_stream().cuda_stream
    with pytest.raises(InvalidInputError, match=r"buffers\[1\]"):
        _C.IntranodeContext([buf, 0xDEAD0000], nbytes, 0, 2, st, 10**9, False)
    with pytest.raises(InvalidInputError, match="status"):
        _C.IntranodeContext([buf, buf], nbytes, 0, 2, 0, 10**9, False)
    ctx = _C.IntranodeContext([buf, buf], nbytes, 0, 2, st, 10**9, False)
    args = [per_rank, None, info, in_rank, None, None, None, 0, 1, 0, 0, 0]
    with pytest.raises(InvalidInputError, match="out_info is None"):
        _C.intranode_notify_call(ctx, stream, *args[:2], None, *args[3:])
    with pytest.raises(InvalidInputError, match=r"out_info has shape \[4\]; expected 1-D with 6"):
        _C.intranode_notify_call(ctx, stream, per_rank, per_expert, *args[2:7], 2, *args[8:])
    with pytest.raises(InvalidInputError, match="num_tokens_per_rank has dtype int64"):
        _C.intranode_notify_call(ctx, stream, per_rank.long(), *args[1:])
    _C.device_free(buf)
    # A context outliving its buffers raises at the call (checked again each time).
    with pytest.raises(InvalidInputError, match=r"intranode_notify: buffers\[0\]"):
        _C.intranode_notify_call(ctx, stream, *args)
    _C.host_status_free(st)
    _context_alive()


def test_transport_region_past_a_tensor_end_raises():
    region = torch.zeros(1 << 16, dtype=torch.uint8, device="cuda")
    with pytest.raises(InvalidInputError, match="runs past the end of the device allocation"):
        _C.IpcTransport(0, 1, 1, 1, region.data_ptr(), 1 << 40, torch.cuda.current_device())
    with pytest.raises(InvalidInputError, match="not device memory"):
        _C.IpcTransport(0, 1, 1, 1, 0x1000, 4096, torch.cuda.current_device())
    _context_alive()
