"""FP8 dispatch's row conversions on one GPU: ``token_dispatcher.fp8.quantize`` / ``dequantize``
(the FP8 row kernels of ``_C``, ``csrc/kernels/fp8.cu``) beside torch's ops of the same
definition (``quantize_reference`` / ``dequantize_reference``), timed in turn on the same rows.

Per shape (rows x hidden, bf16): device µs per call (CUDA events around ``--iters`` calls back
to back after 5 warm-up calls, divided by the calls), the bytes each reads and writes, and
their GB/s. The outputs are checked equal first (codes, scales and dequantized rows).

Run on a GPU machine:

    python bench/fp8_rows.py [--rows 4096,8192] [--hidden 4096,7168] [--iters 50] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import torch
from uccl_ep_megatron.token_dispatcher import fp8


def _time_us(fn: Callable[[], object], iters: int) -> float:
    for _ in range(5):
        fn()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop) * 1e3 / iters


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="4096,8192", help="comma-separated row counts")
    p.add_argument("--hidden", default="4096,7168", help="comma-separated hidden sizes")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--json", help="also write the results to this file")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/fp8_rows.py needs a GPU")
    results = []
    for rows in (int(r) for r in args.rows.split(",")):
        for hidden in (int(h) for h in args.hidden.split(",")):
            x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
            q, ref = fp8.quantize(x), fp8.quantize_reference(x)
            y = fp8.dequantize(*q, torch.bfloat16)
            same = (
                torch.equal(q[0].view(torch.uint8), ref[0].view(torch.uint8))
                and torch.equal(q[1], ref[1])
                and torch.equal(y, fp8.dequantize_reference(*ref, torch.bfloat16))
            )
            # Bytes: bf16 rows in, codes and float32 scales out (and back).
            nbytes = rows * hidden * 3 + rows * (hidden // fp8.BLOCK) * 4
            row = {"rows": rows, "hidden": hidden, "outputs_equal": same, "bytes": nbytes}
            calls = {
                "quantize_kernel_us": (fp8.quantize, (x,)),
                "quantize_torch_us": (fp8.quantize_reference, (x,)),
                "dequantize_kernel_us": (fp8.dequantize, (*q, torch.bfloat16)),
                "dequantize_torch_us": (fp8.dequantize_reference, (*q, torch.bfloat16)),
            }
            for name, (fn, fn_args) in calls.items():
                row[name] = _time_us(lambda fn=fn, fn_args=fn_args: fn(*fn_args), args.iters)
            results.append(row)
            q_us, dq_us = row["quantize_kernel_us"], row["dequantize_kernel_us"]
            print(
                f"{rows:6d} x {hidden:5d} bf16  quantize kernel {q_us:7.1f} us "
                f"({nbytes / q_us / 1e3:6.0f} GB/s), torch ops {row['quantize_torch_us']:7.1f} us"
                f" | dequantize kernel {dq_us:7.1f} us ({nbytes / dq_us / 1e3:6.0f} GB/s), "
                f"torch ops {row['dequantize_torch_us']:7.1f} us | outputs equal: {same}"
            )
    if args.json:
        meta = {
            "device": torch.cuda.get_device_name(),
            "command": "python bench/fp8_rows.py "
            f"--rows {args.rows} --hidden {args.hidden} --iters {args.iters}",
        }
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
