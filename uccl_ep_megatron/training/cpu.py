"""The CPU smoke run of ``uccl-ep-megatron train`` (machines without a GPU).

Megatron-Core's MoE layer needs CUDA (its router moves its weights to the current CUDA
device), so without a GPU ``train`` runs what can run: a DeepSeek-V3-style MoE layer built
from the recipe's routing shapes (experts, top-k, groups, sigmoid scores with expert bias,
shared expert), scaled down in width and tokens so it finishes in seconds, trained for a few
steps in 2 gloo processes with expert parallelism through this package's ``Buffer``
(``reference`` backend) and the autograd ops. Each rank owns ``num_experts / 2`` experts;
the router and the shared expert are replicated and their gradients all-reduced, as in
Megatron. The same metrics as the GPU job are logged (JSONL always, wandb offline when it is
installed); they describe this small layer on CPU, not the recipe's model.

Before training, one forward dispatch/combine round trip is checked against plain indexing:
``combine(dispatch(x))`` must equal ``x`` times the number of distinct ranks each token went to.
"""

from __future__ import annotations

import datetime
import logging
import math
import os
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from uccl_ep_megatron.core.errors import CommTimeoutError, InvalidInputError, UcclEpError

log = logging.getLogger(__name__)

SMOKE_WORLD_SIZE = 2


@dataclass(frozen=True)
class SmokeShapes:
    """Shapes of the CPU smoke MoE layer (recipe routing, scaled-down widths)."""

    hidden: int
    moe_ffn: int
    shared_ffn: int
    num_experts: int
    topk: int
    num_groups: int
    group_topk: int
    score_function: str
    topk_scaling: float
    tokens_per_rank: int

    def forward_flops_per_token(self) -> int:
        """Router + top-k SwiGLU experts + shared SwiGLU expert, 2 FLOPs per multiply-add."""
        h = self.hidden
        return 2 * h * self.num_experts + 2 * 3 * h * (self.topk * self.moe_ffn + self.shared_ffn)


def smoke_shapes(
    model: dict[str, Any], hidden_cap: int = 256, ffn_cap: int = 128, tokens_per_rank: int = 256
) -> SmokeShapes:
    """The recipe's MoE routing shapes with widths capped so a CPU step takes milliseconds.

    Raises:
        InvalidInputError: the recipe has no MoE layers, or its experts do not split over
            :data:`SMOKE_WORLD_SIZE` ranks.
    """
    experts = int(model.get("num_experts") or 0)
    if not experts:
        raise InvalidInputError("the CPU smoke run needs a recipe with MoE layers (num_experts)")
    if experts % SMOKE_WORLD_SIZE:
        raise InvalidInputError(
            f"num_experts={experts} does not split over the smoke run's {SMOKE_WORLD_SIZE} ranks"
        )
    shared = int(model.get("moe_shared_expert_intermediate_size") or 0)
    return SmokeShapes(
        hidden=min(int(model["hidden_size"]), hidden_cap),
        moe_ffn=min(int(model["moe_ffn_hidden_size"]), ffn_cap),
        shared_ffn=min(shared, ffn_cap),
        num_experts=experts,
        topk=int(model["moe_router_topk"]),
        num_groups=int(model.get("moe_router_num_groups") or 1),
        group_topk=int(model.get("moe_router_group_topk") or 1),
        score_function=str(model.get("moe_router_score_function") or "softmax"),
        topk_scaling=float(model.get("moe_router_topk_scaling_factor") or 1.0),
        tokens_per_rank=tokens_per_rank,
    )


def route(
    logits: torch.Tensor, expert_bias: torch.Tensor, s: SmokeShapes
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 routing: scores, group-limited top-k on score + bias, normalized weights.

    Returns:
        ``(topk_idx int64 [T, K], topk_weights float32 [T, K])``; weights carry gradients.
    """
    scores = torch.sigmoid(logits) if s.score_function == "sigmoid" else logits.softmax(-1)
    # The bias steers selection only (auxiliary-loss-free balancing); weights use raw scores.
    select = scores.detach() + expert_bias
    if s.num_groups > 1:
        per_group = s.num_experts // s.num_groups
        grouped = select.view(-1, s.num_groups, per_group)
        # A group's score: the sum of its best topk/group_topk scores (2 for DeepSeek-V3), as
        # in DeepSeek-V3 and megatron-core.
        best = min(per_group, max(1, s.topk // s.group_topk))
        group_score = grouped.topk(best, dim=-1).values.sum(-1)
        keep = group_score.topk(s.group_topk, dim=-1).indices
        mask = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, keep, True)
        select = select.masked_fill(~mask.repeat_interleave(per_group, dim=1), float("-inf"))
    topk_idx = select.topk(s.topk, dim=-1).indices
    weights = scores.gather(1, topk_idx)
    if s.score_function == "sigmoid":
        weights = weights / weights.sum(-1, keepdim=True).clamp_min(1e-20)
    return topk_idx, (weights * s.topk_scaling).float()


def _swiglu(x: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor) -> torch.Tensor:
    gate, up = (x @ w_in).chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up) @ w_out


class SmokeMoE(torch.nn.Module):
    """One expert-parallel MoE layer: router, local routed experts, shared expert."""

    def __init__(self, s: SmokeShapes, rank: int, world: int, seed: int) -> None:
        super().__init__()
        self.s = s
        self.local = s.num_experts // world
        g = torch.Generator().manual_seed(seed)  # replicated weights: same seed on every rank
        std = 0.02
        self.router = torch.nn.Parameter(torch.randn(s.num_experts, s.hidden, generator=g) * std)
        self.register_buffer("expert_bias", torch.zeros(s.num_experts))
        self.shared_in = torch.nn.Parameter(
            torch.randn(s.hidden, 2 * s.shared_ffn, generator=g) * std
        )
        self.shared_out = torch.nn.Parameter(torch.randn(s.shared_ffn, s.hidden, generator=g) * std)
        ge = torch.Generator().manual_seed(seed + 1000 + rank)  # this rank's experts
        self.w_in = torch.nn.Parameter(
            torch.randn(self.local, s.hidden, 2 * s.moe_ffn, generator=ge) * std
        )
        self.w_out = torch.nn.Parameter(
            torch.randn(self.local, s.moe_ffn, s.hidden, generator=ge) * std
        )

    def replicated_parameters(self) -> list[torch.nn.Parameter]:
        return [self.router, self.shared_in, self.shared_out]

    def forward(self, x: torch.Tensor, buffer):
        import uccl_ep_megatron.api.ops as ops
        from uccl_ep_megatron.telemetry.dispatch import recorder

        s = self.s
        topk_idx, topk_w = route(x @ self.router.t(), self.expert_bias, s)
        with recorder.timed(x.device, 0, "dispatch") as nbytes:
            recv_x, recv_idx, recv_w, counts, handle = ops.dispatch(
                buffer, x.to(torch.bfloat16), topk_idx, topk_w, s.num_experts
            )
            nbytes[0] = recv_x.numel() * recv_x.element_size()
        # Experts: every (row, local expert) pair, grouped by expert, then summed back per row
        # with its routing weight. unbind() keeps each expert's gradient a view of one tensor.
        rows = recv_x.float()
        pairs = (recv_idx >= 0).nonzero()
        row_of, expert_of = pairs[:, 0], recv_idx[pairs[:, 0], pairs[:, 1]]
        weight_of = recv_w[pairs[:, 0], pairs[:, 1]]
        order = expert_of.argsort(stable=True)
        row_of, expert_of, weight_of = row_of[order], expert_of[order], weight_of[order]
        sizes = torch.bincount(expert_of, minlength=self.local).tolist()
        w_in, w_out = self.w_in.unbind(0), self.w_out.unbind(0)
        chunks = rows[row_of].split(sizes)
        h = torch.cat([_swiglu(c, w_in[e], w_out[e]) for e, c in enumerate(chunks)])
        out = torch.zeros_like(rows).index_add(0, row_of, h * weight_of.unsqueeze(-1))
        with recorder.timed(x.device, 0, "combine") as nbytes:
            nbytes[0] = recv_x.numel() * recv_x.element_size()
            combined = ops.combine(buffer, out.to(torch.bfloat16), handle)
        y = combined.float()
        if s.shared_ffn:
            y = y + _swiglu(x, self.shared_in, self.shared_out)
        return y, topk_idx


def _round_trip_check(buffer, x: torch.Tensor, topk_idx: torch.Tensor, s: SmokeShapes, world: int):
    """combine(dispatch(x)) == x * distinct destination ranks, from plain indexing."""
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, s.num_experts)
    recv_x, _, _, _, handle, _ = buffer.dispatch(
        x,
        topk_idx=topk_idx,
        topk_weights=torch.ones(topk_idx.shape, dtype=torch.float32),
        num_tokens_per_rank=per_rank,
        is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert,
    )
    combined, _, _ = buffer.combine(recv_x, handle)
    dest = topk_idx // (s.num_experts // world)
    distinct = torch.stack([(dest == r).any(-1) for r in range(world)], -1).sum(-1)
    expected = x.float() * distinct.unsqueeze(-1).float()
    err = (combined.float() - expected).abs().max().item()
    if not err <= 1e-2 * max(1.0, expected.abs().max().item()):
        raise UcclEpError(
            f"CPU smoke: combine(dispatch(x)) differs from x * destination ranks by {err:.3g}; "
            "the Buffer reference backend is broken"
        )


def _train_step(model, buffer, teacher, opt, s, cfg: dict[str, Any], world: int):
    """One step of the smoke model: forward through the Buffer, backward, the replicated
    gradients averaged, the optimizer, and the auxiliary-loss-free bias update. Returns the
    loss, the step's per-expert load and its wall time."""
    import torch.distributed as dist

    t0 = time.perf_counter()
    x = torch.randn(s.tokens_per_rank, s.hidden)
    y, topk_idx = model(x, buffer)
    loss = torch.nn.functional.mse_loss(y, x @ teacher)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    for p in model.replicated_parameters():
        dist.all_reduce(p.grad)
        p.grad /= world
    opt.step()
    # Auxiliary-loss-free balancing (DeepSeek-V3): overloaded experts get a lower bias.
    load = torch.bincount(topk_idx.flatten(), minlength=s.num_experts).float()
    dist.all_reduce(load)
    model.expert_bias -= cfg["bias_update_rate"] * torch.sign(load - load.mean())
    return loss, load, time.perf_counter() - t0


def _log_step(metrics, step, loss, load, step_time, s, world: int, flops_per_token) -> None:
    """The step's means over ranks (loss, time, dispatch/combine times and bytes) to the
    metrics log (rank 0 writes)."""
    import torch.distributed as dist

    from uccl_ep_megatron.telemetry import dispatch as dispatch_metrics
    from uccl_ep_megatron.telemetry.metrics import bandwidth_gbps, expert_load_imbalance

    comm = dispatch_metrics.collect().summary()
    keys = ("dispatch_time_ms", "combine_time_ms", "dispatch_host_ms", "combine_host_ms")
    stats = torch.tensor(
        [loss.item(), step_time, comm["dispatch_bytes"], *(comm[k] for k in keys)],
        dtype=torch.float64,
    )
    dist.all_reduce(stats)
    stats /= world
    mean_loss, step_time, nbytes, *times = stats.tolist()
    comm = dict(zip(keys, times, strict=True))
    tokens_per_s = s.tokens_per_rank * world / step_time
    metrics.log(
        step,
        {
            "loss": mean_loss,
            "step_time_s": step_time,
            "tokens_per_s": tokens_per_s,
            "tokens_per_s_per_gpu": tokens_per_s / world,
            "tflops_per_gpu": flops_per_token * tokens_per_s / world / 1e12,
            **comm,
            "dispatch_gbps": bandwidth_gbps(nbytes, comm["dispatch_time_ms"] / 1e3),
            "combine_gbps": bandwidth_gbps(nbytes, comm["combine_time_ms"] / 1e3),
            "expert_load_imbalance": expert_load_imbalance(load.tolist()),
        },
    )


def _worker(rank: int, world: int, init_file: str, cfg: dict[str, Any]) -> None:
    import torch.distributed as dist

    from uccl_ep_megatron.api.buffer import Buffer
    from uccl_ep_megatron.telemetry import dispatch as dispatch_metrics
    from uccl_ep_megatron.telemetry.metrics import MetricsLogger

    # These processes form their own one-host job: a launcher's variables inherited from the
    # parent (torchrun's LOCAL_WORLD_SIZE=1, ...) would make the Buffer see one node per rank.
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world)
    )
    torch.set_num_threads(1)
    logging.basicConfig(level=cfg["log_level"], format=f"[rank{rank}] %(levelname)s %(message)s")
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=cfg["timeout_s"]),
    )
    s = SmokeShapes(**cfg["shapes"])
    hint = Buffer.get_dispatch_config(world).get_nvl_buffer_size_hint(s.hidden * 2, world)
    hint = max(hint, Buffer.get_combine_config(world).get_nvl_buffer_size_hint(s.hidden * 2, world))
    buffer = Buffer(None, hint, 0, backend="reference")
    torch.manual_seed(cfg["seed"] + rank)
    model = SmokeMoE(s, rank, world, cfg["seed"])
    # A fixed random linear teacher (same on every rank) gives the layer something to learn.
    teacher = torch.randn(
        s.hidden, s.hidden, generator=torch.Generator().manual_seed(7)
    ) / math.sqrt(s.hidden)
    opt = torch.optim.Adam(model.parameters(), lr=cfg["lr"])
    metrics = MetricsLogger(
        cfg["run_dir"],
        cfg["config"],
        project=cfg["wandb_project"],
        use_wandb=cfg["use_wandb"],
        enabled=rank == 0,
    )
    flops_per_token = 3 * s.forward_flops_per_token()
    x0 = torch.randn(s.tokens_per_rank, s.hidden).to(torch.bfloat16)
    idx0, _ = route(x0.float() @ model.router.detach().t(), model.expert_bias, s)
    _round_trip_check(buffer, x0, idx0, s, world)
    # Dispatch/combine timings go through the one recorder (on the CPU: host wall time in both
    # the device and the host columns).
    dispatch_metrics.enable()
    try:
        for step in range(1, cfg["steps"] + 1):
            loss, load, step_time = _train_step(model, buffer, teacher, opt, s, cfg, world)
            _log_step(metrics, step, loss, load, step_time, s, world, flops_per_token)
        metrics.summary({"steps": cfg["steps"], "backend": buffer.backend, "device": "cpu"})
    finally:
        metrics.close()
        buffer.destroy()
        dist.destroy_process_group()


def run_cpu_smoke(
    recipe,
    run_dir: Path,
    steps: int = 12,
    wandb_project: str | None = None,
    use_wandb: bool = True,
    timeout_s: float = 120.0,
    extra_config: dict[str, Any] | None = None,
) -> Path:
    """Run the CPU smoke training in :data:`SMOKE_WORLD_SIZE` spawned gloo processes.

    Returns:
        ``run_dir`` (with ``metrics.jsonl``, ``config.json``, ``summary.json`` and, when wandb
        is installed, ``wandb/offline-run-*``).

    Raises:
        CommTimeoutError: the ranks did not finish within ``timeout_s`` (names the ranks).
        UcclEpError: a rank failed (its error is in the message).
    """
    import torch.multiprocessing as mp

    if steps < 1:
        raise InvalidInputError(f"--iters {steps}: the smoke run needs at least 1 step")
    shapes = smoke_shapes(recipe.model)
    run_dir = Path(run_dir)
    cfg = {
        "shapes": asdict(shapes),
        "steps": steps,
        "seed": int(recipe.training.get("seed") or 1234),
        "lr": 1e-2,
        "bias_update_rate": float(recipe.model.get("moe_router_bias_update_rate") or 1e-3),
        "run_dir": str(run_dir),
        "wandb_project": wandb_project,
        "use_wandb": use_wandb,
        "timeout_s": timeout_s,
        "log_level": logging.getLogger().level or logging.WARNING,
        "config": {
            "recipe": recipe.name,
            "mode": "cpu-smoke",
            "dispatcher": "uccl_ep (Buffer, reference backend)",
            "world_size": SMOKE_WORLD_SIZE,
            **{f"smoke_{k}": v for k, v in asdict(shapes).items()},
            **(extra_config or {}),
        },
    }
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        ctx = mp.start_processes(
            _worker,
            args=(SMOKE_WORLD_SIZE, init_file, cfg),
            nprocs=SMOKE_WORLD_SIZE,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + timeout_s
        try:
            while not ctx.join(timeout=max(0.1, min(1.0, deadline - time.monotonic()))):
                if time.monotonic() > deadline:
                    alive = [i for i, p in enumerate(ctx.processes) if p.is_alive()]
                    raise CommTimeoutError(
                        f"CPU smoke: rank(s) {alive} still running after {timeout_s:g} s "
                        "(stalled in a gloo collective or the Buffer); raise --timeout or rerun "
                        "with --log-level DEBUG"
                    )
        except mp.ProcessRaisedException as exc:
            raise UcclEpError(f"CPU smoke run failed on a rank:\n{exc}") from None
        except mp.ProcessExitedException as exc:
            raise UcclEpError(f"CPU smoke run: a rank exited abnormally: {exc}") from None
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.terminate()
                    p.join(5)
    return run_dir


__all__ = ["SMOKE_WORLD_SIZE", "SmokeMoE", "SmokeShapes", "route", "run_cpu_smoke", "smoke_shapes"]
