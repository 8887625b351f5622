/* hicache: causal attention whose bits for one query row are fixed by that row, its visible
 * keys and values (engine/runtime/model/native_attn.py builds and loads it).
 *
 * For a query row (query m, head hq) that sees keys 0 .. pos[m]:
 *   s[t]  = fma chain over d = 0 .. D-1 in order of (q[d] * scale) * k[t][d], from 0;
 *   mx    = max of s over the visible keys;
 *   e[t]  = exp(s[t] - mx) by one vector routine (every element through the same code);
 *   sum   = sixteen lane sums (lane j: keys j, j+16, ... in order), then added in a fixed order;
 *   p[t]  = e[t] * (1 / sum);
 *   o[dv] = fma chain over t = 0 .. pos[m] in order of p[t] * v[t][dv], from 0.
 * Nothing of it depends on the other rows, on how many keys the chunk needs, on the blocking or
 * on the thread count: batch invariant by construction. Rows of one kv-head (its group of query
 * heads, every query) are taken 12 at a time (two 6-row score tiles, 6-row x 16-column P @ V
 * tiles on AVX2; 8 rows took a fifth longer on a 512-token chunk). Once per call the keys are
 * transposed into blocks of 16 (a key per vector lane) and, on AVX2, the values laid out by
 * kv-head and 16-column range (vt_at), both into a buffer the calling thread keeps, read by
 * every row block. A short chunk
 * (every kv-head's rows in one block: a decode step) takes three phases over all kv-heads
 * instead (short_scores below). Rows are copied in address order before they are read kv-head
 * by kv-head: read where they are, 16 or 64 rows apart, the hardware's prefetch did not follow.
 * No score tensor of the whole chunk. RMS norm and the MLP's activation are row operations of
 * the same kind; hicache_layers, at the end, runs a forward's layers in one call.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <pthread.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#define HC_AVX512 1
typedef __m512 vec;
typedef __mmask16 vmask;
static inline vmask vm(int64_t left)
{ return left >= 16 ? (vmask)0xFFFF : left <= 0 ? (vmask)0 : (vmask)((1u << left) - 1u); }
static inline vec vzero(void) { return _mm512_setzero_ps(); }
static inline vec vload(const float *p, vmask m) { return _mm512_maskz_loadu_ps(m, p); }
static inline void vstore(float *p, vec v, vmask m) { _mm512_mask_storeu_ps(p, m, v); }
static inline vec vbcast(float x) { return _mm512_set1_ps(x); }
static inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
static inline vec vadd_m(vec a, vec b, vmask m) { return _mm512_mask_add_ps(a, m, a, b); }
static inline vec vadd(vec a, vec b) { return _mm512_add_ps(a, b); }
static inline vec vmax(vec a, vec b) { return _mm512_max_ps(a, b); }
static inline vec vmax_m(vec a, vec b, vmask m) { return _mm512_mask_max_ps(a, m, a, b); }
static inline vec vsub(vec a, vec b) { return _mm512_sub_ps(a, b); }
static inline vec vmul(vec a, vec b) { return _mm512_mul_ps(a, b); }
static inline vec vdiv(vec a, vec b) { return _mm512_div_ps(a, b); }
static inline vec vnegabs(vec a) { return _mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(a)); }
static inline vec vsel_ge0(vec x, vec a, vec b)       /* a where x >= 0, else b */
{ return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_GE_OQ), b, a); }
static inline float vhmax(vec v) { return _mm512_reduce_max_ps(v); }
static inline float vhsum(vec v)
{
    __m256 lo = _mm512_castps512_ps256(v);
    __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
    __m256 s8 = _mm256_add_ps(lo, hi);
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    __m128 s1 = _mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1));
    return _mm_cvtss_f32(s1);
}
/* exp for x <= 0: 2^n * p(r), r = x - n ln2, a degree-6 polynomial */
static inline vec vexp(vec x)
{
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    vec n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                 _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    vec r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    vec p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r);
    p = _mm512_add_ps(p, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HC_AVX2 1
/* AVX2: a vector of 16 as two of 8, every operation the AVX-512 one lane for lane (the same
 * bits: the same roundings, max, sums in the same tree, exp's 2^n exact for n >= -126) */
typedef struct { __m256 lo, hi; } vec;
typedef int32_t vmask;                    /* the lanes below this count */
static inline vmask vm(int64_t left) { return left >= 16 ? 16 : left <= 0 ? 0 : (vmask)left; }
static inline __m256i lanes(int32_t below)
{ return _mm256_cmpgt_epi32(_mm256_set1_epi32(below), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)); }
static inline vec vzero(void) { vec v = {_mm256_setzero_ps(), _mm256_setzero_ps()}; return v; }
static inline vec vload(const float *p, vmask m)
{
    if (m == 16) {
        vec v = {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)};
        return v;
    }
    vec v = {_mm256_maskload_ps(p, lanes(m)), _mm256_maskload_ps(p + 8, lanes(m - 8))};
    return v;
}
static inline void vstore(float *p, vec v, vmask m)
{
    if (m == 16) {
        _mm256_storeu_ps(p, v.lo);
        _mm256_storeu_ps(p + 8, v.hi);
        return;
    }
    _mm256_maskstore_ps(p, lanes(m), v.lo);
    _mm256_maskstore_ps(p + 8, lanes(m - 8), v.hi);
}
static inline vec vbcast(float x) { vec v = {_mm256_set1_ps(x), _mm256_set1_ps(x)}; return v; }
static inline vec vfma(vec a, vec b, vec c)
{
    vec v = {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
    return v;
}
static inline vec vpick(vec a, vec b, vmask m)        /* b in the lanes of m, else a */
{
    vec v = {_mm256_blendv_ps(a.lo, b.lo, _mm256_castsi256_ps(lanes(m))),
             _mm256_blendv_ps(a.hi, b.hi, _mm256_castsi256_ps(lanes(m - 8)))};
    return v;
}
static inline vec vadd_m(vec a, vec b, vmask m)
{
    vec s = {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)};
    return vpick(a, s, m);
}
static inline vec vmax_m(vec a, vec b, vmask m)
{
    vec s = {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)};
    return vpick(a, s, m);
}
static inline vec vadd(vec a, vec b)
{ vec v = {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; return v; }
static inline vec vmax(vec a, vec b)
{ vec v = {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; return v; }
static inline vec vsub(vec a, vec b)
{ vec v = {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; return v; }
static inline vec vmul(vec a, vec b)
{ vec v = {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; return v; }
static inline vec vdiv(vec a, vec b)
{ vec v = {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; return v; }
static inline __m256 negabs8(__m256 a)
{ return _mm256_sub_ps(_mm256_setzero_ps(), _mm256_andnot_ps(_mm256_set1_ps(-0.0f), a)); }
static inline vec vnegabs(vec a) { vec v = {negabs8(a.lo), negabs8(a.hi)}; return v; }
static inline vec vsel_ge0(vec x, vec a, vec b)       /* a where x >= 0, else b */
{
    const __m256 z = _mm256_setzero_ps();
    vec v = {_mm256_blendv_ps(b.lo, a.lo, _mm256_cmp_ps(x.lo, z, _CMP_GE_OQ)),
             _mm256_blendv_ps(b.hi, a.hi, _mm256_cmp_ps(x.hi, z, _CMP_GE_OQ))};
    return v;
}
static inline float vhmax(vec v)
{
    __m256 m8 = _mm256_max_ps(v.lo, v.hi);
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
    __m128 m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    return _mm_cvtss_f32(_mm_max_ss(m2, _mm_shuffle_ps(m2, m2, 1)));
}
static inline float vhsum(vec v)
{
    __m256 s8 = _mm256_add_ps(v.lo, v.hi);
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    __m128 s1 = _mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1));
    return _mm_cvtss_f32(s1);
}
static inline __m256 vexp8(__m256 x)
{
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r);
    p = _mm256_add_ps(p, _mm256_set1_ps(1.0f));
    /* 2^n as a float (n in -126 .. 0 for x <= 0: a normal number, so p * 2^n is scalef's
     * one rounding); lanes past the mask may hold anything and are never stored */
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n),
                                                   _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
static inline vec vexp(vec x) { vec v = {vexp8(x.lo), vexp8(x.hi)}; return v; }
#else
typedef struct { float l[16]; } vec;
typedef uint32_t vmask;
static inline vmask vm(int64_t left)
{ return left >= 16 ? 0xFFFFu : left <= 0 ? 0u : ((1u << left) - 1u); }
static inline vec vzero(void) { vec v; memset(&v, 0, sizeof v); return v; }
static inline vec vload(const float *p, vmask m)
{ vec v = vzero(); for (int i = 0; i < 16; i++) if (m >> i & 1) v.l[i] = p[i]; return v; }
static inline void vstore(float *p, vec v, vmask m)
{ for (int i = 0; i < 16; i++) if (m >> i & 1) p[i] = v.l[i]; }
static inline vec vbcast(float x) { vec v; for (int i = 0; i < 16; i++) v.l[i] = x; return v; }
static inline vec vfma(vec a, vec b, vec c)
{ for (int i = 0; i < 16; i++) c.l[i] = fmaf(a.l[i], b.l[i], c.l[i]); return c; }
static inline vec vadd_m(vec a, vec b, vmask m)
{ for (int i = 0; i < 16; i++) if (m >> i & 1) a.l[i] = a.l[i] + b.l[i]; return a; }
static inline vec vmax_m(vec a, vec b, vmask m)
{ for (int i = 0; i < 16; i++) if (m >> i & 1 && b.l[i] > a.l[i]) a.l[i] = b.l[i]; return a; }
static inline vec vadd(vec a, vec b) { return vadd_m(a, b, 0xFFFFu); }
static inline vec vmax(vec a, vec b) { return vmax_m(a, b, 0xFFFFu); }
static inline vec vsub(vec a, vec b) { for (int i = 0; i < 16; i++) a.l[i] -= b.l[i]; return a; }
static inline vec vmul(vec a, vec b) { for (int i = 0; i < 16; i++) a.l[i] *= b.l[i]; return a; }
static inline vec vdiv(vec a, vec b) { for (int i = 0; i < 16; i++) a.l[i] /= b.l[i]; return a; }
static inline vec vnegabs(vec a) { for (int i = 0; i < 16; i++) a.l[i] = 0.0f - fabsf(a.l[i]); return a; }
static inline vec vsel_ge0(vec x, vec a, vec b)
{ for (int i = 0; i < 16; i++) if (!(x.l[i] >= 0.0f)) a.l[i] = b.l[i]; return a; }
static inline float vhmax(vec v) { float m = v.l[0]; for (int i = 1; i < 16; i++) if (v.l[i] > m) m = v.l[i]; return m; }
static inline float vhsum(vec v)
{
    float s8[8], s4[4], s2[2];
    for (int i = 0; i < 8; i++) s8[i] = v.l[i] + v.l[i + 8];
    for (int i = 0; i < 4; i++) s4[i] = s8[i] + s8[i + 4];
    for (int i = 0; i < 2; i++) s2[i] = s4[i] + s4[i + 2];
    return s2[0] + s2[1];
}
static inline vec vexp(vec x)
{
    for (int i = 0; i < 16; i++) {
        float a = x.l[i] < -87.0f ? -87.0f : x.l[i];
        float n = nearbyintf(a * 1.44269504088896341f);
        float r = fmaf(-n, 0.693359375f, a);
        r = fmaf(-n, -2.12194440e-4f, r);
        float p = 1.9875691500e-4f;
        p = fmaf(p, r, 1.3981999507e-3f);
        p = fmaf(p, r, 8.3334519073e-3f);
        p = fmaf(p, r, 4.1665795894e-2f);
        p = fmaf(p, r, 1.6666665459e-1f);
        p = fmaf(p, r, 5.0000001201e-1f);
        p = fmaf(p, r * r, r);
        x.l[i] = ldexpf(p + 1.0f, (int)n);
    }
    return x;
}
#endif

#define RB 12         /* rows per block */
#define PV_KEYS 1024  /* keys per chunk of a row block's P @ V (AVX2): 64 read each tile's values in
                       * page-sized runs, 2% slower (the prefetch starts over in each page) */
#define MAX_THREADS 64

struct task_args {
    const float *q, *k, *v;
    const int64_t *pos, *slots;           /* slots: key t's row is slots[t] (NULL: row t) */
    float *o;
    int64_t M, Hq, Hkv, D, Dv, ldk, ldv;   /* ldk/ldv: floats per key row (all kv-heads) */
    float scale;
    int64_t tasks, per_head;              /* row blocks: per_head per kv-head */
    int32_t threads;
    float *kt;                            /* keys transposed: [Hkv][nblk][D][16] */
    float *vt;                 /* values: [Hkv][(Dv + 15) / 16][nblk * 16][16] (AVX2) */
    int64_t nblk;
    int64_t *next;                        /* the next item of the phase (shared, atomic) */
    /* a short chunk (every kv-head's rows in one block of R = M * G): the scores of every
     * kv-head's rows, [Hkv][R][cap], keys 0 .. tmax - 1, in nchunk chunks (phase 1's items);
     * mx [nchunk][Hkv * R]: each row's largest visible score in each chunk; the value
     * columns in ntile tiles of PV_TILE (tph a kv-head: phase 3's items) */
    float *sc, *mx;
    int64_t R, cap, tmax, nchunk, ntile, tph;
};

struct worker { const struct task_args *a; int32_t id; int err; };

#if defined(HC_AVX2)
/* Scores of a block's rows against 16 keys (kb: the keys transposed, [D][16]) for AVX2:
 * 6 rows at a time in 12 named registers (the 16 keys of one row in two), each key's score
 * the same fma chain over d = 0 .. D-1 in order, from 0 */
#define SC_ROW(r)                                                                          \
    if (RR > r) {                                                                          \
        __m256 b = _mm256_broadcast_ss(q0 + r * D + d);                                    \
        s##r##0 = _mm256_fmadd_ps(b, k0, s##r##0);                                         \
        s##r##1 = _mm256_fmadd_ps(b, k1, s##r##1);                                         \
    }
#define SC_STORE(r)                                                                        \
    if (RR > r) {                                                                          \
        _mm256_storeu_ps(out + (r0 + r) * cap, s##r##0);                                   \
        _mm256_storeu_ps(out + (r0 + r) * cap + 8, s##r##1);                               \
    }
static void scores_avx2(const float *kb, const float *qb, int64_t D, int64_t R, float *out,
                        int64_t cap)
{
    for (int64_t r0 = 0; r0 < R; r0 += 6) {
        const int64_t RR = R - r0 < 6 ? R - r0 : 6;
        const float *q0 = qb + r0 * D;
        __m256 s00 = _mm256_setzero_ps(), s01 = s00, s10 = s00, s11 = s00, s20 = s00,
               s21 = s00, s30 = s00, s31 = s00, s40 = s00, s41 = s00, s50 = s00, s51 = s00;
        for (int64_t d = 0; d < D; d++) {
            __m256 k0 = _mm256_loadu_ps(kb + d * 16), k1 = _mm256_loadu_ps(kb + d * 16 + 8);
            SC_ROW(0) SC_ROW(1) SC_ROW(2) SC_ROW(3) SC_ROW(4) SC_ROW(5)
        }
        SC_STORE(0) SC_STORE(1) SC_STORE(2) SC_STORE(3) SC_STORE(4) SC_STORE(5)
    }
}

/* the fewest keys any of rows 0 .. cnt - 1 sees */
static inline int64_t fewest(const int64_t *n, int64_t cnt)
{
    int64_t m = n[0];
    for (int64_t r = 1; r < cnt; r++)
        m = n[r] < m ? n[r] : m;
    return m;
}

/* P @ V of one tile for AVX2 (16 registers): the R rows of a kv-head (probabilities
 * buf[r * cap + t], r's visible key count n[r]) by the first w <= 16 value columns of one
 * 16-column range, over the keys t0 .. t1 - 1 (key t's 16 values of the range at vb + 16 t:
 * vt_at's layout), 6 rows at a time, keys in order: 12 accumulators, the two value vectors of a
 * key and one probability at a time in the other registers, so each value vector is loaded
 * once per 6 rows (a 3 x 32 tile reloaded it for every row: 1.75x slower on 12 rows). The
 * chains come from and go back to acc (row r at acc + r * lda): zero when t0 is 0, else the
 * stored floats of the keys before t0, so each output is one fma chain over its row's keys in
 * order however the keys and columns are cut. */
#define P6_ROW(r)                                                                          \
    if (RR > r) {                                                                          \
        const __m256 p = _mm256_broadcast_ss(pr + r * cap);                                \
        c##r##0 = _mm256_fmadd_ps(p, v0, c##r##0);                                         \
        c##r##1 = _mm256_fmadd_ps(p, v1, c##r##1);                                         \
    }
#define P6_MROW(r)                                                                         \
    if (RR > r && t < n[rs + r]) {                                                         \
        const __m256 p = _mm256_broadcast_ss(pr + r * cap);                                \
        c##r##0 = _mm256_fmadd_ps(p, v0, c##r##0);                                         \
        c##r##1 = _mm256_fmadd_ps(p, v1, c##r##1);                                         \
    }
#define P6_LOAD(r)                                                                         \
    if (RR > r) {                                                                          \
        c##r##0 = _mm256_loadu_ps(acc + (rs + r) * lda);                                   \
        c##r##1 = _mm256_loadu_ps(acc + (rs + r) * lda + 8);                               \
    }
#define P6_SAVE(r)                                                                         \
    if (RR > r) {                                                                          \
        _mm256_storeu_ps(acc + (rs + r) * lda, c##r##0);                                   \
        _mm256_storeu_ps(acc + (rs + r) * lda + 8, c##r##1);                               \
    }
static void pv_tile16_avx2(int64_t R, const int64_t *n, const float *buf, int64_t cap,
                           float *acc, int64_t lda, int64_t w, int64_t t0, int64_t t1,
                           const float *vb)
{
    const __m256i l0 = lanes((int32_t)w), l1 = lanes((int32_t)w - 8);
    for (int64_t rs = 0; rs < R; rs += 6) {
        const int64_t RR = R - rs < 6 ? R - rs : 6;
        const int64_t nmin = fewest(n + rs, RR);
        __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00,
               c21 = c00, c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
        if (t0) {
            P6_LOAD(0) P6_LOAD(1) P6_LOAD(2) P6_LOAD(3) P6_LOAD(4) P6_LOAD(5)
        }
        const int64_t tm = t1 < nmin ? t1 : nmin > t0 ? nmin : t0;
        const float *pr = buf + rs * cap + t0;
        if (w == 16) {
            for (int64_t t = t0; t < tm; t++, pr++) {
                const float *vr = vb + 16 * t;
                const __m256 v0 = _mm256_loadu_ps(vr), v1 = _mm256_loadu_ps(vr + 8);
                P6_ROW(0) P6_ROW(1) P6_ROW(2) P6_ROW(3) P6_ROW(4) P6_ROW(5)
            }
        } else {
            for (int64_t t = t0; t < tm; t++, pr++) {
                const float *vr = vb + 16 * t;
                const __m256 v0 = _mm256_maskload_ps(vr, l0), v1 = _mm256_maskload_ps(vr + 8, l1);
                P6_ROW(0) P6_ROW(1) P6_ROW(2) P6_ROW(3) P6_ROW(4) P6_ROW(5)
            }
        }
        /* the rest: each row up to its own last key */
        for (int64_t t = tm; t < t1; t++, pr++) {
            const float *vr = vb + 16 * t;
            const __m256 v0 = _mm256_maskload_ps(vr, l0), v1 = _mm256_maskload_ps(vr + 8, l1);
            P6_MROW(0) P6_MROW(1) P6_MROW(2) P6_MROW(3) P6_MROW(4) P6_MROW(5)
        }
        P6_SAVE(0) P6_SAVE(1) P6_SAVE(2) P6_SAVE(3) P6_SAVE(4) P6_SAVE(5)
    }
}

/* The same over 32 value columns, 3 rows at a time (12 accumulators, the 3 rows'
 * probabilities, each value vector used by the 3 FMAs that need it). A decode step's 3 rows a
 * kv-head read the pool directly with it: each row's two lines in one pass, in the pool's
 * order (the two threads then stream 6 column ranges of the same rows side by side: faster on
 * 2 cores than copying each thread's half of the rows first, or 16 columns a pass). */
#define P3_ACC(r, ok)                                                                      \
    if (RR > r && (ok)) {                                                                  \
        const __m256 p = _mm256_broadcast_ss(buf + (rs + r) * cap + t);                    \
        c##r##0 = _mm256_fmadd_ps(p, v0, c##r##0);                                         \
        c##r##1 = _mm256_fmadd_ps(p, v1, c##r##1);                                         \
        c##r##2 = _mm256_fmadd_ps(p, v2, c##r##2);                                         \
        c##r##3 = _mm256_fmadd_ps(p, v3, c##r##3);                                         \
    }
#define P3_LOAD(r)                                                                         \
    if (RR > r) {                                                                          \
        const float *ar = acc + (rs + r) * lda;                                            \
        c##r##0 = _mm256_loadu_ps(ar); c##r##1 = _mm256_loadu_ps(ar + 8);                  \
        c##r##2 = _mm256_loadu_ps(ar + 16); c##r##3 = _mm256_loadu_ps(ar + 24);            \
    }
#define P3_SAVE(r)                                                                         \
    if (RR > r) {                                                                          \
        float *ar = acc + (rs + r) * lda;                                                  \
        _mm256_storeu_ps(ar, c##r##0); _mm256_storeu_ps(ar + 8, c##r##1);                  \
        _mm256_storeu_ps(ar + 16, c##r##2); _mm256_storeu_ps(ar + 24, c##r##3);            \
    }
static void pv_tile32_avx2(int64_t R, const int64_t *n, const float *buf, int64_t cap,
                           float *acc, int64_t lda, int64_t d0, int64_t w, int64_t t0,
                           int64_t t1, const float *vb, int64_t ldv, const int64_t *sl,
                           int64_t tb)
{
    const __m256i l0 = lanes((int32_t)w), l1 = lanes((int32_t)w - 8),
                  l2 = lanes((int32_t)w - 16), l3 = lanes((int32_t)w - 24);
    for (int64_t rs = 0; rs < R; rs += 3) {
        const int64_t RR = R - rs < 3 ? R - rs : 3;
        const int64_t nmin = fewest(n + rs, RR);
        __m256 c00 = _mm256_setzero_ps(), c01 = c00, c02 = c00, c03 = c00,
               c10 = c00, c11 = c00, c12 = c00, c13 = c00, c20 = c00, c21 = c00,
               c22 = c00, c23 = c00;
        if (t0) {
            P3_LOAD(0) P3_LOAD(1) P3_LOAD(2)
        }
        const int64_t tm = t1 < nmin ? t1 : nmin > t0 ? nmin : t0;
        for (int64_t t = t0; t < t1; t++) {
            const float *vr = vb + (sl ? sl[t] : t - tb) * ldv + d0;
            __m256 v0, v1, v2, v3;
            if (w == 32) {
                v0 = _mm256_loadu_ps(vr);
                v1 = _mm256_loadu_ps(vr + 8);
                v2 = _mm256_loadu_ps(vr + 16);
                v3 = _mm256_loadu_ps(vr + 24);
            } else {
                v0 = _mm256_maskload_ps(vr, l0);
                v1 = _mm256_maskload_ps(vr + 8, l1);
                v2 = _mm256_maskload_ps(vr + 16, l2);
                v3 = _mm256_maskload_ps(vr + 24, l3);
            }
            if (t < tm) {                     /* every row of the group sees key t */
                P3_ACC(0, 1) P3_ACC(1, 1) P3_ACC(2, 1)
            } else {                          /* each row up to its own last key */
                P3_ACC(0, t < n[rs]) P3_ACC(1, t < n[rs + 1]) P3_ACC(2, t < n[rs + 2])
            }
        }
        P3_SAVE(0) P3_SAVE(1) P3_SAVE(2)
    }
}

/* P @ V of a row block (the long path): PV_KEYS keys at a time, every row and column of the
 * block over them before the next ones; the chains kept in acc [R][Dp] between key chunks.
 * The values come from vt, where each kv-head's 16-column ranges lie one after the other,
 * every key's 16 values of a range contiguous ([Hkv][(Dv + 15) / 16][keys][16]): a tile
 * reads one contiguous run of 64 bytes a key. (Read from rows of all Dv columns, each tile
 * fetched a different line of every row, 256 bytes apart: P @ V ran ~10% slower than the
 * scores, which do as many multiply-adds; now at their speed.) */
static inline float *vt_at(const struct task_args *a, int64_t h, int64_t c)
{
    return a->vt + ((h * ((a->Dv + 15) / 16) + c) * a->nblk * 16) * 16;
}
static void pv_avx2(const struct task_args *a, int64_t h, int64_t R, const int64_t *n,
                    const int64_t *mrow, const int64_t *hq, const float *buf, int64_t cap,
                    float *acc, int64_t dlo, int64_t dhi)
{
    const int64_t Dv = a->Dv, Dp = (Dv + 31) / 32 * 32;
    int64_t nmax = 0;
    for (int64_t r = 0; r < R; r++)
        if (n[r] > nmax)
            nmax = n[r];
    for (int64_t t0 = 0; t0 < nmax; t0 += PV_KEYS) {
        const int64_t t1 = nmax - t0 < PV_KEYS ? nmax : t0 + PV_KEYS;
        for (int64_t d0 = dlo; d0 < dhi; d0 += 16)    /* (dlo a multiple of 16) */
            pv_tile16_avx2(R, n, buf, cap, acc + d0, Dp, dhi - d0 < 16 ? dhi - d0 : 16, t0,
                           t1, vt_at(a, h, d0 / 16));
    }
    for (int64_t r = 0; r < R; r++)
        memcpy(a->o + (mrow[r] * a->Hq + hq[r]) * Dv + dlo, acc + r * Dp + dlo,
               sizeof(float) * (size_t)(dhi - dlo));
}

/* Scores of N <= 3 rows (qb: their scaled queries, [N][D]) against 16 keys (key j's D values
 * of the kv-head at kr[j]), transposed in registers 4 dimensions at a time (two groups of 8
 * keys, 6 chains: the 3 of one group alone wait on the fused multiply-add's latency): each
 * score the same fma chain over d = 0 .. D-1 in order, from 0, as from the transposed blocks,
 * without storing and reloading them (a decode step's 3 rows a kv-head use each transposed key
 * too few times for that to pay). D a multiple of 4; out[r * cap + j]. */
#define F16_R(r, j)                                                                        \
    if (N > r) {                                                                           \
        const __m256 qv = _mm256_broadcast_ss(qd + r * D + j);                             \
        a##r = _mm256_fmadd_ps(qv, x##j, a##r);                                            \
        b##r = _mm256_fmadd_ps(qv, y##j, b##r);                                            \
    }
#define F16_J(j) F16_R(0, j) F16_R(1, j) F16_R(2, j)
#define F16_STORE(r)                                                                       \
    if (N > r) {                                                                           \
        _mm256_storeu_ps(out + r * cap, a##r);                                             \
        _mm256_storeu_ps(out + r * cap + 8, b##r);                                         \
    }
/* dims d .. d + 3 of keys g0 .. g0 + 7 as 4 vectors (v0: dim d of the 8 keys, ...) */
#define T4X8(g0, v)                                                                        \
    const __m256 v##r0 = _mm256_insertf128_ps(                                             \
        _mm256_castps128_ps256(_mm_loadu_ps(kr[g0] + d)), _mm_loadu_ps(kr[g0 + 4] + d), 1); \
    const __m256 v##r1 = _mm256_insertf128_ps(                                             \
        _mm256_castps128_ps256(_mm_loadu_ps(kr[g0 + 1] + d)), _mm_loadu_ps(kr[g0 + 5] + d), 1); \
    const __m256 v##r2 = _mm256_insertf128_ps(                                             \
        _mm256_castps128_ps256(_mm_loadu_ps(kr[g0 + 2] + d)), _mm_loadu_ps(kr[g0 + 6] + d), 1); \
    const __m256 v##r3 = _mm256_insertf128_ps(                                             \
        _mm256_castps128_ps256(_mm_loadu_ps(kr[g0 + 3] + d)), _mm_loadu_ps(kr[g0 + 7] + d), 1); \
    const __m256 v##t0 = _mm256_unpacklo_ps(v##r0, v##r1), v##t1 = _mm256_unpackhi_ps(v##r0, v##r1), \
                 v##t2 = _mm256_unpacklo_ps(v##r2, v##r3), v##t3 = _mm256_unpackhi_ps(v##r2, v##r3); \
    const __m256 v##0 = _mm256_shuffle_ps(v##t0, v##t2, 0x44),                             \
                 v##1 = _mm256_shuffle_ps(v##t0, v##t2, 0xEE),                             \
                 v##2 = _mm256_shuffle_ps(v##t1, v##t3, 0x44),                             \
                 v##3 = _mm256_shuffle_ps(v##t1, v##t3, 0xEE);
#define FUSED16(NR)                                                                        \
static void fused16_##NR(const float *const *kr, const float *qb, int64_t D, float *out,   \
                         int64_t cap)                                                      \
{                                                                                          \
    enum { N = NR };                                                                       \
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, b0 = a0, b1 = a0, b2 = a0;          \
    for (int64_t d = 0; d < D; d += 4) {                                                   \
        T4X8(0, x)                                                                         \
        T4X8(8, y)                                                                         \
        const float *qd = qb + d;                                                          \
        F16_J(0) F16_J(1) F16_J(2) F16_J(3)                                                \
    }                                                                                      \
    F16_STORE(0) F16_STORE(1) F16_STORE(2)                                                 \
}
FUSED16(1) FUSED16(2) FUSED16(3)
typedef void (*fused16_fn)(const float *const *, const float *, int64_t, float *, int64_t);
static const fused16_fn FUSED16S[4] = {0, fused16_1, fused16_2, fused16_3};
#define FUSED_ROWS 3
#endif


/* Scores of R rows (qb: their scaled queries, [R][D]) against 16 keys (kb: transposed,
 * [D][16]) into out[r * cap .. + 15]: each key's score the fma chain over d = 0 .. D-1 in
 * order, from 0 (the same for any row block and any grouping of the keys) */
static void scores_rows(const float *kb, const float *qb, int64_t D, int64_t R, float *out,
                        int64_t cap)
{
#if defined(HC_AVX2)
    scores_avx2(kb, qb, D, R, out, cap);
#else
    for (int64_t r0 = 0; r0 < R; r0 += 4) {
        int64_t RR = R - r0 < 4 ? R - r0 : 4;
        vec acc0 = vzero(), acc1 = vzero(), acc2 = vzero(), acc3 = vzero();
        const float *q0 = qb + r0 * D;
        if (RR == 4) {
            for (int64_t d = 0; d < D; d++) {
                vec kv = vload(kb + d * 16, vm(16));
                acc0 = vfma(vbcast(q0[d]), kv, acc0);
                acc1 = vfma(vbcast(q0[D + d]), kv, acc1);
                acc2 = vfma(vbcast(q0[2 * D + d]), kv, acc2);
                acc3 = vfma(vbcast(q0[3 * D + d]), kv, acc3);
            }
        } else {
            for (int64_t d = 0; d < D; d++) {
                vec kv = vload(kb + d * 16, vm(16));
                acc0 = vfma(vbcast(q0[d]), kv, acc0);
                if (RR > 1) acc1 = vfma(vbcast(q0[D + d]), kv, acc1);
                if (RR > 2) acc2 = vfma(vbcast(q0[2 * D + d]), kv, acc2);
            }
        }
        vstore(out + (r0 + 0) * cap, acc0, vm(16));
        if (RR > 1) vstore(out + (r0 + 1) * cap, acc1, vm(16));
        if (RR > 2) vstore(out + (r0 + 2) * cap, acc2, vm(16));
        if (RR > 3) vstore(out + (r0 + 3) * cap, acc3, vm(16));
    }
#endif
}

/* the largest of n scores (-inf for none). A maximum is the same number whatever the order it
 * is taken in (a zero's sign aside, which no step after it can tell: exp(s - mx) is the same
 * for mx = +0 and -0), so it may be taken over pieces of a row. */
static float span_max(const float *s, int64_t n)
{
    vec mx = vbcast(-INFINITY);
    int64_t t = 0;
    for (; t + 16 <= n; t += 16)              /* whole vectors: no masks (the same values) */
        mx = vmax(mx, vload(s + t, vm(16)));
    if (t < n)
        mx = vmax_m(mx, vload(s + t, vm(n - t)), vm(n - t));
    return vhmax(mx);
}

/* softmax of one row over its n visible keys, in place, its largest score given */
static void softmax_max(float *s, int64_t n, float mxv)
{
    vec mv = vbcast(mxv);
    vec sum = vzero();
    int64_t t = 0;
    for (; t + 16 <= n; t += 16) {            /* whole vectors: no masks (the same values) */
        vec e = vexp(vsub(vload(s + t, vm(16)), mv));
        vstore(s + t, e, vm(16));
        sum = vadd(sum, e);
    }
    if (t < n) {
        vmask mk = vm(n - t);
        vec e = vexp(vsub(vload(s + t, mk), mv));
        vstore(s + t, e, mk);
        sum = vadd_m(sum, e, mk);
    }
    vec inv = vbcast(1.0f / vhsum(sum));
    for (t = 0; t + 16 <= n; t += 16)
        vstore(s + t, vmul(vload(s + t, vm(16)), inv), vm(16));
    if (t < n) {
        vmask mk = vm(n - t);
        vstore(s + t, vmul(vload(s + t, mk), inv), mk);
    }
}

/* softmax of one row over its n visible keys, in place */
static void softmax_row(float *s, int64_t n)
{
    softmax_max(s, n, span_max(s, n));
}

/* P @ V of R rows of kv-head h (probabilities buf[r * cap + t]) for the value columns
 * dlo .. dhi - 1: each output the fma chain over the row's keys in order, from 0 (the same
 * for any range of columns). acc: scratch of R rows of the value dim rounded up to 32. */
static void pv_rows(const struct task_args *a, int64_t h, int64_t R, const int64_t *n,
                    const int64_t *mrow, const int64_t *hq, const float *buf, int64_t cap,
                    float *acc, int64_t dlo, int64_t dhi)
{
#if defined(HC_AVX2)
    pv_avx2(a, h, R, n, mrow, hq, buf, cap, acc, dlo, dhi);
#else
    (void)acc;
    const int64_t Dv = a->Dv;
    /* 4 rows x 64 value columns at a time, keys in order */
    for (int64_t d0 = dlo; d0 < dhi; d0 += 64) {
        vmask m0 = vm(dhi - d0), m1 = vm(dhi - d0 - 16), m2 = vm(dhi - d0 - 32),
              m3 = vm(dhi - d0 - 48);
        for (int64_t rs = 0; rs < R; rs += 4) {
            int64_t RR = R - rs < 4 ? R - rs : 4, nmax = 0;
            for (int64_t r = 0; r < RR; r++)
                if (n[rs + r] > nmax)
                    nmax = n[rs + r];
            vec acc4[4][4];
            for (int r = 0; r < 4; r++)
                for (int c = 0; c < 4; c++)
                    acc4[r][c] = vzero();
            for (int64_t t = 0; t < nmax; t++) {
                const float *vr = a->v + (a->slots ? a->slots[t] : t) * a->ldv + h * Dv + d0;
                vec v0 = vload(vr, m0), v1 = vload(vr + 16, m1), v2 = vload(vr + 32, m2),
                    v3 = vload(vr + 48, m3);
                for (int64_t r = 0; r < RR; r++) {
                    if (t >= n[rs + r])
                        continue;
                    vec p = vbcast(buf[(rs + r) * cap + t]);
                    acc4[r][0] = vfma(p, v0, acc4[r][0]);
                    acc4[r][1] = vfma(p, v1, acc4[r][1]);
                    acc4[r][2] = vfma(p, v2, acc4[r][2]);
                    acc4[r][3] = vfma(p, v3, acc4[r][3]);
                }
            }
            for (int64_t r = 0; r < RR; r++) {
                float *orow = a->o + (mrow[rs + r] * a->Hq + hq[rs + r]) * Dv + d0;
                vstore(orow, acc4[r][0], m0);
                vstore(orow + 16, acc4[r][1], m1);
                vstore(orow + 32, acc4[r][2], m2);
                vstore(orow + 48, acc4[r][3], m3);
            }
        }
    }
#endif
}

/* The value columns in tiles of PV_TILE: one tile of P @ V over the keys t0 .. t1 - 1, the
 * chains kept in acc (row r at acc + r * lda; zero when t0 is 0, else the stored floats of the
 * keys before t0): each output one fma chain over its row's keys in order, however the keys
 * and columns are cut. */
#define PV_TILE 32
#if defined(HC_AVX2)
#define pv_tile pv_tile32_avx2
#else
/* the other bodies: 4 rows x 32 columns (two vectors of 16) at a time */
static void pv_tile(int64_t R, const int64_t *n, const float *buf, int64_t cap, float *acc,
                    int64_t lda, int64_t d0, int64_t w, int64_t t0, int64_t t1,
                    const float *vb, int64_t ldv, const int64_t *sl, int64_t tb)
{
    const vmask m0 = vm(w), m1 = vm(w - 16);
    for (int64_t rs = 0; rs < R; rs += 4) {
        const int64_t RR = R - rs < 4 ? R - rs : 4;
        vec c[4][2];
        for (int64_t r = 0; r < 4; r++) {
            c[r][0] = t0 && r < RR ? vload(acc + (rs + r) * lda, m0) : vzero();
            c[r][1] = t0 && r < RR ? vload(acc + (rs + r) * lda + 16, m1) : vzero();
        }
        for (int64_t t = t0; t < t1; t++) {
            const float *vr = vb + (sl ? sl[t] : t - tb) * ldv + d0;
            const vec v0 = vload(vr, m0), v1 = vload(vr + 16, m1);
            for (int64_t r = 0; r < RR; r++) {
                if (t >= n[rs + r])
                    continue;
                const vec p = vbcast(buf[(rs + r) * cap + t]);
                c[r][0] = vfma(p, v0, c[r][0]);
                c[r][1] = vfma(p, v1, c[r][1]);
            }
        }
        for (int64_t r = 0; r < RR; r++) {
            vstore(acc + (rs + r) * lda, c[r][0], m0);
            vstore(acc + (rs + r) * lda + 16, c[r][1], m1);
        }
    }
}
#endif

/* The rows r0 .. r0 + R - 1 of a kv-head (row r: group member g = r / M, query m = r % M):
 * their queries, heads, visible key counts (n) and scaled queries (qb [R][D]); returns the
 * most keys any of them sees */
static int64_t block_rows(const struct task_args *a, int64_t h, int64_t r0, int64_t R,
                          int64_t *mrow, int64_t *hq, int64_t *n, float *qb)    /* qb: or 0 */
{
    const int64_t M = a->M, D = a->D, G = a->Hq / a->Hkv;
    int64_t tmax = 0;
    for (int64_t r = 0; r < R; r++) {
        int64_t g = (r0 + r) / M, m = (r0 + r) % M;
        mrow[r] = m;
        hq[r] = h * G + g;
        n[r] = a->pos[m] + 1;
        if (n[r] > tmax)
            tmax = n[r];
        const float *qr = a->q + (m * a->Hq + hq[r]) * D;
        for (int64_t d = 0; qb && d < D; d++)
            qb[r * D + d] = qr[d] * a->scale;
    }
    return tmax;
}

/* one block of up to RB rows of kv-head h: rows r = blk*RB .. (row r: g = r / M, m = r % M) */
static void one_block(const struct task_args *a, int64_t h, int64_t blk, float *buf,
                      float *qb, float *kloc)
{
    const int64_t M = a->M, D = a->D, G = a->Hq / a->Hkv;
    const int64_t r0 = blk * RB, R = (M * G - r0) < RB ? (M * G - r0) : RB;
    int64_t mrow[RB], hq[RB], n[RB];
    const int64_t tmax = block_rows(a, h, r0, R, mrow, hq, n, qb);
    const int64_t cap = (tmax + 15) / 16 * 16;
    /* scores, 16 keys at a time from the transposed keys */
    const float *kth = a->kt + h * a->nblk * D * 16;
    for (int64_t t0 = 0; t0 < tmax; t0 += 16)
        scores_rows(kth + (t0 / 16) * D * 16, qb, D, R, buf + t0, cap);
    for (int64_t r = 0; r < R; r++)
        softmax_row(buf + r * cap, n[r]);
    pv_rows(a, h, R, n, mrow, hq, buf, cap, kloc + 16 * D, 0, a->Dv);
}

static int64_t max_visible(const struct task_args *a)
{
    int64_t mx = 0;
    for (int64_t m = 0; m < a->M; m++)
        if (a->pos[m] + 1 > mx)
            mx = a->pos[m] + 1;
    return mx;
}

/* 16 rows of 16 floats (row j at src + j * ld) to dst[c * 16 + j]: dst row c holds column c of
 * the rows. Rows past `rows` read as zero. Plain copies: the bits are the keys' own. */
#if defined(__AVX512F__)
static void transpose16(const float *const *src, int64_t rows, float *dst)
{
    __m512 r[16], t[16];
    for (int j = 0; j < 16; j++)
        r[j] = j < rows ? _mm512_loadu_ps(src[j]) : _mm512_setzero_ps();
    /* stage 1: interleave pairs of rows (32-bit) */
    for (int j = 0; j < 16; j += 2) {
        t[j] = _mm512_unpacklo_ps(r[j], r[j + 1]);
        t[j + 1] = _mm512_unpackhi_ps(r[j], r[j + 1]);
    }
    /* stage 2: pairs of pairs (64-bit) */
    for (int j = 0; j < 16; j += 4) {
        r[j] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[j]),
                                                   _mm512_castps_pd(t[j + 2])));
        r[j + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[j]),
                                                       _mm512_castps_pd(t[j + 2])));
        r[j + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[j + 1]),
                                                       _mm512_castps_pd(t[j + 3])));
        r[j + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[j + 1]),
                                                       _mm512_castps_pd(t[j + 3])));
    }
    /* stages 3 and 4: 128-bit lanes across groups of four rows, then of eight */
    for (int j = 0; j < 4; j++) {
        t[j] = _mm512_shuffle_f32x4(r[j], r[j + 4], 0x88);
        t[j + 4] = _mm512_shuffle_f32x4(r[j], r[j + 4], 0xDD);
        t[j + 8] = _mm512_shuffle_f32x4(r[j + 8], r[j + 12], 0x88);
        t[j + 12] = _mm512_shuffle_f32x4(r[j + 8], r[j + 12], 0xDD);
    }
    for (int j = 0; j < 4; j++) {
        r[j] = _mm512_shuffle_f32x4(t[j], t[j + 8], 0x88);
        r[j + 8] = _mm512_shuffle_f32x4(t[j], t[j + 8], 0xDD);
        r[j + 4] = _mm512_shuffle_f32x4(t[j + 4], t[j + 12], 0x88);
        r[j + 12] = _mm512_shuffle_f32x4(t[j + 4], t[j + 12], 0xDD);
    }
    /* r[c] now holds column c of the block */
    for (int c = 0; c < 16; c++)
        _mm512_storeu_ps(dst + c * 16, r[c]);
}
#endif

#if defined(HC_AVX2)
/* 8 rows of 8 floats (row j at src[j]) to dst[c * 16 + j] (ld 16, as the blocks of 16 keys);
 * rows past `rows` read as zero */
static void transpose8(const float *const *src, int64_t rows, float *dst)
{
    __m256 r[8], t[8];
    for (int j = 0; j < 8; j++)
        r[j] = j < rows ? _mm256_loadu_ps(src[j]) : _mm256_setzero_ps();
    for (int j = 0; j < 8; j += 2) {
        t[j] = _mm256_unpacklo_ps(r[j], r[j + 1]);
        t[j + 1] = _mm256_unpackhi_ps(r[j], r[j + 1]);
    }
    for (int j = 0; j < 8; j += 4) {
        r[j] = _mm256_shuffle_ps(t[j], t[j + 2], 0x44);
        r[j + 1] = _mm256_shuffle_ps(t[j], t[j + 2], 0xEE);
        r[j + 2] = _mm256_shuffle_ps(t[j + 1], t[j + 3], 0x44);
        r[j + 3] = _mm256_shuffle_ps(t[j + 1], t[j + 3], 0xEE);
    }
    /* r[0..3]: columns 0,1,2,3 of rows 0-3 (low 128) and columns 4,5,6,7 (high); the same
     * for rows 4-7 in r[4..7] */
    for (int j = 0; j < 4; j++) {
        _mm256_storeu_ps(dst + j * 16, _mm256_permute2f128_ps(r[j], r[j + 4], 0x20));
        _mm256_storeu_ps(dst + (j + 4) * 16, _mm256_permute2f128_ps(r[j], r[j + 4], 0x31));
    }
}
#endif

/* 16 key rows (the first `rows` of them real: the others read as zero) of D values each,
 * transposed into dst[d * 16 + j] */
static void transpose_rows(const float *const *kr, int64_t rows, int64_t D, float *dst)
{
    int64_t d = 0;
#if defined(__AVX512F__)
    for (; d + 16 <= D; d += 16) {
        const float *src[16];
        for (int j = 0; j < 16; j++)
            src[j] = kr[j] + d;
        transpose16(src, rows, dst + d * 16);
    }
#elif defined(HC_AVX2)
    for (; d + 8 <= D; d += 8)
        for (int half = 0; half < 2; half++) {
            const float *src[8];
            for (int j = 0; j < 8; j++)
                src[j] = kr[8 * half + j] + d;
            int64_t left = rows - 8 * half;
            transpose8(src, left < 0 ? 0 : left, dst + d * 16 + 8 * half);
        }
#endif
    for (; d < D; d++)
        for (int64_t j = 0; j < 16; j++)
            dst[d * 16 + j] = j < rows ? kr[j][d] : 0.0f;
}

/* the long path's phase 1: blocks of 16 keys taken from a shared counter, each kv-head's part
 * transposed into kt [Hkv][nblk][D][16] */
static void *transpose(void *arg)
{
    struct worker *w = (struct worker *)arg;
    const struct task_args *a = w->a;
    const int64_t D = a->D, T = max_visible(a);
    float *rows16 = (float *)malloc(sizeof(float) * (size_t)(16 * a->ldk));
    if (!rows16) {
        w->err = 1;
        return 0;
    }
    for (;;) {          /* item b: keys 16 b .. 16 b + 15, every kv-head */
        int64_t b = __atomic_fetch_add(a->next, 1, __ATOMIC_RELAXED);
        if (b >= a->nblk)
            break;
        /* the rows copied in address order first (read kv-head by kv-head from the pool, 16
         * rows apart, they came slower: the short path's phase 1 had the same stall) */
        const int64_t t0 = b * 16, rows = T - t0 < 16 ? T - t0 : 16;
        for (int64_t j = 0; j < rows; j++)
            memcpy(rows16 + j * a->ldk, a->k + (a->slots ? a->slots[t0 + j] : t0 + j) * a->ldk,
                   sizeof(float) * (size_t)a->ldk);
        for (int64_t h = 0; h < a->Hkv; h++) {
            const float *kr[16];
            for (int64_t j = 0; j < 16; j++)
                kr[j] = rows16 + (j < rows ? j : 0) * a->ldk + h * D;
            transpose_rows(kr, rows, D, a->kt + (h * a->nblk + b) * D * 16);
        }
#if defined(HC_AVX2)
        /* the values too, by kv-head and 16-column range (vt_at): the row blocks' P @ V
         * tiles read 16 columns of PV_KEYS keys at a time, which from the pool's rows of
         * every kv-head the hardware's prefetch did not follow (a copy per block cost a
         * twentieth of a prefill's time; this is one per call). Plain copies: the values'
         * own bits */
        for (int64_t j = 0; j < rows; j++) {
            const float *vr = a->v + (a->slots ? a->slots[t0 + j] : t0 + j) * a->ldv;
            for (int64_t h = 0; h < a->Hkv; h++) {
                int64_t c = 0;
                for (; c * 16 + 16 <= a->Dv; c++)     /* whole ranges: a copy of fixed size */
                    memcpy(vt_at(a, h, c) + (t0 + j) * 16, vr + h * a->Dv + c * 16,
                           sizeof(float) * 16);
                if (c * 16 < a->Dv)
                    memcpy(vt_at(a, h, c) + (t0 + j) * 16, vr + h * a->Dv + c * 16,
                           sizeof(float) * (size_t)(a->Dv - c * 16));
            }
        }
#endif
    }
    free(rows16);
    return 0;
}

static void *work(void *arg)
{
    struct worker *w = (struct worker *)arg;
    const struct task_args *a = w->a;
    int64_t cap = (max_visible(a) + 15) / 16 * 16;
    const int64_t Dp = (a->Dv + 31) / 32 * 32;      /* pv_avx2's chains between key chunks */
    float *buf = (float *)malloc(sizeof(float) * (size_t)(RB * cap + RB * a->D + 16 * a->D +
                                                          RB * Dp));
    if (!buf) {
        w->err = 1;
        return 0;
    }
    for (;;) {
        int64_t t = __atomic_fetch_add(a->next, 1, __ATOMIC_RELAXED);
        if (t >= a->tasks)
            break;
        one_block(a, t / a->per_head, t % a->per_head, buf, buf + RB * cap,
                  buf + RB * cap + RB * a->D);
    }
    free(buf);
    return 0;
}

/* A short chunk (a decode step, a tail of a few tokens): three phases over every kv-head at
 * once, sharing the work evenly between the threads. The bits are one_block's: each score,
 * softmax and output is the same sequence, only grouped otherwise.
 *   Phase 1: chunks of SHORT_KEYS keys, 16 at a time: their rows (every kv-head) copied in
 *   address order, then every kv-head's scores for them (up to FUSED_ROWS rows a kv-head on
 *   AVX2: the 16 keys transposed in registers 4 dimensions at a time and used at once; more
 *   rows: transposed into a buffer that every row reads), and each row's largest visible
 *   score in the chunk.
 *   Phase 2: each row's softmax, its largest score the largest of its chunks'.
 *   Phase 3: P @ V, one item per kv-head and PV_TILE value columns, read from the pool
 *   directly, SHORT_PV_KEYS keys at a time (on 2 cores faster than a copy of each thread's
 *   half of the rows: 270 against 320 us a layer at 4K context, KV out of cache). */
#define SHORT_KEYS 256
#ifndef SHORT_ROWS
#define SHORT_ROWS 64      /* rows a kv-head at most (M * G) */
#endif
#define SHORT_PV_KEYS 64
static void *short_scores(void *arg)
{
    struct worker *w = (struct worker *)arg;
    const struct task_args *a = w->a;
    const int64_t D = a->D, R = a->R, Hkv = a->Hkv, HR = Hkv * a->R, cap = a->cap;
    float *qb = (float *)malloc(sizeof(float) * (size_t)(HR * D + 16 * D + 16 * a->ldk));
    if (!qb) {
        w->err = 1;
        return 0;
    }
    float *kloc = qb + HR * D, *kbuf = kloc + 16 * D;
    int64_t mrow[SHORT_ROWS], hq[SHORT_ROWS], n[SHORT_ROWS], have = 0;
#if defined(HC_AVX2)
    const int fused = R <= FUSED_ROWS && D % 4 == 0;
#endif
    for (;;) {
        int64_t i = __atomic_fetch_add(a->next, 1, __ATOMIC_RELAXED);
        if (i >= a->nchunk)
            break;
        for (int64_t h = 0; !have && h < Hkv; h++)
            block_rows(a, h, 0, R, mrow, hq, n, qb + h * R * D);
        have = 1;
        const int64_t c0 = i * SHORT_KEYS;
        const int64_t t1 = c0 + SHORT_KEYS < a->tmax ? c0 + SHORT_KEYS : a->tmax;
        for (int64_t t0 = c0; t0 < t1; t0 += 16) {
            /* the 16 keys' rows, every kv-head, copied in address order (read kv-head by
             * kv-head, 8 or 16 rows at a time, they came from memory 3x slower) */
            const int64_t rows = a->tmax - t0 < 16 ? a->tmax - t0 : 16;
            for (int64_t j = 0; j < rows; j++)
                memcpy(kbuf + j * a->ldk, a->k + (a->slots ? a->slots[t0 + j] : t0 + j) * a->ldk,
                       sizeof(float) * (size_t)a->ldk);
            for (int64_t h = 0; h < Hkv; h++) {
                const float *kr[16];
                for (int64_t j = 0; j < 16; j++)
                    kr[j] = kbuf + (j < rows ? j : 0) * a->ldk + h * D;
                float *out = a->sc + h * R * cap + t0;
#if defined(HC_AVX2)
                if (fused) {
                    FUSED16S[R](kr, qb + h * R * D, D, out, cap);
                    continue;
                }
#endif
                transpose_rows(kr, rows, D, kloc);
                scores_rows(kloc, qb + h * R * D, D, R, out, cap);
            }
        }
        for (int64_t h = 0; h < Hkv; h++)         /* (row r's keys are the same for every h) */
            for (int64_t r = 0; r < R; r++) {
                const int64_t e = n[r] < t1 ? n[r] : t1;
                a->mx[i * HR + h * R + r] =
                    c0 < e ? span_max(a->sc + (h * R + r) * cap + c0, e - c0) : -INFINITY;
            }
    }
    free(qb);
    return 0;
}

static void *short_softmax(void *arg)
{
    struct worker *w = (struct worker *)arg;
    const struct task_args *a = w->a;
    const int64_t HR = a->Hkv * a->R;
    for (;;) {
        int64_t i = __atomic_fetch_add(a->next, 1, __ATOMIC_RELAXED);
        if (i >= HR)
            break;
        const int64_t n = a->pos[(i % a->R) % a->M] + 1;
        float mx = -INFINITY;
        for (int64_t c = 0; c * SHORT_KEYS < n; c++)
            mx = a->mx[c * HR + i] > mx ? a->mx[c * HR + i] : mx;
        softmax_max(a->sc + i * a->cap, n, mx);
    }
    return 0;
}

static void *short_pv(void *arg)
{
    struct worker *w = (struct worker *)arg;
    const struct task_args *a = w->a;
    const int64_t R = a->R, Dv = a->Dv, tph = a->tph, cap = a->cap;
    float *acc = (float *)malloc(sizeof(float) * (size_t)(R * PV_TILE));
    if (!acc) {
        w->err = 1;
        return 0;
    }
    int64_t mrow[SHORT_ROWS], hq[SHORT_ROWS], n[SHORT_ROWS];
    for (;;) {
        int64_t tile = __atomic_fetch_add(a->next, 1, __ATOMIC_RELAXED);
        if (tile >= a->ntile)
            break;
        const int64_t h = tile / tph, d0 = (tile % tph) * PV_TILE;
        const int64_t wd = Dv - d0 < PV_TILE ? Dv - d0 : PV_TILE;
        block_rows(a, h, 0, R, mrow, hq, n, 0);
        for (int64_t t0 = 0; t0 < a->tmax; t0 += SHORT_PV_KEYS) {
            const int64_t t1 = t0 + SHORT_PV_KEYS < a->tmax ? t0 + SHORT_PV_KEYS : a->tmax;
            pv_tile(R, n, a->sc + h * R * cap, cap, acc, PV_TILE, d0, wd, t0, t1,
                    a->v + h * Dv, a->ldv, a->slots, 0);
        }
        for (int64_t r = 0; r < R; r++)
            memcpy(a->o + (mrow[r] * a->Hq + hq[r]) * Dv + d0, acc + r * PV_TILE,
                   sizeof(float) * (size_t)wd);
    }
    free(acc);
    return 0;
}

/* the shared worker pool (native/pool.c, handed over by native_attn.py): 0 when it ran the
 * phase, else the threads are started here */
typedef int (*runner_fn)(void *(*)(void *), void **, int32_t);
static runner_fn runner;
void hicache_set_runner(runner_fn fn) { runner = fn; }

/* q [M, Hq, D], k rows of ldk floats (kv-head h at h*D), v rows of ldv floats (h at h*Dv),
 * key t in row slots[t] of both (slots NULL: row t; nslots entries), pos [M] (query m sees
 * keys 0..pos[m]), o [M, Hq, Dv]. Returns 0, -1 on no memory, -3 if a query would read past
 * the slots (or has a negative position). */
int hicache_attend(const float *q, const float *k, int64_t ldk, const float *v, int64_t ldv,
                   const int64_t *slots, int64_t nslots, const int64_t *pos, float *o,
                   int64_t M, int64_t Hq, int64_t Hkv, int64_t D, int64_t Dv, float scale,
                   int32_t threads)
{
    if (M <= 0)
        return 0;
    for (int64_t m = 0; m < M; m++)       /* a page table shorter than the keys to read */
        if (pos[m] < 0 || (slots && pos[m] >= nslots))
            return -3;
    int64_t per_head = (M * (Hq / Hkv) + RB - 1) / RB;
    struct task_args a = {q, k, v, pos, slots, o, M, Hq, Hkv, D, Dv, ldk, ldv, scale,
                          per_head * Hkv, per_head, 1, 0, 0, 0};
    if (threads < 1)
        threads = 1;
    if (threads > MAX_THREADS)
        threads = MAX_THREADS;
    a.nblk = (max_visible(&a) + 15) / 16;
    /* one row block per kv-head (a decode step, a short tail): the three short phases over
     * a buffer of every kv-head's scores. Else the transposed keys, then the row blocks. Either
     * buffer is the calling thread's, grown when needed and kept (a fresh one each call cost
     * more in page faults than the transposition itself) */
    const int is_short = M * (Hq / Hkv) <= SHORT_ROWS;
    if (is_short) {
        a.R = M * (Hq / Hkv);
        a.tmax = max_visible(&a);
        a.cap = (a.tmax + 15) / 16 * 16;
        a.nchunk = (a.tmax + SHORT_KEYS - 1) / SHORT_KEYS;
        a.tph = (Dv + PV_TILE - 1) / PV_TILE;
        a.ntile = Hkv * a.tph;
        int64_t most = a.nchunk > a.ntile ? a.nchunk : a.ntile;
        if (threads > most)
            threads = (int32_t)most;
    } else if (threads > a.tasks) {
        threads = (int32_t)a.tasks;
    }
    a.threads = threads;
    static __thread float *kt_buf;
    static __thread size_t kt_cap;
#if defined(HC_AVX2)
    const int64_t vt_cols = (Dv + 15) / 16 * 16;  /* the values (vt_at) beside the keys */
#else
    const int64_t vt_cols = 0;
#endif
    size_t need = is_short ? (size_t)(Hkv * a.R * (a.cap + a.nchunk))
                           : (size_t)(Hkv * a.nblk * 16 * (D + vt_cols));
    if (need > kt_cap) {
        free(kt_buf);
        kt_cap = need + need / 4;
        kt_buf = (float *)malloc(sizeof(float) * kt_cap);
        if (!kt_buf) {
            kt_cap = 0;
            return -1;
        }
    }
    a.kt = is_short ? 0 : kt_buf;
    a.vt = is_short ? 0 : kt_buf + Hkv * a.nblk * D * 16;
    a.sc = is_short ? kt_buf : 0;
    a.mx = is_short ? kt_buf + Hkv * a.R * a.cap : 0;
    void *(*const long_phases[2])(void *) = {transpose, work};
    void *(*const short_phases[3])(void *) = {short_scores, short_softmax, short_pv};
    void *(*const *phases)(void *) = is_short ? short_phases : long_phases;
    const int nphase = is_short ? 3 : 2;
    struct worker ws[MAX_THREADS];
    pthread_t tid[MAX_THREADS];
    int started[MAX_THREADS];
    int err = 0;
    int64_t next = 0;
    a.next = &next;
    for (int phase = 0; phase < nphase && !err; phase++) {
        void *(*fn)(void *) = phases[phase];
        next = 0;
        for (int t = 0; t < threads; t++) {
            ws[t] = (struct worker){&a, t, 0};
            started[t] = 0;
        }
        void *args[MAX_THREADS];
        for (int t = 0; t < threads; t++)
            args[t] = &ws[t];
        if (!(runner && threads > 1 && runner(fn, args, threads) == 0)) {
            for (int t = 1; t < threads; t++)
                started[t] = pthread_create(&tid[t], 0, fn, &ws[t]) == 0;
            fn(&ws[0]);
            for (int t = 1; t < threads; t++)
                if (started[t])
                    pthread_join(tid[t], 0);  /* one not started: the others took its items */
        }
        for (int t = 0; t < threads; t++)
            err |= ws[t].err;
    }
    return err ? -1 : 0;
}

/* RoPE of one head row in Hugging Face's "rotate half" convention, as ops.apply_rope computes
 * it: out[d] = x[d] * cos[d] + rot[d] * sin[d], rot = (-x[h..D-1], x[0..h-1]), each product and
 * the sum rounded on their own (no fused multiply-add: the build has -ffp-contract=off), so the
 * bits are torch's three elementwise kernels' */
static void rope_row(const float *x, const float *c, const float *s, float *out, int64_t D)
{
    const int64_t half = D / 2;
    for (int64_t d = 0; d < D; d++) {
        float rot = d < half ? -x[d + half] : x[d - half];
        float a = x[d] * c[d];
        float b = rot * s[d];
        out[d] = a + b;
    }
}

/* A layer's new tokens after the QKV product, in one call: qkv [M][(Hq + 2 Hkv) D] (q, k, v of
 * each token), cos/sin [M][D]; q_out [M][Hq][D] gets the rotated queries, and row slots[m] of
 * the pool's k and v ([nslots][Hkv][D]) the rotated key and the value of token m. Returns 0,
 * or -3 (nothing written) if a slot is outside the pool. */
int hicache_rope_write(const float *qkv, int64_t M, int64_t Hq, int64_t Hkv, int64_t D,
                       const float *cos, const float *sin, float *q_out, float *k_pool,
                       float *v_pool, const int64_t *slots, int64_t nslots)
{
    const int64_t W = (Hq + 2 * Hkv) * D;
    for (int64_t m = 0; m < M; m++)       /* a slot outside the pool: nothing written */
        if (slots[m] < 0 || slots[m] >= nslots)
            return -3;
    for (int64_t m = 0; m < M; m++) {
        const float *row = qkv + m * W, *c = cos + m * D, *s = sin + m * D;
        for (int64_t h = 0; h < Hq; h++)
            rope_row(row + h * D, c, s, q_out + (m * Hq + h) * D, D);
        float *kd = k_pool + slots[m] * Hkv * D, *vd = v_pool + slots[m] * Hkv * D;
        for (int64_t h = 0; h < Hkv; h++)
            rope_row(row + (Hq + h) * D, c, s, kd + h * D, D);
        memcpy(vd, row + (Hq + Hkv) * D, sizeof(float) * (size_t)(Hkv * D));
    }
    return 0;
}

/* Row operations of the exact path, each output value one fixed sequence of IEEE operations
 * on its own row (the same bits on every body and for any number of rows):
 *
 * RMS norm of a row x of K: ss = sixteen lane sums (lane j: fma chain of x[k]^2 over
 * k = j, j + 16, ... in order, from 0) added in vhsum's tree; r = 1 / sqrt(ss / K + eps);
 * out[k] = (x[k] * r) * w[k]. x rows ldx floats apart, out rows K. */
void hicache_rms_norm(const float *x, int64_t ldx, int64_t M, int64_t K, const float *w,
                      float eps, float *out)
{
    for (int64_t m = 0; m < M; m++) {
        const float *xr = x + m * ldx;
        float *orow = out + m * K;
        vec acc = vzero();
        for (int64_t k = 0; k < K; k += 16) {
            vec v = vload(xr + k, vm(K - k));
            acc = vfma(v, v, acc);
        }
        const float r = 1.0f / sqrtf(vhsum(acc) / (float)K + eps);
        const vec rv = vbcast(r);
        for (int64_t k = 0; k < K; k += 16) {
            vmask mk = vm(K - k);
            vstore(orow + k, vmul(vmul(vload(xr + k, mk), rv), vload(w + k, mk)), mk);
        }
    }
}

/* The gated MLP's activation: gu rows of ldg floats hold g (columns 0 .. I-1) then u
 * (I .. 2I-1); out[m][i] = silu(g) * u with e = exp(-|g|) (attention's exp routine),
 * silu(g) = g / (1 + e) for g >= 0 and (g * e) / (1 + e) below, each step rounded. */
void hicache_silu_mul(const float *gu, int64_t ldg, int64_t M, int64_t I, float *out)
{
    const vec one = vbcast(1.0f);
    for (int64_t m = 0; m < M; m++) {
        const float *g = gu + m * ldg, *u = g + I;
        float *orow = out + m * I;
        for (int64_t i = 0; i < I; i += 16) {
            vmask mk = vm(I - i);
            vec x = vload(g + i, mk);
            vec e = vexp(vnegabs(x));
            vec s = vdiv(vsel_ge0(x, x, vmul(x, e)), vadd_m(one, e, vm(16)));
            vstore(orow + i, vmul(s, vload(u + i, mk)), mk);
        }
    }
}

/* ---- a stack of decoder layers in one call ---------------------------------------------------
 * Each step is the call the Python forward makes for it (engine/runtime/model/transformer.py:
 * RMS norm, the QKV product, RoPE and the KV write, attention per chunk, the output product
 * and its residual add, RMS norm, the gate/up product, silu(g) * u, the down product and its
 * residual add), with the same operands, so every value has the same bits; only the Python
 * between the calls is gone (about 150 us a layer: a fifth of a decode step). The products are
 * rowdot.c's, handed over as a function pointer (another library). */
typedef int (*rowdot_fn)(const float *, int64_t, const float *, float *, int64_t, int64_t,
                         int64_t, int64_t, int32_t);

struct hc_layer {               /* one layer's weights: norms, the products' packed panels */
    const float *attn_norm, *mlp_norm, *wqkv, *wo, *wgu, *wdown;
    /* the same products as the GGUF's blocks (rowdot.c's hicache_rowdot_quant), or 0 */
    const unsigned char *qqkv, *qo, *qgu, *qdown;
    int32_t kqkv, ko, kgu, kdown;
};
typedef int (*rowdot_quant_fn)(const float *, int64_t, const unsigned char *, int32_t, float *,
                               int64_t, int64_t, int64_t, int64_t, int32_t);

struct hc_fwd {
    int64_t M, hidden, Hq, Hkv, D, inter, nslots;
    float eps, scale;
    float *kv;                  /* the L1 pool: layer li's keys at kv + li * kv_layer, its
                                 * values kv_kind further ([nslots][Hkv][D] each) */
    int64_t kv_layer, kv_kind;
    float *x;                   /* [M][hidden]: the residual stream, in and out */
    float *h, *qkv, *q, *att, *gu, *act, *y;   /* scratch of the steps' widths */
    const float *cos, *sin;     /* [M][D]: the new tokens' rotary tables */
    const int64_t *write_slots; /* [M]: each new token's pool row */
    const int64_t *pos;         /* [M]: each new token's position */
    int64_t nchunk;
    const int64_t *bounds;      /* [nchunk + 1]: chunk c is rows bounds[c] .. bounds[c+1]-1 */
    const int64_t *const *key_slots;  /* per chunk: its keys' pool rows */
    const int64_t *key_count;   /* per chunk: how many */
    int32_t threads, attn_threads;
    rowdot_fn rowdot;
    rowdot_quant_fn rowdot_quant;   /* 0: float32 panels only */
    int64_t quant_rows;             /* the most rows a product takes from the blocks */
};

/* the threads the Python wrapper gives a product (native_gemm.linear): the same formula */
static int32_t product_threads(int32_t t, int64_t M, int64_t N, int64_t K)
{
    int64_t most = (M * N * K) >> 15;
    if (t > most)
        t = (int32_t)most;
    return t < 1 ? 1 : t;
}

/* o = x @ w.T: from the blocks where the layer has them and the rows are few (the same bits:
 * rowdot.c), else from the float32 panels */
static void product(const struct hc_fwd *f, const float *x, int64_t ldx, const float *p,
                    const unsigned char *qp, int32_t kind, float *o, int64_t ldo, int64_t N,
                    int64_t K)
{
    const int32_t t = product_threads(f->threads, f->M, N, K);
    if (qp && f->rowdot_quant && f->M <= f->quant_rows
        && f->rowdot_quant(x, ldx, qp, kind, o, ldo, f->M, N, K, t) != -2)
        return;
    f->rowdot(x, ldx, p, o, ldo, f->M, N, K, t);
}

static void add_rows(float *x, const float *y, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        x[i] = x[i] + y[i];
}

/* Returns 0, -1 (no memory in attention), -3 (a query would read past its page table) or -5
 * (a new token's slot is outside the pool: nothing of that layer written). A product that
 * could not start a thread has had its items taken by the others: complete, the same bits. */
int hicache_layers(const struct hc_layer *layers, int64_t nl, const struct hc_fwd *f)
{
    const int64_t M = f->M, d = f->hidden, Hq = f->Hq, Hkv = f->Hkv, D = f->D, I = f->inter;
    const int64_t W = (Hq + 2 * Hkv) * D;
    for (int64_t li = 0; li < nl; li++) {
        const struct hc_layer *L = &layers[li];
        float *k_pool = f->kv + li * f->kv_layer, *v_pool = k_pool + f->kv_kind;
        hicache_rms_norm(f->x, d, M, d, L->attn_norm, f->eps, f->h);
        product(f, f->h, d, L->wqkv, L->qqkv, L->kqkv, f->qkv, W, W, d);
        if (hicache_rope_write(f->qkv, M, Hq, Hkv, D, f->cos, f->sin, f->q, k_pool, v_pool,
                               f->write_slots, f->nslots) != 0)
            return -5;
        for (int64_t c = 0; c < f->nchunk; c++) {
            const int64_t s = f->bounds[c], e = f->bounds[c + 1];
            int rc = hicache_attend(f->q + s * Hq * D, k_pool, Hkv * D, v_pool, Hkv * D,
                                    f->key_slots[c], f->key_count[c], f->pos + s,
                                    f->att + s * Hq * D, e - s, Hq, Hkv, D, D, f->scale,
                                    f->attn_threads);
            if (rc != 0)
                return rc;
        }
        product(f, f->att, Hq * D, L->wo, L->qo, L->ko, f->y, d, d, Hq * D);
        add_rows(f->x, f->y, M * d);
        hicache_rms_norm(f->x, d, M, d, L->mlp_norm, f->eps, f->h);
        product(f, f->h, d, L->wgu, L->qgu, L->kgu, f->gu, 2 * I, 2 * I, d);
        hicache_silu_mul(f->gu, 2 * I, M, I, f->act);
        product(f, f->act, I, L->wdown, L->qdown, L->kdown, f->y, d, d, I);
        add_rows(f->x, f->y, M * d);
    }
    return 0;
}
