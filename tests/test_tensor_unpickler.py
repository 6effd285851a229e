"""The restricted unpickler of /update_weights_from_tensor: torch's CUDA-tensor rebuild and
nothing else; any other pickled callable or class is refused before it runs."""

from __future__ import annotations

import base64
import builtins
import os
import pickle

import pytest
import torch

from r3srv.engine.tensor_unpickler import ALLOWED_GLOBALS, load_cuda_tensor_dict, load_named_cuda_tensors
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
    buf = io.BytesIO()
    ForkingPickler(buf).dump({"w": tensor})  # SGLang's LoRA push: a dict
    back = load_cuda_tensor_dict(base64.b64encode(buf.getvalue()).decode())
    assert list(back) == ["w"] and torch.equal(back["w"], tensor)


def test_malformed_payloads_are_400s():
    for payload, match in (("not base64!", "base64"), (base64.b64encode(b"junk").decode(), "not a pickled list"),
                           (encoded({"x": 1}), "list of"), (encoded([("x", 1)]), "list of")):
        with pytest.raises(InvalidRequestError, match=match):
            load_named_cuda_tensors(payload)


def test_a_lora_push_is_a_dict_of_tensors_and_runs_no_pickled_code(tmp_path):
    marker = tmp_path / "ran"
    with pytest.raises(InvalidRequestError, match="not a CUDA tensor rebuild"):
        load_cuda_tensor_dict(encoded({"w": Reducing(os.system, f"touch {marker}")}))
    assert not marker.exists()
    for payload in (encoded([("x", 1)]), encoded({"x": 1}), encoded({1: 2})):
        with pytest.raises(InvalidRequestError, match="dict of name -> tensor") as err:
            load_cuda_tensor_dict(payload)
        assert err.value.param == "serialized_named_tensors"


# ---------------------------------------------------------------- hostile pickles, generated

# Globals a hostile pickle would reach for, and the ones the unpickler admits (whose objects a
# pickle then holds, and could try to change with BUILD, SETITEM or APPEND).
_GLOBALS = [("os", "system"), ("posix", "system"), ("builtins", "eval"), ("builtins", "exec"),
            ("builtins", "getattr"), ("builtins", "__import__"), ("subprocess", "Popen"), ("io", "open"),
            ("torch", "load"), ("torch", "save"), ("pickle", "loads"), ("copyreg", "_reconstructor"),
            ("r3srv.engine.tensor_unpickler", "ALLOWED_GLOBALS"), *ALLOWED_GLOBALS]


def _text(s: str) -> bytes:
    data = s.encode()
    return pickle.SHORT_BINUNICODE + bytes([len(data)]) + data


def _pieces(marker: str):
    from hypothesis import strategies as st

    plain = st.sampled_from([
        pickle.MARK, pickle.NONE, pickle.NEWTRUE, pickle.EMPTY_TUPLE, pickle.EMPTY_LIST, pickle.EMPTY_DICT,
        pickle.TUPLE, pickle.TUPLE1, pickle.TUPLE2, pickle.TUPLE3, pickle.LIST, pickle.DICT,
        pickle.REDUCE, pickle.BUILD, pickle.NEWOBJ, pickle.NEWOBJ_EX, pickle.OBJ, pickle.STACK_GLOBAL,
        pickle.APPEND, pickle.APPENDS, pickle.SETITEM, pickle.SETITEMS, pickle.DUP, pickle.POP, pickle.POP_MARK,
        pickle.MEMOIZE, pickle.BINPERSID, pickle.EMPTY_SET, pickle.ADDITEMS, pickle.FROZENSET,
        pickle.BINGET + b"\x00", pickle.EXT1 + b"\x01", pickle.BININT1 + b"\x02", pickle.PERSID + b"0\n",
    ])
    globals_ = st.sampled_from(_GLOBALS).flatmap(lambda g: st.sampled_from([
        pickle.GLOBAL + f"{g[0]}\n{g[1]}\n".encode(),  # by name, as protocol 0-3 do
        _text(g[0]) + _text(g[1]) + pickle.STACK_GLOBAL,  # from the stack, as protocol 4 does
        pickle.INST + f"{g[0]}\n{g[1]}\n".encode(),
    ]))
    texts = st.sampled_from([f"touch {marker}", f"open({marker!r}, 'w').close()", "cls", "__defaults__",
                             "__class__", "__dict__", "__setstate__", "x"]).map(_text)
    return st.one_of(plain, globals_, texts)


def _singletons() -> dict:
    """What every later load is handed: it must come out of any pickle unchanged."""
    return {key: (value, tuple(getattr(value, s, None) for s in getattr(type(value), "__slots__", ())))
            for key, value in ALLOWED_GLOBALS.items()}


@pytest.mark.slow
def test_generated_hostile_pickles_run_nothing_change_nothing_and_are_400s(tmp_path):
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    marker = tmp_path / "ran"
    before = _singletons()
    outcomes: dict[str, int] = {}

    @settings(max_examples=1500, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.lists(_pieces(str(marker)), min_size=1, max_size=24))
    def load(pieces):
        payload = base64.b64encode(pickle.PROTO + b"\x04" + b"".join(pieces) + pickle.STOP).decode()
        try:
            loaded = load_named_cuda_tensors(payload)
            assert loaded == [], loaded  # a CPU server admits no CUDA tensor: an empty list at most
            outcomes["loaded"] = outcomes.get("loaded", 0) + 1
        except InvalidRequestError as exc:
            assert exc.param == "serialized_named_tensors"
            reason = "refused global" if "not a CUDA tensor rebuild" in str(exc) else "other 400"
            outcomes[reason] = outcomes.get(reason, 0) + 1
        assert not marker.exists(), pieces
        assert _singletons() == before, pieces

    load()
    assert outcomes.get("refused global", 0) > 50, outcomes  # the generator reaches the unpickler's refusals


@pytest.mark.parametrize("payload", [
    pickle.GLOBAL + b"torch\nTensor\n" + pickle.EMPTY_DICT + _text("cls") + pickle.NONE + pickle.SETITEM + pickle.BUILD,
    pickle.GLOBAL + b"torch\nTensor\n" + pickle.NONE + pickle.EMPTY_DICT + _text("cls") + pickle.NONE
    + pickle.SETITEM + pickle.TUPLE2 + pickle.BUILD,
    pickle.GLOBAL + b"torch.multiprocessing.reductions\nrebuild_cuda_tensor\n" + pickle.NONE + pickle.EMPTY_DICT
    + _text("__defaults__") + pickle.EMPTY_TUPLE + pickle.SETITEM + pickle.TUPLE2 + pickle.BUILD,
], ids=["dict state on a class argument", "slot state on a class argument", "defaults of the rebuild function"])
def test_a_pickle_cannot_rewrite_what_the_next_load_gets(payload):
    before = _singletons()
    with pytest.raises(InvalidRequestError):
        load_named_cuda_tensors(base64.b64encode(payload + pickle.STOP).decode())
    assert _singletons() == before
