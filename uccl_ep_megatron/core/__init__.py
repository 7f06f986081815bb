"""The bottom layer: errors, ``Config`` + the environment registry, events, the ``_C`` loader.

Nothing here imports another layer of the package (or its root), so every layer may use it.
"""
