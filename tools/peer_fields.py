"""Extract the request and response field names of vLLM's and SGLang's protocol classes.

Reads the peers' own source files (unzipped wheels) with `ast`; nothing of vLLM or SGLang
is imported, so it runs without their dependencies. Writes tests/data/peer_fields.json,
which the server's field table is checked against (tests/test_server_fields.py).

    pip download --no-deps -d wheels vllm==0.33.0 sglang==0.5.23
    mkdir src && for w in wheels/*.whl; do unzip -q -o "$w" -d src; done
    python tools/peer_fields.py src [--check]

A field is a class-body annotated name (pydantic model, dataclass or msgspec Struct) that
does not start with "_" and is not a ClassVar; fields of base classes defined in the same
module are included, as the class decodes them.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
from pathlib import Path

# (key, peer, module path under the source root, class name)
CLASSES = [
    ("vllm.CompletionRequest", "vllm", "vllm/entrypoints/openai/completion/protocol.py", "CompletionRequest"),
    ("vllm.ChatCompletionRequest", "vllm", "vllm/entrypoints/openai/chat_completion/protocol.py", "ChatCompletionRequest"),
    ("vllm.GenerateRequest", "vllm", "vllm/entrypoints/scale_out/token_in_token_out/protocol.py", "GenerateRequest"),
    ("vllm.SamplingParams", "vllm", "vllm/sampling_params.py", "SamplingParams"),
    ("sglang.GenerateReqInput", "sglang", "sglang/srt/managers/io_struct.py", "GenerateReqInput"),
    ("sglang.SamplingParams", "sglang", "sglang/srt/sampling/sampling_params.py", "SamplingParams"),
    # responses: r3srv sends every key these carry (null included)
    ("vllm.CompletionResponse", "vllm", "vllm/entrypoints/openai/completion/protocol.py", "CompletionResponse"),
    ("vllm.CompletionResponseChoice", "vllm", "vllm/entrypoints/openai/completion/protocol.py", "CompletionResponseChoice"),
    ("vllm.ChatCompletionResponse", "vllm", "vllm/entrypoints/openai/chat_completion/protocol.py", "ChatCompletionResponse"),
    ("vllm.ChatCompletionResponseChoice", "vllm", "vllm/entrypoints/openai/chat_completion/protocol.py",
     "ChatCompletionResponseChoice"),
    ("vllm.ChatMessage", "vllm", "vllm/entrypoints/openai/chat_completion/protocol.py", "ChatMessage"),
    ("vllm.UsageInfo", "vllm", "vllm/entrypoints/serve/engine/protocol.py", "UsageInfo"),
    ("vllm.GenerateLogProbsContent", "vllm", "vllm/entrypoints/scale_out/token_in_token_out/protocol.py",
     "GenerateLogProbsContent"),
    ("vllm.ChatCompletionLogProbsContent", "vllm", "vllm/entrypoints/openai/chat_completion/protocol.py",
     "ChatCompletionLogProbsContent"),
]


def _version(root: Path, peer: str) -> str:
    path = root / peer / "_version.py"  # written by the wheel's build (setuptools-scm)
    text = path.read_text() if path.exists() else ""
    match = re.search(r"^__version__\s*=\s*(?:version\s*=\s*)?['\"]([^'\"]+)['\"]", text, re.M)
    if match:
        return match.group(1)
    raise SystemExit(f"cannot find the version of {peer} under {root}")


def _is_classvar(annotation: ast.expr) -> bool:
    node = annotation.value if isinstance(annotation, ast.Subscript) else annotation
    return (isinstance(node, ast.Name) and node.id == "ClassVar") or (
        isinstance(node, ast.Attribute) and node.attr == "ClassVar"
    )


def class_fields(tree: ast.Module, name: str) -> list[str]:
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
    if name not in classes:
        raise SystemExit(f"class {name} not found")
    fields: list[str] = []
    cls = classes[name]
    for base in cls.bases:  # bases of the same module come first, as Python orders fields
        if isinstance(base, ast.Name) and base.id in classes:
            fields += [f for f in class_fields(tree, base.id) if f not in fields]
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            field = node.target.id
            if not field.startswith("_") and not _is_classvar(node.annotation) and field not in fields:
                fields.append(field)
    return fields


def extract(root: Path) -> dict:
    versions = {peer: _version(root, peer) for peer in ("vllm", "sglang")}
    classes = {}
    for key, peer, module, name in CLASSES:
        tree = ast.parse((root / module).read_text(), filename=module)
        classes[key] = {"module": module, "fields": class_fields(tree, name)}
    return {"generated_by": "tools/peer_fields.py", "versions": versions, "classes": classes}


def render(table: dict) -> str:
    return json.dumps(table, indent=1) + "\n"


def run_tool(argv: list[str] | None, doc: str, default_out: Path, make_text, tool: str) -> int:
    """The command line the peer tools share: SOURCE [--out FILE] [--check]; `make_text(source)`
    is the file's content."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("source", type=Path, help="the peers' unzipped wheels (holding vllm/ and sglang/)")
    parser.add_argument("--out", type=Path, default=default_out)
    parser.add_argument("--check", action="store_true", help="exit 1 if --out differs from what the peers give")
    args = parser.parse_args(argv)
    text = make_text(args.source)
    if args.check:
        same = args.out.exists() and args.out.read_text() == text
        print("up to date" if same else f"{args.out} is stale: rerun {tool}")
        return 0 if same else 1
    args.out.write_text(text)
    print(f"wrote {args.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    out = Path(__file__).resolve().parents[1] / "tests/data/peer_fields.json"
    return run_tool(argv, __doc__, out, lambda source: render(extract(source)), "tools/peer_fields.py")


if __name__ == "__main__":
    sys.exit(main())
