"""N ranks of a job on this host: the one launcher of the GPU tests and the benchmarks.

Ranks go round-robin over the visible GPUs. When every rank has a GPU of its own they join an
NCCL group; when there are more ranks than GPUs (a single-GPU box, a development machine) they
share GPUs under CUDA MPS, join a **gloo** group (NCCL refuses two ranks on one GPU), and the
``Buffer`` takes its device from the current CUDA device. Peer traffic then goes through the
GPU's own memory instead of NVLink: the shared mode measures correctness and per-call overhead,
never link bandwidth.

MPS runs for as long as a pool that shares GPUs is open, from a control daemon whose pipe and
log directories live in a fresh temp directory (so it never meets a daemon someone else
started), and is stopped on every exit path: ``close()``, an exception, interpreter exit.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import importlib.util
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from uccl_ep_megatron.proxy.loading import ENV as ENV_MODULE_LOADING

MPS_CONTROL = "nvidia-cuda-mps-control"
# MPS clients share one pool of hardware work queues. With the default 8 per client, the ipc
# transport's copy streams can land on the queue of a kernel that waits for those very copies
# (seen on one H200: "the GPU never ran it" with 2 ranks; 32 queues each fixed it), but the pool
# is finite (4 clients asking 32 each: "out of memory" creating the 4th context). The pool is
# the MPS server's, not each GPU's: 4 ranks on 2 GPUs asking 32 each failed the same way, 16
# each passed. So each rank asks for an equal share of 64 among all the server's clients, at
# least the default 8 and at most 32.


def shared_gpu_env(clients: int) -> dict[str, str]:
    """Environment of ranks under MPS, ``clients`` of them on the one MPS server (every rank
    of the pool, whichever GPU it uses)."""
    return {"CUDA_DEVICE_MAX_CONNECTIONS": str(max(8, min(32, 64 // max(clients, 1))))}


# Multi-GPU hosts keep NVLink multicast off (NCCL NVLS, symmetric memory); children inherit it.
SAFE_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


@dataclass(frozen=True)
class Placement:
    """How many ranks, which GPU each uses (empty: CPU ranks), and the group backend that fits."""

    world: int
    gpus: tuple[int, ...] = ()

    @property
    def shared(self) -> bool:
        """True when two ranks use one GPU (MPS and a gloo group are needed)."""
        return len(set(self.gpus)) < len(self.gpus)

    @property
    def backend(self) -> str:
        """``nccl`` when every rank has its own GPU, else ``gloo``."""
        return "nccl" if self.gpus and not self.shared else "gloo"


def place(world: int, num_gpus: int) -> Placement:
    """Round-robin ``world`` ranks over ``num_gpus`` GPUs (0: CPU ranks)."""
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"world={world!r}: give a positive number of ranks")
    if isinstance(num_gpus, bool) or not isinstance(num_gpus, int) or num_gpus < 0:
        raise ValueError(f"num_gpus={num_gpus!r}: give 0 (CPU ranks) or the visible GPU count")
    if num_gpus == 0:
        return Placement(world)
    return Placement(world, tuple(r % num_gpus for r in range(world)))


def _restore(saved: dict[str, str | None]) -> None:
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@contextlib.contextmanager
def _environ(updates: dict[str, str]):
    """``os.environ`` with ``updates`` inside the block, as it was after it."""
    saved = {k: os.environ.get(k) for k in updates}
    os.environ.update(updates)
    try:
        yield
    finally:
        _restore(saved)


def mps_available(control: str = MPS_CONTROL) -> bool:
    """Whether the MPS control program is on the PATH (shared-GPU runs need it)."""
    return shutil.which(control) is not None


class Mps:
    """A private CUDA MPS control daemon (pipe/log dirs in a temp dir), reference counted so
    that nested pools share one daemon. Clients find it through ``CUDA_MPS_PIPE_DIRECTORY``,
    which :meth:`start` puts into ``os.environ`` for processes spawned afterwards."""

    ENV_KEYS = ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY")

    def __init__(self, control: str = MPS_CONTROL, start_timeout_s: float = 10.0) -> None:
        self.control = control
        self.start_timeout_s = start_timeout_s
        self.dir: str | None = None
        self._users = 0
        self._saved: dict[str, str | None] = {}

    def env(self) -> dict[str, str]:
        """The variables a client needs (valid while the daemon runs)."""
        if self.dir is None:
            return {}
        return {
            "CUDA_MPS_PIPE_DIRECTORY": os.path.join(self.dir, "pipe"),
            "CUDA_MPS_LOG_DIRECTORY": os.path.join(self.dir, "log"),
        }

    @property
    def running(self) -> bool:
        return self.dir is not None

    def _daemon_env(self) -> dict[str, str]:
        """The control daemon's environment: ours with the client variables, without
        ``CUDA_VISIBLE_DEVICES``. The MPS server it starts inherits it, and a client's
        ``CUDA_VISIBLE_DEVICES`` is read against the devices that server sees: a server
        started with ``2,3`` shows its clients two devices, 0 and 1, so clients asking for
        ``2,3`` (what the caller meant: physical GPUs 2 and 3) would see no GPU at all. A
        server that sees every GPU lets each client's own list pick the physical GPUs."""
        env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
        return {**env, **self.env()}

    def start(self) -> None:
        self._users += 1
        if self._users > 1:
            return
        if not mps_available(self.control):
            self._users = 0
            raise RuntimeError(
                f"ranks share a GPU but {self.control!r} is not on the PATH: install the CUDA "
                "MPS control program, or run at most one rank per GPU"
            )
        self.dir = tempfile.mkdtemp(prefix="uccl_ep_mps_")
        env = self.env()
        for d in env.values():
            os.makedirs(d)
        try:
            subprocess.run(
                [self.control, "-d"],
                env=self._daemon_env(),
                check=True,
                timeout=self.start_timeout_s,
                capture_output=True,
            )
            control_pipe = os.path.join(env["CUDA_MPS_PIPE_DIRECTORY"], "control")
            deadline = time.monotonic() + self.start_timeout_s
            while not os.path.exists(control_pipe):
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"MPS control daemon did not create {control_pipe} within "
                        f"{self.start_timeout_s} s; see {env['CUDA_MPS_LOG_DIRECTORY']}"
                    )
                time.sleep(0.02)
        except BaseException:
            self._users = 1
            self.stop()
            raise
        self._saved = {k: os.environ.get(k) for k in self.ENV_KEYS}
        os.environ.update(env)
        atexit.register(self._stop_at_exit)

    def stop(self) -> None:
        """Quit the daemon (and its server) once the last user stops; restore the env."""
        if self._users == 0:
            return
        self._users -= 1
        if self._users > 0 or self.dir is None:
            return
        try:
            subprocess.run(
                [self.control],
                input=b"quit\n",
                env=self._daemon_env(),
                timeout=self.start_timeout_s,
                capture_output=True,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired):
            pass  # a daemon that does not answer dies with its pipe directory below
        _restore(self._saved)
        self._saved = {}
        shutil.rmtree(self.dir, ignore_errors=True)
        self.dir = None
        atexit.unregister(self._stop_at_exit)

    def _stop_at_exit(self) -> None:
        self._users = min(self._users, 1)
        self.stop()


_MPS = Mps()


def mps() -> Mps:
    """The process-wide MPS daemon handle used by :class:`RankPool`."""
    return _MPS


def init_rank(rank: int, placement: Placement, init_file: str, timeout_s: float = 120.0) -> None:
    """Bind this process to its GPU and join the group that fits ``placement``."""
    import torch
    import torch.distributed as dist

    if placement.gpus:
        torch.cuda.set_device(placement.gpus[rank])
    dist.init_process_group(
        placement.backend,
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=placement.world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def _load(path: str):
    """A test file by path (test files are not importable by module name)."""
    name = "_rank_task_" + os.path.splitext(os.path.basename(path))[0]
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _resolve(task: Any) -> Callable[..., Any]:
    if callable(task):
        return task
    path, name = task
    return getattr(_load(path), name)


def _worker(rank: int, placement: Placement, init_file: str, tasks, results, timeout_s) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    init_rank(rank, placement, init_file, timeout_s)
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args, env = task
        with _environ(env):
            try:
                results.put((rank, True, _resolve(fn)(rank, placement.world, *args)))
            except BaseException:  # noqa: BLE001 - reported to the parent with its traceback
                results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


# Bound on one RankPool.run when the caller gives none: a test case or a benchmark step.
DEFAULT_TASK_TIMEOUT_S = 240.0


class RankPool:
    """``world`` long-lived ranks that run functions on request.

    ``run(fn, *args)`` calls ``fn(rank, world, *args)`` on every rank and returns the per-rank
    results; ``fn`` is a picklable callable or a ``(path, name)`` pair naming a function of a
    file. A failure on any rank re-raises here with that rank's traceback; a rank that dies or
    stalls past ``task_timeout_s`` raises ``TimeoutError`` naming the dead ranks. Keeping the
    processes alive costs one torch import per rank per pool instead of one per call.

    Args:
        world: number of ranks.
        num_gpus: GPUs to place them on (``None``: every visible GPU; 0: CPU ranks in a gloo
            group).
        task_timeout_s: bound on one ``run`` (default ``DEFAULT_TASK_TIMEOUT_S``).
        group_timeout_s: the process group's own timeout.
        mps_daemon: the :class:`Mps` to use when ranks share a GPU (default: the process-wide
            one).
    """

    def __init__(
        self,
        world: int,
        num_gpus: int | None = None,
        task_timeout_s: float | None = None,
        group_timeout_s: float = 120.0,
        mps_daemon: Mps | None = None,
    ) -> None:
        import torch.multiprocessing as mp

        if num_gpus is None:
            num_gpus = visible_gpus()
        self.placement = place(world, num_gpus)
        self._closed = False
        self._procs: list[Any] = []
        self.world = world
        self.task_timeout_s = task_timeout_s or DEFAULT_TASK_TIMEOUT_S
        self._mps = (mps_daemon or _MPS) if self.placement.shared else None
        self._dir = tempfile.TemporaryDirectory(prefix="uccl_ep_ranks_")
        child_env = dict(SAFE_ENV)
        if self.placement.gpus and ENV_MODULE_LOADING not in os.environ:
            # Ranks of the pool may run the ipc transport, which needs eager module loading
            # (proxy/loading.py says why); a mode the caller set is kept.
            child_env[ENV_MODULE_LOADING] = "EAGER"
        if self.placement.shared:
            extra = shared_gpu_env(len(self.placement.gpus))
            child_env.update({k: v for k, v in extra.items() if k not in os.environ})
        try:
            if self._mps is not None:
                self._mps.start()
            ctx = mp.get_context("spawn")
            self._tasks = [ctx.Queue() for _ in range(world)]
            self._results = ctx.Queue()
            init_file = os.path.join(self._dir.name, "init")
            self._procs = [
                ctx.Process(
                    target=_worker,
                    args=(
                        r,
                        self.placement,
                        init_file,
                        self._tasks[r],
                        self._results,
                        group_timeout_s,
                    ),
                    daemon=True,
                )
                for r in range(world)
            ]
            with _environ(child_env):  # inherited by the spawned ranks
                for p in self._procs:
                    p.start()
        except BaseException:
            self.close()
            raise

    @property
    def backend(self) -> str:
        return self.placement.backend

    def alive(self) -> bool:
        return not self._closed and all(p.is_alive() for p in self._procs)

    def run(self, fn: Any, *args: Any, env: dict[str, str] | None = None) -> list[Any]:
        """Run ``fn(rank, world, *args)`` on every rank (with ``env`` set around the call)."""
        if self._closed:
            raise RuntimeError("this RankPool is closed; create a new one")
        name = getattr(fn, "__name__", None) or fn[1]
        for q in self._tasks:
            q.put((fn, args, dict(env or {})))
        outs: list[Any] = [None] * self.world
        failures = []
        deadline = time.monotonic() + self.task_timeout_s
        for _ in range(self.world):
            while True:
                try:
                    rank, ok, out = self._results.get(timeout=1.0)
                    break
                except queue.Empty:
                    dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
                    if dead or time.monotonic() > deadline:
                        self.close()
                        why = (
                            f"ranks {dead} died"
                            if dead
                            else f"no result in {self.task_timeout_s} s"
                        )
                        raise TimeoutError(f"{name}: {why} (pool closed)") from None
            if ok:
                outs[rank] = out
            else:
                failures.append(f"--- rank {rank} ---\n{out}")
        if failures:
            raise AssertionError(
                f"{name} failed on {len(failures)} rank(s):\n" + "\n".join(failures)
            )
        return outs

    def close(self) -> None:
        """Stop the ranks (killing any that do not exit) and MPS if this pool started it."""
        if self._closed:
            return
        self._closed = True
        try:
            for q, p in zip(getattr(self, "_tasks", []), self._procs, strict=False):
                if p.is_alive():
                    q.put(None)
            for p in self._procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
                    p.join(timeout=5)
        finally:
            if self._mps is not None:
                self._mps.stop()
            self._dir.cleanup()

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def visible_gpus() -> int:
    """GPUs this process may use (0 without CUDA), without creating a CUDA context."""
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def spawn(fn: Callable[..., Any], world: int, *args: Any, num_gpus: int | None = None) -> list:
    """One-shot :class:`RankPool`: ``fn(rank, world, *args)`` on ``world`` ranks."""
    with RankPool(world, num_gpus=num_gpus, task_timeout_s=3600) as pool:
        return pool.run(fn, *args)


def reference_oracle(group: Any = None, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0) -> Any:
    """A ``reference`` Buffer usable with CUDA tensors in any pool.

    Over NCCL it runs on the GPU. Over gloo (shared GPUs) it runs on CPU copies: tensors go to
    the CPU on the way in and back to the caller's device on the way out, so tests compare the
    kernels with the oracle the same way in both modes."""
    from uccl_ep_megatron.api.buffer import Buffer

    buf = Buffer(group, num_nvl_bytes, num_rdma_bytes, backend="reference")
    return buf if buf.device.type == "cuda" else _CpuOracle(buf)


class _CpuOracle:
    """Moves arguments of a CPU reference ``Buffer`` to the CPU and results back."""

    def __init__(self, buf: Any) -> None:
        self._buf = buf

    def __getattr__(self, name: str) -> Any:
        return getattr(self._buf, name)

    def _call(self, name: str, args: tuple, kwargs: dict) -> Any:
        import torch

        devices = [t.device for t in _walk(list(args) + list(kwargs.values())) if t.is_cuda]
        home = devices[0] if devices else torch.device("cpu")
        cpu_args = _map(args, lambda t: t.cpu())
        cpu_kwargs = {k: _map(v, lambda t: t.cpu()) for k, v in kwargs.items()}
        out = getattr(self._buf, name)(*cpu_args, **cpu_kwargs)
        return _map(out, lambda t: t.to(home))

    def get_dispatch_layout(self, *args: Any, **kwargs: Any) -> Any:
        return self._call("get_dispatch_layout", args, kwargs)

    def dispatch(self, *args: Any, **kwargs: Any) -> Any:
        return self._call("dispatch", args, kwargs)

    def combine(self, *args: Any, **kwargs: Any) -> Any:
        return self._call("combine", args, kwargs)


def _walk(obj: Any) -> list:
    import torch

    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, tuple | list):
        return [t for o in obj for t in _walk(o)]
    return []


def _map(obj: Any, f: Callable[[Any], Any]) -> Any:
    """Apply ``f`` to every tensor in nested tuples/lists (handles and events pass through)."""
    import torch

    if isinstance(obj, torch.Tensor):
        return f(obj)
    if isinstance(obj, list):
        return [_map(o, f) for o in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_map(o, f) for o in obj)
    return obj
