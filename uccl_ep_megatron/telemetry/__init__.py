"""Telemetry: one metrics system (``dispatch`` records, ``metrics`` writes), report, FLOPs.

- ``dispatch``: the recorder that times token dispatch/combine (device and host time), per MoE
  layer, for every dispatcher;
- ``metrics``: metric names, ``metrics.jsonl`` and wandb;
- ``megatron_lm``: the same records inside Megatron-LM's own training log;
- ``report``: tables and plots of finished runs; ``flops``: model FLOPs and parameter counts.
"""
