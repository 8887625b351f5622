/* hicache: float32 x @ w.T whose bits for one output element are fixed by its own row of x
 * and column of w.T (engine/runtime/model/native_gemm.py builds and loads it).
 *
 * Every output element is computed the same way wherever it sits in the product: one
 * accumulator from zero, one fused multiply-add per k, k = 0 .. K-1 in order. Blocks of rows
 * and panels of columns only decide which elements are computed together, never how; threads
 * take disjoint panels. So a row's result does not depend on the row count, on the other rows,
 * on the thread count or on the blocking: batch invariant by construction. The weight is packed
 * once into panels of 32 columns (k-major), so a block of up to 12 rows reads each weight value
 * once and a decode step (one row) streams the weights once.
 *
 * hicache_rowdot_quant (below) computes the same products from a GGUF file's Q4_1/Q8_0 blocks
 * (native_quant.py): the same float32 values rebuilt exactly, the same chains, the same bits,
 * a fifth of the bytes; hicache_rowdot_bf16 is the bfloat16 path (AVX512_BF16).
 */
#include <stdint.h>
#include <string.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#define HC_AVX512 1
typedef __m512 vec;
static inline vec vzero(void) { return _mm512_setzero_ps(); }
static inline vec vload(const float *p, int64_t left)
{
    if (left >= 16)
        return _mm512_loadu_ps(p);
    return _mm512_maskz_loadu_ps((__mmask16)((1u << left) - 1u), p);
}
static inline vec vload16(const float *p) { return _mm512_loadu_ps(p); }
static inline vec vbcast(float x) { return _mm512_set1_ps(x); }
static inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
static inline void vstore(float *o, vec a, vec b, int64_t cols)
{
    if (cols >= 32) {
        _mm512_storeu_ps(o, a);
        _mm512_storeu_ps(o + 16, b);
        return;
    }
    if (cols >= 16) {
        _mm512_storeu_ps(o, a);
        _mm512_mask_storeu_ps(o + 16, (__mmask16)((1u << (cols - 16)) - 1u), b);
        return;
    }
    _mm512_mask_storeu_ps(o, (__mmask16)((1u << cols) - 1u), a);
}
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HC_AVX2 1
#else
/* portable: the same arithmetic, one lane at a time */
typedef struct { float l[16]; } vec;
static inline vec vzero(void) { vec v; memset(&v, 0, sizeof v); return v; }
static inline vec vload(const float *p, int64_t left)
{
    vec v = vzero();
    int n = left >= 16 ? 16 : (int)left;
    for (int i = 0; i < n; i++)
        v.l[i] = p[i];
    return v;
}
static inline vec vload16(const float *p) { return vload(p, 16); }
static inline vec vbcast(float x)
{
    vec v;
    for (int i = 0; i < 16; i++) v.l[i] = x;
    return v;
}
static inline void vstore(float *o, vec a, vec b, int64_t cols)
{
    for (int64_t i = 0; i < cols && i < 16; i++) o[i] = a.l[i];
    for (int64_t i = 16; i < cols; i++) o[i] = b.l[i - 16];
}
static inline vec vfma(vec a, vec b, vec c)
{
    for (int i = 0; i < 16; i++)
        c.l[i] = fmaf(a.l[i], b.l[i], c.l[i]);
    return c;
}
#endif

#if defined(HC_AVX2)
/* AVX2 (16 registers of 8 lanes): the same sequence per output element, in register tiles
 * that fit: one or two rows against the whole 32-column panel, else up to 6 rows against
 * half a panel (16 columns) at a time. Only which elements are computed together changes. */
#define FMA_ROW(r, acc0, acc1)                                                             \
    if (R > r) {                                                                           \
        __m256 xb = _mm256_broadcast_ss(x + r * ldx + k);                                  \
        acc0 = _mm256_fmadd_ps(xb, w0, acc0);                                              \
        acc1 = _mm256_fmadd_ps(xb, w1, acc1);                                              \
    }
/* named accumulators, not an array: gcc kept an array of them in memory, stored every step */
#define MICRO16(N)                                                                         \
static void micro16_##N(const float *x, int64_t ldx, const float *p, float *o,             \
                        int64_t ldo, int64_t K, int64_t cols)                              \
{                                                                                          \
    enum { R = N };                                                                        \
    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00,          \
           a21 = a00, a30 = a00, a31 = a00, a40 = a00, a41 = a00, a50 = a00, a51 = a00;    \
    for (int64_t k = 0; k < K; k++) {                                                      \
        __m256 w0 = _mm256_loadu_ps(p + 32 * k), w1 = _mm256_loadu_ps(p + 32 * k + 8);     \
        FMA_ROW(0, a00, a01) FMA_ROW(1, a10, a11) FMA_ROW(2, a20, a21)                     \
        FMA_ROW(3, a30, a31) FMA_ROW(4, a40, a41) FMA_ROW(5, a50, a51)                     \
    }                                                                                      \
    store4(o, a00, a01, a00, a00, cols);                                                   \
    if (R > 1) store4(o + ldo, a10, a11, a10, a10, cols);                                  \
    if (R > 2) store4(o + 2 * ldo, a20, a21, a20, a20, cols);                              \
    if (R > 3) store4(o + 3 * ldo, a30, a31, a30, a30, cols);                              \
    if (R > 4) store4(o + 4 * ldo, a40, a41, a40, a40, cols);                              \
    if (R > 5) store4(o + 5 * ldo, a50, a51, a50, a50, cols);                              \
}
/* one to three rows against the whole panel, read in order (a decode step or a short tail: the
 * weight streamed once from memory); the rows' values first, then a weight vector at a time:
 * 12 accumulators, 3 values and 1 weight vector in the 16 registers */
#define W_COL(c)                                                                           \
    {                                                                                      \
        __m256 wv = _mm256_loadu_ps(pk + 8 * c);                                           \
        a0##c = _mm256_fmadd_ps(x0, wv, a0##c);                                            \
        if (R > 1) a1##c = _mm256_fmadd_ps(x1, wv, a1##c);                                 \
        if (R > 2) a2##c = _mm256_fmadd_ps(x2, wv, a2##c);                                 \
    }
#define MICRO32(N)                                                                         \
static void micro32_##N(const float *x, int64_t ldx, const float *p, float *o,             \
                        int64_t ldo, int64_t K, int64_t cols, const float *in)             \
{                                                                                          \
    enum { R = N };                                                                        \
    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a02 = a00, a03 = a00, a10 = a00,          \
           a11 = a00, a12 = a00, a13 = a00, a20 = a00, a21 = a00, a22 = a00, a23 = a00;    \
    if (in) {                     /* the chains so far (rows 32 floats apart), continued */ \
        a00 = _mm256_loadu_ps(in); a01 = _mm256_loadu_ps(in + 8);                          \
        a02 = _mm256_loadu_ps(in + 16); a03 = _mm256_loadu_ps(in + 24);                    \
        if (R > 1) {                                                                       \
            a10 = _mm256_loadu_ps(in + 32); a11 = _mm256_loadu_ps(in + 40);                \
            a12 = _mm256_loadu_ps(in + 48); a13 = _mm256_loadu_ps(in + 56);                \
        }                                                                                  \
        if (R > 2) {                                                                       \
            a20 = _mm256_loadu_ps(in + 64); a21 = _mm256_loadu_ps(in + 72);                \
            a22 = _mm256_loadu_ps(in + 80); a23 = _mm256_loadu_ps(in + 88);                \
        }                                                                                  \
    }                                                                                      \
    for (int64_t k = 0; k < K; k++) {                                                      \
        const float *pk = p + 32 * k;                                                      \
        _mm_prefetch((const char *)(pk + 32 * 64), _MM_HINT_T0);                           \
        _mm_prefetch((const char *)(pk + 32 * 64 + 16), _MM_HINT_T0);                      \
        __m256 x0 = _mm256_broadcast_ss(x + k);                                            \
        __m256 x1 = R > 1 ? _mm256_broadcast_ss(x + ldx + k) : x0;                         \
        __m256 x2 = R > 2 ? _mm256_broadcast_ss(x + 2 * ldx + k) : x0;                     \
        W_COL(0) W_COL(1) W_COL(2) W_COL(3)                                                \
    }                                                                                      \
    store4(o, a00, a01, a02, a03, cols);                                                   \
    if (R > 1) store4(o + ldo, a10, a11, a12, a13, cols);                                  \
    if (R > 2) store4(o + 2 * ldo, a20, a21, a22, a23, cols);                              \
}

/* the first `cols` (at most 32) of four vectors of 8, passed by value (an array whose address
 * is taken is kept in memory by the compiler: the accumulators would go through the stack) */
static inline void store4(float *o, __m256 v0, __m256 v1, __m256 v2, __m256 v3, int64_t cols)
{
    if (cols >= 16) {
        _mm256_storeu_ps(o, v0);
        _mm256_storeu_ps(o + 8, v1);
        if (cols >= 32) {
            _mm256_storeu_ps(o + 16, v2);
            _mm256_storeu_ps(o + 24, v3);
            return;
        }
    }
    float tmp[32];
    _mm256_storeu_ps(tmp, v0);
    _mm256_storeu_ps(tmp + 8, v1);
    _mm256_storeu_ps(tmp + 16, v2);
    _mm256_storeu_ps(tmp + 24, v3);
    for (int64_t i = cols >= 16 ? 16 : 0; i < cols; i++)
        o[i] = tmp[i];
}
MICRO32(1) MICRO32(2) MICRO32(3)
MICRO16(1) MICRO16(2) MICRO16(3) MICRO16(4) MICRO16(5) MICRO16(6)

typedef void (*micro_fn)(const float *, int64_t, const float *, float *, int64_t, int64_t,
                         int64_t);
typedef void (*micro32_fn)(const float *, int64_t, const float *, float *, int64_t, int64_t,
                           int64_t, const float *);
static const micro_fn MICRO16S[7] = {0, micro16_1, micro16_2, micro16_3, micro16_4,
                                     micro16_5, micro16_6};

static const micro32_fn MICRO32S[4] = {0, micro32_1, micro32_2, micro32_3};

/* The few-row passes over one panel, KB reduction steps at a time: each step's slice of the
 * panel comes from memory once and stays in L1 for the other passes (a whole panel per pass
 * read it from memory in the first pass alone, at memory speed, and from L2 after). The
 * chains are kept in `acc` between steps: stored and reloaded floats, the same bits. */
#define KB 64
static void stream_passes(const float *x, int64_t ldx, const float *p, float *o, int64_t ldo,
                          int64_t K, int64_t cols, int R)
{
    float acc[12 * 32];                      /* MR rows */
    for (int64_t k0 = 0; k0 < K; k0 += KB) {
        const int64_t kk = K - k0 < KB ? K - k0 : KB;
        const int last = k0 + kk == K;
        for (int r0 = 0; r0 < R; r0 += 3) {
            const int rr = R - r0 < 3 ? R - r0 : 3;
            MICRO32S[rr](x + r0 * ldx + k0, ldx, p + 32 * k0,
                         last ? o + r0 * ldo : acc + r0 * 32, last ? ldo : 32, kk,
                         last ? cols : 32, k0 ? acc + r0 * 32 : 0);
        }
    }
}

/* A product of few rows (STREAM_ROWS or fewer) reads each panel from memory once per item:
 * whole-panel passes of up to 3 rows (the later ones from cache), in order. More rows: 6-row
 * tiles against half panels (fewer loads per multiply-add). */
#define STREAM_ROWS 24
#define BLOCK(R)                                                                           \
static void block_##R(const float *x, int64_t ldx, const float *p, float *o, int64_t ldo,  \
                      int64_t K, int64_t cols, int64_t M)                                  \
{                                                                                          \
    if (R <= 3) {                                                                          \
        MICRO32S[R](x, ldx, p, o, ldo, K, cols, 0);                                        \
        return;                                                                            \
    }                                                                                      \
    if (M <= STREAM_ROWS) {                                                                \
        stream_passes(x, ldx, p, o, ldo, K, cols, R);                                      \
        return;                                                                            \
    }                                                                                      \
    for (int r0 = 0; r0 < R; r0 += 6) {                                                    \
        int rr = R - r0 < 6 ? R - r0 : 6;                                                  \
        MICRO16S[rr](x + r0 * ldx, ldx, p, o + r0 * ldo, ldo, K, cols < 16 ? cols : 16);   \
        if (cols > 16)                                                                     \
            MICRO16S[rr](x + r0 * ldx, ldx, p + 16, o + r0 * ldo + 16, ldo, K, cols - 16); \
    }                                                                                      \
}
BLOCK(1) BLOCK(2) BLOCK(3) BLOCK(4) BLOCK(5) BLOCK(6) BLOCK(7) BLOCK(8)
BLOCK(9) BLOCK(10) BLOCK(11) BLOCK(12)

#else
/* The weight comes packed in panels of 32 output columns: p[panel][k][0..31] = w[32*panel + j][k]
 * (zero past the last column). R rows x one panel: acc[r][j] = fma(x[r][k], p[k][j], acc[r][j])
 * for k = 0 .. K-1, in order, from 0: the one sequence every output element takes. */
#define BLOCK(R)                                                                           \
static void block_##R(const float *x, int64_t ldx, const float *p, float *o, int64_t ldo,  \
                      int64_t K, int64_t cols, int64_t M)                                  \
{                                                                                          \
    (void)M;                                                                               \
    vec a0[R], a1[R];                                                                      \
    for (int r = 0; r < R; r++) {                                                          \
        a0[r] = vzero();                                                                   \
        a1[r] = vzero();                                                                   \
    }                                                                                      \
    for (int64_t k = 0; k < K; k++) {                                                      \
        vec w0 = vload16(p + 32 * k), w1 = vload16(p + 32 * k + 16);                       \
        for (int r = 0; r < R; r++) {                                                      \
            vec xb = vbcast(x[r * ldx + k]);                                               \
            a0[r] = vfma(xb, w0, a0[r]);                                                   \
            a1[r] = vfma(xb, w1, a1[r]);                                                   \
        }                                                                                  \
    }                                                                                      \
    for (int r = 0; r < R; r++)                                                            \
        vstore(o + r * ldo, a0[r], a1[r], cols);                                           \
}
BLOCK(1) BLOCK(2) BLOCK(3) BLOCK(4) BLOCK(5) BLOCK(6) BLOCK(7) BLOCK(8)
BLOCK(9) BLOCK(10) BLOCK(11) BLOCK(12)

#endif

typedef void (*block_fn)(const float *, int64_t, const float *, float *, int64_t, int64_t,
                         int64_t, int64_t);
#define MR 12
static const block_fn BLOCKS[MR + 1] = {0, block_1, block_2, block_3, block_4, block_5,
                                        block_6, block_7, block_8, block_9, block_10,
                                        block_11, block_12};

struct job {
    const float *x, *p;
    float *o;
    int64_t M, N, K, ldx, ldo, panels;
    int64_t *next;                        /* the next panel to take (shared, atomic) */
};

/* Items taken one at a time from a shared counter (a thread whose core is busy elsewhere
 * takes fewer): item i is the rows of chunk i / panels (RC rows: they stay in the core's L2
 * while the threads go through the panels) against panel i % panels, in blocks of MR rows. */
#define RC (8 * MR)
#define GROUP 4       /* panels a thread takes at a time for a few rows (run, qrun) */

static int64_t items_of(int64_t M, int64_t panels)
{
    return (M + RC - 1) / RC * panels;
}

/* A thread's next work item, `take` consecutive items at a time from the shared counter (a
 * few rows: GROUP, so a thread streams a longer run of the weight; the hardware's prefetch
 * starts over at every jump); -1 when none is left. `it` and `left` are the thread's own. */
static int64_t next_item(int64_t *next, int64_t items, int64_t take, int64_t *it,
                         int64_t *left)
{
    if (*left == 0) {
        *it = __atomic_fetch_add(next, 1, __ATOMIC_RELAXED) * take;
        if (*it >= items)
            return -1;
        *left = items - *it < take ? items - *it : take;
    } else {
        ++*it;
    }
    --*left;
    return *it;
}

static void *run(void *arg)
{
    const struct job *j = (const struct job *)arg;
    const int64_t items = items_of(j->M, j->panels), take = j->M <= 3 ? GROUP : 1;
    int64_t it = 0, left = 0;
    while (next_item(j->next, items, take, &it, &left) >= 0) {
        int64_t q = it % j->panels, m0 = it / j->panels * RC;
        int64_t m1 = m0 + RC < j->M ? m0 + RC : j->M;
        int64_t n = 32 * q, cols = j->N - n < 32 ? j->N - n : 32;
        const float *panel = j->p + q * 32 * j->K;
        for (int64_t m = m0; m < m1; m += MR) {
            int64_t R = m1 - m < MR ? m1 - m : MR;
            BLOCKS[R](j->x + m * j->ldx, j->ldx, panel, j->o + m * j->ldo + n, j->ldo, j->K,
                      cols, j->M);
        }
    }
    return 0;
}

#define MAX_THREADS 64

/* the shared worker pool (native/pool.c, handed over by native_gemm.py): 0 when it ran the
 * job, else the threads are started here */
typedef int (*runner_fn)(void *(*)(void *), void **, int32_t);
static runner_fn runner;
void hicache_set_runner(runner_fn fn) { runner = fn; }

/* fn(arg) on the calling thread and threads - 1 more, all taking items from one counter;
 * 0, or -1 if a thread could not be started (the others take its items: the same bits) */
static int on_threads(void *(*fn)(void *), void *arg, int32_t threads)
{
    if (runner && threads > 1) {
        void *args[MAX_THREADS];
        for (int t = 0; t < threads; t++)
            args[t] = arg;
        if (runner(fn, args, threads) == 0)
            return 0;
    }
    pthread_t tid[MAX_THREADS];
    int started[MAX_THREADS];
    int rc = 0;
    for (int t = 1; t < threads; t++) {
        started[t] = pthread_create(&tid[t], 0, fn, arg) == 0;
        if (!started[t])
            rc = -1;
    }
    fn(arg);                              /* takes whatever items are left */
    for (int t = 1; t < threads; t++)
        if (started[t])
            pthread_join(tid[t], 0);
    return rc;
}

/* o[M, N] (row stride ldo) = x[M, K] (row stride ldx) @ w.T, w given packed (above), on up
 * to `threads` threads (panels taken from a shared counter). Returns 0, or -1 if a thread could
 * not be started (the others take its panels: the same bits). */
int hicache_rowdot(const float *x, int64_t ldx, const float *p, float *o, int64_t ldo,
                   int64_t M, int64_t N, int64_t K, int32_t threads)
{
    if (M <= 0 || N <= 0)
        return 0;
    if (threads < 1)
        threads = 1;
    if (threads > MAX_THREADS)
        threads = MAX_THREADS;
    int64_t panels = (N + 31) / 32;
    const int64_t takes = M <= 3 ? (panels + GROUP - 1) / GROUP : items_of(M, panels);
    if (threads > takes)
        threads = (int32_t)takes;
    int64_t next = 0;
    struct job job = {x, p, o, M, N, K, ldx, ldo, panels, &next};
    return on_threads(run, &job, threads);
}

/* ---- products from the GGUF's own blocks: the same float32 values, fewer bytes -------------
 * A weight read from a GGUF file as Q4_1 or Q8_0 blocks (32 values along k: a float16 scale d,
 * for Q4_1 a float16 offset m, and 4- or 8-bit integers q) has, once dequantised, the values
 * w = d*q + m (Q4_1) or d*q (Q8_0) in float32. d*q is exact in float32 (11 significant bits
 * times at most 8), so one fused multiply-add gives the same bits as the loader's multiply then
 * add. The panels here hold those blocks regrouped by 32 output columns (native_gemm.pack_quant):
 * per panel, per block of 32 k: d[32] and (Q4_1) m[32] as float32, then for each k the 32
 * columns' integers (Q4_1: 16 bytes, column j in the low and column j + 16 in the high nibble;
 * Q8_0: 32 signed bytes). A block is turned back into 32 x 32 float32 values in a buffer that
 * stays in L1, and the rows' chains go through it exactly as through a float32 panel (the
 * chained passes above: stored and reloaded floats, the same bits). So every output element is
 * the same sequence of fused multiply-adds on the same values as hicache_rowdot's: the same
 * bits, reading 0.75 (Q4_1) or 1.125 (Q8_0) bytes a weight instead of 4. The caller checks at
 * pack time that hicache_quant_values gives exactly the float32 weight (else keeps float32). */
#define QK 32
#define QROWS_MAX 24
static int64_t quant_products;

#if defined(__AVX2__) && defined(__FMA__)
/* four vectors of 8 from p: a block's 32 scales or offsets */
#define LOAD32(v, p)                                                                       \
    const __m256 v##0 = _mm256_loadu_ps(p), v##1 = _mm256_loadu_ps((p) + 8),              \
                 v##2 = _mm256_loadu_ps((p) + 16), v##3 = _mm256_loadu_ps((p) + 24)
/* 8 bytes at p widened to 8 lanes (Q4_1: columns j in the low nibble, j + 16 above it) */
#define WIDEN8(p) _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p)))
#endif

static inline int64_t qblock_bytes(int kind)
{
    return kind == 1 ? 2 * 4 * QK + QK * QK / 2 : 4 * QK + QK * QK;
}

/* one block (32 k x 32 columns) as float32, k-major: buf[k * 32 + j] */
static void dequant_block(const unsigned char *blk, int kind, float *buf)
{
    const float *d = (const float *)blk;
#if defined(__AVX2__) && defined(__FMA__)
    LOAD32(d, d);
    if (kind == 1) {
        LOAD32(m, d + QK);
        const unsigned char *nib = blk + 2 * 4 * QK;
        const __m256i low = _mm256_set1_epi32(0x0F);
        for (int k = 0; k < QK; k++) {
            const __m256i b0 = WIDEN8(nib + 16 * k), b1 = WIDEN8(nib + 16 * k + 8);
            float *b = buf + QK * k;
            _mm256_storeu_ps(b, _mm256_fmadd_ps(d0, _mm256_cvtepi32_ps(_mm256_and_si256(b0, low)), m0));
            _mm256_storeu_ps(b + 8, _mm256_fmadd_ps(d1, _mm256_cvtepi32_ps(_mm256_and_si256(b1, low)), m1));
            _mm256_storeu_ps(b + 16, _mm256_fmadd_ps(d2, _mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4)), m2));
            _mm256_storeu_ps(b + 24, _mm256_fmadd_ps(d3, _mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4)), m3));
        }
        return;
    }
    const signed char *q = (const signed char *)(blk + 4 * QK);
    for (int k = 0; k < QK; k++) {
        __m128i a = _mm_loadu_si128((const __m128i *)(q + QK * k)),
                b = _mm_loadu_si128((const __m128i *)(q + QK * k + 16));
        float *o = buf + QK * k;
        _mm256_storeu_ps(o, _mm256_mul_ps(d0, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(a))));
        _mm256_storeu_ps(o + 8, _mm256_mul_ps(
            d1, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(a, 8)))));
        _mm256_storeu_ps(o + 16, _mm256_mul_ps(d2, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b))));
        _mm256_storeu_ps(o + 24, _mm256_mul_ps(
            d3, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)))));
    }
#else
    if (kind == 1) {
        const float *m = d + QK;
        const unsigned char *nib = blk + 2 * 4 * QK;
        for (int k = 0; k < QK; k++)
            for (int j = 0; j < 16; j++) {
                unsigned char v = nib[16 * k + j];
                buf[QK * k + j] = fmaf(d[j], (float)(v & 0x0F), m[j]);
                buf[QK * k + j + 16] = fmaf(d[j + 16], (float)(v >> 4), m[j + 16]);
            }
        return;
    }
    const signed char *q = (const signed char *)(blk + 4 * QK);
    for (int k = 0; k < QK; k++)
        for (int j = 0; j < QK; j++)
            buf[QK * k + j] = d[j] * (float)q[QK * k + j];
#endif
}

#if defined(__AVX2__) && defined(__FMA__)
/* One row against a whole panel of blocks, the values made in registers and used at once (no
 * buffer): per output element the same chain, x[k] * w[k] added in k order from zero. */
static void quant_row(const float *x, const unsigned char *panel, int kind, int64_t blocks,
                      int64_t bb, float *o, int64_t cols)
{
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t b = 0; b < blocks; b++) {
        const unsigned char *blk = panel + b * bb;
        for (int64_t l = 0; b + 2 < blocks && l < bb; l += 64)   /* two blocks ahead */
            _mm_prefetch((const char *)(blk + 2 * bb + l), _MM_HINT_T0);
        const float *d = (const float *)blk, *xb = x + b * QK;
        LOAD32(d, d);
        if (kind == 1) {
            LOAD32(m, d + QK);
            const unsigned char *nib = blk + 2 * 4 * QK;
            const __m256i low = _mm256_set1_epi32(0x0F);
            for (int k = 0; k < QK; k++) {
                const __m256i b0 = WIDEN8(nib + 16 * k), b1 = WIDEN8(nib + 16 * k + 8);
                __m256 xv = _mm256_broadcast_ss(xb + k);
                a0 = _mm256_fmadd_ps(xv, _mm256_fmadd_ps(
                    d0, _mm256_cvtepi32_ps(_mm256_and_si256(b0, low)), m0), a0);
                a1 = _mm256_fmadd_ps(xv, _mm256_fmadd_ps(
                    d1, _mm256_cvtepi32_ps(_mm256_and_si256(b1, low)), m1), a1);
                a2 = _mm256_fmadd_ps(xv, _mm256_fmadd_ps(
                    d2, _mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4)), m2), a2);
                a3 = _mm256_fmadd_ps(xv, _mm256_fmadd_ps(
                    d3, _mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4)), m3), a3);
            }
            continue;
        }
        const signed char *q = (const signed char *)(blk + 4 * QK);
        for (int k = 0; k < QK; k++) {
            const signed char *qk = q + QK * k;
            __m256 xv = _mm256_broadcast_ss(xb + k);
            a0 = _mm256_fmadd_ps(xv, _mm256_mul_ps(d0, _mm256_cvtepi32_ps(
                _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)qk)))), a0);
            a1 = _mm256_fmadd_ps(xv, _mm256_mul_ps(d1, _mm256_cvtepi32_ps(
                _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(qk + 8))))), a1);
            a2 = _mm256_fmadd_ps(xv, _mm256_mul_ps(d2, _mm256_cvtepi32_ps(
                _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(qk + 16))))), a2);
            a3 = _mm256_fmadd_ps(xv, _mm256_mul_ps(d3, _mm256_cvtepi32_ps(
                _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(qk + 24))))), a3);
        }
    }
    float tmp[32];
    _mm256_storeu_ps(tmp, a0);
    _mm256_storeu_ps(tmp + 8, a1);
    _mm256_storeu_ps(tmp + 16, a2);
    _mm256_storeu_ps(tmp + 24, a3);
    memcpy(o, tmp, sizeof(float) * (size_t)cols);
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
/* Two rows against a whole panel (two decode steps in one batch): quant_row's values, each
 * used by both rows' chains; the block's scales are read from L1 where they are needed (8
 * accumulators, the two rows' values and one weight vector stay in the 16 registers). */
#define QW(c, wexpr)                                                                       \
    {                                                                                      \
        const __m256 w = (wexpr);                                                          \
        a0##c = _mm256_fmadd_ps(x0, w, a0##c);                                             \
        a1##c = _mm256_fmadd_ps(x1, w, a1##c);                                             \
    }
static void quant_rows2(const float *x, int64_t ldx, const unsigned char *panel, int kind,
                        int64_t blocks, int64_t bb, float *o, int64_t ldo, int64_t cols)
{
    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a02 = a00, a03 = a00, a10 = a00, a11 = a00,
           a12 = a00, a13 = a00;
    for (int64_t b = 0; b < blocks; b++) {
        const unsigned char *blk = panel + b * bb;
        for (int64_t l = 0; b + 2 < blocks && l < bb; l += 64)
            _mm_prefetch((const char *)(blk + 2 * bb + l), _MM_HINT_T0);
        const float *d = (const float *)blk, *xb = x + b * QK;
        if (kind == 1) {
            const float *m = d + QK;
            const unsigned char *nib = blk + 2 * 4 * QK;
            const __m256i low = _mm256_set1_epi32(0x0F);
            for (int k = 0; k < QK; k++) {
                const __m256i b0 = WIDEN8(nib + 16 * k), b1 = WIDEN8(nib + 16 * k + 8);
                const __m256 x0 = _mm256_broadcast_ss(xb + k), x1 = _mm256_broadcast_ss(xb + ldx + k);
                QW(0, _mm256_fmadd_ps(_mm256_loadu_ps(d), _mm256_cvtepi32_ps(_mm256_and_si256(b0, low)),
                                      _mm256_loadu_ps(m)))
                QW(1, _mm256_fmadd_ps(_mm256_loadu_ps(d + 8), _mm256_cvtepi32_ps(_mm256_and_si256(b1, low)),
                                      _mm256_loadu_ps(m + 8)))
                QW(2, _mm256_fmadd_ps(_mm256_loadu_ps(d + 16), _mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4)),
                                      _mm256_loadu_ps(m + 16)))
                QW(3, _mm256_fmadd_ps(_mm256_loadu_ps(d + 24), _mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4)),
                                      _mm256_loadu_ps(m + 24)))
            }
            continue;
        }
        const signed char *q = (const signed char *)(blk + 4 * QK);
        for (int k = 0; k < QK; k++) {
            const signed char *qk = q + QK * k;
            const __m256 x0 = _mm256_broadcast_ss(xb + k), x1 = _mm256_broadcast_ss(xb + ldx + k);
            QW(0, _mm256_mul_ps(_mm256_loadu_ps(d), _mm256_cvtepi32_ps(
                _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)qk)))))
            QW(1, _mm256_mul_ps(_mm256_loadu_ps(d + 8), _mm256_cvtepi32_ps(
                _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(qk + 8))))))
            QW(2, _mm256_mul_ps(_mm256_loadu_ps(d + 16), _mm256_cvtepi32_ps(
                _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(qk + 16))))))
            QW(3, _mm256_mul_ps(_mm256_loadu_ps(d + 24), _mm256_cvtepi32_ps(
                _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(qk + 24))))))
        }
    }
    float tmp[32];
    _mm256_storeu_ps(tmp, a00); _mm256_storeu_ps(tmp + 8, a01);
    _mm256_storeu_ps(tmp + 16, a02); _mm256_storeu_ps(tmp + 24, a03);
    memcpy(o, tmp, sizeof(float) * (size_t)cols);
    _mm256_storeu_ps(tmp, a10); _mm256_storeu_ps(tmp + 8, a11);
    _mm256_storeu_ps(tmp + 16, a12); _mm256_storeu_ps(tmp + 24, a13);
    memcpy(o + ldo, tmp, sizeof(float) * (size_t)cols);
}
#endif

#if !defined(HC_AVX2)
/* R rows (at most 3) against 32 k-steps of a float32 panel slice, the chains continued from
 * `in` (rows 32 floats apart) when given: the fused multiply-adds of BLOCK above, in order */
static void chain_rows(const float *x, int64_t ldx, const float *p, float *o, int64_t ldo,
                       int64_t K, int64_t cols, const float *in, int R)
{
    for (int r = 0; r < R; r++) {
        vec a0 = in ? vload16(in + 32 * r) : vzero(), a1 = in ? vload16(in + 32 * r + 16) : vzero();
        for (int64_t k = 0; k < K; k++) {
            vec xb = vbcast(x[r * ldx + k]);
            a0 = vfma(xb, vload16(p + 32 * k), a0);
            a1 = vfma(xb, vload16(p + 32 * k + 16), a1);
        }
        vstore(o + r * ldo, a0, a1, cols);
    }
}
#endif

struct qjob {
    const float *x;
    const unsigned char *p;
    float *o;
    int64_t M, N, K, ldx, ldo, panels;
    int kind;
    int64_t *next;
};

static void *qrun(void *arg)
{
    const struct qjob *j = (const struct qjob *)arg;
    float buf[QK * QK] __attribute__((aligned(64)));
    float acc[QROWS_MAX * 32] __attribute__((aligned(64)));
    const int64_t bb = qblock_bytes(j->kind), blocks = j->K / QK;
    int64_t q = 0, left = 0;
    while (next_item(j->next, j->panels, GROUP, &q, &left) >= 0) {
        const int64_t n = 32 * q, cols = j->N - n < 32 ? j->N - n : 32;
        const unsigned char *panel = j->p + q * blocks * bb;
#if defined(__AVX2__) && defined(__FMA__)
        if (j->M == 1) {
            quant_row(j->x, panel, j->kind, blocks, bb, j->o + n, cols);
            continue;
        }
        if (j->M == 2) {
            quant_rows2(j->x, j->ldx, panel, j->kind, blocks, bb, j->o + n, j->ldo, cols);
            continue;
        }
#endif
        for (int64_t b = 0; b < blocks; b++) {
            for (int64_t l = 0; b + 2 < blocks && l < bb; l += 64)
                __builtin_prefetch(panel + (b + 2) * bb + l);
            dequant_block(panel + b * bb, j->kind, buf);
            const int last = b == blocks - 1;
            for (int64_t r0 = 0; r0 < j->M; r0 += 3) {
                const int rr = j->M - r0 < 3 ? (int)(j->M - r0) : 3;
                const float *xr = j->x + r0 * j->ldx + b * QK;
                float *out = last ? j->o + r0 * j->ldo + n : acc + r0 * 32;
                const int64_t ldo = last ? j->ldo : 32, c = last ? cols : 32;
                const float *in = b ? acc + r0 * 32 : 0;
#if defined(HC_AVX2)
                MICRO32S[rr](xr, j->ldx, buf, out, ldo, QK, c, in);
#else
                chain_rows(xr, j->ldx, buf, out, ldo, QK, c, in, rr);
#endif
            }
        }
    }
    return 0;
}

/* o[M, N] = x[M, K] @ w.T with w given as block panels (above; kind 1 = Q4_1, 2 = Q8_0), the
 * same bits as hicache_rowdot on the float32 weight. Returns 0; -1 if a thread could not be
 * started (the others take its panels: the same bits); -2 for a shape it does not take (K not
 * a multiple of 32, more than QROWS_MAX rows, an unknown kind). */
int hicache_rowdot_quant(const float *x, int64_t ldx, const unsigned char *p, int32_t kind,
                         float *o, int64_t ldo, int64_t M, int64_t N, int64_t K,
                         int32_t threads)
{
    if (M <= 0 || N <= 0)
        return 0;
    if (K % QK || K <= 0 || M > QROWS_MAX || (kind != 1 && kind != 2))
        return -2;
    if (threads < 1)
        threads = 1;
    if (threads > MAX_THREADS)
        threads = MAX_THREADS;
    int64_t panels = (N + 31) / 32;
    if (threads > (panels + GROUP - 1) / GROUP)
        threads = (int32_t)((panels + GROUP - 1) / GROUP);
    int64_t next = 0;
    struct qjob job = {x, p, o, M, N, K, ldx, ldo, panels, kind, &next};
    __atomic_fetch_add(&quant_products, 1, __ATOMIC_RELAXED);
    return on_threads(qrun, &job, threads);
}

/* how many products the blocks have served in this process (tests, reports) */
int64_t hicache_quant_products(void) { return __atomic_load_n(&quant_products, __ATOMIC_RELAXED); }

/* the float32 values the panels stand for, as the weight w[N, K] (row-major): what the
 * caller compares with the loader's weight before it uses the panels */
int hicache_quant_values(const unsigned char *p, int32_t kind, float *w, int64_t N, int64_t K)
{
    if (K % QK || K <= 0 || (kind != 1 && kind != 2))
        return -2;
    float buf[QK * QK];
    const int64_t bb = qblock_bytes(kind), blocks = K / QK;
    for (int64_t q = 0; q * 32 < N; q++)
        for (int64_t b = 0; b < blocks; b++) {
            dequant_block(p + (q * blocks + b) * bb, kind, buf);
            for (int64_t j = 0; j < 32 && 32 * q + j < N; j++)
                for (int k = 0; k < QK; k++)
                    w[(32 * q + j) * K + b * QK + k] = buf[QK * k + j];
        }
    return 0;
}

int hicache_quant_rows_max(void) { return QROWS_MAX; }

/* ---- bfloat16 products (AVX512_BF16): the same shape of computation on bf16 pairs ----------
 * x is rounded to bfloat16 (round to nearest even, one fixed function per element) and taken
 * two reduction indices at a time: each output element is one float32 accumulator from zero,
 * one VDPBF16PS per pair k = 2i, 2i + 1 (i = 0 .. ceil(K/2)-1, in order; a missing last k is
 * zero). The instruction's rounding is fixed by the architecture, so the bits of an element
 * again depend only on its row of x and column of w: batch invariant by construction. The
 * weight comes packed (native_gemm.pack_bf16): p[panel][i][j][e] = bf16(w[32*panel + j][2i + e]),
 * 128 bytes per pair row; half the bytes of the float32 panels. */
#if defined(__AVX512BF16__)
static inline uint32_t bf16_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7F800000u) == 0x7F800000u && (u & 0x007FFFFFu))
        return (u >> 16) | 0x40u;                     /* NaN stays NaN (quiet) */
    return (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;    /* round to nearest even */
}

/* bf16_bits of 16 floats, in the low half of each 32-bit lane (the same integer steps) */
static inline __m512i round_bf16(__m512 v)
{
    __m512i u = _mm512_castps_si512(v);
    __m512i rounded = _mm512_srli_epi32(
        _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)),
                         _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))), 16);
    __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    return _mm512_mask_mov_epi32(rounded, nan, quiet);
}

/* the 16-bit halves of two vectors of rounded values, in order: 32 bf16 */
static inline __m512i pack_idx(void)
{
    return _mm512_set_epi16(62, 60, 58, 56, 54, 52, 50, 48, 46, 44, 42, 40, 38, 36, 34, 32,
                            30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
}

#define BBLOCK(R)                                                                          \
static void bblock_##R(const uint32_t *xb, int64_t ldb, const uint16_t *p, float *o,       \
                       int64_t ldo, int64_t KP, int64_t cols)                              \
{                                                                                          \
    __m512 a0[R], a1[R];                                                                   \
    for (int r = 0; r < R; r++) {                                                          \
        a0[r] = _mm512_setzero_ps();                                                       \
        a1[r] = _mm512_setzero_ps();                                                       \
    }                                                                                      \
    for (int64_t i = 0; i < KP; i++) {                                                     \
        __m512bh w0 = (__m512bh)_mm512_loadu_si512(p + 64 * i);                            \
        __m512bh w1 = (__m512bh)_mm512_loadu_si512(p + 64 * i + 32);                       \
        for (int r = 0; r < R; r++) {                                                      \
            __m512bh xv = (__m512bh)_mm512_set1_epi32((int)xb[r * ldb + i]);               \
            a0[r] = _mm512_dpbf16_ps(a0[r], xv, w0);                                       \
            a1[r] = _mm512_dpbf16_ps(a1[r], xv, w1);                                       \
        }                                                                                  \
    }                                                                                      \
    for (int r = 0; r < R; r++)                                                            \
        vstore(o + r * ldo, a0[r], a1[r], cols);                                           \
}
BBLOCK(1) BBLOCK(2) BBLOCK(3) BBLOCK(4) BBLOCK(5) BBLOCK(6) BBLOCK(7) BBLOCK(8)
BBLOCK(9) BBLOCK(10) BBLOCK(11) BBLOCK(12)

typedef void (*bblock_fn)(const uint32_t *, int64_t, const uint16_t *, float *, int64_t,
                          int64_t, int64_t);
static const bblock_fn BBLOCKS[MR + 1] = {0, bblock_1, bblock_2, bblock_3, bblock_4,
                                          bblock_5, bblock_6, bblock_7, bblock_8, bblock_9,
                                          bblock_10, bblock_11, bblock_12};

struct bjob {
    const uint32_t *xb;
    const uint16_t *p;
    float *o;
    int64_t M, N, KP, ldo, panels;
    int64_t *next;
};

static void *brun(void *arg)
{
    const struct bjob *j = (const struct bjob *)arg;
    const int64_t items = items_of(j->M, j->panels);
    for (;;) {
        int64_t it = __atomic_fetch_add(j->next, 1, __ATOMIC_RELAXED);
        if (it >= items)
            break;
        int64_t q = it % j->panels, m0 = it / j->panels * RC;
        int64_t m1 = m0 + RC < j->M ? m0 + RC : j->M;
        int64_t n = 32 * q, cols = j->N - n < 32 ? j->N - n : 32;
        const uint16_t *panel = j->p + q * 64 * j->KP;
        for (int64_t m = m0; m < m1; m += MR) {
            int64_t R = m1 - m < MR ? m1 - m : MR;
            BBLOCKS[R](j->xb + m * j->KP, j->KP, panel, j->o + m * j->ldo + n, j->ldo, j->KP,
                       cols);
        }
    }
    return 0;
}
#endif

/* o[M, N] = bf16(x[M, K]) @ w.T with w packed as bf16 pairs (above). Returns 0; -1 if a
 * thread could not be started (the others take its panels: the same bits); -2 without
 * AVX512_BF16 or memory for the rounded x. */
int hicache_rowdot_bf16(const float *x, int64_t ldx, const uint16_t *p, float *o, int64_t ldo,
                        int64_t M, int64_t N, int64_t K, int32_t threads)
{
#if defined(__AVX512BF16__)
    if (M <= 0 || N <= 0)
        return 0;
    if (threads < 1)
        threads = 1;
    if (threads > MAX_THREADS)
        threads = MAX_THREADS;
    int64_t panels = (N + 31) / 32, KP = (K + 1) / 2;
    if (threads > items_of(M, panels))
        threads = (int32_t)items_of(M, panels);
    static __thread uint32_t *xb_buf;
    static __thread size_t xb_cap;
    size_t need = (size_t)(M * KP);
    if (need > xb_cap) {
        free(xb_buf);
        xb_cap = need + need / 4;
        xb_buf = (uint32_t *)malloc(sizeof(uint32_t) * xb_cap);
        if (!xb_buf) {
            xb_cap = 0;
            return -2;
        }
    }
    for (int64_t m = 0; m < M; m++) {
        const float *xr = x + m * ldx;
        uint32_t *dr = xb_buf + m * KP;
        int64_t i = 0;
        for (; 2 * i + 32 <= K; i += 16) {       /* 32 values a time: the same rounding */
            __m512 lo = _mm512_loadu_ps(xr + 2 * i), hi = _mm512_loadu_ps(xr + 2 * i + 16);
            __m512i r0 = round_bf16(lo), r1 = round_bf16(hi);
            _mm512_storeu_si512(dr + i, _mm512_permutex2var_epi16(r0, pack_idx(), r1));
        }
        for (; i < K / 2; i++)
            dr[i] = bf16_bits(xr[2 * i]) | bf16_bits(xr[2 * i + 1]) << 16;
        if (K & 1)
            dr[KP - 1] = bf16_bits(xr[K - 1]);
    }
    int64_t next = 0;
    struct bjob job = {xb_buf, p, o, M, N, KP, ldo, panels, &next};
    return on_threads(brun, &job, threads);
#else
    (void)x; (void)ldx; (void)p; (void)o; (void)ldo; (void)M; (void)N; (void)K; (void)threads;
    return -2;
#endif
}

int hicache_rowdot_bf16_available(void)
{
#if defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}

/* 1: AVX-512, 2: AVX2 with FMA, 0: portable (the same bits on each) */
int hicache_rowdot_features(void)
{
#if defined(HC_AVX512)
    return 1;
#elif defined(HC_AVX2)
    return 2;
#else
    return 0;
#endif
}
