"""MoE model families (see config.ARCHITECTURE_FAMILIES), their loader and the built-in model.

Entry point: `r3srv.models.loader.load_model(path, device=..., dtype=...)`.
"""
