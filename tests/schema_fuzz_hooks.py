"""schemathesis hooks of the fuzz runs (SCHEMATHESIS_HOOKS, tests/schema_fuzzing.py): the deep
run's acceptance check, positive_data_acceptance less the refusals the peers answer too.

A request the published schema admits may still be refused for what no JSON Schema of the route
says: a rule across fields, a value vLLM's or SGLang's own classes refuse in the same place
(`n: 1.0` where vLLM's SamplingParams wants an int), or the server's state (a weight update not
begun). Each such refusal is listed below with its route and reason; any other 400 for a
schema-valid request stays a failure, so a long run exits 0 only when every refusal it met is one
the peers give as well.
"""

from __future__ import annotations

import json
import re

import schemathesis
from schemathesis.openapi.checks import RejectedPositiveData
from schemathesis.specs.openapi.checks import positive_data_acceptance

# the generation routes of vLLM's kind (SamplingParams underneath), and all of them
VLLM_GENERATION = ("POST /v1/completions", "POST /v1/chat/completions", "POST /inference/v1/generate",
                   "POST /skyrl/v1/generate")
GENERATION = (*VLLM_GENERATION, "POST /generate")

# (operation, pattern of the error's message): refusals the peers give as well, by why
PEER_REFUSALS: tuple[tuple[str, str], ...] = (
    # -- what vLLM's or SGLang's own request classes refuse in the same place --
    # vLLM: a completion needs a non-empty prompt and at least one token to make (0 only with echo);
    # chat messages that render to no tokens; tools, when given, not empty
    ("POST /v1/completions",
     r"^prompt must be provided and non-empty|^prompt token lists must not be empty|^prompt (is|must not be) empty"
     r"|^max_tokens=0 must be at least 1|^prompt must be a string, a list of strings"),
    ("POST /v1/chat/completions",
     r"^`tools` must not be an empty array|^messages is empty"
     r"|^when using `top_logprobs`, `logprobs` must be set to true|^When using `tool_choice`, `tools` must be set"),
    # vLLM: tools the model may call need a server started with a tool parser
    ("POST /v1/chat/completions", r"^tools: tool calling needs a server started with --enable-auto-tool-choice"),
    # vLLM's TokenizeRequest is one of two bodies: a prompt or messages
    ("POST /tokenize", r"^give exactly one of prompt or messages"),
    # SGLang's GenerateReqInput: input_ids, when given, not empty; its contract gate types the
    # sampling params exactly (server/coerce.py's strict fields)
    ("POST /generate", r"^input_ids cannot be empty|^\w+: Expected `int( \| [\w |]+)?`, got `float`"),
    # vLLM's token-in routes: text out needs detokenizing; a prompt that holds no tokens
    ("POST /inference/v1/generate", r"^output_mode='text' requires sampling_params.detokenize"),
    ("POST /skyrl/v1/generate", r"^token_ids is empty"),
    # the routed experts' and indexer's offsets (the wire contract: a bad offset is a 400), vLLM's cache_salt
    *((op, r"^(routed_experts|indexer_topk)_prompt_start=-?\d+ (must be >= 0|is outside)"
           r"|^cache_salt=.* must be a non-empty string") for op in VLLM_GENERATION),
    # vLLM's SamplingParams(**raw JSON), as SkyRL's route builds it: its ints must be ints, n >= 1
    ("POST /skyrl/v1/generate", r"^\w+: Expected `int`, got `float`|^n=-?\d+ must be >= 1"),
    # vLLM: logit_bias keys are token ids
    *((op, r"^logit_bias=.* keys cannot be converted to integer token ids")
      for op in ("POST /v1/completions", "POST /v1/chat/completions")),
    # vLLM's SamplingParams: min_tokens <= max_tokens
    *((op, r"^min_tokens=\d+ must be <= max_tokens") for op in VLLM_GENERATION),
    # the sampling params' value rules, worded "field=value must ...": vLLM's SamplingParams
    # ranges (presence_penalty in [-2, 2], top_k -1, 0 or positive, truncation_side left or right,
    # ...), which the schemas of vLLM's own routes leave open too
    *((op, r"^\w+=.* must (be|not)") for op in GENERATION),
    # vLLM: stream_options only with stream; SGLang: text or input_ids, meta info not streamed
    *((op, r"^stream_options can only be set when stream is true")
      for op in ("POST /v1/completions", "POST /v1/chat/completions", "POST /inference/v1/generate")),
    ("POST /generate", r"^text: give text or input_ids|^sampling_params has \d+ entries for \d+ prompts"
     r"|is not a field of this object \(the peer refuses unknown keys here\)"),
    # vLLM: logit_bias keys are token ids; at most --max-logprobs logprobs
    *((op, r"`\$\.sampling_params\.logit_bias`$|^(top_)?logprobs: requested -?\d+, which is greater than max allowed")
      for op in VLLM_GENERATION),
    *((op, r"^return_meta_info is not supported with streaming")
      for op in ("POST /v1/completions", "POST /v1/chat/completions")),
    # vLLM's /pause modes, SGLang's memory tags and load sections
    ("POST /pause", r"^mode must be one of "),
    ("POST /release_memory_occupation", r"^unknown memory tags "),
    ("POST /resume_memory_occupation", r"^unknown memory tags "),
    ("GET /v1/loads", r"^Invalid include sections"),
    ("GET /get_load", r"^Invalid include sections"),
    # -- what depends on the model or the server's state --
    # token ids past this model's vocabulary; a data-parallel rank this server does not have
    *((op, r"outside the vocabulary") for op in ("POST /detokenize", *GENERATION)),
    *((op, r"^dp_rank -?\d+ does not exist") for op in ("GET /v1/loads", "GET /get_load")),
    # a prompt (with its tokens to make) past this server's max_model_len (vLLM's 400 too)
    *((op, r"max_model_len=|^min_tokens=\d+ exceeds the \d+ tokens this request may generate") for op in GENERATION),
    # router weights asked of a server started without their capture (the flag the message names)
    *((op, r"^return_routed_expert_weights=true, but this engine was started without") for op in GENERATION),
    # the weight-update protocols' order: a step before the one it needs, a group never made
    ("POST /end_weight_update", r"^no weight-update session is open"),
    ("POST /begin_weight_update", r"^a weight-update session is already open"),
    ("POST /finish_weight_update", r"^no weight update was started|^no weights arrived for"),
    ("POST /update_weights_from_distributed",
     r"^no weight update group named|^names, dtypes and shapes must|^dtypes: .* is not a torch dtype"),
    ("POST /destroy_weights_update_group", r"^no weight update group named"),
    ("POST /shutdown_weight_transfer_engine", r"^no weight update group named"),
    ("POST /init_broadcaster", r"^rank_offset must be in \[1, world_size\)|^could not join "),
    # vLLM's init_info is a free dict: a rendezvous without an address cannot start
    ("POST /init_weight_transfer_engine",
     r"master_address and master_port are required|packed_\w+ must be positive"),
    ("POST /update_weights", r"^/update_weights needs weight_dir"),
    # -- what r3srv does not serve, refused naming the field (DESIGN's rule, never ignored) --
    *((op, r"draft model") for op in ("POST /start_draft_weight_update", "POST /begin_weight_update",
                                       "POST /update_weights_from_distributed", "POST /update_weights_from_tensor")),
    ("POST /init_broadcaster", r"^quantize_in_weight_transfer .* is not supported"),
    ("POST /init_weight_transfer_engine", r"nccl_unique_id_b64 is not supported"),
    *((op, r"^load_format .* is not supported") for op in ("POST /update_weights_from_distributed",
                                                            "POST /update_weights_from_tensor")),
    *((op, r"^format=.* is not served") for op in ("GET /v1/loads", "GET /get_load")),
    ("POST /update_weights_from_tensor", r"hands over CUDA IPC handles, and this server runs on the cpu"),
    *((op, r"content parts are supported by r3srv") for op in ("POST /v1/chat/completions", "POST /tokenize")),
    ("POST /inference/v1/generate", r"^content_parts\[\d+\]: only image_url parts are supported by r3srv"),
    *((op, r"^image_data: an image has no field") for op in ("POST /generate", "POST /v1/chat/completions")),
)


def peer_refusal(operation: str, body: bytes) -> bool:
    """Whether a 400's body is one of PEER_REFUSALS for `operation` ("POST /path")."""
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return False
    return any(op == operation and re.search(pattern, str(message)) for op, pattern in PEER_REFUSALS)


@schemathesis.check
def positive_data_acceptance_but_peer_refusals(ctx, response, case):
    """positive_data_acceptance, but a 400 that PEER_REFUSALS lists passes."""
    try:
        return positive_data_acceptance(ctx, response, case)
    except RejectedPositiveData:
        if response.status_code == 400 and peer_refusal(case.operation.label, response.content):
            return None
        raise
