"""MoE model families (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE), their loader and the built-in model.

Entry point: `r3srv.models.loader.load_model(path, device=..., dtype=...)`.
"""
