"""r3srv: an OpenAI-compatible MoE server that returns the routed experts of every token."""

__version__ = "0.1.0"

__all__ = ["LLM", "AsyncLLM", "SamplingParams", "__version__"]


def __getattr__(name: str):
    # Lazy, so `import r3srv` (e.g. for r3srv.serial) does not import torch.
    if name == "LLM":
        from r3srv.engine.llm import LLM

        return LLM
    if name == "AsyncLLM":
        from r3srv.engine.async_llm import AsyncLLM

        return AsyncLLM
    if name == "SamplingParams":
        from r3srv.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'r3srv' has no attribute {name!r}")
