"""A Hugging Face cache that keeps K and V as flashmetal codes.

    cache = QuantizedKVCache(model.config, k_bits=8, v_bits=4)
    model.generate(ids, cache=cache, ...)   # past_key_values= before transformers 5

Each layer holds two ``QuantizedKV`` stores ``[B, capacity, Hkv]`` (K and V
widths and seeds separate) that grow in chunks of code rows. The layer's
``update()`` reserves rows for the new tokens and returns the new k/v tagged
with the layer; the flashmetal attention backend sees the tag and calls
``flash_attn_with_kvcache`` with them as ``k``/``v``, which encodes them into
the codes and attends over the codes in one call. No dense copy of the cache
exists at any point. The model must use the flashmetal backend (checked when
the cache is made), since another attention would see only the new tokens.
A left-padded batch keeps only each sequence's real tokens (the mask's first
kept key per sequence); a sliding-window layer (transformers passes its
``sliding_window``) attends with that window over the codes, which keep every
row; other masks (holes) are refused by name.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .. import _native
from .._errors import InvalidTypeError, InvalidValueError, UnsupportedFeatureError
from .._interop import to_numpy, wrapper_like
from ..kv_codec import KVCodec, QuantizedKV
from ..registry import RegistryLike
from ..serving import flash_attn_with_kvcache
from . import hf

_CACHE = "QuantizedKVCache"
_TAG = hf.CODES_TAG
_WIDTHS = (2, 3, 4, 5, 6, 8)


class QuantizedKVLayer(CacheLayerMixin):  # type: ignore[misc]
    """One layer's K and V codes, ``[B, capacity, Hkv]`` each; ``length``
    rows are in use (counting those the next attention call appends)."""

    is_sliding = False
    is_croppable = True
    supports_early_init = False

    def __init__(self, k_bits: int, v_bits: int, k_seed: int, v_seed: int, chunk: int,
                 registry: RegistryLike = None) -> None:
        super().__init__()
        self.registry = registry
        self.k_bits, self.v_bits, self.k_seed, self.v_seed, self.chunk = k_bits, v_bits, k_seed, v_seed, chunk
        self.k_codes: QuantizedKV | None = None
        self.v_codes: QuantizedKV | None = None
        self.length = 0
        self.start = 0  # where the pending k/v go: the rows before them
        self.pad: np.ndarray | None = None  # each sequence's left padding (rows not stored), int32 [B]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, hkv, _, dim = key_states.shape
        self.device = key_states.device
        if self.device.type != "cpu":
            raise InvalidValueError(_CACHE, f"key states on {self.device} (the codes live in host memory: cpu "
                                    "tensors only)")
        if value_states.shape[-1] != dim:
            raise InvalidValueError(_CACHE, f"value head dim {value_states.shape[-1]} differs from the key head "
                                    f"dim {dim}")
        self.k_codes = KVCodec(dim, self.k_bits, seed=self.k_seed).empty((batch, self.chunk, hkv))
        self.v_codes = KVCodec(dim, self.v_bits, seed=self.v_seed).empty((batch, self.chunk, hkv))
        self.is_initialized = True

    def _reserve(self, rows: int) -> None:
        assert self.k_codes is not None and self.v_codes is not None
        cap = self.k_codes.shape[1]
        if rows <= cap:
            return
        grown = -(-rows // self.chunk) * self.chunk
        self.k_codes, self.v_codes = (_grow(c, grown, self.length) for c in (self.k_codes, self.v_codes))

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Reserves rows for the new tokens; returns them tagged with this
        layer for the attention backend, which appends and attends."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        assert self.k_codes is not None
        if key_states.shape[0] != self.k_codes.shape[0] or key_states.shape[1] != self.k_codes.shape[2]:
            raise InvalidValueError(_CACHE, f"key states {tuple(key_states.shape)} do not match the cache's batch "
                                    f"and kv heads {self.k_codes.shape[0], self.k_codes.shape[2]}")
        self.start = self.length
        self._reserve(self.length + key_states.shape[2])
        self.length += key_states.shape[2]
        setattr(key_states, _TAG, self)
        return key_states, value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.k_codes = self.v_codes = None
        self.pad = None
        self.length = self.start = 0
        self.is_initialized = False

    def crop(self, tokens: int) -> None:
        """Removes ``-tokens`` tokens when negative; keeps the first
        ``tokens`` when positive (transformers' older meaning); 0: nothing."""
        if tokens == 0:
            return
        keep = max(0, min(self.length, self.length + tokens if tokens < 0 else tokens))
        if self.pad is not None and keep < int(self.pad.max(initial=0)):
            raise UnsupportedFeatureError(_CACHE, f"crop to {keep} tokens would cut into a sequence's left padding "
                                          f"({self.pad.tolist()})", argument="tokens")
        self.length = self.start = keep

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.k_codes is None or self.v_codes is None:
            return
        idx = np.asarray(indices.cpu().numpy(), dtype=np.int64)
        if self.pad is not None:
            self.pad = self.pad[idx]
        self.k_codes, self.v_codes = (QuantizedKV(c.codec, np.ascontiguousarray(c.codes[idx]),
                                                  np.ascontiguousarray(c.norms[idx]))
                                      for c in (self.k_codes, self.v_codes))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.batch_select_indices(torch.arange(self.k_codes.shape[0] if self.k_codes else 0)
                                  .repeat_interleave(repeats))


def _grow(c: QuantizedKV, capacity: int, used: int) -> QuantizedKV:
    """The same codes in storage of ``capacity`` rows (the first ``used`` copied)."""
    b, _, hkv = c.shape
    bigger = c.codec.empty((b, capacity, hkv))
    bigger.codes[:, :used] = c.codes[:, :used]
    bigger.norms[:, :used] = c.norms[:, :used]
    return bigger


class QuantizedKVCache(Cache):  # type: ignore[misc]
    """A ``transformers`` cache whose layers keep K at ``k_bits`` and V at
    ``v_bits`` (2, 3, 4, 5, 6 or 8) flashmetal codes, read directly by the
    flashmetal attention backend (``flashmetal.integrations.hf``). ``config``:
    the model's config; its ``_attn_implementation`` must be the backend's
    registered name. ``seed``: K's rotation signs (V's use ``seed + 1``).
    ``chunk``: code rows added per layer whenever the cache grows.
    ``registry``: where the attention runs (a Registry or backend name;
    None: the default)."""

    def __init__(self, config: Any, k_bits: int = 8, v_bits: int = 4, *, seed: int = 0, chunk: int = 256,
                 registry: RegistryLike = None) -> None:
        impl = getattr(config, "_attn_implementation", None)
        if impl not in hf.registered_names():
            raise InvalidValueError(_CACHE, f"the model's attention implementation is {impl!r}; the codes are read "
                                    "only by flashmetal's backend (register it with flashmetal.integrations.hf."
                                    f"register() and load the model with attn_implementation={hf.NAME!r})",
                                    argument="config")
        chunk = _native.index_arg(_CACHE, "chunk", chunk, 1)
        for name, bits in (("k_bits", k_bits), ("v_bits", v_bits)):
            if _native.index_arg(_CACHE, name, bits) not in _WIDTHS:
                raise InvalidValueError(_CACHE, f"{name} must be one of {_WIDTHS}, got {bits!r}", argument=name)
        if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, (int, np.integer)):
            raise InvalidTypeError(_CACHE, f"seed must be an integer, got {seed!r}", argument="seed")
        if not 0 <= int(seed) < 2**64 - 1:  # V's signs use seed + 1: both must be KVCodec seeds
            raise InvalidValueError(_CACHE, f"seed must be in [0, 2**64 - 1) (V uses seed + 1), got {seed}",
                                    argument="seed")
        seed = int(seed)
        self.k_bits, self.v_bits, self.seed = k_bits, v_bits, seed
        layers = [QuantizedKVLayer(k_bits, v_bits, seed, seed + 1, chunk, registry)
                  for _ in range(config.num_hidden_layers)]
        super().__init__(layers=layers)

    @property
    def nbytes(self) -> int:
        """Bytes of K and V codes and norms held by every layer."""
        return sum(c.nbytes for layer in self.layers for c in (layer.k_codes, layer.v_codes) if c is not None)


def codes_layer(key: torch.Tensor) -> QuantizedKVLayer | None:
    """The QuantizedKVLayer whose update() returned ``key``, or None."""
    return getattr(key, _TAG, None)


def attend_codes(layer: QuantizedKVLayer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, scaling: float | None, softcap: float,
                 sinks: torch.Tensor | None, op: str, sliding_window: int | None = None) -> torch.Tensor:
    """Appends the new ``key``/``value`` ``[B, Hkv, T, D]`` to the layer's
    codes and attends ``query`` ``[B, H, T, D]`` over them; returns
    ``[B, T, H, D]`` in the query's dtype. A left-padded sequence keeps only
    its real tokens: its rows start at cache row 0, and its padding query
    rows (which see no key) read zeros. ``sliding_window`` w (the layer's,
    as transformers passes it): each query row sees its newest w keys, the
    mask's window too (positions counted in cache rows, so the same window
    over each sequence's stored rows)."""
    t = query.shape[2]
    if key.shape[2] != t:
        raise InvalidValueError(op, f"{key.shape[2]} new keys for {t} query rows (the codes cache appends one key "
                                "per query row)")
    window = None
    if sliding_window is not None:
        window = _native.index_arg(op, "sliding_window", sliding_window, 1)
    try:
        layer.pad = _first_keys(attention_mask, query.shape[0], layer.start, t, window, layer.pad, op)
    except UnsupportedFeatureError:
        layer.length = layer.start  # the rows update() reserved stay free
        raise
    assert layer.k_codes is not None and layer.v_codes is not None
    # q, k and v in the model's dtype: the kernels read them exactly and the
    # attention writes the output in q's dtype (one rounding of its float32 result).
    q, k, v = (to_numpy(x.transpose(1, 2).contiguous(), op, name)
               for x, name in ((query, "query"), (key, "key"), (value, "value")))
    sk = None if sinks is None else sinks.detach().to(torch.float32).contiguous().numpy()
    kw: dict[str, Any] = dict(softmax_scale=scaling, causal=True, softcap=softcap, sinks=sk, registry=layer.registry,
                              window_size=(-1 if window is None else window - 1, 0))
    kc: Any = layer.k_codes  # the signature's ArrayLike does not name QuantizedKV
    vc: Any = layer.v_codes
    skip = np.maximum(layer.pad - layer.start, 0)  # new rows that are padding, per sequence
    if not skip.any():
        lens = (layer.start - layer.pad).astype(np.int32)
        out = flash_attn_with_kvcache(q, kc, vc, k=k, v=v, cache_seqlens=lens, **kw)
        return wrapper_like(query)(out)
    # Sequences append different counts of real rows: one call each.
    out = np.zeros(q.shape, q.dtype)
    for b in range(q.shape[0]):
        r = int(skip[b])
        if r == t:
            continue
        rows = slice(b, b + 1)
        kb: Any = QuantizedKV(kc.codec, kc.codes[rows], kc.norms[rows])
        vb: Any = QuantizedKV(vc.codec, vc.codes[rows], vc.norms[rows])
        lens = np.array([layer.start + r - int(layer.pad[b])], np.int32)
        out[b, r:] = flash_attn_with_kvcache(q[rows, r:], kb, vb, k=np.ascontiguousarray(k[rows, r:]),
                                             v=np.ascontiguousarray(v[rows, r:]), cache_seqlens=lens, **kw)[0]
    return wrapper_like(query)(out)


def _first_keys(mask: torch.Tensor | None, batch: int, past: int, rows: int, window: int | None,
                known: np.ndarray | None, op: str) -> np.ndarray:
    """Each sequence's first kept key, int32 ``[B]`` (``known``, the layer's
    padding, once the prompt set it), when the mask keeps, for every query
    row at position ``p = past + i``, exactly the keys ``first ... p`` (causal
    over a left-padded sequence), with ``window`` w only those with
    ``p - key < w``; other masks are refused."""
    if mask is None:
        return np.zeros(batch, np.int32) if known is None else known
    keep = mask if mask.dtype == torch.bool else mask == 0
    keep = keep[..., : past + rows]
    if keep.shape[-1] != past + rows or keep.shape[1] != 1:
        raise UnsupportedFeatureError(op, f"an attention mask of shape {tuple(mask.shape)} (one head-independent "
                                      f"mask over {past + rows} keys expected)", argument="attention_mask")
    keep = keep[:, 0].expand(batch, rows, past + rows)
    pos = torch.arange(past + rows)
    if known is not None:
        first = torch.from_numpy(known.astype(np.int64))
    else:  # the smallest key any row keeps: the first real row sees its own key (the window is >= 1)
        kept = keep.any(-1).any(-1)
        lowest = torch.where(keep, pos, past + rows).amin(dim=(1, 2))
        first = torch.where(kept, lowest, past + rows)
    rows_at = past + torch.arange(rows)
    want = (pos[None, None, :] >= first[:, None, None]) & (pos[None, None, :] <= rows_at[None, :, None])
    if window is not None:
        want &= pos[None, None, :] > rows_at[None, :, None] - window
    if not bool((keep == want).all()):
        what = "a causal block after left padding" + ("" if known is None else f" (fixed at the prompt: "
                                                      f"{known.tolist()})") + \
            ("" if window is None else f" within a window of {window}")
        raise UnsupportedFeatureError(op, f"the attention mask keeps keys other than {what} (holes, or another "
                                      "window), which QuantizedKVCache does not support: use a dense cache",
                                      argument="attention_mask")
    return np.asarray(first.numpy(), np.int32)
