"""Which replica serves a generation: the one that caches the prompt's prefix, unless it is much busier.

The front hashes the prompt in blocks. Token ids are cut into blocks of the KV block size (so a
matched block is a cached KV block); a text prompt is first encoded with the served model's
tokenizer (prompt_encoder), so that a conversation whose first turn is text and whose next turns
are token ids (an RL agent appending the ids it got back) keeps one key; a chat's messages,
encoded one after the other as JSON, are cut into blocks of BLOCK_CHARS characters. Each block's
hash chains the one before it (as a prefix cache keys its blocks), so a match is always a whole
prefix. A conversation's next turn starts with the previous turn's prompt, finds its blocks
recorded under the replica that served it, and goes there.

A prompt's images (front/images.py: a digest of each image's bytes) make a second chain, one
block per image in prompt order, beside the prompt's own: a replica's match is the prefix it
holds of each chain, added. So a repeat whose ids fill no block before the replica expands its
image placeholders still finds the replica holding its images, a next turn that adds an image
keeps the first turn's, and a first image sent in a later turn still matches the text before
it. A chat's image parts enter its text without their URLs (a data: URI would otherwise fill
thousands of text blocks).

Balance first, as the SGLang router's cache_aware policy does: when the busiest replica has more
than BALANCE_ABS requests in flight beyond the idlest and more than BALANCE_REL times as many,
the idlest takes the request whatever it caches. Otherwise the longest recorded prefix wins; a
request that matches nothing goes to the idlest (ties: the one with the fewest recorded blocks,
then in turn).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec

from r3srv.front.images import is_image_part

logger = logging.getLogger("r3srv.fleet")

# ~16 tokens of English text: a text block is about a KV block
BLOCK_CHARS = 64
# recorded blocks over all replicas; the least recently used are forgotten first
MAX_BLOCKS = 1 << 18
BALANCE_ABS = 32
BALANCE_REL = 1.5

Key = tuple[str, Sequence[Any]]  # ("ids", token ids), ("text", a prompt's characters) or ("chat", messages as JSON)


def prompt_key(body: Any) -> Key | None:
    """What identifies a request's prefix, from its JSON body: the first prompt of whichever field
    the dialect names it with (vLLM's token_ids, SGLang's input_ids / text, OpenAI's prompt /
    messages); None when the body has none of them."""
    if not isinstance(body, dict):
        return None
    for field in ("token_ids", "input_ids", "prompt", "text"):
        if field in body:
            return _first_prompt(body[field])
    messages = body.get("messages")
    if isinstance(messages, list) and messages:
        return "chat", "".join(msgspec.json.encode(_without_image_urls(m)).decode() for m in messages)
    return None


def _without_image_urls(message: Any) -> Any:
    content = message.get("content") if isinstance(message, dict) else None
    if not isinstance(content, list) or not any(is_image_part(part) for part in content):
        return message
    return {**message, "content": [{"type": "image_url"} if is_image_part(part) else part for part in content]}


def _first_prompt(value: Any) -> Key | None:
    for _ in range(3):  # a prompt, a batch of them, a batch of token-id lists: the first prompt decides
        if isinstance(value, str):
            return "text", value
        if not isinstance(value, list) or not value:
            return None
        first = value[0]
        if isinstance(first, int) and not isinstance(first, bool):
            return "ids", value
        value = first
    return None


def prompt_encoder(model: str | None) -> Callable[[str], list[int]] | None:
    """The served model's tokenizer (as its replicas load it), or None: text is then keyed by characters."""
    from r3srv.models.builtin import BUILTIN_MODEL_NAME, builtin_model_dir
    from r3srv.tokenizer import Tokenizer

    path = builtin_model_dir() if model is None or (model == BUILTIN_MODEL_NAME and not Path(model).is_dir()) else Path(model)
    if not (path / "tokenizer.json").is_file():
        return None
    try:
        return Tokenizer.from_dir(path).encode
    except Exception as exc:  # a tokenizer the replicas cannot load either: they say so themselves
        logger.warning("the front keys text prompts by characters: cannot load %s's tokenizer (%s)", path, exc)
        return None


class PrefixAwarePolicy:
    def __init__(self, num_replicas: int, block_tokens: int) -> None:
        self.num_replicas = num_replicas
        self.block_tokens = block_tokens
        self._owners: OrderedDict[int, set[int]] = OrderedDict()  # block hash -> replicas that served it
        self._recorded = [0] * num_replicas
        self._turn = 0

    def block_hashes(self, key: Key | None) -> list[int]:
        if key is None:
            return []
        kind, items = key
        size = self.block_tokens if kind == "ids" else BLOCK_CHARS
        hashes, previous = [], hash(kind)
        for end in range(size, len(items) + 1, size):
            previous = hash((previous, tuple(items[end - size:end]) if kind == "ids" else items[end - size:end]))
            hashes.append(previous)
        return hashes

    def image_hashes(self, digests: Sequence[bytes]) -> list[int]:
        """One chained block per image (digests from front/images.py), a chain of its own."""
        hashes, previous = [], hash("images")
        for digest in digests:
            previous = hash((previous, digest))
            hashes.append(previous)
        return hashes

    def choose(self, hashes: list[int], candidates: Sequence[int], in_flight: Sequence[int],
               images: Sequence[int] = ()) -> int:
        """The replica (one of `candidates`, not empty) for a request whose prefix blocks are `hashes`
        and whose images' blocks are `images`."""
        loads = {i: in_flight[i] for i in candidates}
        idlest, busiest = min(loads.values()), max(loads.values())
        if not (busiest - idlest > BALANCE_ABS and busiest > BALANCE_REL * idlest):
            best, best_len = None, 0
            for i in candidates:
                matched = self._matched(hashes, i) + self._matched(images, i)
                if matched > best_len or (matched == best_len and best is not None and loads[i] < loads[best]):
                    best, best_len = i, matched
            if best is not None and best_len > 0:
                return best
        return self._idlest(candidates, loads)

    def _matched(self, hashes: Sequence[int], replica: int) -> int:
        n = 0
        for h in hashes:
            if replica not in self._owners.get(h, ()):
                break
            n += 1
        return n

    def _idlest(self, candidates: Sequence[int], loads: dict[int, int]) -> int:
        order = sorted(candidates, key=lambda i: (loads[i], self._recorded[i], (i - self._turn) % self.num_replicas))
        self._turn = (order[0] + 1) % self.num_replicas
        return order[0]

    def record(self, hashes: list[int], replica: int) -> None:
        """`replica` now caches these blocks (it is serving their request)."""
        for h in hashes:
            owners = self._owners.get(h)
            if owners is None:
                owners = self._owners[h] = set()
            else:
                self._owners.move_to_end(h)
            if replica not in owners:
                owners.add(replica)
                self._recorded[replica] += 1
        while len(self._owners) > MAX_BLOCKS:
            _, owners = self._owners.popitem(last=False)
            for i in owners:
                self._recorded[i] -= 1

    def forget(self, replica: int) -> None:
        """A replica restarted: its cache is empty."""
        for h in [h for h, owners in self._owners.items() if replica in owners]:
            owners = self._owners[h]
            owners.discard(replica)
            if not owners:
                del self._owners[h]
        self._recorded[replica] = 0
