// FP4-weight grouped GEMM for MoE decode on sm_90 (W4A16): y[t, n] = sum_k x[t, k] * W_e[n, k], expert e of
// token row t (rows offs[e-1]..offs[e]), weights NVFP4 or MXFP4 (packed codes + block scales), dequantized in
// registers and fed to mma.sync m16n8k16 (bf16 in, fp32 accumulate). Compiled at run time by NVRTC
// (moe_mma.py); no headers.
//
// Work split. A CTA (8 warps) takes blocks of 256 weight rows of one expert (a segment; the kernel's comment says
// how blocks are dealt to CTAs); in each block a warp takes 32 rows (two m16 tiles). The weight rows are the MMA's M
// side and the tokens its N side (8 or 16 per pass), so one token per expert still reads each weight byte once.
// Each thread (lane = 4 g + q) streams rows g and g + 8 of each m16 tile, 64 of every 256 k (32 bytes per row) per
// step; the quad's lanes read adjacent bytes. A warp's steps over all its row blocks form one sequence with the next
// two steps always in flight (a register double buffer), so the loads of a block's first steps overlap the previous
// block's last MMAs.
// The MMA does not care in which order k is summed: the MMA's k slots of lane q take lane q's own k, and a thread's
// 8 codes of one word (k0 .. k0 + 7) fill two MMA k-steps in the order (k0, k0+4), (k0+1, k0+5) | (k0+2, k0+6),
// (k0+3, k0+7). The token rows are stored in shared memory permuted the same way: one 16-byte shared load gives
// the B operands of both k-steps.
//
// Weight layouts. The plain one is FP4Tensor's (codes [E, N, K/2], scales [E, N, K/16 or K/32]). The packed one
// (moe_mma.pack) stores each warp's step (32 rows x 256 k) as one contiguous 4 KB: load i (t, h, half) of lane l at
// 512 i + 16 l, the bytes the plain layout has there. Its block scales follow the same order: lane l's 16 (NVFP4) or
// 8 (MXFP4) bytes of a step are one load. Every load of a warp then covers 512 contiguous bytes (the plain layout:
// 8 rows x 64 bytes per code load, 8 rows x 8 bytes per scale load), and a warp streams its 32 rows' codes as one
// sequence.
//
// Dequantization: code c = s e1 e0 m placed as bf16 bits (c & 7) << 6 | (c & 8) << 12 is exactly value * 2^-126;
// times the block scale * 2^64 (exact in bf16) that is value * scale * 2^-62, normal and exact. The epilogue
// multiplies by 2^62 / S_enc (NVFP4 global amax; 2^62 without one). A NaN e4m3 block scale makes its row's outputs
// NaN, as dequantize-then-matmul does. MXFP4 exponents outside [-63, 63] over- or underflow here, as in the Triton
// kernel.

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;

#ifndef MIN_BLOCKS
#define MIN_BLOCKS 2   // CTAs per multiprocessor the registers are budgeted for (2: at most 128 per thread)
#endif
#ifndef SKIP_DEQUANT
#define SKIP_DEQUANT 0  // 1: the codes go to the MMA as they are (wrong numbers: a benchmark of the rest)
#endif
#ifndef PROBE_CONTIGUOUS
#define PROBE_CONTIGUOUS 0  // 1: each warp step reads its 4 KB as one contiguous block (wrong numbers: a DRAM probe)
#endif
#define WARPS 8
#define ROWS_PER_WARP 32
#define ROWS_PER_CTA (WARPS * ROWS_PER_WARP)

struct alignas(16) Words4 { u32 x, y, z, w; };

struct Step {       // one thread's weights of one 64-k step: 2 tiles x 2 rows x 8 words, and their block scales
    u32 w[2][2][8];
    u32 s[2][2];    // NVFP4: 4 scale bytes (one per 16 k); MXFP4: 2 bytes (one per 32 k) in the low half
};

__device__ __forceinline__ Words4 ldg_stream(const u32* p) {
    Words4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

__device__ __forceinline__ u32 ldg_u8(const u8* p) {
    unsigned short v;
    asm volatile("ld.global.nc.u8 %0, [%1];" : "=h"(v) : "l"(p));
    return v;
}

__device__ __forceinline__ u32 ldg_u16(const u8* p) {
    unsigned short v;
    asm volatile("ld.global.nc.u16 %0, [%1];" : "=h"(v) : "l"(p));
    return v;
}

__device__ __forceinline__ Words4 lds128(const u8* p) {
    Words4 v;
    u32 a = (u32)__cvta_generic_to_shared(p);
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(a));
    return v;
}

__device__ __forceinline__ u32 mul_bf16x2(u32 a, u32 b) {
    u32 d;
    asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}

__device__ __forceinline__ void mma(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// MXFP4 block scale byte -> bf16 (2^(b - 127) * 2^64) in both halves.
__device__ __forceinline__ u32 mxfp4_scale2(u32 b) {
    u32 h = ((b + 64u) << 7) & 0xFFFFu;  // bf16 2^(b - 127 + 64)
    return h | (h << 16);
}

// 8 codes of one word (code i at bits 4i) -> bf16x2 pairs (c0, c4), (c1, c5), (c2, c6), (c3, c7); pairs 0 and 2
// times sa, 1 and 3 times sb (moe_wgmma.cu's words hold two weight rows: even pairs one, odd pairs the other).
__device__ __forceinline__ void dequant8_rows(u32 w, u32 sa, u32 sb, u32* p) {
#if SKIP_DEQUANT
    p[0] = w; p[1] = w ^ sa; p[2] = w >> 8; p[3] = w << 8;
    return;
#endif
    u32 w2 = w >> 8;
    p[0] = mul_bf16x2(((w & 0x000F000Fu) * 0x1040u) & 0x81C081C0u, sa);
    p[1] = mul_bf16x2(((w & 0x00F000F0u) * 0x104u) & 0x81C081C0u, sb);
    p[2] = mul_bf16x2(((w2 & 0x000F000Fu) * 0x1040u) & 0x81C081C0u, sa);
    p[3] = mul_bf16x2(((w2 & 0x00F000F0u) * 0x104u) & 0x81C081C0u, sb);
}

// The same with one scale for all 8 codes (one weight row).
__device__ __forceinline__ void dequant8(u32 w, u32 s2, u32* p) { dequant8_rows(w, s2, s2, p); }

__device__ __forceinline__ u16 f32_to_bf16(float v) {
    u16 h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(v));
    return h;
}

struct Args {
    const u16* x; const u8* codes; const u8* scales; const float* gamax; void* y; const int* offs;
    int T, N, K, E, sx, sy, mx, gmode, out_f32;
};

// this thread's weights of step u: per row, bytes 128 u + 16 q and 128 u + 64 + 16 q (16 each), so the 4 lanes of a
// quad read 64 contiguous bytes per load (k of word m: k0 = 256 u + 128 (m / 4) + 32 q + 8 (m % 4)); and their block
// scales, packed so that word m's is byte m / 2 (NVFP4: 16 k per block) or m / 4 (MXFP4: 32 k)
template <int PACKED>
__device__ __forceinline__ void load_step(Step& st, const Args& a, long long row0, int g, int q, int u) {
    const int kb = a.K / 2;                         // bytes per row
    const int sb = a.K / (a.mx ? 32 : 16);          // scale bytes per row
    if (PACKED) {  // (row0: a multiple of 32; the warp's step is 4 KB block row0 / 32 * steps + u, at row0 kb + 4096 u)
        const int lane = 4 * g + q;
        const u32* p = (const u32*)(a.codes + row0 * kb + u * 4096 + lane * 16);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            Words4 v0 = ldg_stream(p + 256 * i), v1 = ldg_stream(p + 256 * i + 128);  // (i = 2 t + h; +512 bytes)
            u32* w = st.w[i >> 1][i & 1];
            w[0] = v0.x; w[1] = v0.y; w[2] = v0.z; w[3] = v0.w; w[4] = v1.x; w[5] = v1.y; w[6] = v1.z; w[7] = v1.w;
        }
        if (a.mx) {
            const u32* s = (const u32*)(a.scales + row0 * sb + u * 256 + lane * 8);
            u32 x, y;
            asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];" : "=r"(x), "=r"(y) : "l"(s));
            st.s[0][0] = x; st.s[0][1] = x >> 16; st.s[1][0] = y; st.s[1][1] = y >> 16;
        } else {
            Words4 v = ldg_stream((const u32*)(a.scales + row0 * sb + u * 512 + lane * 16));
            st.s[0][0] = v.x; st.s[0][1] = v.y; st.s[1][0] = v.z; st.s[1][1] = v.w;
        }
        return;
    }
#pragma unroll
    for (int t = 0; t < 2; ++t) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            long long r = row0 + t * 16 + h * 8 + g;
#if PROBE_CONTIGUOUS
            const u8* p = a.codes + row0 * kb + u * 4096 + ((t * 2 + h) * 8 + g) * 128 + q * 16;
#else
            const u8* p = a.codes + r * kb + u * 128 + q * 16;
#endif
            Words4 v0 = ldg_stream((const u32*)p), v1 = ldg_stream((const u32*)(p + 64));
            st.w[t][h][0] = v0.x; st.w[t][h][1] = v0.y; st.w[t][h][2] = v0.z; st.w[t][h][3] = v0.w;
            st.w[t][h][4] = v1.x; st.w[t][h][5] = v1.y; st.w[t][h][6] = v1.z; st.w[t][h][7] = v1.w;
            const u8* s = a.scales + r * sb;
            if (a.mx) st.s[t][h] = ldg_u8(s + u * 8 + q) | (ldg_u8(s + u * 8 + 4 + q) << 8);
            else st.s[t][h] = ldg_u16(s + u * 16 + 2 * q) | (ldg_u16(s + u * 16 + 8 + 2 * q) << 16);
        }
    }
}

// Where token granule G (8 elements) sits in its shared-memory row: bit 0 flipped in the upper half of each 16. The
// 8 lanes of one 16-byte load phase (g in {0, 1}, q = 0..3, the same word) then hit 8 different bank groups, with
// rows 2 K + 32 bytes apart.
__device__ __forceinline__ int swizzle(int G) { return G ^ ((G >> 3) & 1); }

// Two NVFP4 block scales (e4m3 bytes in the low 16 bits of v) -> bf16x2 (scale * 2^64 each), exact: e4m3 -> f16x2
// (exact, e4m3 subnormals become f16 normals), the f16 bits moved down by 3 are the value * 2^-112 as bf16 bits, and
// two multiplies by 2^88 finish. A NaN byte does not survive this: nan_bytes flags it.
__device__ __forceinline__ u32 nvfp4_scales2(u32 v) {
    u32 h;
    asm("{ .reg .b16 lo; cvt.u16.u32 lo, %1; cvt.rn.f16x2.e4m3x2 %0, lo; }" : "=r"(h) : "r"(v));
    u32 p = ((h & 0x7FFF7FFFu) >> 3) | (h & 0x80008000u);
    const u32 two88 = 0x6B806B80u;  // bf16x2 2^88
    return mul_bf16x2(mul_bf16x2(p, two88), two88);
}

// Nonzero where one of the 4 e4m3 bytes of v is NaN (low 7 bits all set).
__device__ __forceinline__ u32 nan_bytes(u32 v) { return ((v & 0x7F7F7F7Fu) + 0x01010101u) & 0x80808080u; }

// MMAs of one step: NT token tiles of 8 (B operands from the permuted token rows in shared memory)
template <int NT, int MX>
__device__ __forceinline__ void mma_step(float (&acc)[2][2][4], const Step& st, const u8* xs, int stride, int g,
                                         int q, int u, u32& bad) {
    u32 pair[2][2];  // NVFP4: the bf16x2 scales of words 0-3 (m < 4) or 4-7 of row (t, h)
    if (!MX) {
#pragma unroll
        for (int t = 0; t < 2; ++t)
#pragma unroll
            for (int h = 0; h < 2; ++h)
                if (nan_bytes(st.s[t][h])) bad |= 1u << (2 * t + h);
    }
    // x granule of word m: G = 32 u + 16 (m / 4) + 4 q + m % 4, stored at swizzle(G) = G ^ (q / 2) (bit 3 of G is
    // q / 2): rows g of token tile n at xs + (8 n + g) stride, so the flip is +-16 bytes by the parity of m
    const int flip = (q >> 1) * 16;
    const u8* x_even = xs + g * stride + (32 * u + 4 * q) * 16 + flip;  // (words m with m % 2 == 0)
    const u8* x_odd = xs + g * stride + (32 * u + 4 * q) * 16 - flip;
#pragma unroll
    for (int m = 0; m < 8; ++m) {  // word m: k0 = 256 u + 128 (m / 4) + 32 q + 8 (m % 4)
        Words4 b[NT];
        const int off = ((m >> 2) * 16 + (m & 3)) * 16;
#pragma unroll
        for (int n = 0; n < NT; ++n) b[n] = lds128(((m & 1) ? x_odd : x_even) + n * 8 * stride + off);
#pragma unroll
        for (int t = 0; t < 2; ++t) {
            u32 p0[4], p1[4];
            u32 s0, s1;  // the bf16x2 block scale of word m in rows g and g + 8
            if (MX) {
                s0 = mxfp4_scale2((st.s[t][0] >> (8 * (m >> 2))) & 0xFFu);
                s1 = mxfp4_scale2((st.s[t][1] >> (8 * (m >> 2))) & 0xFFu);
            } else {
                if ((m & 3) == 0) {  // scale bytes 0, 1 (words 0-3) or 2, 3 (words 4-7)
                    pair[t][0] = nvfp4_scales2(st.s[t][0] >> (4 * m));
                    pair[t][1] = nvfp4_scales2(st.s[t][1] >> (4 * m));
                }
                const u32 sel = (m & 2) ? 0x3232u : 0x1010u;  // (byte m / 2: the low or the high half, twice)
                s0 = __byte_perm(pair[t][0], 0, sel);
                s1 = __byte_perm(pair[t][1], 0, sel);
            }
            dequant8(st.w[t][0][m], s0, p0);
            dequant8(st.w[t][1][m], s1, p1);
#pragma unroll
            for (int n = 0; n < NT; ++n) {
                mma(acc[t][n], p0[0], p1[0], p0[1], p1[1], b[n].x, b[n].y);
                mma(acc[t][n], p0[2], p1[2], p0[3], p1[3], b[n].z, b[n].w);
            }
        }
    }
}

// Token rows t0 .. t0 + count of x -> shared memory, each 8-element granule permuted to (0, 4, 1, 5, 2, 6, 3, 7)
// (the k order of dequant8's pairs) and stored at swizzle(G).
__device__ __forceinline__ void fill_tokens(u8* xs, const Args& a, int t0, int count, int stride) {
    const int gpr = a.K / 8;  // granules per row
    for (int i = threadIdx.x; i < count * gpr; i += blockDim.x) {
        int r = i / gpr, gi = i - r * gpr;
        const Words4 v = *(const Words4*)(a.x + (long long)(t0 + r) * a.sx + gi * 8);
        Words4 o;
        o.x = __byte_perm(v.x, v.z, 0x5410);
        o.y = __byte_perm(v.x, v.z, 0x7632);
        o.z = __byte_perm(v.y, v.w, 0x5410);
        o.w = __byte_perm(v.y, v.w, 0x7632);
        *(Words4*)(xs + r * stride + swizzle(gi) * 16) = o;
    }
}

__device__ __forceinline__ float column_scale(const Args& a, int e, long long row) {
    const float two62 = 4611686018427387904.0f;
    if (a.gmode == 0) return two62;
    float g = a.gmode == 1 ? a.gamax[0] : a.gamax[(long long)e * a.N + row];
    float s_enc = g > 0.0f ? fminf(2688.0f / g, 3.40282347e38f) : 1.0f;  // nvfp4.encode_scale: saturates at FLT_MAX
    return two62 / s_enc;  // one rounding (2^62 * (1 / s_enc) is an ulp off where 1 / s_enc is subnormal)
}

__device__ __forceinline__ void store(const Args& a, int t, long long n, float v) {
    if (a.out_f32) ((float*)a.y)[(long long)t * a.sy + n] = v;
    else ((u16*)a.y)[(long long)t * a.sy + n] = f32_to_bf16(v);
}

// The C fragments of one m16 pair (rows row_w .. row_w + 31) for tokens t0 .. t0 + count: c0, c1 = (row g, tokens
// 2q, 2q + 1), c2, c3 = (row g + 8, the same tokens). The MMA's k slots of lane q hold lane q's own k, so every
// fragment holds the sum over all of K. A NaN block scale seen by any lane of the quad makes its row NaN.
__device__ __forceinline__ void store_tile(const Args& a, const float (&acc)[2][2][4], u32 bad, int e,
                                           long long row_w, int g, int q, int t0, int count) {
    bad |= __shfl_xor_sync(0xFFFFFFFFu, bad, 1);
    bad |= __shfl_xor_sync(0xFFFFFFFFu, bad, 2);
#pragma unroll
    for (int t = 0; t < 2; ++t) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            long long n_row = row_w + t * 16 + h * 8 + g;
            float cs = (bad >> (2 * t + h)) & 1 ? __int_as_float(0x7FC00000) : column_scale(a, e, n_row);
#pragma unroll
            for (int n = 0; n < 2; ++n) {
#pragma unroll
                for (int j = 0; j < 2; ++j) {
                    int tok = n * 8 + 2 * q + j;
                    if (tok < count) store(a, t0 + tok, n_row, acc[t][n][h * 2 + j] * cs);
                }
            }
        }
    }
}

__device__ __forceinline__ void clear(float (&acc)[2][2][4], u32& bad) {
#pragma unroll
    for (int t = 0; t < 2; ++t)
#pragma unroll
        for (int n = 0; n < 2; ++n)
#pragma unroll
            for (int j = 0; j < 4; ++j) acc[t][n][j] = 0.0f;
    bad = 0;
}

template <int MX>
__device__ __forceinline__ void run_step(float (&acc)[2][2][4], const Step& st, const u8* xs, int stride, int g, int q,
                                         int u, u32& bad, bool two) {
    if (two) mma_step<2, MX>(acc, st, xs, stride, g, q, u, bad);
    else mma_step<1, MX>(acc, st, xs, stride, g, q, u, bad);
}

// Rows past offs[E - 1] belong to no expert: zeros in columns col0 .. col0 + cols.
__device__ __forceinline__ void zero_rows(const Args& a, long long col0, long long cols) {
    const int t_end = a.offs[a.E - 1];
    if (cols <= 0) return;
    for (long long i = threadIdx.x; i < (long long)(a.T - t_end) * cols; i += blockDim.x)
        store(a, t_end + (int)(i / cols), col0 + i % cols, 0.0f);
}

// The segment a CTA works on: expert e's row blocks b0 .. b0 + tiles. SPLIT 0: e = blockIdx.y, b0 = blockIdx.x
// tiles (so nothing of it needs a register); SPLIT 1: read from shared memory at each use (seg: e, b0, tiles), for
// the same reason (the pipeline takes all 128 registers).
template <int SPLIT>
struct Seg {
    const volatile long long* seg;
    int tiles0;
    __device__ __forceinline__ int e() const { return SPLIT ? (int)seg[0] : (int)blockIdx.y; }
    __device__ __forceinline__ long long n_cta() const {
        return (SPLIT ? seg[1] : (long long)blockIdx.x * tiles0) * ROWS_PER_CTA;
    }
    __device__ __forceinline__ int tiles() const { return SPLIT ? (int)seg[2] : tiles0; }
};

// One segment (expert e's weight rows n_cta .. n_cta + 256 tiles) for all of its tokens, in passes of up to tt
// tokens. Called by the whole CTA.
template <int MX, int PACKED, int SPLIT, int STEPS>
__device__ __forceinline__ void segment(const Args& a, u8* xs, const Seg<SPLIT>& sg, int tt) {
    const int t_begin = sg.e() ? a.offs[sg.e() - 1] : 0, t_end = a.offs[sg.e()];
    if (t_end <= t_begin) return;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    const int stride = 2 * a.K + 32, steps = STEPS ? STEPS : a.K / 256;
    // this warp's rows: FIRST + 256 i .. + 31 of the expert, BASE + 256 i .. of all experts' rows
#define FIRST (sg.n_cta() + (unsigned)(warp * ROWS_PER_WARP))
#define BASE ((long long)sg.e() * a.N + FIRST)
    const int mine = FIRST < a.N ? (int)min((long long)sg.tiles(), (a.N - FIRST + ROWS_PER_CTA - 1) / ROWS_PER_CTA)
                                 : 0;
    const int total = mine * steps;  // the warp's steps, block-major
#define ROWS_OF(j) (BASE + (long long)((j) / steps) * ROWS_PER_CTA)
    Step s0, s1;
    auto load_first = [&]() {
        if (total > 0) load_step<PACKED>(s0, a, ROWS_OF(0), g, q, 0);
        if (total > 1) load_step<PACKED>(s1, a, ROWS_OF(1), g, q, 1 % steps);
    };
    load_first();  // (the first pass's first two steps are in flight while the tokens are staged)
    for (int t0 = t_begin; t0 < t_end; t0 += tt) {
        const int count = min(tt, t_end - t0);
        const bool two = count > 8;  // (tt == 16)
        __syncthreads();  // (the previous pass's readers are done with xs)
        fill_tokens(xs, a, t0, count, stride);
        __syncthreads();
        if (t0 != t_begin) load_first();
        float acc[2][2][4];
        u32 bad;  // bit 2 t + h: a NaN block scale in row (t, h) of this lane's K part
        clear(acc, bad);
        // step jj from buffer st, which then loads step jj + 2; a block's last step stores its rows
        auto advance = [&](Step& st, int jj) {
            const int u = jj % steps;
            run_step<MX>(acc, st, xs, stride, g, q, u, bad, two);
            if (jj + 2 < total) load_step<PACKED>(st, a, ROWS_OF(jj + 2), g, q, (jj + 2) % steps);
            if (u == steps - 1) {
                store_tile(a, acc, bad, sg.e(), FIRST + (long long)(jj / steps) * ROWS_PER_CTA, g, q, t0, count);
                clear(acc, bad);
            }
        };
        for (int j = 0; j < total; j += 2) {
            advance(s0, j);
            if (j + 1 < total) advance(s1, j + 1);
        }
    }
#undef ROWS_OF
#undef BASE
#undef FIRST
}

// The balanced split's next segment for this CTA: the lowest expert above `after` (-1: any) with row blocks whose
// cost starts in the CTA's share [lo, hi), written to seg (e, first block, blocks; blocks 0: none left). Each
// expert's cost is its row blocks x passes (ceil(tokens / tt)); thread t takes expert t (E <= blockDim.x), a block
// scan gives the prefix, and the share is [x share, (x + 1) share) with share = ceil(total / CTAs). All of it is
// computed again for every segment, so nothing of it stays in registers through one (the pipeline takes all 128).
// scratch: the scan's WARPS sums, then the int the CTA's threads pick the lowest expert with.
__device__ __forceinline__ void next_segment(const Args& a, int tt, int nblk, int after, long long* scratch,
                                             long long* seg) {
    const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
    int* pick = (int*)(scratch + WARPS);
    if (t == 0) *pick = a.E;
    long long p = 0;  // expert t's passes
    if (t < a.E) {
        const int n = a.offs[t] - (t ? a.offs[t - 1] : 0);
        p = n > 0 ? (n + tt - 1) / tt : 0;
    }
    long long v = nblk * p;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
        const long long u = __shfl_up_sync(0xFFFFFFFFu, v, d);
        if (lane >= d) v += u;
    }
    if (lane == 31) scratch[warp] = v;
    __syncthreads();
    long long c0 = v - nblk * p, total = 0;  // (c0: the cost before expert t)
    for (int i = 0; i < WARPS; ++i) {
        c0 += i < warp ? scratch[i] : 0;
        total += scratch[i];
    }
    const long long share = (total + gridDim.x - 1) / gridDim.x;
    const long long lo = (long long)blockIdx.x * share, hi = min(total, lo + share);
    long long b0 = 0, b1 = 0;  // expert t's blocks whose cost starts in [lo, hi)
    if (p && t > after && lo < hi) {
        b0 = lo > c0 ? (lo - c0 + p - 1) / p : 0;
        b1 = hi > c0 ? min((long long)nblk, (hi - c0 + p - 1) / p) : 0;
        if (b0 < b1) atomicMin(pick, t);
    }
    __syncthreads();
    const int e = *pick;
    if (e == a.E ? t == 0 : t == e) seg[0] = e, seg[1] = b0, seg[2] = e == a.E ? 0 : b1 - b0;
    __syncthreads();
}

// SPLIT 0: CTA (x, e) takes row blocks x tiles .. of expert e (y = E: the rows of no expert). SPLIT 1, the balanced
// split (E <= 256): the blocks of all experts in expert order, each costing its expert's passes, are dealt to the
// gridDim.x CTAs of y = 0 in equal contiguous shares of cost; a share may span several experts (a segment each,
// next_segment). Experts without tokens cost nothing, so no CTA idles on them. y = 1 zeroes the rows of no expert.
// MX 0: NVFP4, 1: MXFP4; PACKED: the weights in moe_mma.pack's layout; STEPS: K / 256 where known at compile time
// (0: from K; a constant divides without a register for the reciprocal)
template <int MX, int PACKED, int SPLIT, int STEPS>
__global__ void __launch_bounds__(WARPS * 32, MIN_BLOCKS)
fp4_w4a16_mma(const u16* x, const u8* codes, const u8* scales, const float* gamax, void* y, const int* offs,
              int T, int N, int K, int E, int sx, int sy, int gmode, int out_f32, int tt, int tiles) {
    extern __shared__ __align__(16) u8 xs[];
    Args a{x, codes, scales, gamax, y, offs, T, N, K, E, sx, sy, MX, gmode, out_f32};
    if (blockIdx.y == (SPLIT ? 1 : E)) {
        const long long cols = SPLIT ? (N + gridDim.x - 1) / gridDim.x : (long long)ROWS_PER_CTA * tiles;
        const long long col0 = (long long)blockIdx.x * cols;
        zero_rows(a, col0, min(cols, N - col0));
        return;
    }
    // SPLIT 1, after the token rows in shared memory: next_segment's scratch and the current segment
    long long* scratch = (long long*)(xs + tt * (2 * K + 32));
    long long* seg = scratch + WARPS + 1;
    if (!SPLIT) {
        segment<MX, PACKED, 0, STEPS>(a, xs, Seg<0>{seg, tiles}, tt);
        return;
    }
    const int nblk = (N + ROWS_PER_CTA - 1) / ROWS_PER_CTA;
    for (int after = -1;; after = (int)((volatile long long*)seg)[0]) {  // one segment per round
        next_segment(a, tt, nblk, after, scratch, seg);
        if (((volatile long long*)seg)[2] == 0) return;
        segment<MX, PACKED, 1, STEPS>(a, xs, Seg<1>{seg, 0}, tt);
    }
}
