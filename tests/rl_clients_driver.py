"""SkyRL's and AReaL's own client code driving an r3srv server, run in .rl_clients_venv (skyrl 0.4.0,
areal 1.0.4, tools/rl_clients_env.sh) by tests/test_rl_framework_clients.py; imports nothing of r3srv.

    python rl_clients_driver.py check
    python rl_clients_driver.py areal HOST:PORT REPLICAS CHECKPOINT SECOND_CHECKPOINT WORKDIR OUT.json
    python rl_clients_driver.py skyrl URL MODEL OUT.json

Each writes what the framework's client handed back (token ids, logprobs, routed-experts rows) for
the test to check against transformers.

skyrl 0.4.0 declares Python>=3.12; on 3.11 its modules load except for one thing: pydantic refuses
`typing.TypedDict` inside a model before Python 3.12 (skyrl/tinker/types.py:132, `MultiModalKwargs`,
a field of `RenderedModelInput` at line 137, imported through skyrl/backends/__init__.py:3). The
same class from typing_extensions is what pydantic asks for there, so `typing.TypedDict` is pointed
at it before skyrl is imported; nothing else of skyrl is touched.
"""

from __future__ import annotations

import asyncio
import json
import socket
import sys
import time
import typing
from pathlib import Path

import typing_extensions

typing.TypedDict = typing_extensions.TypedDict  # see the module docstring: skyrl's one 3.12-only need

PROMPTS = ([5, 17, 42, 99, 123, 7], [64, 3, 88, 250, 31, 12, 9])
NEXT_TURN = [77, 21, 140]  # the tokens of a second user turn, appended to turn 1's prompt and output
MAX_NEW_TOKENS = 4


def check() -> None:
    import areal
    import areal.engine.sglang_remote  # noqa: F401
    import skyrl.backends.skyrl_train.inference_servers.remote_inference_client  # noqa: F401
    from importlib.metadata import version

    print("skyrl", version("skyrl"), "and areal", areal.__version__, "clients import")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def areal_response(resp) -> dict:
    rows = resp.routed_experts
    return {"input_tokens": list(resp.input_tokens), "output_tokens": list(resp.output_tokens),
            "output_logprobs": list(resp.output_logprobs), "stop_reason": resp.stop_reason,
            "rows": None if rows is None else rows.tolist()}


def areal(addr: str, replicas: int, first_checkpoint: str, second_checkpoint: str, workdir: str) -> dict:
    """AReaL's RemoteSGLangEngine as its trainer drives it: rollouts (a second turn on the same rid,
    so the same server), then its default weight update (xccl: the FSDP engine's group init and
    broadcasts, as areal/engine/fsdp_engine.py does them, over gloo: AReaL's own backend on a host
    without accelerators), then a disk update back to the served checkpoint's weights."""
    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file

    from areal.api import ModelAllocation, ParamSpec, WeightUpdateMeta
    from areal.api.cli_args import GenerationHyperparameters, InferenceEngineConfig, NameResolveConfig
    from areal.api.io_struct import ModelRequest
    from areal.engine.core.distributed import init_custom_process_group
    from areal.engine.sglang_remote import RemoteSGLangEngine
    from areal.infra.platforms import current_platform
    from areal.utils import name_resolve, names

    name_resolve.reconfigure(NameResolveConfig(type="nfs", nfs_record_root=str(Path(workdir) / "name_resolve")))
    config = InferenceEngineConfig(experiment_name="r3srv", trial_name="clients", return_routed_experts=True,
                                   setup_timeout=120, request_timeout=300, pause_grace_period=0.0)
    engine = RemoteSGLangEngine(config)
    engine.initialize(addr=[addr], train_data_parallel_size=1)
    out: dict = {"backend": current_platform.communication_backend}

    def generate(prompt: list[int], rid: str) -> dict:
        gconfig = GenerationHyperparameters(greedy=True, max_new_tokens=MAX_NEW_TOKENS, n_samples=1)
        return areal_response(asyncio.run(engine.agenerate(ModelRequest(rid=rid, input_ids=list(prompt),
                                                                         gconfig=gconfig))))

    try:
        first = generate(PROMPTS[0], "r0")
        second = generate(first["input_tokens"] + first["output_tokens"] + NEXT_TURN, "r0")
        out["before"] = [first, second, generate(PROMPTS[1], "r1")]

        engine.pause_generation()
        engine.continue_generation()

        # the default weight mode (xccl): fsdp_engine.py's _init_weight_update_group_for_xccl, then
        # _update_weights_from_distributed (pause, one bucket of broadcasts, continue)
        meta = WeightUpdateMeta(type="xccl", gen_allocation=ModelAllocation.from_str(f"sglang:d{replicas}"),
                                nccl_master_address="127.0.0.1", nccl_master_port=free_port(),
                                nccl_group_name="update_weight_group")
        joining = engine.init_weights_update_group(meta)
        group = init_custom_process_group(backend=current_platform.communication_backend,
                                          world_size=meta.gen_allocation.parallel.world_size + 1,
                                          init_method=f"tcp://127.0.0.1:{meta.nccl_master_port}", rank=0,
                                          group_name=meta.nccl_group_name)
        joining.result()
        tensors = {}
        for shard in sorted(Path(second_checkpoint).glob("*.safetensors")):
            tensors |= load_file(shard)
        engine.pause_generation()
        specs = [ParamSpec(name=n, shape=tuple(t.shape), dtype=str(t.dtype).split("torch.")[1])
                 for n, t in tensors.items()]
        pushed = engine.update_weights_from_distributed(meta, specs)
        for t in tensors.values():
            dist.broadcast(t.contiguous(), src=0, group=group)
        pushed.result()
        engine.continue_generation()
        engine.set_version(1)
        out["after_xccl"] = [generate(p, f"x{i}") for i, p in enumerate(PROMPTS)]
        dist.destroy_process_group(group)

        # the disk mode (its other mode): the trainer saves, announces the save through name_resolve
        # (fsdp_engine.py's _update_weights_from_disk), the engine posts /update_weights_from_disk
        name_resolve.add(names.update_weights_from_disk(config.experiment_name, config.trial_name,
                                                        engine.get_version()), str(time.time()))
        engine.update_weights_from_disk(WeightUpdateMeta(type="disk", path=first_checkpoint,
                                                         clear_checkpoint_after_load=False)).result()
        out["after_disk"] = [generate(p, f"d{i}") for i, p in enumerate(PROMPTS)]
        return out
    finally:
        engine.destroy()


def skyrl_response(output: dict, i: int) -> dict:
    rows = output["rollout_expert_indices"][i]
    return {"response_ids": list(output["response_ids"][i]), "response_logprobs": output["response_logprobs"][i],
            "stop_reason": output["stop_reasons"][i], "response": output["responses"][i],
            "rows": rows.tolist(), "rows_dtype": str(rows.dtype)}


async def skyrl(url: str, model: str) -> dict:
    """SkyRL's RemoteInferenceClient as its generator and trainer call it: a batch on
    /skyrl/v1/generate with routed experts on, sampling params from SkyRL's own builder and its
    prefix-cache salt; a second turn sent with `routed_experts_prompt_starts` (its R3 multi-turn
    offsets); then its control plane: world size, keep-mode pause and resume, sleep and wake."""
    from skyrl.backends.skyrl_train.inference_servers.engine_utils import get_vllm_sampling_params
    from skyrl.backends.skyrl_train.inference_servers.remote_inference_client import PauseMode, RemoteInferenceClient
    from skyrl.train.generators.utils import build_vllm_cache_salt
    from skyrl.train.config import SamplingParams

    client = RemoteInferenceClient(proxy_url=url, server_urls=[url], data_parallel_size=1, model_name=model,
                                   enable_return_routed_experts=True)
    sampling = get_vllm_sampling_params(SamplingParams(max_generate_length=MAX_NEW_TOKENS, temperature=0.0,
                                                       logprobs=0))
    salt = build_vllm_cache_salt(client.weight_version, model)
    out: dict = {"cache_salt": salt}
    try:
        first = await client.generate({"prompt_token_ids": [list(p) for p in PROMPTS],
                                       "sampling_params": sampling, "cache_salt": salt})
        out["turn1"] = [dict(skyrl_response(first, i), prompt=list(p)) for i, p in enumerate(PROMPTS)]
        follow = [list(p) + list(first["response_ids"][i]) + NEXT_TURN for i, p in enumerate(PROMPTS)]
        # rows already held: every token of turn 1 but its last sampled one
        starts = [len(p) + len(first["response_ids"][i]) - 1 for i, p in enumerate(PROMPTS)]
        second = await client.generate({"prompt_token_ids": follow, "sampling_params": sampling, "cache_salt": salt,
                                        "routed_experts_prompt_starts": starts})
        out["turn2"] = [dict(skyrl_response(second, i), prompt=follow[i], start=starts[i])
                        for i in range(len(PROMPTS))]
        out["world_size"] = list(await client.get_world_size())
        await client.pause(PauseMode.KEEP)
        await client.resume()
        await client.sleep(level=1)
        out["sleeping"] = await client.is_sleeping()
        await client.wake_up(tags=["weights"])
        await client.wake_up(tags=["kv_cache"])
        out["awake"] = not await client.is_sleeping()
        await client.reset_prefix_cache()
        again = await client.generate({"prompt_token_ids": [list(PROMPTS[0])], "sampling_params": sampling,
                                       "cache_salt": salt})
        out["after_wake"] = skyrl_response(again, 0)
    finally:
        await client.teardown()
    return out


if __name__ == "__main__":
    command, args = sys.argv[1], sys.argv[2:]
    if command == "check":
        check()
    elif command == "areal":
        addr, replicas, first, second, workdir, out = args
        Path(out).write_text(json.dumps(areal(addr, int(replicas), first, second, workdir)))
    elif command == "skyrl":
        url, model, out = args
        Path(out).write_text(json.dumps(asyncio.run(skyrl(url, model))))
    else:
        raise SystemExit(f"unknown command {command}")
