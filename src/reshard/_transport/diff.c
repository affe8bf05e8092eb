/* The fused pass of a sparse refit's change detection (reshard._transport.native builds
 * and loads it; reshard._transport.sparse.encode_fused calls it).
 *
 * One pass over a region of `rows` x `cols` elements (row r of the source at
 * src + (r / inner) * ostride + (r % inner) * stride: rows at one stride, in groups of
 * `inner` rows at another, as a slice of a 3-D tensor's middle dimension; the copy `old`
 * flat): each source element (cast to bfloat16 first,
 * for the float32 variant) is compared bit for bit with the copy; every changed element's
 * new value is written to `values` (in row-major order), its flat position to `pos`
 * (while fewer than `cap` were found) and into `old`; once more than `cap` changed (then
 * the positions are not all kept, and a bitmap is the cheaper encoding), `bits` (may be
 * NULL; element i at bit i % 8 of byte i / 8) is zeroed and takes every change's bit,
 * those found so far from their positions; with `cap` or fewer it is left as it was, not
 * read. Returns how
 * many changed, or -1 when a float32 element is a NaN (then `old` is partly written: the
 * caller casts the region again with torch, whose own NaN differs between its vector and
 * scalar loops, and sends it whole).
 *
 * The cast is torch's (c10's and its vector loops'): round to nearest even on the bits,
 * subnormals kept. Each block of 64 elements is first cast, compared and OR-reduced in
 * registers by a straight-line loop a compiler vectorizes for the host (nothing stored);
 * only a block with a change is cast again into a buffer and its changes collected. A
 * block with no change costs about its read (64 elements of 150M, one core: 0.065 s
 * against 0.091 s when every block was stored and scanned; 0.106 s against 0.112 s at 1%
 * changed, where about half the blocks hold a change). Where the compiler targets
 * AVX-512 (BW, VL, VBMI2), float32 into bfloat16 takes the vector pass below instead:
 * 0.086 s at 1% changed, 0.119 s at 5% (0.106 and 0.133 s portable); both ask for
 * the lines ahead themselves (AHEAD): the vector pass then 0.073 and 0.082 s.
 */
#include <stdint.h>
#include <string.h>

#define BLOCK 64
/* How far ahead (elements) each pass asks for the source and the copy: the hardware's own
 * prefetch leaves the pass well short of a plain read's speed (one core, 150 M float32
 * values against their bfloat16 copy, unchanged: 0.068 s against 0.059 s for the read;
 * with this, 0.059 s; 512 to 2048 the same) */
#define AHEAD 1024

/* ask for the cache lines of `bytes` bytes at p (a hint: never faults, past an end too) */
static inline void prefetch(const void *p, int bytes) {
    for (int b = 0; b < bytes; b += 64)
        __builtin_prefetch((const char *)p + b, 0, 3);
}

/* row r's first source element (rows at one stride, in groups of `inner` at another) */
#define ROW(src, r, inner, stride, ostride) \
    ((src) + ((r) / (inner)) * (ostride) + ((r) % (inner)) * (stride))

/* the source element AHEAD on from column c in the region's own order: along the row,
 * then into the next row (`next`; the row itself for the last), not into the columns
 * between them (a region of some columns of each row: those are another region's) */
#define AHEAD_OF(row, next, c, cols) \
    ((c) + AHEAD < (cols) ? (row) + (c) + AHEAD : (next) + ((c) + AHEAD - (cols)))

static inline uint16_t to_bf16(uint32_t u) {
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

static inline uint64_t gather_bits(const uint8_t *ne, int k) {
    /* k (<= 64) flags of 0 or 1 as the bits of a word: eight at a time, a multiply moves
     * each byte's flag to its bit of the top byte */
    uint64_t w = 0;
    for (int b = 0; b * 8 < k; b++) {
        uint64_t x = 0;
        memcpy(&x, ne + 8 * b, (size_t)(k - 8 * b < 8 ? k - 8 * b : 8));
        w |= ((x * 0x0102040810204080ull) >> 56) << (8 * b);
    }
    return w;
}

static inline void or_bits(uint8_t *bits, int64_t at, uint64_t w, int k) {
    /* the k bits of w, for elements at, at + 1, ..., OR-ed into the bitmap */
    uint8_t *p = bits + at / 8;
    int shift = (int)(at % 8), last = (shift + k - 1) / 8;
    for (int j = 0; j <= last; j++) {
        int lo = 8 * j - shift; /* the bit of w at this byte's bit 0 */
        p[j] |= (uint8_t)(lo >= 0 ? w >> lo : w << -lo);
    }
}

/* whether a block's `pc` changes, after `m`, set bits: from the change that passes `cap`
 * on (then `bits`, zeroed, first takes the `m` positions kept so far) */
static inline int use_bits(uint8_t *bits, int *on, int64_t n, const int32_t *pos, int64_t m,
                           int pc, int64_t cap) {
    if (*on || !bits || m + pc <= cap)
        return *on;
    memset(bits, 0, (size_t)((n + 7) / 8));
    for (int64_t i = 0; i < m; i++)
        bits[pos[i] / 8] |= (uint8_t)(1u << (pos[i] % 8));
    return *on = 1;
}

#define SAME(u) (u)
#define NO_NAN(u) 0
#define F32_NAN(u) (((u) & 0x7FFFFFFFu) > 0x7F800000u)

/* one block's cast and compare, K elements from column c, into nb / ne */
#define SCAN(K, CONVERT)                                                                  \
    for (int j = 0; j < (K); j++) {                                                       \
        nb[j] = CONVERT(row[c + j]);                                                      \
        ne[j] = nb[j] != was[c + j];                                                      \
    }

/* whether a whole block (BLOCK elements from column c) holds a change or a NaN: an
 * OR-reduction in registers, nothing stored; most blocks end here */
#define QUICK(CONVERT, IS_NAN)                                                            \
    for (int j = 0; j < BLOCK; j++) {                                                     \
        any |= (uint32_t)(CONVERT(row[c + j]) ^ was[c + j]);                              \
        nan |= IS_NAN(row[c + j]);                                                        \
    }

/* NAME(src, rows, cols, stride, inner, ostride, old, values, pos, cap, bits): source
 * elements of type S, the copy's of type T, CONVERT(S) -> T, IS_NAN(S) */
#define DIFF(NAME, S, T, CONVERT, IS_NAN)                                                 \
    int64_t NAME(const S *restrict src, int64_t rows, int64_t cols, int64_t stride,       \
                 int64_t inner, int64_t ostride, T *restrict old, T *restrict values,     \
                 int32_t *restrict pos, int64_t cap, uint8_t *restrict bits) {            \
        int64_t m = 0, n = rows * cols;                                                   \
        int on = 0;                                                                       \
        for (int64_t r = 0; r < rows; r++) {                                              \
            const S *row = ROW(src, r, inner, stride, ostride);                           \
            const S *next = r + 1 < rows ? ROW(src, r + 1, inner, stride, ostride) : row; \
            T *was = old + r * cols;                                                      \
            for (int64_t c = 0; c < cols; c += BLOCK) {                                   \
                int k = cols - c < BLOCK ? (int)(cols - c) : BLOCK;                       \
                prefetch(AHEAD_OF(row, next, c, cols), BLOCK * (int)sizeof(S));           \
                prefetch(was + c + AHEAD, BLOCK * (int)sizeof(T));                        \
                T nb[BLOCK];                                                              \
                uint8_t ne[BLOCK];                                                        \
                uint32_t nan = 0, any = 0;                                                \
                if (k == BLOCK) { /* a constant trip count: vectorized whole */        \
                    QUICK(CONVERT, IS_NAN)                                                \
                    if (nan) return -1;                                                   \
                    if (!any) continue;                                                   \
                    SCAN(BLOCK, CONVERT)                                                  \
                } else {                                                                  \
                    for (int j = 0; j < k; j++) nan |= IS_NAN(row[c + j]);                \
                    if (nan) return -1;                                                   \
                    SCAN(k, CONVERT)                                                      \
                }                                                                         \
                uint64_t w = gather_bits(ne, k);                                          \
                if (!w) continue;                                                         \
                int64_t at = r * cols + c;                                                \
                if (use_bits(bits, &on, n, pos, m, __builtin_popcountll(w), cap))         \
                    or_bits(bits, at, w, k);                                              \
                while (w) {                                                               \
                    int j = __builtin_ctzll(w);                                           \
                    w &= w - 1;                                                           \
                    if (m < cap) pos[m] = (int32_t)(at + j);                              \
                    values[m++] = nb[j];                                                  \
                    was[c + j] = nb[j];                                                   \
                }                                                                         \
            }                                                                             \
        }                                                                                 \
        return m;                                                                         \
    }

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512VBMI2__)
/* The float32 -> bfloat16 pass with AVX-512 (BW, VL, VBMI2), 32 elements a step (the
 * last of a row under a mask): two vectors of 16 rounded (the same bits as to_bf16),
 * their high halves picked into one vector of 32 by one permute (where a narrowing move
 * a vector of 16 costs two shuffles), one compare with the copy into a 32-bit mask; a
 * NaN seen through the largest magnitude of a block (an unsigned max, off the shuffle
 * port the compares into masks use). For a step with a change, its values and positions
 * are compressed into place and the copy written under the mask. Same results as the
 * portable pass (a test compares them). */
#include <immintrin.h>

static inline __m512i round_bf16(__m512i u) { /* in each 32-bit lane's high half */
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    return _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb));
}

/* the elements of k (of 32 from row) cast into *b, in order; the mask of those that
 * differ from the copy; *top: the unsigned max of *top and their magnitudes' bits */
static inline __mmask32 step32(const uint32_t *row, const uint16_t *was, __mmask32 k,
                               __m512i *b, __m512i *top) {
    const __m512i abs = _mm512_set1_epi32(0x7FFFFFFF);
    const __m512i odd = _mm512_setr_epi32( /* 16-bit lanes 1, 3, ..., 63 of a then b */
        0x00030001, 0x00070005, 0x000B0009, 0x000F000D, 0x00130011, 0x00170015,
        0x001B0019, 0x001F001D, 0x00230021, 0x00270025, 0x002B0029, 0x002F002D,
        0x00330031, 0x00370035, 0x003B0039, 0x003F003D);
    __m512i u0 = _mm512_maskz_loadu_epi32((__mmask16)k, row);
    __m512i u1 = _mm512_maskz_loadu_epi32((__mmask16)(k >> 16), row + 16);
    *top = _mm512_max_epu32(*top, _mm512_max_epu32(_mm512_and_si512(u0, abs),
                                                    _mm512_and_si512(u1, abs)));
    *b = _mm512_permutex2var_epi16(round_bf16(u0), odd, round_bf16(u1));
    return _mm512_mask_cmpneq_epi16_mask(k, *b, _mm512_maskz_loadu_epi16(k, was));
}

/* up to 16 changes' flat positions (the bits of ne from at), after the m kept */
static inline void positions16(uint32_t ne, int64_t at, int32_t *pos, int64_t m,
                               int64_t cap) {
    if (m + 16 <= cap) {
        __m512i p = _mm512_add_epi32(_mm512_set1_epi32((int32_t)at),
            _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
        _mm512_storeu_si512((void *)(pos + m), _mm512_maskz_compress_epi32((__mmask16)ne, p));
    } else {
        for (int64_t i = m; ne; i++, ne &= ne - 1)
            if (i < cap) pos[i] = (int32_t)(at + __builtin_ctz(ne));
    }
}

/* a step's changes (ne, at flat position at): values and positions compressed into
 * place, the copy written under the mask, the bits set (use_bits); the new count */
static inline int64_t collect32(__m512i b, __mmask32 ne, int64_t at, uint16_t *was,
                                uint16_t *values, int64_t n, int32_t *pos, int64_t cap,
                                uint8_t *bits, int *on, int64_t m) {
    if (m + 32 <= n) /* a whole store: m changes before at, so this holds but at a tail */
        _mm512_storeu_si512((void *)(values + m), _mm512_maskz_compress_epi16(ne, b));
    else
        _mm512_mask_compressstoreu_epi16(values + m, ne, b);
    _mm512_mask_storeu_epi16(was, ne, b);
    uint32_t lo = ne & 0xFFFF, hi = ne >> 16;
    if (use_bits(bits, on, n, pos, m, __builtin_popcount(ne), cap))
        or_bits(bits, at, (uint64_t)ne, 32);
    if (lo) positions16(lo, at, pos, m, cap);
    m += __builtin_popcount(lo);
    if (hi) positions16(hi, at + 16, pos, m, cap);
    return m + __builtin_popcount(hi);
}

int64_t reshard_diff_f32_bf16(const uint32_t *restrict src, int64_t rows, int64_t cols,
                              int64_t stride, int64_t inner, int64_t ostride,
                              uint16_t *restrict old, uint16_t *restrict values,
                              int32_t *restrict pos, int64_t cap, uint8_t *restrict bits) {
    int64_t m = 0, n = rows * cols;
    int on = 0;
    const __m512i inf = _mm512_set1_epi32(0x7F800000); /* a magnitude above: a NaN */
    for (int64_t r = 0; r < rows; r++) {
        const uint32_t *row = ROW(src, r, inner, stride, ostride);
        const uint32_t *next = r + 1 < rows ? ROW(src, r + 1, inner, stride, ostride) : row;
        uint16_t *was = old + r * cols;
        int64_t at = r * cols, c = 0;
        for (; c + 64 <= cols; c += 64) { /* two steps, then their NaN check */
            prefetch(AHEAD_OF(row, next, c, cols), 256);
            prefetch(was + c + AHEAD, 128);
            __m512i b0, b1, top = _mm512_setzero_si512();
            __mmask32 ne0 = step32(row + c, was + c, 0xFFFFFFFFu, &b0, &top);
            __mmask32 ne1 = step32(row + c + 32, was + c + 32, 0xFFFFFFFFu, &b1, &top);
            if (_mm512_cmpgt_epu32_mask(top, inf)) return -1;
            if (ne0) m = collect32(b0, ne0, at + c, was + c, values, n, pos, cap, bits, &on, m);
            if (ne1) m = collect32(b1, ne1, at + c + 32, was + c + 32, values, n, pos, cap,
                                   bits, &on, m);
        }
        for (; c < cols; c += 32) { /* the rest, the last step under a mask */
            __m512i b, top = _mm512_setzero_si512();
            __mmask32 k = cols - c >= 32 ? 0xFFFFFFFFu : (__mmask32)((1u << (cols - c)) - 1);
            __mmask32 ne = step32(row + c, was + c, k, &b, &top);
            if (_mm512_cmpgt_epu32_mask(top, inf)) return -1;
            if (ne) m = collect32(b, ne, at + c, was + c, values, n, pos, cap, bits, &on, m);
        }
    }
    return m;
}
#else
DIFF(reshard_diff_f32_bf16, uint32_t, uint16_t, to_bf16, F32_NAN)
#endif
/* the portable pass under its own name on every host, so that tests compare the two */
DIFF(reshard_diff_f32_bf16_portable, uint32_t, uint16_t, to_bf16, F32_NAN)
DIFF(reshard_diff_u8, uint8_t, uint8_t, SAME, NO_NAN)
DIFF(reshard_diff_u16, uint16_t, uint16_t, SAME, NO_NAN)
DIFF(reshard_diff_u32, uint32_t, uint32_t, SAME, NO_NAN)

/* The receiver's side: a region's payload applied in place. `kind` is the codec's
 * encoding (reshard._transport.sparse): 1 (bitmap), `index` a bitmap of the region's n
 * elements (as above); 2 (offsets32), `m` int32 flat positions; 3 (offsets16), `m`
 * 16-bit flat positions (unsigned). The k-th changed element (ascending) takes
 * values[k]; flat position p is row p / cols, column p % cols of the region (row r at
 * dst + (r / inner) * ostride + (r % inner) * stride, as above). Returns how many were written (a bitmap's set bits, which the
 * caller checks against the header's count before trusting the region), or -1 when a
 * position lies outside the region or the bitmap has more than `m` bits set. */
static inline int64_t at_of(int64_t p, int64_t cols, int64_t stride, int64_t inner,
                            int64_t ostride) {
    if (stride == cols && ostride == inner * cols) return p; /* contiguous */
    int64_t r = p / cols;
    return (r / inner) * ostride + (r % inner) * stride + p % cols;
}

#define APPLY(NAME, T)                                                                    \
    int64_t NAME(T *restrict dst, int64_t rows, int64_t cols, int64_t stride,             \
                 int64_t inner, int64_t ostride, int kind, const void *restrict index,    \
                 int64_t m, const T *restrict values) {                                   \
        int64_t n = rows * cols, k = 0;                                                   \
        if (kind == 2 || kind == 3) {                                                     \
            for (; k < m; k++) {                                                          \
                int64_t p = kind == 2 ? (int64_t)((const int32_t *)index)[k]              \
                                      : (int64_t)((const uint16_t *)index)[k];            \
                if (p < 0 || p >= n) return -1;                                           \
                dst[at_of(p, cols, stride, inner, ostride)] = values[k];                  \
            }                                                                             \
            return k;                                                                     \
        }                                                                                 \
        const uint8_t *bits = (const uint8_t *)index;                                     \
        for (int64_t i = 0; i < n; i += 64) {                                             \
            uint64_t w = 0;                                                               \
            int64_t bytes = (n - i + 7) / 8 < 8 ? (n - i + 7) / 8 : 8;                    \
            memcpy(&w, bits + i / 8, (size_t)bytes);                                      \
            if (n - i < 64) w &= (1ull << (n - i)) - 1;                                   \
            while (w) {                                                                   \
                int j = __builtin_ctzll(w);                                               \
                w &= w - 1;                                                               \
                if (k >= m) return -1;                                                    \
                dst[at_of(i + j, cols, stride, inner, ostride)] = values[k++];            \
            }                                                                             \
        }                                                                                 \
        return k;                                                                         \
    }

APPLY(reshard_apply_u8, uint8_t)
APPLY(reshard_apply_u16, uint16_t)
APPLY(reshard_apply_u32, uint32_t)

/* Many regions in one call, so that a caller pays its own per-region cost once a batch
 * rather than between passes: region i is d[12 i .. 12 i + 11] = {kind, src, rows,
 * cols, stride, inner, ostride, old, values, pos, cap, bits} (kind 0: float32 into
 * bfloat16; 1, 2 or 4: a type of that many bytes against its own), its count (as the
 * one-region functions return it) into out[i]. */
void reshard_diff_many(const int64_t *d, int64_t count, int64_t *out) {
    for (int64_t i = 0; i < count; i++, d += 12) {
#define ARGS(S, T) (const S *)d[1], d[2], d[3], d[4], d[5], d[6], (T *)d[7], (T *)d[8], \
                   (int32_t *)d[9], d[10], (uint8_t *)d[11]
        switch (d[0]) {
        case 0: out[i] = reshard_diff_f32_bf16(ARGS(uint32_t, uint16_t)); break;
        case 1: out[i] = reshard_diff_u8(ARGS(uint8_t, uint8_t)); break;
        case 2: out[i] = reshard_diff_u16(ARGS(uint16_t, uint16_t)); break;
        case 4: out[i] = reshard_diff_u32(ARGS(uint32_t, uint32_t)); break;
        default: out[i] = -2;
        }
#undef ARGS
    }
}

/* Many regions' payloads applied in one call: region i is d[11 i .. 11 i + 10] =
 * {width (1, 2 or 4 bytes), dst, rows, cols, stride, inner, ostride, kind, index, m,
 * values}, its result (as the one-region functions return it) into out[i]. */
void reshard_apply_many(const int64_t *d, int64_t count, int64_t *out) {
    for (int64_t i = 0; i < count; i++, d += 11) {
#define ARGS(T) (T *)d[1], d[2], d[3], d[4], d[5], d[6], (int)d[7], (const void *)d[8], \
                d[9], (const T *)d[10]
        switch (d[0]) {
        case 1: out[i] = reshard_apply_u8(ARGS(uint8_t)); break;
        case 2: out[i] = reshard_apply_u16(ARGS(uint16_t)); break;
        case 4: out[i] = reshard_apply_u32(ARGS(uint32_t)); break;
        default: out[i] = -2;
        }
#undef ARGS
    }
}

/* Many copies in one call: copy i is d[3 i .. 3 i + 2] = {to, from, bytes}; a message's
 * body laid out from its regions' parts, the caller's Python running once a body rather
 * than once a part. */
void reshard_copy_many(const int64_t *d, int64_t count) {
    for (int64_t i = 0; i < count; i++, d += 3)
        memcpy((void *)(intptr_t)d[0], (const void *)(intptr_t)d[1], (size_t)d[2]);
}
