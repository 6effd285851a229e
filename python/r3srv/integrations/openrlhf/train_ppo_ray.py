"""OpenRLHF's PPO entry point with r3srv's engines:

    python -m r3srv.integrations.openrlhf.train_ppo_ray [--r3srv.engine_kwargs JSON] <openrlhf.cli.train_ppo_ray arguments>

It rebinds one attribute, `openrlhf.trainer.ray.create_vllm_engines` (the package's exported
factory, in its `__all__`), to r3srv's factory, then runs `openrlhf.cli.train_ppo_ray` as
`__main__` (its argument parser lives under `if __name__ == "__main__"`). That module imports
the factory by that name (`from openrlhf.trainer.ray import create_vllm_engines`) when it is
run, so it binds r3srv's; OpenRLHF's files are not changed. The rest of OpenRLHF (its trainer,
samples generator, agent executors, weight broadcast) runs as it is and calls the engines by
method name. `--r3srv.engine_kwargs` (r3srv's, taken out before OpenRLHF parses the rest) is a
JSON object of r3srv engine options for every engine, e.g. '{"num_kv_blocks": 4096}'.
"""

from __future__ import annotations

import functools
import json
import runpy
import sys

from r3srv.integrations.openrlhf import create_vllm_engines

ENGINE_KWARGS_FLAG = "--r3srv.engine_kwargs"


def split_engine_kwargs(argv: list[str]) -> tuple[dict, list[str]]:
    """(r3srv's engine options, OpenRLHF's arguments) from the command line."""
    rest, engine_kwargs = [], {}
    args = iter(argv)
    for arg in args:
        if arg == ENGINE_KWARGS_FLAG or arg.startswith(ENGINE_KWARGS_FLAG + "="):
            text = arg.partition("=")[2] if "=" in arg else next(args, None)
            if text is None:
                raise SystemExit(f"{ENGINE_KWARGS_FLAG} needs a JSON object")
            engine_kwargs = json.loads(text)
            if not isinstance(engine_kwargs, dict):
                raise SystemExit(f"{ENGINE_KWARGS_FLAG} must be a JSON object, got {text!r}")
        else:
            rest.append(arg)
    return engine_kwargs, rest


def bind(engine_kwargs: dict | None = None) -> None:
    """Make OpenRLHF's CLI build r3srv's engines (before its module runs)."""
    import openrlhf.trainer.ray

    openrlhf.trainer.ray.create_vllm_engines = functools.partial(create_vllm_engines,
                                                                 engine_kwargs=engine_kwargs or {})


def main(argv: list[str] | None = None) -> None:
    engine_kwargs, rest = split_engine_kwargs(sys.argv[1:] if argv is None else argv)
    bind(engine_kwargs)
    sys.argv = ["openrlhf.cli.train_ppo_ray", *rest]
    runpy.run_module("openrlhf.cli.train_ppo_ray", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
