"""Record what vLLM 0.33's and SGLang 0.5.23's own request classes decide on generated bodies.

For each generation route r3srv shares with a peer, every field of the peer's request class
(tests/data/peer_fields.json) is set, one at a time, on a small valid body to each of a fixed
list of probe values: valid ones, type-swapped ones (`"2"` for an int, `"true"` for a bool,
`1.0` for an int, `1` for a string), out-of-range ones, and extra fields neither peer has.
The peer's own classes decide each body, the way its HTTP server does before the engine sees
the request:

- vLLM (`/v1/completions`, `/v1/chat/completions`, `/inference/v1/generate`): pydantic's
  `model_validate` of CompletionRequest / ChatCompletionRequest / GenerateRequest (lax mode, as
  FastAPI validates a body), then `to_sampling_params` with the route's `get_max_tokens`
  (max_model_len 64), which builds vLLM's SamplingParams and runs its `_verify_args`.
- SGLang (`/generate`): pydantic's validation of the GenerateReqInput dataclass (as FastAPI),
  then SGLang's JSON contract gate (`api_contract.generate_contract_error`, strict types, unknown
  sampling_params keys refused), `normalize_batch_and_arguments()`, and each prompt's
  `SamplingParams(**sampling_params).verify(vocab_size)`.

Each verdict is "ok" with the value the peer coerced the probed field to (JSON), or "error"
with the field the peer's error names (pydantic's location, VLLMValidationError's parameter;
null when the peer names none, as SGLang's contract gate). tests/test_peer_verdicts.py decodes
the same bodies with r3srv and holds it to the same decisions and values.

This imports the peers' real protocol modules, so it runs outside CI, in a throwaway virtual
environment that sees the project's packages (torch, transformers, pydantic, msgspec) and has
the peers' few other import-time dependencies; modules needing a GPU build are stubbed:

    python3.11 -m venv "$VENV"    # any throwaway directory
    echo "$PWD/.venv/lib/python3.11/site-packages" > "$VENV/lib/python3.11/site-packages/zz_project.pth"
    "$VENV/bin/pip" install cbor2 psutil pyzmq openai-harmony pillow cachetools cloudpickle uvloop \\
        ipython dill sentencepiece gguf partial-json-parser && "$VENV/bin/pip" install --no-deps compressed-tensors
    "$VENV/bin/python" tools/peer_verdicts.py SRC   # SRC: the unzipped vllm==0.33.0 and sglang==0.5.23 wheels

It writes tests/data/peer_verdicts.json (`--check` compares instead).
"""

from __future__ import annotations

import copy
import enum
import importlib.abc
import importlib.machinery
import json
import math
import sys
import types
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests/data/peer_verdicts.json"
MAX_MODEL_LEN = 64
VOCAB_SIZE = 259  # the built-in model's: ids in the bodies stay inside it

# A small valid body per route; each probe sets one field of it.
BASES: dict[str, dict[str, Any]] = {
    "completions": {"prompt": "hi", "max_tokens": 2},
    "chat": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    "tito": {"token_ids": [5, 6], "sampling_params": {"max_tokens": 2}},
    "sglang": {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}},
}
# (route, nested object or None, the peer class whose fields are probed)
OBJECTS = [
    ("completions", None, "vllm.CompletionRequest"),
    ("chat", None, "vllm.ChatCompletionRequest"),
    ("tito", None, "vllm.GenerateRequest"),
    ("tito", "sampling_params", "vllm.SamplingParams"),
    ("sglang", None, "sglang.GenerateReqInput"),
    ("sglang", "sampling_params", "sglang.SamplingParams"),
]
# Values every field is probed with: of every JSON type, numbers as strings, bools as numbers
# and strings, fractions, negatives, a 64-bit overflow, cache-salt-like strings.
PROBES: list[Any] = [
    None, True, False, 0, 1, 2, -1, -2, 1.0, 2.0, 2.5, 0.5, -0.5, 3.0, 2**63,
    "1", "2", " 3 ", "1_0", "2.0", "2.5", "-1", "true", "false", "True", "yes", "off", "abc", "", "nan",
    "a/b", "model@v1", "x" * 200,
    [], [1, 2], ["a"], [[1, 2]], {}, {"a": 1}, {"5": 1.5}, {"5": "1.5"},
]
# Fields neither peer defines: vLLM ignores them, SGLang too (but not in sampling_params).
EXTRA_FIELDS = ["r3srv_no_such_field", "guided_json"]


def jsonable(value: Any) -> Any:
    """A coerced value as JSON (what the test compares r3srv's decoded value with)."""
    if isinstance(value, enum.Enum):
        return jsonable(value.value)
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, (str, int, bool)) or value is None:
        return value
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted(jsonable(v) for v in value)
    dump = getattr(value, "model_dump", None)
    if dump is not None:
        return jsonable(dump(mode="json"))
    try:
        import msgspec

        return jsonable(msgspec.to_builtins(value))
    except Exception:
        return repr(value)


# ---------------------------------------------------------------- importing the peers


class _Anything:
    """Stands in for any attribute of a stubbed module (a GPU kernel library)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> _Anything:
        return _Anything()

    def __getattr__(self, name: str) -> _Anything:
        return _Anything()

    def __mro_entries__(self, bases: tuple) -> tuple:
        return (object,)

    def __iter__(self):
        return iter(())

    def __bool__(self) -> bool:
        return False


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything()


class _Stubs(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Module finder for packages a protocol module imports but never uses to validate."""

    def __init__(self, roots: set[str]) -> None:
        self.roots = roots

    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name.split(".")[0] in self.roots:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def import_peers(source: Path) -> types.SimpleNamespace:
    sys.path.insert(0, str(source))
    import transformers.utils.import_utils  # noqa: F401  (its availability checks run before the stubs exist)

    sys.meta_path.append(_Stubs({"torchvision", "tvm_ffi", "sgl_kernel"}))
    import pydantic
    from vllm.sampling_params import SamplingParams as VllmSamplingParams

    # What pydantic converted sampling_params' fields to, before SamplingParams.__post_init__
    # rewrites some (stop into a list, ...): hooked before GenerateRequest's schema is built.
    converted: dict[str, Any] = {}
    build = VllmSamplingParams._validate_msgspec.__func__

    def capture(cls: type, data: Any) -> Any:
        converted.clear()
        converted.update(data if isinstance(data, dict) else {})
        return build(cls, data)

    VllmSamplingParams._validate_msgspec = classmethod(capture)
    from sglang.srt.entrypoints.api_contract import generate_contract_error
    from sglang.srt.managers.io_struct import GenerateReqInput
    from sglang.srt.sampling.sampling_params import SamplingParams as SglangSamplingParams
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateRequest
    from vllm.entrypoints.serve.utils.api_utils import get_max_tokens
    from vllm.exceptions import VLLMClientError

    return types.SimpleNamespace(**locals())


# ---------------------------------------------------------------- verdicts


def _error_param(exc: BaseException) -> str | None:
    """The field an error names: VLLMValidationError's parameter, else pydantic's location."""
    import pydantic

    if isinstance(exc, pydantic.ValidationError):
        first = exc.errors()[0]
        inner = (first.get("ctx") or {}).get("error")
        if getattr(inner, "parameter", None):
            return inner.parameter
        loc = [str(part) for part in first["loc"] if not isinstance(part, int)]
        return ".".join(loc) or None
    return getattr(exc, "parameter", None)


class Recorder:
    def __init__(self, peers: types.SimpleNamespace) -> None:
        self.p = peers
        self.sglang_adapter = peers.pydantic.TypeAdapter(peers.GenerateReqInput)

    def verdict(self, route: str, body: dict[str, Any], nested: str | None, name: str) -> dict[str, Any]:
        try:
            value = getattr(self, route)(copy.deepcopy(body), nested, name)
        except (ValueError, TypeError, AssertionError, self.p.VLLMClientError) as exc:  # a 4xx in the peer
            return {"error": _error_param(exc)}
        except Exception as exc:  # the peer would answer 500: r3srv must still answer 400
            return {"crash": type(exc).__name__}
        return {"ok": value}

    def _vllm_openai(self, cls: type, body: dict[str, Any], name: str, chat: bool) -> Any:
        req = cls.model_validate(body)
        requested = req.max_tokens
        if chat and req.max_completion_tokens is not None:
            requested = req.max_completion_tokens
        max_tokens = self.p.get_max_tokens(MAX_MODEL_LEN, requested, 2, {},
                                           truncate_prompt_tokens=req.truncate_prompt_tokens)
        req.to_sampling_params(max_tokens, {})
        return jsonable(getattr(req, name, None))

    def completions(self, body: dict[str, Any], nested: str | None, name: str) -> Any:
        return self._vllm_openai(self.p.CompletionRequest, body, name, chat=False)

    def chat(self, body: dict[str, Any], nested: str | None, name: str) -> Any:
        return self._vllm_openai(self.p.ChatCompletionRequest, body, name, chat=True)

    def tito(self, body: dict[str, Any], nested: str | None, name: str) -> Any:
        req = self.p.GenerateRequest.model_validate(body)
        if nested is not None:
            return jsonable(self.p.converted.get(name))
        return jsonable(getattr(req, name, None))

    def sglang(self, body: dict[str, Any], nested: str | None, name: str) -> Any:
        obj = self.sglang_adapter.validate_python(copy.deepcopy(body))
        error = self.p.generate_contract_error(body)
        if error is not None:
            raise ValueError(error)
        value = None if nested is not None else jsonable(getattr(obj, name, None))
        obj.normalize_batch_and_arguments()
        params = obj.sampling_params if isinstance(obj.sampling_params, list) else [obj.sampling_params]
        for sp in params:
            self.p.SglangSamplingParams(**(sp or {})).verify(VOCAB_SIZE)
        if nested is not None:  # the contract is strict: what passes it is used as sent
            sp = body.get(nested)
            return jsonable(sp.get(name) if isinstance(sp, dict) else None)
        return value


def probe_bodies(fields: dict[str, list[str]]) -> list[tuple[str, str | None, str, Any, dict[str, Any]]]:
    """(route, nested, field, value, body) for every probe of every field."""
    out = []
    for route, nested, key in OBJECTS:
        names = fields[key] + EXTRA_FIELDS
        for name in names:
            for value in PROBES:
                body = copy.deepcopy(BASES[route])
                target = body if nested is None else body.setdefault(nested, {})
                target[name] = value
                out.append((route, nested, name, value, body))
    return out


def generate(source: Path) -> dict[str, Any]:
    peer_fields = json.loads((ROOT / "tests/data/peer_fields.json").read_text())
    peers = import_peers(source)
    recorder = Recorder(peers)
    cases = []
    for route, nested, name, value, body in probe_bodies({k: v["fields"] for k, v in peer_fields["classes"].items()}):
        cases.append({"route": route, "nested": nested, "field": name, "value": value,
                      **recorder.verdict(route, body, nested, name)})
    import pydantic

    return {
        "generated_by": "tools/peer_verdicts.py",
        "versions": {**peer_fields["versions"], "pydantic": pydantic.VERSION},
        "max_model_len": MAX_MODEL_LEN,
        "vocab_size": VOCAB_SIZE,
        "bases": BASES,
        "cases": cases,
    }


def render(table: dict[str, Any]) -> str:
    # one case per line: reviewable diffs when a peer release changes a verdict
    head = {k: v for k, v in table.items() if k != "cases"}
    lines = [json.dumps(case, sort_keys=True) for case in table["cases"]]
    return json.dumps(head, indent=1)[:-2] + ',\n "cases": [\n' + ",\n".join(lines) + "\n ]\n}\n"


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from peer_fields import run_tool

    return run_tool(argv, __doc__, OUT, lambda source: render(generate(source)), "tools/peer_verdicts.py")


if __name__ == "__main__":
    sys.exit(main())
