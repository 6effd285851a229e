"""The input processor: a request's prompt and SamplingParams in, a validated EngineRequest out.

Tokenization, chat templates and every check that needs the prompt's length happen here,
once, before the engine core sees the request (so `routed_experts_prompt_start` is checked
where the prompt length is first known, and the core never asserts on a bad offset). It
reads only the tokenizer and fixed configuration, so any thread may call it: AsyncLLM runs
it on the caller's event loop for small inputs and on a worker thread for large ones
(r3srv/offload.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from r3srv.engine.indexer_topk import IndexerTopkLimits
from r3srv.errors import InvalidRequestError
from r3srv.outputs import OutputKind
from r3srv.sampling_params import SamplingParams
from r3srv.vision.inputs import ImageInputConfig, MultiModalPrompt, with_images


@dataclass
class EngineRequest:
    """A validated request, ready for the engine core and the output processor."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int
    return_routed_experts: bool
    # FINAL_ONLY for a consumer that waits for the end (non-streaming HTTP, offline generate):
    # no per-step outputs. DELTA for a streaming one: per-step outputs cost the new tokens only,
    # where CUMULATIVE ones copy every token and logprob so far, every step.
    output_kind: OutputKind = OutputKind.CUMULATIVE
    # a vision-language prompt's images (prompt_token_ids holds their expanded placeholders)
    multimodal: MultiModalPrompt | None = None
    lora_name: str | None = None  # the LoRA adapter it runs under (None: the base model)


class InputProcessor:
    def __init__(self, tokenizer, vocab_size: int, max_model_len: int, enable_return_routed_experts: bool,
                 max_logprobs: int = 20, images: ImageInputConfig | None = None,
                 return_sampling_mask: bool = False, enable_return_routed_expert_weights: bool = False,
                 indexer_topk: IndexerTopkLimits = IndexerTopkLimits()) -> None:
        self.tokenizer = tokenizer
        self.indexer_topk = indexer_topk  # what return_indexer_topk may ask
        self.enable_return_routed_expert_weights = enable_return_routed_expert_weights
        self.return_sampling_mask = return_sampling_mask  # the default of requests that leave it None
        self.images = images  # None: the served model takes no images
        self.max_logprobs = max_logprobs  # -1: the whole vocabulary
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.enable_return_routed_experts = enable_return_routed_experts

    @classmethod
    def of(cls, core) -> InputProcessor:
        """The input processor of an EngineCore (its tokenizer, vocabulary, limits)."""
        return cls(core.tokenizer, core.model_config.vocab_size, core.max_model_len, core.enable_return_routed_experts,
                   core.config.max_logprobs, core.image_inputs, core.config.return_sampling_mask,
                   core.config.enable_return_routed_expert_weights,
                   IndexerTopkLimits.of(core.config, core.model_config))

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, **template_kwargs) -> str:
        """A conversation as prompt text, through the tokenizer's chat template: the one place
        every chat road renders (LLM.chat, the chat and tokenize routes). `template_kwargs` reach
        the template as variables (tools, chat_template_kwargs). Process the text with
        add_special_tokens=False (chat_prompt_ids does): the template writes the specials
        itself (the tokenizer adding a second BOS would shift every token). A template that
        rejects the messages is an InvalidRequestError naming `messages`."""
        if self.tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer (no tokenizer.json): no chat template", param="messages")
        try:
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                      **template_kwargs)
        except InvalidRequestError:
            raise
        except Exception as exc:  # e.g. a template reading a key these messages lack
            raise InvalidRequestError(f"cannot apply the chat template to these messages: {exc}",
                                      param="messages") from exc

    def chat_prompt_ids(self, messages: list[dict], add_generation_prompt: bool = True, **template_kwargs) -> list[int]:
        """render_chat's text as token ids, without the tokenizer's specials (the template's own)."""
        text = self.render_chat(messages, add_generation_prompt, **template_kwargs)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def expand_images(self, ids: list[int], images: list, *, param: str,
                      fields: list[str] | None = None) -> tuple[list[int], MultiModalPrompt]:
        """The prompt's token ids with its images' placeholders expanded, and its images
        (r3srv/vision/inputs.py); CPU work (decoding, resizing), so callers off the event loop.
        Errors name `param`, or fields[k] (default `param[k]`) for image k."""
        if self.images is None:
            raise InvalidRequestError(param=param, problem=": this model takes no image inputs")
        return with_images(ids, images, self.images, param=param, fields=fields)

    def process(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None,
        *,
        add_special_tokens: bool = True,
        images: list | None = None,
        images_param: str = "multi_modal_data",
        multimodal: MultiModalPrompt | None = None,
        lora_name: str | None = None,
    ) -> EngineRequest:
        """Validate and tokenize; every problem is an InvalidRequestError raised here, before scheduling.

        add_special_tokens=False for a rendered chat template: it already holds the BOS
        and other specials, and the tokenizer's post-processor would add a second BOS.
        images: the prompt's images in order (bytes, PIL images or (H, W, 3) uint8 arrays),
        one placeholder run each in the prompt (r3srv/vision/inputs.py); their problems are
        400s naming `images_param` (the field the client sent them in). multimodal: images
        expanded already (expand_images), `prompt` being their expanded token ids.
        """
        if params is None:
            params = SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError(
                    "this model has no tokenizer (no tokenizer.json): send the prompt as token ids", param="prompt"
                )
            text: str | None = prompt
            ids = list(self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens))
        else:
            text = None
            try:
                ids = [int(t) for t in prompt]
            except (TypeError, ValueError):
                raise InvalidRequestError(param="prompt", problem=" must be a string or a list of token ids") from None
        if images:
            ids, multimodal = self.expand_images(ids, list(images), param=images_param)
        if multimodal is not None and params.truncate_prompt_tokens is not None:
            raise InvalidRequestError(param="truncate_prompt_tokens", problem=" cannot cut a prompt with images")
        ids = self._truncated(ids, params)
        if not ids:
            raise InvalidRequestError(param="prompt", problem=" is empty (it has no tokens)")
        vocab = self.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(param="prompt", problem=f" holds token id {bad}, outside the vocabulary [0, {vocab})")
        bad = next((t for t in params.stop_token_ids or () if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(param="stop_token_ids", problem=f" holds {bad}, outside the vocabulary [0, {vocab})")
        self._check_sampling_limits(params)
        n_prompt = len(ids)
        if params.prompt_logprobs_start > n_prompt:
            raise InvalidRequestError(
                param="prompt_logprobs_start",
                problem=f"={params.prompt_logprobs_start} is beyond the prompt's {n_prompt} tokens",
            )
        start = params.routed_experts_prompt_start
        if not 0 <= start <= n_prompt:
            raise InvalidRequestError(
                param="routed_experts_prompt_start",
                # past the end in SGLang's words (its clients and tests look for them)
                problem=f"={start} is outside 0..{n_prompt} (the prompt has {n_prompt} tokens)"
                + (": it is higher than the number of input tokens" if start > n_prompt else ""),
            )
        max_len = self.max_model_len
        if n_prompt >= max_len and multimodal is not None:  # the images' placeholders filled the context
            image_tokens = sum(image.num_tokens(multimodal.merge) for image in multimodal.images)
            raise InvalidRequestError(
                param=images_param, problem=f": the images take {image_tokens} of the prompt's {n_prompt} tokens, "
                f"leaving no room to generate within max_model_len={max_len}")
        if n_prompt >= max_len:
            raise InvalidRequestError(
                param="prompt",
                problem=f" has {n_prompt} tokens, leaving no room to generate within max_model_len={max_len}",
            )
        max_tokens = params.max_tokens if params.max_tokens is not None else max_len - n_prompt
        if n_prompt + max_tokens > max_len:
            raise InvalidRequestError(
                param="max_tokens",
                problem=f"={max_tokens} plus the prompt's {n_prompt} tokens exceeds max_model_len="
                f"{max_len}; ask for at most {max_len - n_prompt} tokens",
            )
        if params.min_tokens > max_tokens:
            raise InvalidRequestError(
                param="min_tokens", problem=f"={params.min_tokens} exceeds the {max_tokens} tokens this request may generate"
            )
        want = params.return_routed_experts
        if want and not self.enable_return_routed_experts:
            raise InvalidRequestError(
                "return_routed_experts=true, but this engine was started without routed-experts capture; "
                "start it with --enable-return-routed-experts (enable_return_routed_experts=True)",
                param="return_routed_experts",
            )
        if want is None:
            want = self.enable_return_routed_experts
        if params.return_routed_expert_weights:
            self._check_weights_wanted(bool(want))
        params = self.indexer_topk.resolve(params, n_prompt, max_tokens)
        if params.return_sampling_mask is None:  # resolved once: the sampler reads the params
            params = msgspec.structs.replace(params, return_sampling_mask=self.return_sampling_mask)
        return EngineRequest(str(request_id), text, ids, params, max_tokens, bool(want), multimodal=multimodal,
                             lora_name=lora_name)

    def _check_weights_wanted(self, rows_wanted: bool) -> None:
        if not self.enable_return_routed_expert_weights:
            raise InvalidRequestError(
                "return_routed_expert_weights=true, but this engine was started without router-weights capture; "
                "start it with --enable-return-routed-expert-weights (enable_return_routed_expert_weights=True)",
                param="return_routed_expert_weights")
        if not rows_wanted:
            raise InvalidRequestError("return_routed_expert_weights=true needs the routed experts they weigh; "
                                      "do not set return_routed_experts=false", param="return_routed_expert_weights")

    def _truncated(self, ids: list[int], params: SamplingParams) -> list[int]:
        """The prompt after truncate_prompt_tokens, checked in vLLM's order: a size above
        max_model_len is refused before truncating; -1 keeps max_model_len - 1 tokens."""
        keep = params.truncate_prompt_tokens
        if keep is None:
            return ids
        if keep > self.max_model_len:
            raise InvalidRequestError(
                param="truncate_prompt_tokens",
                problem=f"={keep} cannot be greater than max_model_len={self.max_model_len}; "
                "request a smaller truncation size",
            )
        if keep == -1:
            keep = self.max_model_len - 1
        if keep >= len(ids):
            return ids
        return ids[len(ids) - keep :] if params.truncation_side == "left" else ids[:keep]

    def _check_sampling_limits(self, params: SamplingParams) -> None:
        """What SamplingParams cannot check alone: logit_bias ids against the vocabulary, and logprob
        counts against max_logprobs (-1, the whole vocabulary, counts as vocab_size), as vLLM."""
        vocab = self.vocab_size
        bad = sorted(t for t in (params.logit_bias or ()) if not 0 <= t < vocab)
        if bad:
            raise InvalidRequestError(param="logit_bias", problem=f" holds token ids {bad}, outside the vocabulary [0, {vocab})")
        limit = vocab if self.max_logprobs == -1 else self.max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            asked = getattr(params, name)
            asked = vocab if asked == -1 else asked
            if asked is not None and asked > limit:
                raise InvalidRequestError(
                    param=name,
                    problem=f": requested {asked}, which is greater than max allowed: {limit} "
                    "(the server's --max-logprobs; -1 asks for the whole vocabulary)",
                )


def prompt_and_images(prompt) -> tuple[str | list[int], list | None]:
    """A prompt as vLLM's offline API takes it: a string, token ids, or a dict with "prompt" or
    "prompt_token_ids" and "multi_modal_data" ({"image": one image or a list}); (prompt, images)."""
    if not isinstance(prompt, dict):
        return prompt, None
    unknown = sorted(set(prompt) - {"prompt", "prompt_token_ids", "multi_modal_data"})
    if unknown or ("prompt" in prompt) == ("prompt_token_ids" in prompt):
        raise InvalidRequestError(param="prompt", problem=" as a dict needs one of prompt / prompt_token_ids, and "
                                  f"besides only multi_modal_data{f' (unknown: {unknown})' if unknown else ''}")
    text = prompt.get("prompt", prompt.get("prompt_token_ids"))
    data = prompt.get("multi_modal_data") or {}
    other = sorted(set(data) - {"image"})
    if other:
        raise InvalidRequestError(param=f"multi_modal_data.{other[0]}", problem=": only images are supported")
    images = data.get("image")
    if images is None:
        return text, None
    return text, list(images) if isinstance(images, (list, tuple)) else [images]
