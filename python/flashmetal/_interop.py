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

_BF16 = np.dtype(ml_dtypes.bfloat16)


def is_torch_tensor(x: Any) -> bool:
    """True for a torch.Tensor, decided from the type's module: no import."""
    return type(x).__module__.startswith("torch") and "torch" in sys.modules and \
        isinstance(x, sys.modules["torch"].Tensor)


def _torch_to_numpy(t: Any, op: str, name: str) -> np.ndarray:
    torch = sys.modules["torch"]
    if t.device.type != "cpu":
        raise InvalidValueError(op, f"{name} is on device '{t.device}'; flashmetal takes CPU tensors "
                         "(on a Mac the metal backend reads host memory: move it with .cpu())")
    t = t.detach()
    if t.dtype == torch.bfloat16:
        # numpy has no bfloat16: view the bits as int16, then as ml_dtypes.bfloat16 (no copy).
        bits: np.ndarray = t.view(torch.int16).numpy().view(_BF16)
        return bits
    a: np.ndarray = t.numpy()
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
        except (TypeError, BufferError, RuntimeError) as e:
            raise InvalidTypeError(op, f"{name} ({type(x).__name__}) could not be read through DLPack: {e}") from e
    try:
        return np.asarray(x)
    except (TypeError, ValueError) as e:
        raise InvalidTypeError(op, f"{name} ({type(x).__name__}) is not an array numpy can view: {e}") from e


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
