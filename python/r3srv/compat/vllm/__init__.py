"""vLLM's in-process API over r3srv's engine, for code written for vLLM (RL frameworks' rollout
workers): swap `import vllm` for `import r3srv.compat.vllm as vllm`.

What is here is naming: vLLM's classes, keywords, prompt forms and method names, each mapped onto
r3srv's own engine, outputs and commands (docs/rl.md, "In-process rollouts"). A vLLM argument that
would change what is sampled and that r3srv does not implement raises an error naming it.
"""

from r3srv.compat.vllm.async_llm import AsyncLLM
from r3srv.compat.vllm.engine_args import AsyncEngineArgs, EngineArgs, ModelConfig, VllmConfig
from r3srv.compat.vllm.llm import LLM
from r3srv.compat.vllm.lora import LoRARequest
from r3srv.compat.vllm.prompts import TextPrompt, TokensPrompt
from r3srv.compat.vllm.sampling import RequestOutputKind, SamplingParams
from r3srv.outputs import CompletionOutput, Logprob, RequestOutput

AsyncLLMEngine = AsyncLLM  # vLLM's older name, still imported by frameworks

__all__ = [
    "AsyncEngineArgs", "AsyncLLM", "AsyncLLMEngine", "CompletionOutput", "EngineArgs", "LLM", "Logprob", "LoRARequest", "ModelConfig",
    "RequestOutput", "RequestOutputKind", "SamplingParams", "TextPrompt", "TokensPrompt", "VllmConfig",
]
