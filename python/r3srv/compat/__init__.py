"""Other engines' in-process APIs over r3srv's own engine, for RL frameworks that hold an
engine object instead of calling a server (r3srv.compat.vllm: vLLM's names and semantics)."""
