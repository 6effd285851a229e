"""The synchronous engine: input processor -> engine core -> output processor, on one thread.

The offline `LLM` drives it step by step. `AsyncLLM` uses the same three pieces, each on
its own side of a thread boundary (docs/architecture.md, "Engine").
"""

from __future__ import annotations

from dataclasses import dataclass, field

from r3srv.config import EngineConfig, engine_config
from r3srv.engine.commands import commands_as_methods
from r3srv.engine.core import MEMORY_TAGS, EngineCore, EngineFacts, EngineStats
from r3srv.engine.input_processor import EngineRequest, InputProcessor, prompt_and_images
from r3srv.engine.output_processor import OutputProcessor, ProcessedOutputs
from r3srv.engine.requests import CoreOutputs
from r3srv.engine_options import with_option_keywords
from r3srv.outputs import RequestOutput
from r3srv.sampling_params import SamplingParams
from r3srv.vision.inputs import MultiModalPrompt

__all__ = ["MEMORY_TAGS", "EngineStats", "LLMEngine", "StepResult"]


@dataclass
class StepResult:
    # requests that changed this step (only the finished ones for FINAL_ONLY requests)
    outputs: list[RequestOutput] = field(default_factory=list)
    failed: list[tuple[str, BaseException]] = field(default_factory=list)  # (request_id, error)
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0


@commands_as_methods("at_once")
class LLMEngine(EngineFacts):
    """The engine on the caller's thread; its control methods (update_weights, release_memory,
    ...) come from engine/commands.py and run at once."""

    def __init__(self, config: EngineConfig) -> None:
        self.core = EngineCore(config)
        core = self.core
        self.input_processor = InputProcessor.of(core)
        self.output_processor = OutputProcessor(core.tokenizer)

    @classmethod
    @with_option_keywords
    def from_kwargs(cls, model: str | None = None, **options) -> "LLMEngine":
        """Every engine option (r3srv.config) as a keyword."""
        return cls(engine_config(model, **options))

    # -- facts (EngineFacts: config, tokenizer, model_config, max_model_len, device, ...) --
    @property
    def released_memory(self) -> set[str]:
        return self.core.released_memory

    @property
    def model(self):
        """The in-process executor's model (for inspection; the core reaches it only through the executor)."""
        return self.core.executor.model

    @property
    def runner(self):
        """The in-process executor's model runner (for inspection: graph steps, ...)."""
        return self.core.executor.runner

    @property
    def rows(self):
        """The core's slot-indexed routed-experts rows (None when capture is off)."""
        return self.core.rows

    @property
    def block_manager(self):
        return self.core.block_manager

    @property
    def scheduler(self):
        return self.core.scheduler

    @property
    def requests(self) -> dict:
        """The core's requests in flight, by id."""
        return self.core.requests

    # -- requests -----------------------------------------------------------------------
    def prepare_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams | None, *, add_special_tokens: bool = True,
        lora_name: str | None = None, multimodal: MultiModalPrompt | None = None,
    ) -> EngineRequest:
        """InputProcessor.process: every problem is an InvalidRequestError raised here, before scheduling.
        A dict prompt may carry images (input_processor.prompt_and_images); multimodal: the
        images of a prompt of expanded ids (InputProcessor.expand_images)."""
        self.core.lora_ref(lora_name)  # an unknown adapter: refused before anything is scheduled
        prompt, images = prompt_and_images(prompt)
        return self.input_processor.process(request_id, prompt, params, add_special_tokens=add_special_tokens,
                                            images=images, lora_name=lora_name, multimodal=multimodal)

    def add_prepared(self, prep: EngineRequest) -> None:
        self.core.add_request(prep)
        self.output_processor.add_request(prep)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None, *,
                    lora_name: str | None = None) -> None:
        self.add_prepared(self.prepare_request(request_id, prompt, params, lora_name=lora_name))

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request and free its blocks; returns its final output (finish_reason "abort")."""
        if self.core.abort_request(request_id) is None:
            return None
        return self.output_processor.abort(request_id)

    def retract_running(self) -> int:
        return self.core.retract_running()

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (nothing to do at one device)."""
        self.core.shutdown()

    def has_unfinished(self) -> bool:
        return self.core.has_unfinished()

    def stats(self) -> EngineStats:
        return self.core.stats()

    # -- the step -----------------------------------------------------------------------
    def step(self) -> StepResult:
        core_out = self.core.step()
        result = StepResult(num_prefill_tokens=core_out.num_prefill_tokens, num_decode_tokens=core_out.num_decode_tokens)
        processed = process_outputs(self.core, self.output_processor, core_out)
        result.outputs, result.failed = processed.outputs, processed.failed
        return result


def process_outputs(core: EngineCore, output_processor: OutputProcessor, core_out: CoreOutputs) -> ProcessedOutputs:
    """The output processor's pass over a step's updates, with its stop strings and failures
    carried back to the core at once (on one thread: the offline engine)."""
    done = ProcessedOutputs()
    while True:
        processed = output_processor.process(core_out)
        done.outputs += processed.outputs
        done.failed += processed.failed
        for rid in processed.to_abort:
            core.abort_request(rid)
        if not processed.stops:
            return done
        core_out = CoreOutputs()
        for stop in processed.stops:
            core_out.extend(core.stop_sequence(stop.request_id, stop.index, stop.num_output_tokens, stop.stop))
