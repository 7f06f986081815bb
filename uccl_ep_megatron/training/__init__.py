"""The training application: the ``train`` job, recipes, the CPU smoke and the GPU loop.

- ``job``: ``uccl-ep-megatron train`` as a function (validation, torchrun relaunch, compare);
- ``recipes``: YAML recipes (load, merge, validate); ``results``: the closing table;
- ``cpu``: the CPU smoke through ``Buffer`` on gloo; ``gpu/``: pretraining on megatron-core.
"""
