"""Foreign arrays in, the caller's array type out, without copies.

Accepted: numpy arrays, torch CPU tensors (bfloat16 too), and anything numpy
can view through DLPack, the buffer protocol or ``__array_interface__``.
torch is never imported here unless the caller passed a torch object (its
module is then already loaded): flashmetal runs without torch installed.
"""
from __future__ import annotations

import sys
from typing import Any
from collections.abc import Callable

import ml_dtypes
import numpy as np

from ._errors import InvalidTypeError, InvalidValueError
from ._hints import dlpack_unreadable, unsupported_dtype

_BF16 = np.dtype(ml_dtypes.bfloat16)


def is_torch_tensor(x: Any) -> bool:
    """True for a torch.Tensor or a subclass of it (defined anywhere), without
    importing torch: a torch object means torch is loaded."""
    torch = sys.modules.get("torch")
    return torch is not None and not isinstance(x, np.ndarray) and isinstance(x, torch.Tensor)


def _storage_is_value(cls: type, torch: Any) -> bool:
    """Whether a torch.Tensor (sub)class keeps its values in its storage: it
    overrides neither __torch_function__ nor __torch_dispatch__ (Parameter
    disables both). A subclass that does (CausalBias, wrapper subclasses)
    computes its values when torch uses it; its storage may be garbage."""
    plain = {"__torch_function__": torch._C._disabled_torch_function_impl,
             "__torch_dispatch__": torch._C._disabled_torch_dispatch_impl}
    for attr, disabled in plain.items():
        owner = next(k for k in cls.__mro__ if attr in k.__dict__)
        f = owner.__dict__[attr]
        if owner not in (torch.Tensor, torch._C.TensorBase) and getattr(f, "__func__", f) is not disabled:
            return False
    return True


def _torch_to_numpy(t: Any, op: str, name: str) -> np.ndarray:
    torch = sys.modules["torch"]
    if type(t) is not torch.Tensor and not _storage_is_value(type(t), torch):
        raise InvalidTypeError(op, f"{name} is a {type(t).__name__}, a tensor subclass whose values torch computes "
                               "when it uses it (its storage does not hold them): pass a plain tensor")
    if not t.is_cpu:
        raise InvalidValueError(op, f"{name} is on device '{t.device}'; flashmetal takes CPU tensors "
                         "(on a Mac the metal backend reads host memory: move it with .cpu())")
    if t.requires_grad:
        if torch.is_grad_enabled():
            # flashmetal has no backward: the result would carry no grad_fn and
            # backward() would silently give the inputs' producers no gradient.
            raise InvalidValueError(op, f"{name} requires grad in grad mode, but flashmetal has no backward pass: "
                                    "call it under torch.no_grad() or torch.inference_mode(), or pass "
                                    f"{name}.detach() to cut the graph on purpose")
        t = t.detach()  # numpy() refuses a tensor that requires grad
    if t.layout != torch.strided:
        raise InvalidTypeError(op, f"{name} is a {t.layout} tensor; flashmetal reads dense (strided) tensors: "
                               "pass .to_dense()")
    if t.is_neg() or t.is_conj():
        raise InvalidTypeError(op, f"{name} is a lazily negated or conjugated view whose memory does not hold its "
                               "values: pass .resolve_neg() / .resolve_conj()")
    if t.dtype == torch.bfloat16:
        # numpy has no bfloat16: view the bits as int16, then as ml_dtypes.bfloat16 (no copy).
        bits: np.ndarray = t.view(torch.int16).numpy().view(_BF16)
        return bits
    try:
        a: np.ndarray = t.numpy()
    except (TypeError, RuntimeError) as e:  # a dtype numpy has no counterpart for (float8, ...)
        raise unsupported_dtype(op, name, t.dtype) from e
    return a


def to_numpy(x: Any, op: str, name: str) -> np.ndarray:
    """A numpy view of `x` (a copy only where numpy itself must make one)."""
    if isinstance(x, np.ndarray):
        return x
    if is_torch_tensor(x):
        return _torch_to_numpy(x, op, name)
    if hasattr(x, "__dlpack__") and not hasattr(x, "__array_interface__"):
        try:
            return np.from_dlpack(x)
        except (TypeError, ValueError, BufferError, RuntimeError, AttributeError) as e:
            raise dlpack_unreadable(op, name, x, e) from e
    try:
        return np.asarray(x)
    except (TypeError, ValueError) as e:
        raise InvalidTypeError(op, f"{name} ({type(x).__name__}) is not an array numpy can view: {e}") from e


def refuse_grad_write(x: Any, op: str, name: str) -> None:
    """A torch tensor that requires grad is never written in place (out=,
    an appended cache): the write would bypass autograd's version counter,
    so a graph that saved it would silently read the new values."""
    if is_torch_tensor(x) and x.requires_grad:
        raise InvalidValueError(op, f"{name} requires grad; flashmetal writes it in place, which autograd cannot "
                                f"track: pass a tensor that does not require grad (e.g. {name}.detach())")


def _numpy_to_torch(a: np.ndarray) -> Any:
    torch = sys.modules["torch"]
    if a.dtype == _BF16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def wrapper_like(x: Any) -> Callable[[np.ndarray], Any]:
    """A function that returns a numpy result as the caller's type: a torch
    tensor sharing the result's memory when `x` is one, else the array."""
    if is_torch_tensor(x):
        return _numpy_to_torch
    return lambda a: a
