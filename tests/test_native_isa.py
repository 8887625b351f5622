"""The exact path's C kernels give the same bits on every instruction set they are built for.

rowdot.c (products) and attend.c (attention) have an AVX-512 body, an AVX2 body and a portable
one (one lane at a time). Each output element is one fixed sequence of IEEE operations in all
three, so a server on an AVX2 machine and one on an AVX-512 machine store and read the same KV
bits. Here each source is built the ways this CPU can run — as the server builds it
(``-march=native``), without AVX-512 (the AVX2 body, where the CPU has AVX2) and for the
baseline x86-64 (the portable body) — and the builds are compared element for element on odd
shapes that reach every block, tail and mask path, with and without a page table.
"""

from __future__ import annotations

import ctypes
import platform

import pytest
import torch

from engine.core import native
from engine.runtime.model import native_attn, native_gemm

pytestmark = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"),
                                reason="the ISA variants are x86-64's")

_BASE = ["-O3", "-ffp-contract=off", "-shared", "-fPIC", "-pthread"]


def _flags_of_cpu() -> str:
    return native_gemm._cpu_flags()


def _variants() -> dict[str, list[str]]:
    """name -> the -march flags of a build this CPU can run."""
    flags = _flags_of_cpu().split()
    out = {"native": ["-march=native"], "portable": ["-march=x86-64"]}
    if "avx2" in flags and "fma" in flags and "avx512f" in flags:
        out["avx2"] = ["-march=native", "-mno-avx512f"]
    return out


def _load(source, march: list[str]) -> ctypes.CDLL:
    try:
        lib, _ = native.load(source, _BASE + march, key_extra=_flags_of_cpu(),
                                         libs=("-lm",))
    except RuntimeError as exc:            # no compiler: the kernels are off here anyway
        pytest.skip(f"cannot build {source.name}: {exc}")
    return lib


@pytest.fixture(scope="module")
def rowdot_libs() -> dict[str, ctypes.CDLL]:
    libs = {}
    for name, march in _variants().items():
        lib = _load(native_gemm._SOURCE, march)
        lib.hicache_rowdot.restype = ctypes.c_int
        lib.hicache_rowdot.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                                       ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                       ctypes.c_int64, ctypes.c_int64, ctypes.c_int32]
        libs[name] = lib
    return libs


@pytest.fixture(scope="module")
def attend_libs() -> dict[str, ctypes.CDLL]:
    libs = {}
    for name, march in _variants().items():
        lib = _load(native_attn._SOURCE, march)
        fn = lib.hicache_attend
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                       ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                       ctypes.c_void_p,
                       ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                       ctypes.c_int64, ctypes.c_float, ctypes.c_int32]
        libs[name] = lib
    return libs


def test_the_builds_say_which_body_they_run(rowdot_libs):
    feats = {name: lib.hicache_rowdot_features() for name, lib in rowdot_libs.items()}
    assert feats["portable"] == 0
    if "avx2" in rowdot_libs:
        assert feats["avx2"] == 2 and feats["native"] == 1
    cpu = _flags_of_cpu().split()
    want = 1 if "avx512f" in cpu else 2 if "avx2" in cpu and "fma" in cpu else 0
    assert feats["native"] == want


# (rows, columns, reduction): one row (decode), 2 (the whole-panel pair), 3-13 (the 6-row
# tiles and their rests), past one 96-row work item; columns off the 16/32 panel widths
PRODUCTS = [(1, 45, 83), (2, 45, 83), (3, 33, 7), (7, 100, 64), (13, 31, 576),
            (37, 65, 129), (100, 96, 50), (5, 16, 9), (1, 8, 1), (12, 17, 300)]


@pytest.mark.parametrize("M,N,K", PRODUCTS)
def test_products_have_the_same_bits_on_every_isa(rowdot_libs, M, N, K):
    g = torch.Generator().manual_seed(M * 1000 + N * 10 + K)
    x, w = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g)
    packed = native_gemm.pack(w)
    outs = {}
    for name, lib in rowdot_libs.items():
        for threads in (1, 3):
            o = torch.full((M, N), float("nan"))
            assert lib.hicache_rowdot(x.data_ptr(), K, packed.data_ptr(), o.data_ptr(), N, M,
                                      N, K, threads) == 0
            outs[(name, threads)] = o
    ref = outs[("portable", 1)]
    assert torch.allclose(ref.double(), x.double() @ w.double().t(), rtol=1e-4, atol=1e-4)
    for key, o in outs.items():
        assert torch.equal(o, ref), key


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("M,N,K", [(1, 45, 64), (3, 100, 96), (8, 33, 32)])
def test_block_products_have_the_same_bits_on_every_isa(rowdot_libs, kind, M, N, K):
    """The GGUF blocks' kernel (native_quant) on each body, and the float32 panels: one set of
    bits (the AVX2 and AVX-512 builds make the values with AVX2 instructions, the portable
    one a lane at a time)."""
    from engine.runtime.model import native_quant
    from tests.test_native_quant import blocks  # (needs gguf: the smollm extra)

    raw, w = blocks(kind, N, K, seed=M + N)
    code, panels = native_quant.regroup(native_quant.Blocks(kind, raw), N, K)
    p = torch.from_numpy(panels)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(K))
    want = torch.empty((M, N))
    packed = native_gemm.pack(w)
    rowdot_libs["portable"].hicache_rowdot(x.data_ptr(), K, packed.data_ptr(), want.data_ptr(),
                                           N, M, N, K, 1)
    for name, lib in rowdot_libs.items():
        fn = lib.hicache_rowdot_quant
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int32,
                       ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                       ctypes.c_int64, ctypes.c_int32]
        for threads in (1, 3):
            o = torch.full((M, N), float("nan"))
            assert fn(x.data_ptr(), K, p.data_ptr(), code, o.data_ptr(), N, M, N, K,
                      threads) == 0
            assert torch.equal(o, want), (name, threads)


# (queries, q-heads, kv-heads, head dim, value dim, keys): decode at a long context, a
# chunk, odd dims (the 8- and 16-wide transposes' rests), one key; up to 64 rows a kv-head
# take the short path's phases, more the row blocks (the last four; the last one's rows see
# more keys than one of the row blocks' P @ V chunks of 1,024, with a value dim that ends
# in a part of a 16-column range)
ATTENTION = [(1, 9, 3, 64, 64, 1030), (16, 9, 3, 64, 64, 300), (21, 6, 2, 40, 72, 53),
             (5, 4, 4, 13, 7, 9), (1, 2, 1, 8, 8, 1), (3, 8, 2, 24, 20, 37),
             (30, 6, 2, 40, 72, 80), (64, 9, 3, 64, 64, 300), (70, 1, 1, 8, 33, 75),
             (36, 4, 2, 16, 20, 2100)]


@pytest.mark.parametrize("M,Hq,Hkv,D,Dv,T", ATTENTION)
def test_attention_has_the_same_bits_on_every_isa(attend_libs, M, Hq, Hkv, D, Dv, T):
    g = torch.Generator().manual_seed(M + Hq + D + T)
    q = torch.randn(M, Hq, D, generator=g) * 3          # wide scores: exp's whole range
    k, v = torch.randn(T, Hkv, D, generator=g), torch.randn(T, Hkv, Dv, generator=g)
    pos = torch.arange(T - M, T)
    pos[0] = max(0, T - M - 5)                           # a row that sees fewer keys
    perm = torch.randperm(T + 7, generator=g)[:T].contiguous()
    kp, vp = torch.zeros(T + 7, Hkv, D), torch.zeros(T + 7, Hkv, Dv)
    kp[perm], vp[perm] = k, v

    def run(lib, kk, vv, slots, threads):
        o = torch.full((M, Hq, Dv), float("nan"))
        assert lib.hicache_attend(q.data_ptr(), kk.data_ptr(), Hkv * D, vv.data_ptr(),
                                  Hkv * Dv, None if slots is None else slots.data_ptr(),
                                  0 if slots is None else len(slots), pos.data_ptr(),
                                  o.data_ptr(), M, Hq, Hkv, D, Dv, 0.3, threads) == 0
        return o

    outs = {}
    for name, lib in attend_libs.items():
        outs[(name, "rows", 1)] = run(lib, k, v, None, 1)
        outs[(name, "pool", 2)] = run(lib, kp, vp, perm, 2)
    ref = outs[("portable", "rows", 1)]
    G = Hq // Hkv
    s = torch.einsum("mhd,thd->hmt", q.double() * 0.3, k.double().repeat_interleave(G, 1))
    s = s.masked_fill(torch.arange(T)[None, None, :] > pos[None, :, None], float("-inf"))
    want = torch.einsum("hmt,thd->mhd", s.softmax(-1), v.double().repeat_interleave(G, 1))
    assert torch.allclose(ref.double(), want, rtol=1e-4, atol=1e-5)
    for key, o in outs.items():
        assert torch.equal(o, ref), key


def test_attention_refuses_a_read_past_the_page_table():
    """The bounds are checked in C for every query (a short page table is an error, not a
    read of whatever memory follows it)."""
    if not native_attn.available():
        pytest.skip(f"native attention: {native_attn.describe()}")
    q, k, v = torch.randn(3, 4, 8), torch.randn(20, 2, 8), torch.randn(20, 2, 8)
    pos = torch.tensor([5, 6, 7])
    with pytest.raises(ValueError, match="past its page table"):
        native_attn.attention(q, k, v, pos, 0.3, slots=torch.arange(7))     # needs 8
    with pytest.raises(ValueError, match="negative position"):
        native_attn.attention(q, k, v, torch.tensor([5, -1, 7]), 0.3, slots=torch.arange(8))
    got = native_attn.attention(q, k, v, pos, 0.3, slots=torch.arange(8))
    assert torch.equal(got, native_attn.attention(q, k[:8], v[:8], pos, 0.3))


def _row_fns(lib):
    lib.hicache_rms_norm.restype = None
    lib.hicache_rms_norm.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                     ctypes.c_int64, ctypes.c_void_p, ctypes.c_float,
                                     ctypes.c_void_p]
    lib.hicache_silu_mul.restype = None
    lib.hicache_silu_mul.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                     ctypes.c_int64, ctypes.c_void_p]
    return lib.hicache_rms_norm, lib.hicache_silu_mul


# (rows, width): a decode row, a chunk; widths off the 16-lane step (masked tails), one
@pytest.mark.parametrize("M,K", [(1, 576), (37, 576), (5, 300), (3, 17), (2, 1), (9, 1536)])
def test_row_ops_have_the_same_bits_on_every_isa_and_row_count(attend_libs, M, K):
    """RMS norm and the MLP's silu(g) * u: every body gives the same bits, a row alone the
    same as among others (and a strided source the same as a packed one), close to float64."""
    g = torch.Generator().manual_seed(M * 7 + K)
    x = torch.randn(M, K + 3, generator=g) * 5        # rows 3 floats apart: a strided view
    x[0, :3] = torch.tensor([0.0, -0.0, 40.0])[:min(3, K)]
    w = torch.randn(K, generator=g)
    gu = torch.randn(M, 2 * K, generator=g) * 8       # wide: exp's range, both signs
    gu[0, :2] = torch.tensor([0.0, -0.0])[:min(2, K)]
    outs = {}
    for name, lib in attend_libs.items():
        rms, silu = _row_fns(lib)
        o = torch.full((M, K), float("nan"))
        rms(x.data_ptr(), K + 3, M, K, w.data_ptr(), 1e-6, o.data_ptr())
        one = torch.full((1, K), float("nan"))
        xl = x[M - 1:, :K].contiguous()
        rms(xl.data_ptr(), K, 1, K, w.data_ptr(), 1e-6, one.data_ptr())
        assert torch.equal(one, o[M - 1:]), name
        s = torch.full((M, K), float("nan"))
        silu(gu.data_ptr(), 2 * K, M, K, s.data_ptr())
        s1 = torch.full((1, K), float("nan"))
        silu(gu[M - 1:].contiguous().data_ptr(), 2 * K, 1, K, s1.data_ptr())
        assert torch.equal(s1, s[M - 1:]), name
        outs[name] = (o, s)
    ref_o, ref_s = outs["portable"]
    xd = x[:, :K].double()
    want = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    assert torch.allclose(ref_o.double(), want, rtol=1e-5, atol=1e-6)
    gd = gu.double()
    want = torch.nn.functional.silu(gd[:, :K]) * gd[:, K:]
    assert torch.allclose(ref_s.double(), want, rtol=1e-5, atol=1e-5)
    for name, (o, s) in outs.items():
        assert torch.equal(o, ref_o) and torch.equal(s, ref_s), name


def test_short_and_long_paths_give_a_row_the_same_bits():
    """A chunk of up to 64 rows a kv-head runs in three phases over every kv-head, a longer
    one in row blocks: a query's result must not follow which (a decode step's row equals
    the same row inside a prefill chunk)."""
    if not native_attn.available():
        pytest.skip(f"native attention: {native_attn.describe()}")
    g = torch.Generator().manual_seed(11)
    # 120 rows a kv-head: the long path; 700 keys fit one of its P @ V chunks, 2,100 take three
    for M, Hq, Hkv, D, T in ((40, 9, 3, 64, 700), (40, 9, 3, 64, 2100)):
        q = torch.randn(M, Hq, D, generator=g) * 2
        k, v = torch.randn(T, Hkv, D, generator=g), torch.randn(T, Hkv, D, generator=g)
        pos = torch.arange(T - M, T)
        whole = native_attn.attention(q, k, v, pos, 0.125, threads=2)
        for lo, hi in ((39, 40), (0, 1), (10, 26), (5, 26)):  # 3, 3, 48 and 63 rows: short
            got = native_attn.attention(q[lo:hi], k, v, pos[lo:hi], 0.125, threads=2)
            assert torch.equal(got, whole[lo:hi]), (T, lo, hi)
