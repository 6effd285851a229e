"""vLLM's NCCL weight-transfer wire, held to what vLLM itself produces (tests/data/vllm_transfer.json,
recorded by tools/record_vllm_transfer.py from vLLM's own ncclUniqueId and pack_tensors): the
unique id read out of its pickle without unpickling, and the packed chunk layout."""

from __future__ import annotations

import base64
import json
import os
import pickle
import pickletools
from pathlib import Path

import pytest
import torch

from r3srv.engine.rpc import arguments
from r3srv.engine.vllm_transfer import Packing, nccl_unique_id
from r3srv.errors import InvalidRequestError

RECORDED = json.loads((Path(__file__).parent / "data" / "vllm_transfer.json").read_text())
VLLM_PICKLE = base64.b64decode(RECORDED["unique_id_pickle_b64"])


def test_the_unique_id_is_read_out_of_vllms_pickle():
    assert nccl_unique_id(VLLM_PICKLE) == bytes.fromhex(RECORDED["unique_id_hex"])


def test_the_unique_id_reader_accepts_the_same_pickle_without_its_memo():
    rewritten = pickletools.optimize(VLLM_PICKLE)
    assert nccl_unique_id(rewritten) == bytes.fromhex(RECORDED["unique_id_hex"])


class _Runs:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("case", ["os_system", "other_class", "dict", "two_ids", "short_id", "truncated", "not_pickle",
                                  "empty"])
def test_anything_but_vllms_unique_id_is_refused_and_never_runs(case, tmp_path):
    marker = tmp_path / "ran"
    raw = bytes.fromhex(RECORDED["unique_id_hex"])
    payload = {
        "os_system": pickle.dumps(_Runs(marker)),
        "other_class": VLLM_PICKLE.replace(b"ncclUniqueId", b"ncclUniqueIx"),  # same bytes, another global
        "dict": pickle.dumps({"internal": raw}),
        "two_ids": VLLM_PICKLE[:-1] + pickle.dumps(raw)[2:],
        "short_id": VLLM_PICKLE.replace(raw, raw[:100]),
        "truncated": VLLM_PICKLE[: len(VLLM_PICKLE) // 2],
        "not_pickle": b"\x00not a pickle",
        "empty": b"",
    }[case]
    with pytest.raises(ValueError, match="ncclUniqueId"):
        nccl_unique_id(payload)
    assert not marker.exists()


@pytest.mark.parametrize("case", RECORDED["packing"], ids=lambda c: f"{len(c['tensors'])}x-{c['buffer_size_bytes']}B")
def test_packed_chunks_are_cut_where_vllm_cuts_them(case):
    metas = {name: (tuple(shape), getattr(torch, dtype)) for name, shape, dtype in case["tensors"]}
    chunks = [[name for name, _ in chunk] for chunk in Packing(case["buffer_size_bytes"]).chunks(metas)]
    assert chunks == case["chunks"]
    sizes = [sum(size for _, size in chunk) for chunk in Packing(case["buffer_size_bytes"]).chunks(metas)]
    assert sum(sizes) == sum(torch.empty(s, dtype=d).nbytes for s, d in metas.values())


def test_packing_sizes_must_be_positive():
    for fields, param in (({"buffer_size_bytes": 0}, "packed_buffer_size_bytes"), ({"num_buffers": 0}, "packed_num_buffers")):
        with pytest.raises(InvalidRequestError) as err:
            Packing(**fields)
        assert err.value.param == param


@pytest.mark.parametrize("method, args, kwargs, param", [
    ("os.system", [], {}, "method"),
    ("__init__", [], {}, "method"),
    ("load_weights", [], {}, "method"),
    ("skyrl_start_weight_update", [], {"is_checkpoint_format": "yes"}, "kwargs.is_checkpoint_format"),
    ("skyrl_start_weight_update", [True, False], {}, "args"),
    ("skyrl_start_weight_update", [True], {"is_checkpoint_format": True}, "args"),
    ("update_weights_nccl", [], {"update_info": {"names": "x"}}, "kwargs.update_info.names"),
    ("update_weights_nccl", [], {}, "kwargs"),
    ("skyrl_wake_for_weight_sync", [], {"tags": ["weights"], "extra": 1}, "kwargs"),
])
def test_collective_rpc_arguments_are_checked_against_the_fixed_table(method, args, kwargs, param):
    with pytest.raises(InvalidRequestError) as err:
        arguments(method, args, kwargs)
    assert err.value.param == param


def test_collective_rpc_positional_arguments_fill_the_fields_in_order():
    assert arguments("skyrl_start_weight_update", [False], {}).is_checkpoint_format is False
    info = arguments("update_weights_nccl", [{"names": ["a"], "dtype_names": ["float32"], "shapes": [[2]],
                                             "packed": True}], {}).update_info
    assert info.packed is True and info.names == ["a"] and info.packed_buffer_size_bytes == 1 << 30
