/* hicache: copy a list of equal-size chunks in one call (engine/cache/hostcopy.py builds and
 * loads it).
 *
 * Python hands over the chunk offsets of a whole layer (or one copy thread's share of them) as
 * numpy int64 arrays, so a chunk costs a loop iteration instead of a Python-level call, and
 * ctypes releases the GIL for the duration: several copy threads run at once.
 *
 * stream != 0 (large transfers): runs are written with non-temporal (streaming) stores, which
 * skip reading each destination line into the cache before overwriting it and leave the caches
 * to the program, and the next run is prefetched while the current one is copied; a store fence
 * at the end makes the bytes visible to whichever thread is told the copy is done. Runs whose
 * ranges overlap always go through memmove. Every path writes the same bytes as one
 * ctypes.memmove per run, in order (the Python fallback).
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(__SSE2__)
#include <emmintrin.h>
#include <xmmintrin.h>
#define HICACHE_STREAM 1

/* n >= 256. While it copies, it prefetches the next run's first bytes (next, up to next_len),
 * as far ahead as it has come in this one: scattered runs then stream like one. */
static void stream_copy(char *d, const char *s, size_t n, const char *next, size_t next_len)
{
    size_t head = (size_t)(-(uintptr_t)d & 15);    /* bytes until d is 16-byte aligned */
    memcpy(d, s, head);
    d += head;
    s += head;
    n -= head;
    size_t body = n & ~(size_t)63;
    size_t pf = next ? next_len : 0;
    for (size_t i = 0; i < body; i += 64) {
        if (i < pf)
            _mm_prefetch(next + i, _MM_HINT_T0);
        __m128i a = _mm_loadu_si128((const __m128i *)(s + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(s + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(s + i + 32));
        __m128i e = _mm_loadu_si128((const __m128i *)(s + i + 48));
        _mm_stream_si128((__m128i *)(d + i), a);
        _mm_stream_si128((__m128i *)(d + i + 16), b);
        _mm_stream_si128((__m128i *)(d + i + 32), c);
        _mm_stream_si128((__m128i *)(d + i + 48), e);
    }
    memcpy(d + body, s + body, n - body);
}
#else
#define HICACHE_STREAM 0
#endif

/* 1 when this build has the streaming-store path (x86-64), else 0 (memmove only). */
int32_t hicache_copy_features(void)
{
    return HICACHE_STREAM;
}

static void copy_run(char *d, const char *s, size_t m, int32_t stream, const char *next,
                     size_t next_len)
{
#if HICACHE_STREAM
    uintptr_t du = (uintptr_t)d, su = (uintptr_t)s;
    if (stream && m >= 256 && (du + m <= su || su + m <= du)) {
        stream_copy(d, s, m, next, next_len);
        return;
    }
#else
    (void)stream;
    (void)next;
    (void)next_len;
#endif
    memmove(d, s, m);
}

/* End of the run that starts at chunk i: chunks that follow each other on both sides. */
static int64_t run_end(const int64_t *dst_off, const int64_t *src_off, int64_t i, int64_t n,
                       int64_t chunk)
{
    int64_t j = i + 1;
    while (j < n && dst_off[j] == dst_off[j - 1] + chunk && src_off[j] == src_off[j - 1] + chunk)
        j++;
    return j;
}

/* Copy n chunks of `chunk` bytes: chunk i from src_base + src_off[i] to dst_base + dst_off[i].
 * Chunks that follow each other on both sides are copied as one run. Returns the bytes. */
int64_t hicache_copy_chunks(char *dst_base, const char *src_base, const int64_t *dst_off,
                            const int64_t *src_off, int64_t n, int64_t chunk, int32_t stream)
{
    int64_t i = 0, j = n > 0 ? run_end(dst_off, src_off, 0, n, chunk) : 0;
    while (i < n) {
        int64_t k = j < n ? run_end(dst_off, src_off, j, n, chunk) : n;
        const char *next = j < n ? src_base + src_off[j] : NULL;
        copy_run(dst_base + dst_off[i], src_base + src_off[i], (size_t)((j - i) * chunk), stream,
                 next, (size_t)((k - j) * chunk));
        i = j;
        j = k;
    }
#if HICACHE_STREAM
    if (stream)
        _mm_sfence();
#endif
    return n * chunk;
}
