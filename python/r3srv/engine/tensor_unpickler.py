"""Read SGLang's /update_weights_from_tensor and /load_lora_adapter_from_tensors payloads (a trainer on the
same GPU hands over CUDA IPC handles, pickled by torch's ForkingPickler) without unpickling arbitrary objects.

A pickle names the callables it runs; this unpickler resolves only the handful that rebuild a
CUDA tensor from its IPC handle (torch.multiprocessing.reductions.rebuild_cuda_tensor and the
classes and dtypes in its arguments). Any other global (os.system, builtins.eval, a class of
the sender's) is refused before it is called, so a hostile payload runs nothing.
"""

from __future__ import annotations

import base64
import binascii
import io
import pickle

import torch

from r3srv.errors import InvalidRequestError

_DTYPES = ("float32", "float16", "bfloat16", "float64", "float8_e4m3fn", "float8_e5m2")


class _Frozen:
    """What the unpickler hands a pickle is shared by every load: its attributes cannot be set
    (a pickle's BUILD opcode sets attributes on any object it holds), so one payload cannot
    change what the next one gets."""

    __slots__ = ()

    def __setattr__(self, name: str, value: object) -> None:
        raise pickle.UnpicklingError(f"{type(self).__name__} is read-only")

    def __delattr__(self, name: str) -> None:
        raise pickle.UnpicklingError(f"{type(self).__name__} is read-only")


class _ClassArgument(_Frozen):
    """Stands for a class that rebuild_cuda_tensor takes as an argument: not callable, so a
    pickle cannot instantiate it (a TypedStorage of any size, say) on its own."""

    __slots__ = ("cls",)

    def __init__(self, cls: type) -> None:
        object.__setattr__(self, "cls", cls)


_TENSOR, _TYPED_STORAGE = _ClassArgument(torch.Tensor), _ClassArgument(torch.storage.TypedStorage)


class _RebuildCudaTensor(_Frozen):
    """torch's rebuild_cuda_tensor, for a plain tensor in a typed storage only (an object, not a
    function: a function's attributes, its __defaults__ among them, could be set by a pickle)."""

    __slots__ = ()

    def __call__(self, tensor_cls, size, stride, offset, storage_cls, dtype, *rest):
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        if tensor_cls is not _TENSOR or storage_cls is not _TYPED_STORAGE or not isinstance(dtype, torch.dtype):
            raise pickle.UnpicklingError("rebuild_cuda_tensor is admitted for plain tensors in typed storages only")
        if not torch.cuda.is_available():
            raise pickle.UnpicklingError("CUDA tensors cannot be opened on a server without CUDA")
        return rebuild_cuda_tensor(tensor_cls.cls, size, stride, offset, storage_cls.cls, dtype, *rest)


ALLOWED_GLOBALS = {
    ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"): _RebuildCudaTensor(),
    ("torch", "Tensor"): _TENSOR,
    ("torch.storage", "TypedStorage"): _TYPED_STORAGE,
    ("torch", "Size"): torch.Size,
    **{("torch", name): getattr(torch, name) for name in _DTYPES},
}


class CudaTensorUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        found = ALLOWED_GLOBALS.get((module, name))
        if found is None:
            raise pickle.UnpicklingError(f"{module}.{name} is not a CUDA tensor rebuild function, class or dtype")
        return found

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("persistent ids are not allowed")


def _unpickled(payload: str, param: str, shape: str):
    """The object a base64 ForkingPickler payload holds, read by CudaTensorUnpickler; a malformed
    one is an InvalidRequestError naming `param` (`shape`: what the payload should hold)."""
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InvalidRequestError(f"{param} must be standard base64: {exc}", param=param) from exc
    try:
        return CudaTensorUnpickler(io.BytesIO(data)).load()
    except Exception as exc:  # whatever a malformed pickle raises; nothing outside ALLOWED_GLOBALS ran
        raise InvalidRequestError(f"{param}: not a pickled {shape}: {exc}", param=param) from exc


def load_named_cuda_tensors(payload: str, param: str = "serialized_named_tensors") -> list[tuple[str, torch.Tensor]]:
    """A base64 ForkingPickler payload of [(name, cuda tensor), ...] (SGLang's weight updates),
    checked as it is read; anything else is an InvalidRequestError naming `param`."""
    value = _unpickled(payload, param, "list of (name, CUDA tensor)")
    ok = isinstance(value, list) and all(
        isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str) and isinstance(item[1], torch.Tensor)
        for item in value
    )
    if not ok:
        raise InvalidRequestError(f"{param} must hold a list of (name, tensor) pairs", param=param)
    return value


def load_cuda_tensor_dict(payload: str, param: str = "serialized_named_tensors") -> dict[str, torch.Tensor]:
    """A base64 ForkingPickler payload of {name: cuda tensor} (SGLang's LoRA adapter from tensors),
    checked as it is read; anything else is an InvalidRequestError naming `param`."""
    value = _unpickled(payload, param, "dict of name -> CUDA tensor")
    ok = isinstance(value, dict) and all(
        isinstance(name, str) and isinstance(tensor, torch.Tensor) for name, tensor in value.items())
    if not ok:
        raise InvalidRequestError(f"{param} must hold a dict of name -> tensor", param=param)
    return value
