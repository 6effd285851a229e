"""An RL rollout loop against r3srv, as a trainer would run it.

Each episode is multi-turn: turn k's prompt is everything so far plus new user tokens, and
asks only for the routed-experts rows the trainer does not hold yet
(`routed_experts_prompt_start`). After a batch of episodes the trainer writes a checkpoint
and the server switches to it (`/update_weights_from_disk`); every choice names the weights
that produced it, so rows and tokens of one policy are never mixed up with the next.

    r3srv serve CHECKPOINT --enable-return-routed-experts --enable-weight-updates
    python examples/rl_rollout.py --base-url http://127.0.0.1:8000 --next-checkpoint DIR
"""

from __future__ import annotations

import argparse

import httpx
import numpy as np
import openai

from r3srv.serial import decode_routed_experts


def episode(client: openai.OpenAI, model: str, turns: list[list[int]], max_tokens: int) -> tuple[list[int], np.ndarray, set]:
    """(every token of the episode, one routed-experts row per token but the last, weight versions seen)."""
    context: list[int] = []
    rows: np.ndarray | None = None
    versions = set()
    for user_tokens in turns:
        prompt = context + user_tokens
        start = 0 if rows is None else len(rows)  # the rows already held: tokens 0 .. len(context) - 2
        choice = client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=1.0,
            extra_body={"return_token_ids": True, "return_routed_experts": True, "routed_experts_prompt_start": start},
        ).choices[0]
        new_rows = decode_routed_experts(choice.routed_experts)  # rows of tokens start .. len(prompt + output) - 2
        rows = new_rows if rows is None else np.concatenate([rows, new_rows])
        context = prompt + list(choice.token_ids)
        versions.add((choice.model_extra or {}).get("weight_version"))
    assert rows is not None and len(rows) == len(context) - 1, "one row per token but the last"
    return context, rows, versions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--episodes", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--next-checkpoint", help="a checkpoint directory to switch to after the first batch")
    args = parser.parse_args()

    client = openai.OpenAI(base_url=args.base_url + "/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    turns = [[72, 105, 33], [32, 72, 111, 119, 63], [32, 79, 107]]  # token ids of three user turns
    checkpoints = [None, args.next_checkpoint] if args.next_checkpoint else [None]
    for batch, checkpoint in enumerate(checkpoints):
        if checkpoint is not None:
            reply = httpx.post(
                args.base_url + "/update_weights_from_disk",
                json={"model_path": checkpoint, "weight_version": f"batch-{batch}"},
                timeout=600,
            ).json()
            print(f"policy update: {reply}")
        for e in range(args.episodes):
            tokens, rows, versions = episode(client, model, turns, args.max_tokens)
            print(
                f"batch {batch} episode {e}: {len(tokens)} tokens, routed experts {rows.shape} {rows.dtype}, "
                f"weights {sorted(map(str, versions))}"
            )


if __name__ == "__main__":
    main()
