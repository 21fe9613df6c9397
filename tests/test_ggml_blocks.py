"""ggml's block formats computed in place, at every SIMD level this machine has.

The oracle is gguf-py (llama.cpp's ``gguf`` package), whose numpy
``gguf.quants.dequantize`` mirrors ggml's reference dequantization:
``ggml_dequantize`` must equal it bit for bit, and ``cpu_ggml_matmul`` must be
within float32 accumulation of the float64 product with those exact weights:
|y - y64| / sum_k |x_k w_k| <= (k + 2) * 2^-24 + 2 units of roundoff of the output
dtype (the bound tests/native/kernels_selftest.cpp states for every product).
"""

from __future__ import annotations

import os

import gguf
import mlx.core as mx
import numpy as np
import pytest

from pyloader import cpu_kernels as ck

LEVELS = list(ck.kernel_isas())
TYPES = list(ck.ggml_block_types())
FLOATS = [mx.float32, mx.float16, mx.bfloat16]
ROUNDOFF = {mx.float32: 2.0**-24, mx.float16: 2.0**-11, mx.bfloat16: 2.0**-8}

#: Values and bytes per block, and the byte offsets of each block's float16 scales
#: (d, and m or dmin): these hold finite values, every other byte is random.
LAYOUT = {
    "F32": (1, 4, ()), "F16": (1, 2, ()), "BF16": (1, 2, ()),
    "Q4_0": (32, 18, (0,)), "Q4_1": (32, 20, (0, 2)), "Q5_0": (32, 22, (0,)),
    "Q5_1": (32, 24, (0, 2)), "Q8_0": (32, 34, (0,)), "Q2_K": (256, 84, (80, 82)),
    "Q3_K": (256, 110, (108,)), "Q4_K": (256, 144, (0, 2)), "Q5_K": (256, 176, (0, 2)),
    "Q6_K": (256, 210, (208,)),
}


@pytest.fixture(params=LEVELS)
def level(request):
    """Runs the test at one SIMD level, then restores the default."""
    before = ck.kernel_isa()
    ck.set_kernel_isa(request.param)
    yield request.param
    ck.set_kernel_isa(before)


def test_the_types_are_the_ones_the_loader_asks_for():
    assert TYPES == list(LAYOUT)
    for name, (elems, size, _) in LAYOUT.items():
        qtype = gguf.GGMLQuantizationType[name]
        assert gguf.GGML_QUANT_SIZES[qtype] == (elems, size), name


def random_blocks(name: str, n: int, k: int, rng) -> np.ndarray:
    """(n, row_bytes) uint8: random codes and packed scales, finite float16 scales
    from 2^-20 (subnormal) to about 1, both signs."""
    elems, size, halves = LAYOUT[name]
    if name == "F32":
        return rng.standard_normal((n, k)).astype(np.float32).view(np.uint8)
    if name == "F16":
        return rng.standard_normal((n, k)).astype(np.float16).view(np.uint8)
    if name == "BF16":
        bits = rng.standard_normal((n, k)).astype(np.float32).view(np.uint32) >> 16
        return bits.astype(np.uint16).view(np.uint8)
    blocks = rng.integers(0, 256, (n, k // elems, size), dtype=np.uint8)
    for offset in halves:
        magnitude = np.exp2(rng.uniform(-20, 0, (n, k // elems)))
        sign = rng.choice([-1.0, 1.0], (n, k // elems))
        blocks[:, :, offset:offset + 2] = (
            (magnitude * sign).astype(np.float16).view(np.uint8).reshape(n, -1, 2))
    return blocks.reshape(n, -1)


def reference(blocks: np.ndarray, name: str) -> np.ndarray:
    out = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[name])
    return np.asarray(out, dtype=np.float32)


def f64(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32)).astype(np.float64)


def check_product(y: mx.array, x: mx.array, w: np.ndarray, what: str) -> None:
    k = x.shape[-1]
    x64 = f64(x).reshape(-1, k)
    w64 = w.astype(np.float64)
    ref = x64 @ w64.T
    mag = np.abs(x64) @ np.abs(w64).T
    got = f64(y).reshape(ref.shape)
    err = float((np.abs(got - ref) / np.maximum(mag, 1e-300)).max())
    bound = (k + 2) * 2.0**-24 + 2 * ROUNDOFF[y.dtype]
    assert err <= bound, f"{what}: error {err:.3g} > bound {bound:.3g}"


def shapes(name: str):
    """(n, blocks): one block, several, and n around the panel heights (24, 32)."""
    elems = LAYOUT[name][0]
    if elems == 1:
        return [(1, 32), (37, 96), (70, 40)]
    if elems == 32:
        return [(1, 1), (37, 5), (70, 12)]
    return [(1, 1), (37, 3), (70, 2)]


@pytest.mark.parametrize("name", TYPES)
def test_dequantize_is_ggml_reference_bit_for_bit(level, name):
    rng = np.random.default_rng(TYPES.index(name))
    for n, blocks in shapes(name):
        k = blocks * LAYOUT[name][0]
        b = random_blocks(name, n, k, rng)
        got = ck.ggml_dequantize(mx.array(b), name, k)
        assert got.dtype == mx.float32 and got.shape == (n, k)
        ref = reference(b, name)
        np.testing.assert_array_equal(np.array(got).view(np.uint32), ref.view(np.uint32),
                                      err_msg=f"{level} {name} n={n} k={k}")


@pytest.mark.parametrize("name", TYPES)
def test_matmul_is_within_float32_accumulation_of_float64(level, name):
    rng = np.random.default_rng(100 + TYPES.index(name))
    for case, (n, blocks) in enumerate(shapes(name)):
        k = blocks * LAYOUT[name][0]
        b = random_blocks(name, n, k, rng)
        w = reference(b, name)
        for rows in (1, 3, 37):
            for dtype in FLOATS:
                x = mx.random.normal((rows, k), key=mx.random.key(case * 7 + rows)).astype(dtype)
                y = ck.cpu_ggml_matmul(x, mx.array(b), name, k)
                assert y.dtype == dtype and y.shape == (rows, n)
                check_product(y, x, w, f"{level} {name} n={n} k={k} rows={rows} x={dtype}")


@pytest.mark.parametrize("name", ["Q4_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K"])
def test_huge_activations_stay_finite_where_float64_is(level, name):
    """Decode sums a run's codes times x before its scale: with |x| near float32's largest
    and a small scale, those sums would overflow where the weights times x do not. Such x
    are multiplied weight by weight."""
    elems, size, halves = LAYOUT[name]
    k, n = elems * 2, 3
    # Codes of large magnitude: q - 8 = -8 (Q4_0), 119, q - 32 up to 23 with scales 119;
    # Q4_K/Q5_K: codes 7 (and 23 or 7), scales and mins 55.
    fill = 0x00 if name == "Q4_0" else 0x77
    blocks = np.full((n, k // elems, size), fill, dtype=np.uint8)
    for offset in halves:
        blocks[:, :, offset:offset + 2] = np.full(
            (n, k // elems), 2.0**-20, np.float16).view(np.uint8).reshape(n, -1, 2)
    blocks = blocks.reshape(n, -1)
    w = reference(blocks, name)
    for top in (3e37, 1.0):
        x = mx.full((1, k), top, dtype=mx.float32)
        y = ck.cpu_ggml_matmul(x, mx.array(blocks), name, k)
        assert np.isfinite(np.array(y)).all(), f"{level} {name} x={top}: {np.array(y)}"
        check_product(y, x, w, f"{level} {name} x={top}")


@pytest.mark.parametrize("name", ["Q4_0", "Q5_1", "Q8_0", "Q3_K", "Q4_K", "Q6_K", "F16"])
def test_in_compiled_and_lazy_graphs(level, name):
    """Inside mx.compile with other ops, on a lazy x of batch shape (2, 5, k), and
    dequantizing gathered rows (an embedding lookup) of a lazy index."""
    rng = np.random.default_rng(7)
    elems = LAYOUT[name][0]
    k, n = max(elems, 32) * 2, 29
    b = mx.array(random_blocks(name, n, k, rng))
    w = reference(np.array(b), name)
    x = mx.random.normal((2, 5, k), key=mx.random.key(3))

    def layer(x, b):
        return mx.maximum(ck.cpu_ggml_matmul(x * 0.5 + 1.0, b, name, k), 0.0) * 2.0

    eager = layer(x, b)
    compiled = mx.compile(layer)(x, b)
    np.testing.assert_array_equal(np.array(compiled), np.array(eager))
    check_product(ck.cpu_ggml_matmul(x * 0.5 + 1.0, b, name, k), x * 0.5 + 1.0, w, name)

    ids = mx.array([[3, 0, 28], [3, 17, 1]]) + mx.array(0)  # lazy
    rows = ck.ggml_dequantize(b[ids], name, k) + 0.0
    assert rows.shape == (2, 3, k)
    np.testing.assert_array_equal(np.array(rows), w[np.array(ids)])


@pytest.mark.parametrize("name", TYPES)
def test_gathered_experts_are_each_tokens_own_products(level, name):
    """A stack of experts, gathered as mlx-lm's SwitchGLU calls it: tokens (3, 1, 1, k) times
    their 2 routed experts each, and the sorted layout (6, 1, k) by (6,) of adjacent and
    scattered runs; each product within float32 accumulation of float64, an index past the
    stack NaN."""
    rng = np.random.default_rng(200 + TYPES.index(name))
    experts, n = 3, 24
    k = max(LAYOUT[name][0], 32) * 2
    stack = np.stack([random_blocks(name, n, k, rng) for _ in range(experts)])
    w = [reference(stack[e], name) for e in range(experts)]
    for dtype in FLOATS:
        x = mx.random.normal((3, 1, 1, k), key=mx.random.key(5)).astype(dtype)
        idx = np.array([[2, 0], [1, 1], [0, 2]], dtype=np.uint32)
        y = ck.cpu_gather_ggml_matmul(x, mx.array(stack), name, k, mx.array(idx))
        assert y.dtype == dtype and y.shape == (3, 2, 1, n)
        for t in range(3):
            for j in range(2):
                check_product(y[t, j], x[t, 0], w[idx[t, j]], f"{level} {name} {t},{j}")
    x = mx.random.normal((6, 1, k), key=mx.random.key(6))
    for order in ([0, 0, 1, 2, 2, 2], [2, 0, 2, 1, 0, 2]):
        y = ck.cpu_gather_ggml_matmul(x, mx.array(stack), name, k,
                                      mx.array(np.array(order, dtype=np.int32)))
        for t, e in enumerate(order):
            check_product(y[t], x[t], w[e], f"{level} {name} sorted {order} {t}")
    y = ck.cpu_gather_ggml_matmul(x[:2], mx.array(stack), name, k,
                                  mx.array(np.array([1, experts], dtype=np.int64)))
    assert np.isfinite(np.array(y[0])).all() and np.isnan(np.array(y[1])).all()


def test_each_rule_raises_value_error():
    rng = np.random.default_rng(1)
    b = mx.array(random_blocks("Q4_K", 4, 512, rng))
    x = mx.random.normal((2, 512))
    with pytest.raises(ValueError, match="k=500 is not a multiple of Q4_K's block of 256"):
        ck.cpu_ggml_matmul(x[:, :500], b, "Q4_K", 500)
    with pytest.raises(ValueError, match="k=500 is not a multiple"):
        ck.ggml_dequantize(b, "Q4_K", 500)
    with pytest.raises(ValueError, match="rows of 288 bytes, but k=768 values of Q4_K take 432"):
        ck.cpu_ggml_matmul(mx.random.normal((2, 768)), b, "Q4_K", 768)
    with pytest.raises(ValueError, match="rows of 288 bytes, but k=512 values of Q6_K take 420"):
        ck.ggml_dequantize(b, "Q6_K", 512)
    with pytest.raises(ValueError, match="blocks must be uint8"):
        ck.cpu_ggml_matmul(x, b.astype(mx.int8), "Q4_K", 512)
    with pytest.raises(ValueError, match="blocks must be uint8"):
        ck.ggml_dequantize(b.astype(mx.float32), "Q4_K", 512)
    with pytest.raises(ValueError, match="unknown ggml type 'Q4_Z'"):
        ck.cpu_ggml_matmul(x, b, "Q4_Z", 512)
    with pytest.raises(ValueError, match="unknown ggml type 'q4_k'"):
        ck.ggml_dequantize(b, "q4_k", 512)
    wide = mx.array(random_blocks("Q4_K", 4, 1024, rng))
    view = wide[:, :288]
    mx.eval(view)
    with pytest.raises(ValueError, match="row-contiguous"):
        ck.cpu_ggml_matmul(x, view, "Q4_K", 512)
    with pytest.raises(ValueError, match="row-contiguous"):
        ck.ggml_dequantize(view, "Q4_K", 512)
    with pytest.raises(ValueError, match="must be"):
        ck.cpu_ggml_matmul(mx.random.normal((2, 256)), b, "Q4_K", 512)
    with pytest.raises(ValueError, match="x has dtype"):
        ck.cpu_ggml_matmul(x.astype(mx.int32), b, "Q4_K", 512)
    stack = mx.stack([b, b])
    idx = mx.array([[0, 1]])
    with pytest.raises(ValueError, match=r"blocks must be 3-D \(experts, n, row_bytes\)"):
        ck.cpu_gather_ggml_matmul(x[:, None], b, "Q4_K", 512, idx)
    with pytest.raises(ValueError, match="indices must be integers"):
        ck.cpu_gather_ggml_matmul(x[:, None], stack, "Q4_K", 512, idx.astype(mx.float32))
    with pytest.raises(ValueError, match="does not broadcast"):
        ck.cpu_gather_ggml_matmul(x[:, None], stack, "Q4_K", 512, mx.array([[0, 1, 0]]))
    with pytest.raises(ValueError, match="must be"):
        ck.cpu_gather_ggml_matmul(mx.random.normal((2, 1, 256)), stack, "Q4_K", 512, idx)


def test_rows_of_a_larger_array_are_read_in_place():
    """A row slice of a computed array (as a view of a mapped file is) is accepted
    and read where it lies."""
    rng = np.random.default_rng(2)
    b = mx.array(random_blocks("Q8_0", 40, 64, rng))
    view = b[5:30]
    mx.eval(view)
    x = mx.random.normal((1, 64))
    w = reference(np.array(b), "Q8_0")[5:30]
    check_product(ck.cpu_ggml_matmul(x, view, "Q8_0", 64), x, w, "row slice")


def test_empty_shapes():
    b = mx.zeros((0, 144), dtype=mx.uint8)
    assert ck.cpu_ggml_matmul(mx.zeros((3, 256)), b, "Q4_K", 256).shape == (3, 0)
    assert ck.ggml_dequantize(b, "Q4_K", 256).shape == (0, 256)
    b = mx.array(random_blocks("Q4_0", 5, 64, np.random.default_rng(0)))
    assert ck.cpu_ggml_matmul(mx.zeros((0, 64)), b, "Q4_0", 64).shape == (0, 5)


def test_the_automatic_level_computes_as_one_of_the_levels(tmp_path):
    """With no level forced, a GGUF product is the best level's, except that a CPU which
    splits 512-bit vectors (AMD Zen 4) decodes a few rows with the avx2 level's decoders:
    each result is bit for bit one level's own."""
    import subprocess
    import sys

    rng = np.random.default_rng(9)
    k, n = 512, 40
    blocks = random_blocks("Q4_K", n, k, rng)
    np.save(tmp_path / "b.npy", blocks)
    child = (
        "import sys, numpy as np, mlx.core as mx\n"
        "from pyloader import cpu_kernels as ck\n"
        "b = mx.array(np.load(sys.argv[1]))\n"
        "for rows in (1, 8):\n"
        "    x = mx.random.normal((rows, 512), key=mx.random.key(rows))\n"
        "    np.save(f'{sys.argv[2]}/auto{rows}.npy', np.array(ck.cpu_ggml_matmul(x, b, 'Q4_K', 512)))\n")
    env = {k: v for k, v in os.environ.items() if k != "PYLOADER_KERNEL_ISA"}
    subprocess.run([sys.executable, "-c", child, str(tmp_path / "b.npy"), str(tmp_path)],
                   check=True, env=env, timeout=300)
    best = LEVELS[-1]
    before = ck.kernel_isa()
    try:
        for rows in (1, 8):
            x = mx.random.normal((rows, k), key=mx.random.key(rows))
            got = np.load(tmp_path / f"auto{rows}.npy")
            by_level = {}
            for level in LEVELS:
                ck.set_kernel_isa(level)
                by_level[level] = np.array(ck.cpu_ggml_matmul(x, mx.array(blocks), "Q4_K", k))
            same = [lv for lv, y in by_level.items() if np.array_equal(y, got)]
            allowed = {best, "avx2"} if rows <= 4 and best == "avx512" else {best}
            assert set(same) & allowed, (rows, same)
            check_product(mx.array(got), x, reference(blocks, "Q4_K"), f"auto rows={rows}")
    finally:
        ck.set_kernel_isa(before)
