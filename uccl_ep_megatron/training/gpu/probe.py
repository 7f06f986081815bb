"""What the GPU job measures inside megatron-core's MoE layers.

Dispatch/combine time goes through the one recorder (``telemetry.dispatch``): every MoE
layer's dispatcher is instrumented the same way whatever its type, so ``uccl_ep`` and
``alltoall`` report the same quantities (device time from CUDA events, host time from the
CPU clock; see that module for what each includes). Expert load comes from the routers'
routing maps, summed over all ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from uccl_ep_megatron.telemetry import dispatch as dispatch_metrics


class MoEProbe:
    """Dispatch/combine timing (``telemetry.dispatch``) and routing-map load per MoE layer.

    Creating a probe turns the recorder on for this process.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        from megatron.core.transformer.moe.moe_layer import MoELayer

        self.loads: list[torch.Tensor] = []
        layers = [m for m in model.modules() if isinstance(m, MoELayer)]
        for index, layer in enumerate(layers):
            disp = layer.token_dispatcher
            # The uccl_ep dispatcher notes tokens per local expert under its own layer_number.
            dispatch_metrics.instrument(disp, int(getattr(disp, "layer_number", index) or index))
            load = torch.zeros(layer.config.num_moe_experts, device="cuda", dtype=torch.float64)
            self.loads.append(load)
            layer.router.register_forward_hook(self._load_hook(load))
        self.num_layers = len(layers)
        self.layers = layers
        dispatch_metrics.collect()  # drop records from before the probe
        dispatch_metrics.enable()

    def buffer_backends(self) -> list[str]:
        """Backends of the ``Buffer`` objects the MoE layers' dispatchers use (``uccl_ep``)."""
        names = set()
        for layer in self.layers:
            buffer = getattr(layer.token_dispatcher, "buffer", None)
            if buffer is not None and hasattr(buffer, "backend"):
                names.add(str(buffer.backend))
        return sorted(names)

    @staticmethod
    def _load_hook(load: torch.Tensor):
        def hook(_module, _inputs, output):
            routing_map = output[1]
            load.add_(routing_map.sum(0).to(load.dtype))

        return hook

    def collect(self) -> dict[str, float]:
        """Metrics since the last call (syncs the device; all-reduces loads over the world)."""
        torch.cuda.synchronize()
        out: dict[str, float] = {}
        if self.num_layers:
            stacked = torch.stack(self.loads)
            dist.all_reduce(stacked)
            mean = stacked.mean(-1).clamp_min(1e-9)
            out["expert_load_imbalance"] = float((stacked.max(-1).values / mean).mean())
            for load in self.loads:
                load.zero_()
            out.update(dispatch_metrics.collect().summary())
        return out


__all__ = ["MoEProbe"]
