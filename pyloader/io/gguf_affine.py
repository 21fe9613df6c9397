"""The ggml block formats that are exactly one of MLX's affine formats, rewritten into it.

MLX's affine mode stores, per group of 32 weights, ``w = scale * q + bias``. Q4_0, Q4_1,
Q5_0, Q5_1 and Q8_0 blocks, and each 32-weight sub-block of Q4_K and Q5_K, are of that form:
with float32 scales and biases every weight dequantizes to the value ggml's reference gives,
bit for bit (the products ``scale * q`` are exact in float32, so one rounding remains in
both). The other formats (Q2_K, Q3_K, Q6_K: 16-weight groups) have no MLX equivalent and are
refused by the caller. See docs/gguf.md.
"""

from __future__ import annotations

import numpy as np

#: Block formats MLX computes exactly -> their bits (groups of :data:`GROUP_SIZE`).
AFFINE_TYPES = {"Q4_0": 4, "Q4_1": 4, "Q5_0": 5, "Q5_1": 5, "Q8_0": 8, "Q4_K": 4, "Q5_K": 5}
GROUP_SIZE = 32


def _half(b: np.ndarray, at: int) -> np.ndarray:
    """The float16 at byte ``at`` of each block, as float32 (exact)."""
    return np.ascontiguousarray(b[..., at:at + 2]).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """ggml's 32-weight nibble order: the low nibbles are weights 0-15, the high 16-31."""
    return np.concatenate([qs & 0xF, qs >> 4], axis=-1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1's fifth bits: bit j of the little-endian uint32 is weight j's."""
    bits = np.unpackbits(qh, axis=-1, bitorder="little")
    return bits.astype(np.uint8) << 4


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's eight 6-bit (scale, min) pairs from their 12 packed bytes."""
    s = s.astype(np.uint8)
    sc = np.empty(s.shape[:-1] + (8,), np.uint8)
    mn = np.empty_like(sc)
    sc[..., :4] = s[..., 0:4] & 63
    mn[..., :4] = s[..., 4:8] & 63
    sc[..., 4:] = (s[..., 8:12] & 0xF) | ((s[..., 0:4] >> 6) << 4)
    mn[..., 4:] = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return sc.astype(np.float32), mn.astype(np.float32)


def _k_quants(qs: np.ndarray) -> np.ndarray:
    """Q4_K's 256 4-bit weights: each 32 bytes hold two sub-blocks (low, then high nibbles)."""
    c = qs.reshape(qs.shape[:-1] + (4, 32))
    return np.stack([c & 0xF, c >> 4], axis=-2).reshape(qs.shape[:-1] + (256,))


def _blocks(blocks: np.ndarray, type_name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(q, scale, bias)``: (..., groups, 32) uint8 weights and (..., groups) float32."""
    b = blocks
    if type_name == "Q8_0":
        d = _half(b, 0)
        q = (b[..., 2:34].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return q, d, -128 * d
    if type_name in ("Q4_0", "Q4_1"):
        at = 2 if type_name == "Q4_0" else 4
        d, q = _half(b, 0), _nibbles(b[..., at:at + 16])
        return q, d, (-8 * d if type_name == "Q4_0" else _half(b, 2))
    if type_name in ("Q5_0", "Q5_1"):
        at = 2 if type_name == "Q5_0" else 4
        d = _half(b, 0)
        q = _nibbles(b[..., at + 4:at + 20]) | _high_bits(b[..., at:at + 4])
        return q, d, (-16 * d if type_name == "Q5_0" else _half(b, 2))
    d, dmin = _half(b, 0)[..., None], _half(b, 2)[..., None]
    sc, mn = _k_scales(b[..., 4:16])
    if type_name == "Q4_K":
        q = _k_quants(b[..., 16:144])
    else:  # Q5_K: the fifth bit of sub-block j's weight l is bit j of qh[l]
        q = _k_quants(b[..., 48:176])
        qh = np.unpackbits(b[..., 16:48, None], axis=-1, bitorder="little")  # (..., 32, 8)
        q = q | (np.moveaxis(qh, -1, -2).reshape(q.shape) << 4)
    q = q.reshape(q.shape[:-1] + (8, 32))
    return q, d * sc, -(dmin * mn)


def _pack(q: np.ndarray, bits: int) -> np.ndarray:
    """``bits``-bit values packed as MLX packs them: least significant bit first, into
    little-endian uint32 words."""
    rows = q.shape[0]
    stream = np.unpackbits(q.reshape(rows, -1, 1), axis=-1, bitorder="little")[..., :bits]
    return np.packbits(stream.reshape(rows, -1), axis=-1, bitorder="little").view("<u4")


def to_affine(blocks: np.ndarray, type_name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A ``(..., rows, row bytes)`` tensor of ``type_name`` blocks as MLX's affine triple
    ``(packed uint32, float32 scales, float32 biases)`` at ``AFFINE_TYPES[type_name]`` bits,
    groups of 32, of the same leading shape."""
    from .gguf_header import GGML_TYPES

    nbytes = next(n for name, _, n in GGML_TYPES.values() if name == type_name)
    outer = blocks.shape[:-1]
    rows = int(np.prod(outer))
    q, scale, bias = _blocks(blocks.reshape(rows, -1, nbytes), type_name)
    return (_pack(q, AFFINE_TYPES[type_name]).reshape(*outer, -1), scale.reshape(*outer, -1),
            bias.reshape(*outer, -1).astype(np.float32))
