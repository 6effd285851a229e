"""The offline API: `LLM(...).generate(prompts, sampling_params)`, shaped like vLLM's."""

from __future__ import annotations

import asyncio
import itertools
import numbers
from collections.abc import Sequence as SequenceABC

from r3srv.engine.commands import commands_as_methods
from r3srv.engine.llm_engine import EngineStats, LLMEngine
from r3srv.engine_options import with_option_keywords
from r3srv.errors import InvalidRequestError
from r3srv.outputs import OutputKind, RequestOutput
from r3srv.sampling_params import SamplingParams
from r3srv.vision.chat import chat_images

PromptType = str | list[int] | dict  # a dict: vLLM's, with multi_modal_data (input_processor.prompt_and_images)


@commands_as_methods("through_engine")
class LLM:
    """Batch generation on one device (or tensor-parallel ranks); the control methods
    (update_weights, release_memory, ...) come from engine/commands.py.

    `LLM()` loads the built-in model, whose weights are random (deterministic from a
    fixed seed): its text is gibberish, but its routing has a real MoE's shape.
    """

    @with_option_keywords
    def __init__(self, model: str | None = None, **options) -> None:
        """Every engine option (r3srv.config) as a keyword, with its default; a ConfigError for a
        bad value or an unknown keyword."""
        self.engine = LLMEngine.from_kwargs(model, **options)
        self._ids = itertools.count()
        self._trainer = None  # TrainerUpdates, once a trainer joins

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (they also stop when this process exits)."""
        self.engine.shutdown()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def model_config(self):
        return self.engine.model_config

    @property
    def routed_experts_info(self) -> dict | None:
        return self.engine.routed_experts_info

    # -- a trainer pushing weights over torch.distributed (SGLang Engine's names; docs/weight_sync.md)
    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str = "weight_update_group", backend: str = "gloo",
                                  timeout: float = 600.0) -> str:
        """Join the trainer's process group (the trainer, rank 0, joins at the same time):
        as rank rank_offset, or under tensor parallelism every rank, rank_offset + its rank."""
        updates = self.trainer_updates()
        updates.sync.timeout = timeout  # seconds a rendezvous or a broadcast may wait for the trainer
        return asyncio.run(updates.sync.join(master_address=master_address, master_port=master_port,
                                             rank_offset=rank_offset, world_size=world_size, group_name=group_name,
                                             backend=backend))

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                        group_name: str = "weight_update_group",
                                        weight_version: str | None = None) -> str:
        """Receive the announced tensors, broadcast by the trainer in this order; once they
        fill every parameter (with earlier calls' staged ones) they replace the weights."""
        from r3srv.engine.weight_sync import named_tensor_metas

        named = named_tensor_metas(names, dtypes, shapes, dtypes_param="dtypes")
        return asyncio.run(self.trainer_updates().receive(group_name, named, weight_version=weight_version))

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> None:
        asyncio.run(self.trainer_updates().sync.leave(group_name))

    def trainer_updates(self):
        """The road for weights a trainer sends (engine/weight_sync.py), made on first use."""
        from r3srv.engine.weight_sync import OfflineTrainerEngine, TrainerUpdates

        if self._trainer is None:
            self._trainer = TrainerUpdates(OfflineTrainerEngine(self.engine.core), 600.0)
        return self._trainer

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def generate(
        self,
        prompts: PromptType | list[PromptType],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
        add_special_tokens: bool = True,
        lora_name: str | None | list[str | None] = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (a string, a list of token ids, or vLLM's dict with
        multi_modal_data images); outputs come back in prompt order.

        add_special_tokens: let the tokenizer add its specials (e.g. a BOS) to string prompts.
        lora_name: the LoRA adapter (loaded by load_lora_adapter) every prompt, or each prompt,
        runs under; None: the base model. Prompts of different adapters share steps.

        Every request is validated before any is scheduled: one bad prompt or offset raises
        InvalidRequestError and nothing runs.
        """
        return self._generate(_as_prompt_list(prompts), sampling_params, use_tqdm=use_tqdm,
                              add_special_tokens=add_special_tokens, lora_name=lora_name)

    def _generate(self, prompts: list, sampling_params, *, use_tqdm: bool, add_special_tokens: bool, lora_name,
                  multimodal: list | None = None) -> list[RequestOutput]:
        """generate's work; multimodal: each prompt's images expanded already (its prompt their
        expanded token ids), or None."""
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise InvalidRequestError(
                    f"got {len(params_list)} sampling_params for {len(prompts)} prompts; pass one, or one per prompt",
                    param="sampling_params",
                )
        engine = self.engine
        loras = lora_name if isinstance(lora_name, list) else [lora_name] * len(prompts)
        if len(loras) != len(prompts):
            raise InvalidRequestError(f"got {len(loras)} lora_name for {len(prompts)} prompts", param="lora_name")
        images = multimodal or [None] * len(prompts)
        prepared = [
            engine.prepare_request(str(next(self._ids)), p, sp, add_special_tokens=add_special_tokens, lora_name=lora,
                                   multimodal=mm)
            for p, sp, lora, mm in zip(prompts, params_list, loras, images)
        ]
        for prep in prepared:
            prep.output_kind = OutputKind.FINAL_ONLY  # generate() only collects finished requests
            engine.add_prepared(prep)
        order = {prep.request_id: i for i, prep in enumerate(prepared)}
        results: list[RequestOutput | None] = [None] * len(prepared)
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(prepared), desc="Generating", dynamic_ncols=True)
        try:
            while any(r is None for r in results):
                step = engine.step()
                if step.failed:
                    raise step.failed[0][1]
                for out in step.outputs:
                    if out.finished:
                        results[order[out.request_id]] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            for prep in prepared:
                engine.abort_request(prep.request_id)
            raise
        finally:
            if bar is not None:
                bar.close()
        return results  # type: ignore[return-value]

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
        lora_name: str | None | list[str | None] = None,
    ) -> list[RequestOutput]:
        """Render each conversation with the tokenizer's chat template, then generate. Images come
        as vLLM's offline chat takes them (image_url parts with data: URIs, image_pil parts;
        r3srv/vision/chat.py); their problems are 400s naming the part."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        processor = self.engine.input_processor
        prompts, multimodal = [], []
        for conv in conversations:
            template_messages, images, fields = chat_images(conv)
            if not images:
                prompts.append(processor.render_chat(template_messages))
                multimodal.append(None)
                continue
            ids, mm = processor.expand_images(processor.chat_prompt_ids(template_messages), images, param="messages",
                                              fields=fields)
            prompts.append(ids)
            multimodal.append(mm)
        # The template writes the specials itself (a second BOS would shift every token).
        return self._generate(prompts, sampling_params, use_tqdm=use_tqdm, add_special_tokens=False,
                              lora_name=lora_name, multimodal=multimodal)


def _as_prompt_list(prompts) -> list[PromptType]:
    if hasattr(prompts, "tolist") and not isinstance(prompts, (list, str)):  # a numpy array of ids
        prompts = prompts.tolist()
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, SequenceABC) and prompts and all(isinstance(t, numbers.Integral) for t in prompts):
        return [list(prompts)]  # one prompt of token ids
    if not isinstance(prompts, SequenceABC):
        raise InvalidRequestError("prompts must be a string, a list of token ids, or a list of those", param="prompt")
    return list(prompts)
