"""A multi-turn rollout through prime-rl's own client code, run in .verifiers_venv (verifiers 0.4.0,
renderers 0.1.12) by tests/test_verifiers_client.py; imports nothing of r3srv.

verifiers' TrainClient renders each turn with renderers (the chat template of the checkpoint's
tokenizer), posts it to /inference/v1/generate with `routed_experts_prompt_start` set to the
reused prefix (bridged turns), and its trace graph stitches the turns' rows, logprobs and tokens
into one branch, as prime-rl's orchestrator hands them to its trainer:

    python verifiers_rollout.py BASE_URL CHECKPOINT MODEL TURNS SEED OUT.json
"""

from __future__ import annotations

import asyncio
import json
import random
import sys

from verifiers.v1.clients.train import TrainClient
from verifiers.v1.configs.client import TrainClientConfig
from verifiers.v1.dialects.chat import ChatDialect
from verifiers.v1.graph import prepare_turn
from verifiers.v1.trace import AgentInfo, Trace, TraceTask
from verifiers.v1.types import SamplingConfig, UserMessage

WORDS = ("route", "expert", "token", "layer", "batch", "replay", "policy", "reward", "gate", "cache")
MAX_TOKENS = 6


def user_turn(rng: random.Random) -> UserMessage:
    return UserMessage(content=" ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 7))) + "?")


async def rollout(base_url: str, checkpoint: str, model: str, turns: int, seed: int) -> dict:
    rng = random.Random(seed)
    client = TrainClient(TrainClientConfig(base_url=base_url + "/v1", renderer_model_name=checkpoint))
    trace = Trace(task=TraceTask(type="generated", data={"seed": seed}), agent=AgentInfo(config={}))
    sampling = SamplingConfig(temperature=0.0, max_tokens=MAX_TOKENS)
    messages, starts = [], []
    try:
        for _ in range(turns):
            messages.append(user_turn(rng))
            turn = prepare_turn(trace, list(messages))
            starts.append(turn.path_len)
            response = await client.get_response(ChatDialect(), {"model": model}, sampling, turn=turn)
            turn.commit(response)
            messages.append(response.message)
    finally:
        await client.close()
    branch = trace.branches[-1]
    rows = branch.routed_experts
    return {
        "token_ids": branch.token_ids,
        "sampled": [bool(m) for node in branch.nodes for m in (node.mask or [False] * len(node.token_ids))],
        "logprobs": branch.logprobs,
        "rows": None if rows is None else rows.tolist(),
        "rows_dtype": None if rows is None else str(rows.dtype),
        "turn_prefix_lengths": starts,
    }


if __name__ == "__main__":
    base_url, checkpoint, model, turns, seed, out = sys.argv[1:7]
    result = asyncio.run(rollout(base_url, checkpoint, model, int(turns), int(seed)))
    with open(out, "w", encoding="utf-8") as f:
        json.dump(result, f)
