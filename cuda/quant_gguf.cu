// ggml's block formats on the GPU: Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 (32 elements per block) and
// Q2_K Q3_K Q4_K Q5_K Q6_K (256 per super-block), the bytes of the GGUF file unchanged.
//
// dequantize: out[n, k] = the CPU's scalar reference (pyx/quant_legacy.c, pyx/quant_k.c) with
// the same float operations in the same order, products and sums kept apart with __fmul_rn /
// __fadd_rn so nvcc cannot fuse them into an FMA (the CPU build does not contract either), and
// f16 scales widened exactly; so the output is the CPU's float32 bit for bit, then rounded to
// the activation dtype. One thread per 8 consecutive elements (all in one 16-element group, so
// one scale), a 2D grid: chunks of a row on x, rows on y. Prefill multiplies these panels with
// cuBLAS.
//
// mmvq (decode, any M, meant for M <= 16): out[m, n] = sum_k x[m, k] * w[n, k] in two kernels.
//  1. quantize_q8_1: each 32-element block of each row of x becomes 32 int8 q = round(x / d)
//     with d = max|x| / 127 and the block's s = d * sum(q) (llama.cpp's block_q8_1 idea, but d
//     and s kept in float), one warp per block, into the workspace.
//  2. mmvq: a warp per weight row and M-tile of MT activation rows. The trick: every weight type
//     is cut into 32-element sub-blocks aligned with the Q8_1 blocks; a lane unpacks one
//     sub-block of the weight into 8 ints of 4 packed int8 levels once (load), then for each of
//     the MT rows takes 8 __dp4a with the row's int8 block and applies the type's scales and
//     mins as the CPU's vec_dot does (dot): signed levels (Q4_0 q-8, Q5_0 q-16, Q8_0, Q3_K u-4,
//     Q6_K u-32) are made signed bytes before the dp4a; minimums (Q4_1 Q5_1 Q4_K Q5_K) use the
//     block's s; Q2_K's minimums per 16 elements use sums of the int8 halves (dp4a with ones).
//     Lanes stride over the row's sub-blocks, float partial sums meet in a warp reduction.
//  The CPU quantizes activations to Q8_0 (legacy types) or Q8_K (K types, one scale per 256)
//  instead, so mmvq differs from the CPU's linear only by activation rounding: on Gaussian rows
//  each is 0.4-0.8% (relative L2) from the product with the float x, the CPU's K types a little
//  more (one scale per 256); against the exact product of the dequantized weight and the
//  Q8_1-rounded x, mmvq is float rounding only (~1e-7).
//  Workspace (taper_cuda_gguf_mmvq_workspace_bytes): int8 levels (M, K) at offset 0, then the
//  (d, s) float pairs (M, K / 32) at the next multiple of 16 bytes; 16-byte aligned.
//
// The per-block routines (dequant8, load, dot) are __host__ __device__ so a host program can
// check them against the CPU reference without a GPU. Blocks are only 2-byte aligned (every size
// and field offset is even, but Q4_0 is 18 bytes), so 32-bit words are read as two 16-bit loads.
#include "common.cuh"

#include <string.h>

#define TAPER_HD __host__ __device__ __forceinline__

namespace {

// ---- block formats: ggml's structs (pyx/quant_kernels.h), f16 fields as raw bits

struct BlockQ4_0 { uint16_t d; uint8_t qs[16]; };
struct BlockQ4_1 { uint16_t d, m; uint8_t qs[16]; };
struct BlockQ5_0 { uint16_t d; uint8_t qh[4]; uint8_t qs[16]; };
struct BlockQ5_1 { uint16_t d, m; uint8_t qh[4]; uint8_t qs[16]; };
struct BlockQ8_0 { uint16_t d; int8_t qs[32]; };
struct BlockQ2_K { uint8_t scales[16]; uint8_t qs[64]; uint16_t d, dmin; };
struct BlockQ3_K { uint8_t hmask[32]; uint8_t qs[64]; uint8_t scales[12]; uint16_t d; };
struct BlockQ4_K { uint16_t d, dmin; uint8_t scales[12]; uint8_t qs[128]; };
struct BlockQ5_K { uint16_t d, dmin; uint8_t scales[12]; uint8_t qh[32]; uint8_t qs[128]; };
struct BlockQ6_K { uint8_t ql[128]; uint8_t qh[64]; int8_t scales[16]; uint16_t d; };

static_assert(sizeof(BlockQ4_0) == 18, "q4_0 is 18 bytes");
static_assert(sizeof(BlockQ4_1) == 20, "q4_1 is 20 bytes");
static_assert(sizeof(BlockQ5_0) == 22, "q5_0 is 22 bytes");
static_assert(sizeof(BlockQ5_1) == 24, "q5_1 is 24 bytes");
static_assert(sizeof(BlockQ8_0) == 34, "q8_0 is 34 bytes");
static_assert(sizeof(BlockQ2_K) == 84, "q2_K is 84 bytes");
static_assert(sizeof(BlockQ3_K) == 110, "q3_K is 110 bytes");
static_assert(sizeof(BlockQ4_K) == 144, "q4_K is 144 bytes");
static_assert(sizeof(BlockQ5_K) == 176, "q5_K is 176 bytes");
static_assert(sizeof(BlockQ6_K) == 210, "q6_K is 210 bytes");

// ---- helpers shared by host and device

TAPER_HD float h2f(uint16_t bits) {
    __half_raw r;
    r.x = bits;
    return __half2float(__half(r));  // exact, subnormals included
}

// Separate rounding for each product and sum, as the CPU reference (no FMA contraction).
TAPER_HD float mul_rn(float a, float b) {
#ifdef __CUDA_ARCH__
    return __fmul_rn(a, b);
#else
    return a * b;
#endif
}
TAPER_HD float add_rn(float a, float b) {
#ifdef __CUDA_ARCH__
    return __fadd_rn(a, b);
#else
    return a + b;
#endif
}
TAPER_HD float sub_rn(float a, float b) {
#ifdef __CUDA_ARCH__
    return __fsub_rn(a, b);
#else
    return a - b;
#endif
}

// 4 bytes at a 2-byte aligned address, little endian.
TAPER_HD uint32_t ld32(const uint8_t* p) {
#ifdef __CUDA_ARCH__
    const uint16_t* h = reinterpret_cast<const uint16_t*>(p);
    return (uint32_t)h[0] | ((uint32_t)h[1] << 16);
#else
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
#endif
}

// Sum of the 4 byte products of a and b as signed int8, plus c.
TAPER_HD int dp4a(int a, int b, int c) {
#ifdef __CUDA_ARCH__
    return __dp4a(a, b, c);  // sm_61+: one instruction
#else
    for (int k = 0; k < 4; k++) c += (int)(int8_t)(a >> (8 * k)) * (int)(int8_t)(b >> (8 * k));
    return c;
#endif
}

// Bytes u (each <= 127) minus c (each <= 128), bytewise mod 256: the signed levels as int8.
// Bit 7 set in every byte first, so no byte borrows from its neighbour.
TAPER_HD int sub_bytes(uint32_t u, uint32_t c) {
    return (int)(((u | 0x80808080u) - c) ^ 0x80808080u);
}

// Bit k of `bits` (k = 0..3) to bit 4 of byte k: the 5th bit of 4 consecutive elements.
TAPER_HD uint32_t bits_to_b4(uint32_t bits) {
    return ((bits & 1u) << 4) | ((bits & 2u) << 11) | ((bits & 4u) << 18) | ((bits & 8u) << 25);
}

// Q4_K/Q5_K group j's 6-bit scale and min (ggml's get_scale_min_k4).
TAPER_HD void scale_min_k4(int j, const uint8_t* q, int& sc, int& mn) {
    if (j < 4) {
        sc = q[j] & 63;
        mn = q[j + 4] & 63;
    } else {
        sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        mn = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

// Q3_K group g's signed 6-bit scale: low nibble from byte (g / 4 % 2) * 4 + g % 4 (nibble g / 8),
// top 2 bits from byte 8 + g % 4 (bits 2 * (g / 4)), minus 32 (pyx/quant_k.c's q3_K_scales).
TAPER_HD int scale_q3_K(int g, const uint8_t* s) {
    const int k = g & 3;
    const int lo = (s[((g >> 2) & 1) * 4 + k] >> (4 * (g >> 3))) & 0xF;
    const int hi = (s[8 + k] >> (2 * (g >> 2))) & 3;
    return (lo | (hi << 4)) - 32;
}

// The x values of one int8 32-block, its d and s = d * sum(q).
struct XBlock {
    int q[8];
    float d, s;
};

// Sub-block forms shared by several types: the 8 packed int8 words of levels and the float
// factors; dot = the integer dot product with an activation block, then the factors.

// levels times one scale (Q4_0, Q5_0, Q8_0)
struct ScaledDot {
    struct Sub {
        int v[8];
        float d;
    };
    TAPER_HD static float dot(const Sub& s, const XBlock& x) {
        int p = 0;
        for (int i = 0; i < 8; i++) p = dp4a(s.v[i], x.q[i], p);
        return (float)p * (s.d * x.d);
    }
};

// levels times a scale plus a min (Q4_1, Q5_1)
struct ScaledMinDot {
    struct Sub {
        int v[8];
        float d, m;
    };
    TAPER_HD static float dot(const Sub& s, const XBlock& x) {
        int p = 0;
        for (int i = 0; i < 8; i++) p = dp4a(s.v[i], x.q[i], p);
        return (float)p * (s.d * x.d) + s.m * x.s;
    }
};

// levels times a sub-block scale minus a sub-block min (Q4_K, Q5_K)
struct SubScaledMinDot {
    struct Sub {
        int v[8];
        float dl, ml;
    };
    TAPER_HD static float dot(const Sub& s, const XBlock& x) {
        int p = 0;
        for (int i = 0; i < 8; i++) p = dp4a(s.v[i], x.q[i], p);
        return (s.dl * x.d) * (float)p - s.ml * x.s;
    }
};

// ---- per type: dequant8 (elements 8c .. 8c+7 of a block, the CPU's float ops) and, for mmvq,
// load (sub-block j of 32 elements: 8 ints of packed int8 levels and the scales) and dot (that
// sub-block with one Q8_1 block of x).

struct Q4_0 : ScaledDot {
    using Block = BlockQ4_0;
    static constexpr int kQK = 32;
    TAPER_HD static void dequant8(const Block* b, int c, float y[8]) {
        const float d = h2f(b->d);
        const int sh = c < 2 ? 0 : 4, o = 8 * (c & 1);
        for (int k = 0; k < 8; k++) y[k] = (float)(((b->qs[o + k] >> sh) & 0xF) - 8) * d;
    }
    TAPER_HD static void load(const Block* b, int, Sub& s) {
        for (int i = 0; i < 4; i++) {
            const uint32_t q = ld32(b->qs + 4 * i);
            s.v[i] = sub_bytes(q & 0x0F0F0F0Fu, 0x08080808u);
            s.v[i + 4] = sub_bytes((q >> 4) & 0x0F0F0F0Fu, 0x08080808u);
        }
        s.d = h2f(b->d);
    }
};

struct Q4_1 : ScaledMinDot {
    using Block = BlockQ4_1;
    static constexpr int kQK = 32;
    TAPER_HD static void dequant8(const Block* b, int c, float y[8]) {
        const float d = h2f(b->d), m = h2f(b->m);
        const int sh = c < 2 ? 0 : 4, o = 8 * (c & 1);
        for (int k = 0; k < 8; k++)
            y[k] = add_rn(mul_rn((float)((b->qs[o + k] >> sh) & 0xF), d), m);
    }
    TAPER_HD static void load(const Block* b, int, Sub& s) {
        for (int i = 0; i < 4; i++) {
            const uint32_t q = ld32(b->qs + 4 * i);
            s.v[i] = (int)(q & 0x0F0F0F0Fu);
            s.v[i + 4] = (int)((q >> 4) & 0x0F0F0F0Fu);
        }
        s.d = h2f(b->d);
        s.m = h2f(b->m);
    }
};

struct Q5_0 : ScaledDot {
    using Block = BlockQ5_0;
    static constexpr int kQK = 32;
    TAPER_HD static void dequant8(const Block* b, int c, float y[8]) {
        const float d = h2f(b->d);
        const uint32_t qh = ld32(b->qh);
        const int sh = c < 2 ? 0 : 4, o = 8 * (c & 1);
        for (int k = 0; k < 8; k++) {
            const int e = 8 * c + k;
            const int q = ((b->qs[o + k] >> sh) & 0xF) | (int)(((qh >> e) & 1u) << 4);
            y[k] = (float)(q - 16) * d;
        }
    }
    TAPER_HD static void load(const Block* b, int, Sub& s) {
        const uint32_t qh = ld32(b->qh);
        for (int i = 0; i < 4; i++) {
            const uint32_t q = ld32(b->qs + 4 * i);
            const uint32_t lo = (q & 0x0F0F0F0Fu) | bits_to_b4(qh >> (4 * i));
            const uint32_t hi = ((q >> 4) & 0x0F0F0F0Fu) | bits_to_b4(qh >> (4 * i + 16));
            s.v[i] = sub_bytes(lo, 0x10101010u);
            s.v[i + 4] = sub_bytes(hi, 0x10101010u);
        }
        s.d = h2f(b->d);
    }
};

struct Q5_1 : ScaledMinDot {
    using Block = BlockQ5_1;
    static constexpr int kQK = 32;
    TAPER_HD static void dequant8(const Block* b, int c, float y[8]) {
        const float d = h2f(b->d), m = h2f(b->m);
        const uint32_t qh = ld32(b->qh);
        const int sh = c < 2 ? 0 : 4, o = 8 * (c & 1);
        for (int k = 0; k < 8; k++) {
            const int e = 8 * c + k;
            const int q = ((b->qs[o + k] >> sh) & 0xF) | (int)(((qh >> e) & 1u) << 4);
            y[k] = add_rn(mul_rn((float)q, d), m);
        }
    }
    TAPER_HD static void load(const Block* b, int, Sub& s) {
        const uint32_t qh = ld32(b->qh);
        for (int i = 0; i < 4; i++) {
            const uint32_t q = ld32(b->qs + 4 * i);
            s.v[i] = (int)((q & 0x0F0F0F0Fu) | bits_to_b4(qh >> (4 * i)));
            s.v[i + 4] = (int)(((q >> 4) & 0x0F0F0F0Fu) | bits_to_b4(qh >> (4 * i + 16)));
        }
        s.d = h2f(b->d);
        s.m = h2f(b->m);
    }
};

struct Q8_0 : ScaledDot {
    using Block = BlockQ8_0;
    static constexpr int kQK = 32;
    TAPER_HD static void dequant8(const Block* b, int c, float y[8]) {
        const float d = h2f(b->d);
        for (int k = 0; k < 8; k++) y[k] = (float)b->qs[8 * c + k] * d;
    }
    TAPER_HD static void load(const Block* b, int, Sub& s) {
        const uint8_t* q = reinterpret_cast<const uint8_t*>(b->qs);
        for (int i = 0; i < 8; i++) s.v[i] = (int)ld32(q + 4 * i);
        s.d = h2f(b->d);
    }
};

// K types: element e of a super-block; chunk c = elements 8c..8c+7 (group of 16: c / 2, of 32:
// c / 4); sub-block j = elements 32j..32j+31. Q2_K/Q3_K: the 2 low bits of e are bits
// 2 * (e % 128 / 32) of qs[32 * (e / 128) + e % 32]; Q3_K's third bit is bit e / 32 of
// hmask[e % 32].

struct Q2_K {
    using Block = BlockQ2_K;
    static constexpr int kQK = 256;
    TAPER_HD static void dequant8(const Block* b, int c, float y[8]) {
        const float d = h2f(b->d), min = h2f(b->dmin);
        const int e0 = 8 * c, sh = 2 * ((e0 & 127) >> 5);
        const uint8_t* q = b->qs + 32 * (e0 >> 7) + (e0 & 31);
        const uint8_t sc = b->scales[c >> 1];
        const float dl = d * (float)(sc & 0xF), ml = min * (float)(sc >> 4);
        for (int k = 0; k < 8; k++) y[k] = sub_rn(mul_rn(dl, (float)((q[k] >> sh) & 3)), ml);
    }
    struct Sub {
        int v[8];
        int sc[2], mn[2];
        float d, dmin;
    };
    TAPER_HD static void load(const Block* b, int j, Sub& s) {
        const uint8_t* q = b->qs + 32 * (j >> 2);
        const int sh = 2 * (j & 3);
        for (int i = 0; i < 8; i++) s.v[i] = (int)((ld32(q + 4 * i) >> sh) & 0x03030303u);
        for (int h = 0; h < 2; h++) {
            s.sc[h] = b->scales[2 * j + h] & 0xF;
            s.mn[h] = b->scales[2 * j + h] >> 4;
        }
        s.d = h2f(b->d);
        s.dmin = h2f(b->dmin);
    }
    TAPER_HD static float dot(const Sub& s, const XBlock& x) {
        int isum = 0, summs = 0;
        for (int h = 0; h < 2; h++) {
            int p = 0, sx = 0;
            for (int i = 4 * h; i < 4 * h + 4; i++) {
                p = dp4a(s.v[i], x.q[i], p);
                sx = dp4a(0x01010101, x.q[i], sx);  // sum of the x levels of this 16
            }
            isum += s.sc[h] * p;
            summs += s.mn[h] * sx;
        }
        return (x.d * s.d) * (float)isum - (x.d * s.dmin) * (float)summs;
    }
};

struct Q3_K {
    using Block = BlockQ3_K;
    static constexpr int kQK = 256;
    TAPER_HD static void dequant8(const Block* b, int c, float y[8]) {
        const float d_all = h2f(b->d);
        const int e0 = 8 * c, sh = 2 * ((e0 & 127) >> 5), l0 = e0 & 31;
        const uint8_t* q = b->qs + 32 * (e0 >> 7) + l0;
        const uint8_t m = (uint8_t)(1u << (e0 >> 5));
        const float dl = d_all * (float)scale_q3_K(c >> 1, b->scales);
        for (int k = 0; k < 8; k++)
            y[k] = dl * (float)(((q[k] >> sh) & 3) - ((b->hmask[l0 + k] & m) ? 0 : 4));
    }
    struct Sub {
        int v[8];
        int sc[2];
        float d;
    };
    TAPER_HD static void load(const Block* b, int j, Sub& s) {
        const uint8_t* q = b->qs + 32 * (j >> 2);
        const int sh = 2 * (j & 3);
        for (int i = 0; i < 8; i++) {
            const uint32_t lo = (ld32(q + 4 * i) >> sh) & 0x03030303u;
            const uint32_t hi = (ld32(b->hmask + 4 * i) >> j) & 0x01010101u;
            s.v[i] = sub_bytes(lo | (hi << 2), 0x04040404u);
        }
        s.sc[0] = scale_q3_K(2 * j, b->scales);
        s.sc[1] = scale_q3_K(2 * j + 1, b->scales);
        s.d = h2f(b->d);
    }
    TAPER_HD static float dot(const Sub& s, const XBlock& x) {
        int isum = 0;
        for (int h = 0; h < 2; h++) {
            int p = 0;
            for (int i = 4 * h; i < 4 * h + 4; i++) p = dp4a(s.v[i], x.q[i], p);
            isum += s.sc[h] * p;
        }
        return (x.d * s.d) * (float)isum;
    }
};

// Q4_K/Q5_K: group g = e / 32 is nibble g % 2 of qs[32 * (g / 2) + e % 32]; Q5_K's fifth bit is
// bit g of qh[e % 32].
struct Q4_K : SubScaledMinDot {
    using Block = BlockQ4_K;
    static constexpr int kQK = 256;
    TAPER_HD static void dequant8(const Block* b, int c, float y[8]) {
        const float d = h2f(b->d), min = h2f(b->dmin);
        const int g = c >> 2, sh = 4 * (g & 1);
        const uint8_t* q = b->qs + 32 * (g >> 1) + 8 * (c & 3);
        int sc, mn;
        scale_min_k4(g, b->scales, sc, mn);
        const float d1 = d * (float)sc, m1 = min * (float)mn;
        for (int k = 0; k < 8; k++) y[k] = sub_rn(mul_rn(d1, (float)((q[k] >> sh) & 0xF)), m1);
    }
    TAPER_HD static void load(const Block* b, int j, Sub& s) {
        const uint8_t* q = b->qs + 32 * (j >> 1);
        const int sh = 4 * (j & 1);
        for (int i = 0; i < 8; i++) s.v[i] = (int)((ld32(q + 4 * i) >> sh) & 0x0F0F0F0Fu);
        int sc, mn;
        scale_min_k4(j, b->scales, sc, mn);
        s.dl = h2f(b->d) * (float)sc;
        s.ml = h2f(b->dmin) * (float)mn;
    }
};

struct Q5_K : SubScaledMinDot {
    using Block = BlockQ5_K;
    static constexpr int kQK = 256;
    TAPER_HD static void dequant8(const Block* b, int c, float y[8]) {
        const float d = h2f(b->d), min = h2f(b->dmin);
        const int g = c >> 2, sh = 4 * (g & 1), l0 = 8 * (c & 3);
        const uint8_t* q = b->qs + 32 * (g >> 1) + l0;
        const uint8_t u = (uint8_t)(1u << g);
        int sc, mn;
        scale_min_k4(g, b->scales, sc, mn);
        const float d1 = d * (float)sc, m1 = min * (float)mn;
        for (int k = 0; k < 8; k++) {
            const int v = ((q[k] >> sh) & 0xF) + ((b->qh[l0 + k] & u) ? 16 : 0);
            y[k] = sub_rn(mul_rn(d1, (float)v), m1);
        }
    }
    TAPER_HD static void load(const Block* b, int j, Sub& s) {
        const uint8_t* q = b->qs + 32 * (j >> 1);
        const int sh = 4 * (j & 1);
        for (int i = 0; i < 8; i++) {
            const uint32_t lo = (ld32(q + 4 * i) >> sh) & 0x0F0F0F0Fu;
            const uint32_t hi = (ld32(b->qh + 4 * i) >> j) & 0x01010101u;
            s.v[i] = (int)(lo | (hi << 4));
        }
        int sc, mn;
        scale_min_k4(j, b->scales, sc, mn);
        s.dl = h2f(b->d) * (float)sc;
        s.ml = h2f(b->dmin) * (float)mn;
    }
};

// Q6_K: per 128 elements (half h), e % 128 = 32k + l: low 4 bits are nibble k / 2 of
// ql[64h + 32 (k % 2) + l], high 2 bits are bits 2k of qh[32h + l]; scale scales[e / 16].
struct Q6_K {
    using Block = BlockQ6_K;
    static constexpr int kQK = 256;
    TAPER_HD static void dequant8(const Block* b, int c, float y[8]) {
        const float d = h2f(b->d);
        const int e0 = 8 * c, h = e0 >> 7, k4 = (e0 & 127) >> 5, l0 = e0 & 31;
        const uint8_t* ql = b->ql + 64 * h + 32 * (k4 & 1) + l0;
        const uint8_t* qh = b->qh + 32 * h + l0;
        const int shl = 4 * (k4 >> 1), shh = 2 * k4;
        const float ds = d * (float)b->scales[c >> 1];  // (d * scale) * q, ggml's association
        for (int k = 0; k < 8; k++) {
            const int q = (((ql[k] >> shl) & 0xF) | (((qh[k] >> shh) & 3) << 4)) - 32;
            y[k] = ds * (float)q;
        }
    }
    struct Sub {
        int v[8];
        int sc[2];
        float d;
    };
    TAPER_HD static void load(const Block* b, int j, Sub& s) {
        const int h = j >> 2, k4 = j & 3;
        const uint8_t* ql = b->ql + 64 * h + 32 * (k4 & 1);
        const uint8_t* qh = b->qh + 32 * h;
        const int shl = 4 * (k4 >> 1), shh = 2 * k4;
        for (int i = 0; i < 8; i++) {
            const uint32_t lo = (ld32(ql + 4 * i) >> shl) & 0x0F0F0F0Fu;
            const uint32_t hi = (ld32(qh + 4 * i) >> shh) & 0x03030303u;
            s.v[i] = sub_bytes(lo | (hi << 4), 0x20202020u);
        }
        s.sc[0] = b->scales[2 * j];
        s.sc[1] = b->scales[2 * j + 1];
        s.d = h2f(b->d);
    }
    TAPER_HD static float dot(const Sub& s, const XBlock& x) {
        int isum = 0;
        for (int h = 0; h < 2; h++) {
            int p = 0;
            for (int i = 4 * h; i < 4 * h + 4; i++) p = dp4a(s.v[i], x.q[i], p);
            isum += s.sc[h] * p;
        }
        return (x.d * s.d) * (float)isum;
    }
};

// ---- workspace: int8 levels (M, K) at offset 0, then (d, s) float pairs (M, K / 32) at the
// next multiple of 16 bytes (so both parts are 16-byte aligned when the workspace is).

inline int64_t align16(int64_t n) { return (n + 15) / 16 * 16; }
inline int64_t ws_q_bytes(int64_t M, int64_t K) { return align16(M * K); }

// One lane's share of out[m0 .. m0+MT-1, n] (before the warp sum): the row's sub-blocks lane,
// lane + lanes, ... Rows m >= M are skipped. xq: (M, K) int8; xds: (M, K / 32) (d, s).
template <typename Q, int MT>
TAPER_HD void mmvq_lane(const uint8_t* wrow, const int8_t* xq, const float2* xds, int64_t m0,
                        int64_t M, int64_t K, int lane, int lanes, float acc[MT]) {
    constexpr int kSubs = Q::kQK / 32;
    const typename Q::Block* blocks = reinterpret_cast<const typename Q::Block*>(wrow);
    const int64_t nsub = K / 32;
    for (int64_t i = lane; i < nsub; i += lanes) {
        typename Q::Sub s;
        Q::load(blocks + i / kSubs, (int)(i % kSubs), s);
#ifdef __CUDA_ARCH__
#pragma unroll  // acc[] must stay in registers
#endif
        for (int mm = 0; mm < MT; mm++) {
            const int64_t m = m0 + mm;
            if (m >= M) break;
            XBlock x;
            const int4* p = reinterpret_cast<const int4*>(xq + m * K + 32 * i);
            const int4 a = p[0], b = p[1];
            x.q[0] = a.x, x.q[1] = a.y, x.q[2] = a.z, x.q[3] = a.w;
            x.q[4] = b.x, x.q[5] = b.y, x.q[6] = b.z, x.q[7] = b.w;
            const float2 ds = xds[m * nsub + i];
            x.d = ds.x;
            x.s = ds.y;
            acc[mm] += Q::dot(s, x);
        }
    }
}

// The level of x for the inverse scale id: round half away from zero (the CPU's round_away).
TAPER_HD int q8_level(float x, float id) { return (int)roundf(x * id); }

// ---- kernels

__device__ __forceinline__ int warp_sum_int(int v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

constexpr int kQuantThreads = 256;  // 8 warps: 8 blocks of 32 elements per thread block
constexpr int kDequantThreads = 256;
// 4 warps (4 weight rows) per block: small enough that a short N still spreads over the SMs,
// large enough that a block is not scheduling overhead; occupancy comes from many blocks.
constexpr int kMmvqWarps = 4;

template <typename T>
__global__ void quantize_q8_1_kernel(const T* __restrict__ x,     // (M, K)
                                     int8_t* __restrict__ xq,     // (M, K)
                                     float2* __restrict__ xds,    // (M, K / 32)
                                     int64_t nblocks) {           // M * K / 32
    const int64_t blk = (int64_t)blockIdx.x * (kQuantThreads / 32) + (threadIdx.x >> 5);
    if (blk >= nblocks) return;  // whole warps leave together
    const int lane = threadIdx.x & 31;
    const int64_t e = blk * 32 + lane;  // a 32-block never straddles rows: K % 32 == 0
    const float v = taper::to_float(x[e]);
    const float d = taper::warp_max(fabsf(v)) / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    const int q = q8_level(v, id);
    xq[e] = (int8_t)q;
    const int sum = warp_sum_int(q);
    if (lane == 0) xds[blk] = make_float2(d, d * (float)sum);
}

template <typename Q, typename T>
__global__ void dequantize_kernel(const uint8_t* __restrict__ w,  // (N, row_bytes) blocks
                                  T* __restrict__ out,            // (N, K)
                                  int64_t N, int64_t K, int64_t row_bytes, bool vec) {
    const int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;  // chunk of 8 in the row
    if (c >= K / 8) return;
    constexpr int kChunks = Q::kQK / 8;
    for (int64_t n = blockIdx.y; n < N; n += gridDim.y) {
        const typename Q::Block* b =
            reinterpret_cast<const typename Q::Block*>(w + n * row_bytes) + c / kChunks;
        float y[8];
        Q::dequant8(b, (int)(c % kChunks), y);
        T* o = out + n * K + 8 * c;
        if (vec) {  // out 16-byte aligned and K % 8 == 0: every chunk is too
            taper::Pack<T, 8, 16> p;
#pragma unroll
            for (int k = 0; k < 8; k++) p.v[k] = taper::from_float<T>(y[k]);
            *reinterpret_cast<taper::Pack<T, 8, 16>*>(o) = p;
        } else {
#pragma unroll
            for (int k = 0; k < 8; k++) o[k] = taper::from_float<T>(y[k]);
        }
    }
}

template <typename Q, typename T, int MT>
__global__ void __launch_bounds__(kMmvqWarps * 32)
mmvq_kernel(const uint8_t* __restrict__ w,     // (N, row_bytes) blocks
            const int8_t* __restrict__ xq,     // (M, K)
            const float2* __restrict__ xds,    // (M, K / 32)
            T* __restrict__ out,               // (M, ldo), columns [0, N)
            int64_t M, int64_t N, int64_t K, int64_t ldo, int64_t row_bytes) {
    const int64_t n = (int64_t)blockIdx.x * kMmvqWarps + (threadIdx.x >> 5);
    if (n >= N) return;  // whole warps leave together
    const int lane = threadIdx.x & 31;
    const uint8_t* wrow = w + n * row_bytes;
    for (int64_t m0 = (int64_t)blockIdx.y * MT; m0 < M; m0 += (int64_t)gridDim.y * MT) {
        float acc[MT];
#pragma unroll
        for (int mm = 0; mm < MT; mm++) acc[mm] = 0.0f;
        mmvq_lane<Q, MT>(wrow, xq, xds, m0, M, K, lane, 32, acc);
#pragma unroll
        for (int mm = 0; mm < MT; mm++) {
            const float v = taper::warp_sum(acc[mm]);
            if (lane == 0 && m0 + mm < M) out[(m0 + mm) * ldo + n] = taper::from_float<T>(v);
        }
    }
}

// ---- launchers

template <typename Q>
int launch_dequantize(const void* w, void* out, int64_t N, int64_t K, int dtype, cudaStream_t s) {
    if (K % Q::kQK) return TAPER_CUDA_ERR_ARG;
    if (N == 0 || K == 0) return TAPER_CUDA_OK;
    const int64_t row_bytes = K / Q::kQK * (int64_t)sizeof(typename Q::Block);
    const bool vec = taper::aligned16(out);
    // Rows on y, capped at 65535 (the hardware limit); the kernel's row loop covers the rest.
    const dim3 grid((unsigned)taper::ceil_div(K / 8, kDequantThreads),
                    (unsigned)(N < 65535 ? N : 65535));
    TAPER_DISPATCH_DTYPE(dtype, scalar_t,
                         dequantize_kernel<Q, scalar_t><<<grid, kDequantThreads, 0, s>>>(
                             (const uint8_t*)w, (scalar_t*)out, N, K, row_bytes, vec));
    return taper::launch_status();
}

template <typename Q, typename T, int MT>
void launch_mmvq_tile(const void* w, const int8_t* xq, const float2* xds, void* out, int64_t M,
                      int64_t N, int64_t K, int64_t ldo, cudaStream_t s) {
    const int64_t row_bytes = K / Q::kQK * (int64_t)sizeof(typename Q::Block);
    const int64_t tiles = taper::ceil_div(M, MT);
    const dim3 grid((unsigned)taper::ceil_div(N, kMmvqWarps),
                    (unsigned)(tiles < 65535 ? tiles : 65535));
    mmvq_kernel<Q, T, MT><<<grid, kMmvqWarps * 32, 0, s>>>(
        (const uint8_t*)w, xq, xds, (T*)out, M, N, K, ldo, row_bytes);
}

template <typename Q, typename T>
int launch_mmvq_t(const void* x, const void* w, void* out, int64_t M, int64_t N, int64_t K,
                  int64_t ldo, void* workspace, cudaStream_t s) {
    int8_t* xq = (int8_t*)workspace;
    float2* xds = (float2*)((char*)workspace + ws_q_bytes(M, K));
    if (K > 0) {
        const int64_t nblocks = M * (K / 32);
        quantize_q8_1_kernel<T>
            <<<(unsigned)taper::ceil_div(nblocks, kQuantThreads / 32), kQuantThreads, 0, s>>>(
                (const T*)x, xq, xds, nblocks);
    }
    // The M-tile: every weight sub-block a lane unpacks serves MT rows of x. 8 rows at most
    // keeps the accumulators and one x block in registers; M = 1, 2, 3-4 get exact tiles.
    if (M == 1)
        launch_mmvq_tile<Q, T, 1>(w, xq, xds, out, M, N, K, ldo, s);
    else if (M == 2)
        launch_mmvq_tile<Q, T, 2>(w, xq, xds, out, M, N, K, ldo, s);
    else if (M <= 4)
        launch_mmvq_tile<Q, T, 4>(w, xq, xds, out, M, N, K, ldo, s);
    else
        launch_mmvq_tile<Q, T, 8>(w, xq, xds, out, M, N, K, ldo, s);
    return taper::launch_status();
}

template <typename Q>
int launch_mmvq(const void* x, const void* w, void* out, int64_t M, int64_t N, int64_t K,
                int64_t ldo, int dtype, void* workspace, int64_t workspace_bytes,
                cudaStream_t s) {
    if (K % Q::kQK) return TAPER_CUDA_ERR_ARG;
    if (M == 0 || N == 0) return TAPER_CUDA_OK;
    if (workspace_bytes < taper_cuda_gguf_mmvq_workspace_bytes(M, K) ||
        !taper::aligned16(workspace) || (K > 0 && !workspace))
        return TAPER_CUDA_ERR_ARG;
    // The quantize grid (M * K / 256 blocks) and the mmvq grid (N / 4 blocks) are on x, whose
    // limit is 2^31 - 1.
    if (taper::ceil_div(M * (K / 32), kQuantThreads / 32) > INT32_MAX ||
        taper::ceil_div(N, kMmvqWarps) > INT32_MAX)
        return TAPER_CUDA_ERR_ARG;
    TAPER_DISPATCH_DTYPE(dtype, scalar_t,
                         return launch_mmvq_t<Q, scalar_t>(x, w, out, M, N, K, ldo, workspace,
                                                           s));
    return TAPER_CUDA_ERR_ARG;
}

// Runs the body (which must return) with Q the traits of block type `qtype`; an unsupported id
// is an argument error.
#define TAPER_DISPATCH_QTYPE(qtype, Q, ...)               \
    switch (qtype) {                                      \
        case 2: { using Q = Q4_0; __VA_ARGS__; }          \
        case 3: { using Q = Q4_1; __VA_ARGS__; }          \
        case 6: { using Q = Q5_0; __VA_ARGS__; }          \
        case 7: { using Q = Q5_1; __VA_ARGS__; }          \
        case 8: { using Q = Q8_0; __VA_ARGS__; }          \
        case 10: { using Q = Q2_K; __VA_ARGS__; }         \
        case 11: { using Q = Q3_K; __VA_ARGS__; }         \
        case 12: { using Q = Q4_K; __VA_ARGS__; }         \
        case 13: { using Q = Q5_K; __VA_ARGS__; }         \
        case 14: { using Q = Q6_K; __VA_ARGS__; }         \
        default: return TAPER_CUDA_ERR_ARG;               \
    }

}  // namespace

extern "C" int taper_cuda_gguf_supported(int qtype) {
    switch (qtype) {
        case 2: case 3: case 6: case 7: case 8: case 10: case 11: case 12: case 13: case 14:
            return 1;
        default:
            return 0;
    }
}

// w must be 2-byte aligned (every block size and field offset is even; a row offset into a
// device buffer keeps that), which the 16-bit loads of the scales rely on.
extern "C" int taper_cuda_gguf_dequantize(int qtype,
                                          const void* w,  // (N, row_bytes) blocks
                                          void* out,      // (N, K) dtype
                                          int64_t N, int64_t K, int dtype,
                                          taper_stream_t stream) {
    if (N < 0 || K < 0 || ((uintptr_t)w & 1)) return TAPER_CUDA_ERR_ARG;
    // K / 8 chunks on the x grid (256 per block) stay far below its 2^31 - 1 limit.
    if (K / 8 > (int64_t)INT32_MAX) return TAPER_CUDA_ERR_ARG;
    TAPER_DISPATCH_QTYPE(qtype, Q,
                         return launch_dequantize<Q>(w, out, N, K, dtype, (cudaStream_t)stream));
}

extern "C" int64_t taper_cuda_gguf_mmvq_workspace_bytes(int64_t M, int64_t K) {
    if (M <= 0 || K <= 0) return 0;
    const int64_t Kp = (K + 31) / 32 * 32;
    return ws_q_bytes(M, Kp) + M * (Kp / 32) * (int64_t)sizeof(float2);
}

extern "C" int taper_cuda_gguf_mmvq(int qtype,
                                    const void* x,    // (M, K) dtype
                                    const void* w,    // (N, row_bytes) blocks
                                    void* out,        // (M, ldo) dtype, columns [0, N) written
                                    int64_t M, int64_t N, int64_t K, int64_t ldo, int dtype,
                                    void* workspace, int64_t workspace_bytes,
                                    taper_stream_t stream) {
    if (M < 0 || N < 0 || K < 0 || ldo < N || ((uintptr_t)w & 1)) return TAPER_CUDA_ERR_ARG;
    TAPER_DISPATCH_QTYPE(qtype, Q,
                         return launch_mmvq<Q>(x, w, out, M, N, K, ldo, dtype, workspace,
                                               workspace_bytes, (cudaStream_t)stream));
}
