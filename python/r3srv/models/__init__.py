"""MoE model families (one module each in models/families/), their loader and the built-in model.

Entry point: `r3srv.models.loader.load_model(path, device=..., dtype=...)`.
"""
