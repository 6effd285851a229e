"""The restricted unpickler of /update_weights_from_tensor: torch's CUDA-tensor rebuild and
nothing else; any other pickled callable or class is refused before it runs."""

from __future__ import annotations

import base64
import builtins
import os
import pickle

import pytest
import torch

from r3srv.engine.tensor_unpickler import ALLOWED_GLOBALS, load_named_cuda_tensors
from r3srv.errors import InvalidRequestError


class PlainClass:
    pass


def encoded(obj) -> str:
    return base64.b64encode(pickle.dumps(obj)).decode()


class Reducing:
    """Pickles as a call of `func(*args)`, as a hostile payload would."""

    def __init__(self, func, *args) -> None:
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


@pytest.mark.parametrize("make", [
    lambda marker: Reducing(os.system, f"touch {marker}"),
    lambda marker: Reducing(builtins.eval, f"open({str(marker)!r}, 'w').close()"),
    lambda marker: Reducing(builtins.exec, f"open({str(marker)!r}, 'w').close()"),
    lambda marker: Reducing(torch.save, {}, str(marker)),
    lambda marker: PlainClass(),
], ids=["os.system", "builtins.eval", "builtins.exec", "torch.save", "plain class"])
def test_any_other_pickled_object_is_refused_without_running(tmp_path, make):
    marker = tmp_path / "ran"
    with pytest.raises(InvalidRequestError, match="not a CUDA tensor rebuild") as err:
        load_named_cuda_tensors(encoded([("model.norm.weight", make(marker))]))
    assert err.value.param == "serialized_named_tensors"
    assert not marker.exists()


def test_the_classes_rebuild_cuda_tensor_takes_cannot_be_called_by_the_pickle():
    """torch.Tensor and TypedStorage are admitted as arguments only: a pickle that calls one
    (a storage of any size, say) is refused."""
    payload = encoded([("x", Reducing(torch.storage.TypedStorage, 10))])
    with pytest.raises(InvalidRequestError, match="not a pickled list"):
        load_named_cuda_tensors(payload)


def test_the_admitted_globals_are_torchs_cuda_tensor_rebuild_and_its_arguments():
    assert {module for module, _ in ALLOWED_GLOBALS} == {"torch.multiprocessing.reductions", "torch", "torch.storage"}
    assert ("torch.multiprocessing.reductions", "rebuild_cuda_tensor") in ALLOWED_GLOBALS


@pytest.mark.gpu("CUDA IPC handles")
def test_a_cuda_tensor_pickled_by_torch_comes_back():
    from torch.multiprocessing.reductions import ForkingPickler
    import io

    tensor = torch.arange(12, dtype=torch.bfloat16, device="cuda").reshape(3, 4)
    buf = io.BytesIO()
    ForkingPickler(buf).dump([("w", tensor)])
    [(name, back)] = load_named_cuda_tensors(base64.b64encode(buf.getvalue()).decode())
    assert name == "w" and torch.equal(back, tensor)


def test_malformed_payloads_are_400s():
    for payload, match in (("not base64!", "base64"), (base64.b64encode(b"junk").decode(), "not a pickled list"),
                           (encoded({"x": 1}), "list of"), (encoded([("x", 1)]), "list of")):
        with pytest.raises(InvalidRequestError, match=match):
            load_named_cuda_tensors(payload)
