"""The paged-KV, continuous-batching engine: input_processor -> core (scheduler, pools, rows) ->
executor (the model) -> output_processor; llm_engine.py runs them on one thread, async_llm.py
on three sides of two threads (docs/architecture.md, "Engine")."""
