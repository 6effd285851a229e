"""The paged-KV, continuous-batching engine (see llm_engine.py for the step loop)."""
