"""Every request and response body of the HTTP API, as msgspec Structs, one module per dialect.

Field names follow OpenAI's completions/chat API and vLLM 0.33 (`openai`, `tito`), SGLang 0.5.23
(`sglang`, the RL control routes in `control`, `weight_sync` and `fleet`), for every field r3srv
supports, so clients written for a peer work unchanged. Every field the peers define is served
here, has no effect, or is refused with a 400 naming it (`server/fields.py` holds the table);
fields neither peer has are ignored, as vLLM does.

Errors name fields as the client spelled them: each request's `param_names` maps the engine's
names (SamplingParams and prompt checks) to its own. Each OpenAI request has exactly one
`to_sampling_params`: the one road from the wire to the engine's `SamplingParams`;
`/inference/v1/generate` decodes its `sampling_params` object straight into `SamplingParams`.

The request and response bodies of the generation and info routes are importable from here
(`from r3srv.server import protocol as p; p.CompletionRequest`).
"""

from r3srv.server.protocol.common import *  # noqa: F403
from r3srv.server.protocol.control import *  # noqa: F403
from r3srv.server.protocol.info import *  # noqa: F403
from r3srv.server.protocol.lora import *  # noqa: F403
from r3srv.server.protocol.openai import *  # noqa: F403
from r3srv.server.protocol.sglang import *  # noqa: F403
from r3srv.server.protocol.skyrl import *  # noqa: F403
from r3srv.server.protocol.tito import *  # noqa: F403
