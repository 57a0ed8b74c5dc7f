// FP4-weight grouped GEMM for many tokens per expert (prefill, 128+) on sm_90a: wgmma with the dequantized weights as
// the register A operand. Compiled together with moe_mma.cu (its helpers: loads, dequant8_rows, the NVFP4 / MXFP4
// scale conversions, column_scale, store, zero_rows); moe_wgmma.py builds and launches it.
//
// Work split. An item (x, e) is weight rows 128 x .. 128 x + 127 of expert e (warpgroup w: 64 of them, the wgmma's M
// side; warp i of a warpgroup its rows 16 i .. 16 i + 15 as in an m16 MMA fragment) and all of e's tokens, in tiles
// of BT (the N side). A CTA of 2 warpgroups, one per multiprocessor, takes items from a counter until none are left
// (next_tile), and loads the next tile's first stages under the current tile's last.
// K runs in stages of 64: the stage's token tile [BT x 64] comes to shared memory by one TMA copy (XS slots, XS - 2
// stages ahead, an mbarrier each; 128-byte swizzle: row r's 16-byte chunk c at r * 128 + (c ^ r % 8) * 16, the layout
// wgmma's descriptor names; token rows past T read as zeros, rows of other experts are computed and not stored). TMA
// writes through the async proxy that wgmma reads by, so no proxy fence is needed (one after cp.async costs a MEMBAR
// that waits for the weight loads in flight: session 27, call 2). The weights stream straight to registers 4 stages
// ahead, and each warpgroup issues 4 (k16) wgmma.m64n{BT}k16 per stage, one commit group, and waits for the previous
// stage's group only (its A registers are then free; the dequantization of stage s + 1 overlaps the MMAs of stage s).
//
// Weight layout (moe_wgmma.pack): per 16-row group and stage, 512 bytes of codes, lane l = 4 g + q's 16 at 16 l:
// word j (k16 step j of the stage) holds the 8 codes of lane l's A fragment, nibble 4 kp + 2 kh + rh = the code of
// row g + 8 rh, k = 16 j + 8 kh + 2 q + kp, so dequant8_rows gives the fragment's 4 registers in order. Block scales
// per 16-row group and stage: NVFP4 64 bytes, lane l's u16 at 2 l = (row g, block q), (row g + 8, block q); MXFP4 32
// bytes, (row g, block b), (row g + 8, block b) at 4 g + 2 b. A lane takes step j's scales from lane 4 g + j (NVFP4)
// or 4 g + j / 2 (MXFP4) by shuffle.

#ifndef XS
#define XS 4  // token-tile stages in shared memory (the refill of stage s + XS - 2 goes where stage s - 2 was)
#endif
#ifndef N256
#define N256 1  // a 256-token tile's two halves as one m64n256k16 (acc[0], acc[1] contiguous; 0: two m64n128k16,
                // 1.04-1.08x slower: session 27, call 6)
#endif
#define WG_THREADS 256
#define WG_ROWS 128
#define SLOTS_BYTES(BT) (XS * (BT) * 128)
// the epilogue's tile, beside the slots (the next tile's first stages land there while it drains): BT tokens of bf16
// outputs, or 128 of fp32 a pass (the mbarriers follow)
#define EPI_BYTES(BT) ((BT) * (128 * 2 + 16) > 128 * (128 * 4 + 16) ? (BT) * (128 * 2 + 16) : 128 * (128 * 4 + 16))


__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory"); }
// Keeps r live and in place up to here (an in-flight wgmma still reads or writes it).
__device__ __forceinline__ void hold(float& r) { asm volatile("" : "+f"(r)::"memory"); }
__device__ __forceinline__ void hold(u32& r) { asm volatile("" : "+r"(r)::"memory"); }

// The CUtensorMap of x (cuTensorMapEncodeTiled on the host; a kernel parameter).
struct alignas(64) TensorMap { unsigned long long v[16]; };

__device__ __forceinline__ u32 smem_addr(const void* p) { return (u32)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void bar_init(unsigned long long* bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ bool bar_try_wait(unsigned long long* bar, u32 parity) {
    u32 ok;
    asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                 : "=r"(ok) : "r"(smem_addr(bar)), "r"(parity) : "memory");
    return ok;
}
// Rows t0 .. t0 + BT, k 64 s .. + 63 of x -> slot, completing on bar (one thread).
template <int BT>
__device__ __forceinline__ void tma_x_stage(u8* slot, unsigned long long* bar, const TensorMap* xmap, int t0, int s) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(BT * 128)
                 : "memory");
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes "
                 "[%0], [%1, {%2, %3}], [%4];"
                 ::"r"(smem_addr(slot)), "l"(xmap), "r"(64 * s), "r"(t0), "r"(smem_addr(bar)) : "memory");
}

// wgmma descriptor of a K-major bf16 tile in 128-byte swizzle: rows of 128 bytes, 8-row groups 1024 bytes apart.
__device__ __forceinline__ unsigned long long smem_desc(const u8* p) {
    const u32 addr = (u32)__cvta_generic_to_shared(p);
    return (unsigned long long)((addr & 0x3FFFFu) >> 4) | (1ull << 16) | ((unsigned long long)(1024 >> 4) << 32) |
           (1ull << 62);
}

// d (64 rows x 128 tokens, fp32 fragments) += a (bf16 A fragment) x the tile desc names.
__device__ __forceinline__ void wgmma_n128(float (&d)[64], const u32* a, unsigned long long desc) {
    asm volatile(
        "{ .reg .pred p; setp.ne.b32 p, %69, 0; wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
        "}, {%64, %65, %66, %67}, %68, p, 1, 1, 0; }"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "n"(1));
}

// One stage's A fragments (4 k16 steps x 4 registers) from this lane's 4 code words and its scale u16.
template <int MX>
__device__ __forceinline__ void dequant_stage(u32 (&A)[4][4], const Words4& w, u32 sc, int lane, u32& bad) {
    u32 conv = sc;  // NVFP4: bf16x2 (row g, row g + 8) of block q; MXFP4: the raw bytes of block q % 2
    if (!MX) {  // (a NaN byte is zeroed first: its row is NaN anyway, and nvfp4_scales2 would spill it into the
                // other half, the other row)
        const u32 nb = nan_bytes(sc);
        bad |= nb;
        conv = nvfp4_scales2(sc & ~((nb >> 7) * 0xFFu));
    }
    const u32 words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const u32 v = __shfl_sync(0xFFFFFFFFu, conv, (lane & ~3) | (MX ? j >> 1 : j));
        const u32 sa = MX ? mxfp4_scale2(v & 0xFFu) : __byte_perm(v, 0, 0x1010);
        const u32 sb = MX ? mxfp4_scale2((v >> 8) & 0xFFu) : __byte_perm(v, 0, 0x3232);
        dequant8_rows(words[j], sa, sb, A[j]);
    }
}

// d (64 rows x 256 tokens) += a x the tile desc names (one instruction for both halves of a 256-token tile).
__device__ __forceinline__ void wgmma_n256(float (&d)[128], const u32* a, unsigned long long desc) {
    asm volatile(
        "{ .reg .pred p; setp.ne.b32 p, %133, 0; wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
        "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
        "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
        "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
        "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
        "}, {%128, %129, %130, %131}, %132, p, 1, 1, 0; }"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
          "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
          "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
          "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
          "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
          "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
          "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]),
          "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]),
          "+f"(d[118]), "+f"(d[119]),
          "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "n"(1));
}

// The CTA's outputs (acc[h][4 n + i]: row g + 8 (i / 2) of the warp's 16, token 128 h + 8 n + 2 q + i % 2) through
// shared memory: [tokens x 128 rows] of ES-byte outputs, rows 128 ES + 16 bytes apart (the padding puts the quad's 4
// tokens in different banks), then each of the count tokens' 128 outputs (rows col0 ..) as 16-byte stores (call 3's
// direct 2-byte stores were scattered). bf16 in one pass, fp32 in 128-token passes (EPI_BYTES). ES a constant: the
// 64 addresses per h are immediates.
template <int NH, int ES>
__device__ __forceinline__ void store_tile_wg(const float (&acc)[NH][64], u8* tile, void* y, int sy, int t0,
                                              long long col0, int count, int warp, int g, int q, float cs0,
                                              float cs1) {
    constexpr int STRIDE = 128 * ES + 16, CHUNKS = 8 * ES, HP = ES == 4 ? 1 : NH;  // (16-byte chunks per token)
    u8* base = tile + 2 * q * STRIDE + (((threadIdx.x >> 7) * 64 + warp * 16 + g) * ES);
    u8* yb = (u8*)y + ((long long)t0 * sy + col0) * ES;
#pragma unroll
    for (int h0 = 0; h0 < NH; h0 += HP) {
        if (h0) __syncthreads();  // (the previous pass has left the tile)
#pragma unroll
        for (int h = h0; h < h0 + HP; ++h)
#pragma unroll
            for (int i = 0; i < 64; ++i) {
                u8* dst = base + (128 * (h - h0) + 8 * (i >> 2) + (i & 1)) * STRIDE + 8 * ((i >> 1) & 1) * ES;
                const float v = acc[h][i] * ((i & 2) ? cs1 : cs0);
                if (ES == 4) *(float*)dst = v;
                else *(u16*)dst = f32_to_bf16(v);
            }
        __syncthreads();
        const int n = min(count - 128 * h0, 128 * HP);
        for (int c = threadIdx.x; c < n * CHUNKS; c += WG_THREADS) {
            const int tl = c / CHUNKS, part = c % CHUNKS;
            *(Words4*)(yb + (long long)(128 * h0 + tl) * sy * ES + part * 16) =
                *(const Words4*)(tile + tl * STRIDE + part * 16);
        }
    }
}

// Thread 0 takes the next item from the counter ctr[0] (its register, in flight until used; the other threads' stays
// 0), and later posts it to this CTA's mailbox ctr[1 + blockIdx.x]. Predicated, not branches: ptxas serializes every
// wgmma of a kernel where a divergent path may touch their registers.
__device__ __forceinline__ u32 take_item(int* ctr) {
    u32 r = 0;
    asm volatile("{ .reg .pred p; setp.eq.u32 p, %2, 0; @p atom.global.add.u32 %0, [%1], 1; }"
                 : "+r"(r) : "l"(ctr), "r"((u32)threadIdx.x) : "memory");
    return r;
}
__device__ __forceinline__ void post_item(int* ctr, u32 item) {
    asm volatile("{ .reg .pred p; setp.eq.u32 p, %2, 0; @p st.global.u32 [%0], %1; }"
                 ::"l"(ctr + 1 + blockIdx.x), "r"(item), "r"((u32)threadIdx.x) : "memory");
}

// The tile after c, in every thread: c's item's next token tile, else the first tile of the next item with tokens.
// CTA b's first item is b, then the counter ctr[0] (G at launch) hands the items out in order; each CTA holds one
// taken ahead (pend, thread 0's), so that the atomic's latency passes during a tile. False: none left. The mailbox is
// global memory: read from shared memory, the item would count as divergent to ptxas, and the kernel's wgmmas
// serialized (ptxas's C7520: the SASS test checks the wait that keeps one group running).
struct Tile { int p, t0, t_end; };
template <int BT>
__device__ __forceinline__ bool next_tile(Tile& c, const int* offs, int items, int nx, int* ctr, u32& pend) {
    c.t0 += BT;
    while (c.t0 >= c.t_end) {
        post_item(ctr, pend);
        pend = take_item(ctr);
        __syncthreads();
        c.p = ctr[1 + blockIdx.x];
        __syncthreads();  // (every thread has read it before the next one is posted)
        if (c.p >= items) return false;
        const int e = c.p / nx;
        c.t0 = e ? offs[e - 1] : 0;
        c.t_end = offs[e];
    }
    return true;
}

// Scale bytes of a 16-row group's stage: NVFP4 4 blocks x 16 rows, MXFP4 2 x 16.
#define STAGE_SCALE_BYTES(MX) ((MX) ? 32 : 64)

// Code and scale words of stage s of item p's 16-row group (wbase, sbase: this lane's in item 0).
template <int STEPS>
__device__ __forceinline__ const u32* w_at(const u8* wbase, int p, int s) {
    return (const u32*)(wbase + ((long long)p * 8 * STEPS + s) * 512);
}
template <int MX, int STEPS>
__device__ __forceinline__ const u8* s_at(const u8* sbase, int p, int s) {
    return sbase + ((long long)p * 8 * STEPS + s) * STAGE_SCALE_BYTES(MX);
}

// One tile's MMAs: acc += the dequantized weights of cur's item x its token tile, over all STEPS stages (the stages
// this CTA loaded before it: n0), running the MMAs W tokens wide (BT, or 128 for a last tile of at most 128 tokens: a
// separate copy of the loop, so that no branch sits between the wgmmas in flight). Stage s + 4's weights and stage
// s + XS - 2's token rows load at stage s, the next tile's (nxt, where more) past the end.
template <int MX, int BT, int STEPS, int W>
__device__ __forceinline__ void mma_tile(float (&acc)[BT / 128][64], u32& bad, Words4 (&wq)[4], u32 (&sc)[4], u8* xs,
                                         unsigned long long* full, const TensorMap* xmap, const Tile& cur,
                                         const Tile& nxt, bool more, u32 n0, const u8* wbase, const u8* sbase,
                                         int lane, int tid) {
    constexpr int NH = BT / 128;
    u32 A[2][4][4];
    for (int s0 = 0; s0 < STEPS; s0 += 4) {
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const int s = s0 + u;
            const u32 n = n0 + s;
            __syncthreads();  // (both warpgroups past stage s - 1's wait: stage s - 2's slot is free)
            if (tid == 0) {
                const u32 m = n + XS - 2;
                if (s + XS - 2 < STEPS)
                    tma_x_stage<BT>(xs + (m % XS) * BT * 128, full + m % XS, xmap, cur.t0, s + XS - 2);
                else if (more)  // (the next tile's first stages)
                    tma_x_stage<BT>(xs + (m % XS) * BT * 128, full + m % XS, xmap, nxt.t0, s + XS - 2 - STEPS);
            }
            dequant_stage<MX>(A[u & 1], wq[u], sc[u], lane, bad);
            if (s + 4 < STEPS) {
                wq[u] = ldg_stream(w_at<STEPS>(wbase, cur.p, s + 4));
                sc[u] = ldg_u16(s_at<MX, STEPS>(sbase, cur.p, s + 4));
            } else if (more) {
                wq[u] = ldg_stream(w_at<STEPS>(wbase, nxt.p, s + 4 - STEPS));
                sc[u] = ldg_u16(s_at<MX, STEPS>(sbase, nxt.p, s + 4 - STEPS));
            }
#pragma unroll
            for (int h = 0; h < NH; ++h)
#pragma unroll
                for (int i = 0; i < 64; ++i) hold(acc[h][i]);
            wgmma_fence();
            while (!bar_try_wait(full + n % XS, (n / XS) & 1)) {
            }
            const u8* slot = xs + (n % XS) * BT * 128;
#pragma unroll
            for (int j = 0; j < 4; ++j)
                if (W == 256 && N256)
                    wgmma_n256(*(float(*)[128])acc, A[u & 1][j], smem_desc(slot + j * 32));
                else
#pragma unroll
                    for (int h = 0; h < W / 128; ++h)
                        wgmma_n128(acc[h], A[u & 1][j], smem_desc(slot + h * 16384 + j * 32));
            wgmma_commit();
            wgmma_wait<1>();  // (stage s - 1's group: its A registers, A[(u + 1) & 1], are free again)
#pragma unroll
            for (int j = 0; j < 4; ++j)
#pragma unroll
                for (int i = 0; i < 4; ++i) hold(A[(u + 1) & 1][j][i]);
        }
    }
    wgmma_wait<0>();
#pragma unroll
    for (int h = 0; h < NH; ++h)
#pragma unroll
        for (int i = 0; i < 64; ++i) hold(acc[h][i]);
}

// MX 0: NVFP4, 1: MXFP4; BT: token tile (128 or 256); STEPS: K / 64 (a multiple of 4). Grid (G, 1): the CTAs take
// the N / 128 x E items (item p: expert p / nx, its weight rows 128 (p % nx) .. + 127) in order from the counter
// ctr[0], CTA b's first one b (ctr: 1 + G ints, all G at launch; persistent with G = the multiprocessors; G = the
// items is one each); CTAs b < N / 128 first zero the rows of no expert. A tile's last stages already load the next
// tile's first token stages and weights, so they land while this one's MMAs finish and its outputs drain. xmap:
// x [T, K] bf16, box 64 x BT, 128-byte swizzle. Dynamic shared memory: XS x BT x 128 bytes of slots, EPI_BYTES(BT),
// XS mbarriers, 1024 (alignment).
template <int MX, int BT, int STEPS>
__global__ void __launch_bounds__(WG_THREADS, 1)
fp4_w4a16_wgmma(const __grid_constant__ TensorMap xmap, const u16* x, const u8* codes, const u8* scales,
                const float* gamax, void* y, const int* offs, int T, int N, int K, int E, int sx, int sy, int gmode,
                int out_f32, int* ctr) {
    extern __shared__ __align__(16) u8 smem_raw[];
    u8* xs = (u8*)(((unsigned long long)smem_raw + 1023) & ~1023ull);
    u8* epi = xs + SLOTS_BYTES(BT);
    unsigned long long* full = (unsigned long long*)(epi + EPI_BYTES(BT));  // slot i's stage has landed
    Args a{x, codes, scales, gamax, y, offs, T, N, K, E, sx, sy, MX, gmode, out_f32};
    const int nx = N / WG_ROWS, items = nx * E;
    for (int z = blockIdx.x; z < nx; z += gridDim.x) zero_rows(a, (long long)z * WG_ROWS, WG_ROWS);
    Tile cur{-1, -BT, 0};
    u32 pend = blockIdx.x;
    if (!next_tile<BT>(cur, offs, items, nx, ctr, pend)) return;
    const int tid = threadIdx.x, warp = (tid >> 5) & 3, lane = tid & 31, g = lane >> 2, q = lane & 3;
    const int sub = (tid >> 7) * 4 + warp;  // the warp's 16-row group of the item's 8 (rows 16 sub .. + 15)
    constexpr int NH = BT / 128;
    // item p's 16-row group: 512 code bytes a stage (this lane's 16 at 16 lane), STAGE_SCALE_BYTES scale bytes
    const u8* wbase = codes + (long long)sub * STEPS * 512 + lane * 16;
    const u8* sbase = scales + (long long)sub * STEPS * STAGE_SCALE_BYTES(MX) + (MX ? 4 * g + 2 * (q & 1) : 2 * lane);
    if (tid == 0) {
        for (int i = 0; i < XS; ++i) bar_init(full + i, 1);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        for (int s = 0; s < XS - 2; ++s) tma_x_stage<BT>(xs + s * BT * 128, full + s, &xmap, cur.t0, s);
    }
    Words4 wq[4];
    u32 sc[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
        wq[u] = ldg_stream(w_at<STEPS>(wbase, cur.p, u));
        sc[u] = ldg_u16(s_at<MX, STEPS>(sbase, cur.p, u));
    }
    u32 n0 = 0;  // stages this CTA has loaded before this tile (slot n % XS, its barrier's phase n / XS)
    while (true) {
        float acc[NH][64];
#pragma unroll
        for (int h = 0; h < NH; ++h)
#pragma unroll
            for (int i = 0; i < 64; ++i) acc[h][i] = 0.0f;
        Tile nxt = cur;
        const bool more = next_tile<BT>(nxt, offs, items, nx, ctr, pend);
        u32 bad = 0;
        if (NH == 2 && cur.t_end - cur.t0 <= 128)  // (a last tile of <= 128 tokens: m64n128k16 on its first half)
            mma_tile<MX, BT, STEPS, 128>(acc, bad, wq, sc, xs, full, &xmap, cur, nxt, more, n0, wbase, sbase, lane,
                                         tid);
        else
            mma_tile<MX, BT, STEPS, BT>(acc, bad, wq, sc, xs, full, &xmap, cur, nxt, more, n0, wbase, sbase, lane,
                                        tid);
        // acc[h][4 n + i]: row g + 8 (i / 2), token 128 h + 8 n + 2 q + i % 2; a NaN block scale of a row in any
        // lane of the quad (each holds one block of the row's stages) makes the row NaN
        bad |= __shfl_xor_sync(0xFFFFFFFFu, bad, 1);
        bad |= __shfl_xor_sync(0xFFFFFFFFu, bad, 2);
        const float nan = __int_as_float(0x7FC00000);
        const int e = cur.p / nx;
        const long long col0 = (long long)(cur.p - e * nx) * WG_ROWS, row0 = col0 + 16 * sub;
        const float cs0 = (bad & 0x80u) ? nan : column_scale(a, e, row0 + g);
        const float cs1 = (bad & 0x8000u) ? nan : column_scale(a, e, row0 + g + 8);
        const int count = min(BT, cur.t_end - cur.t0);
        if (out_f32) store_tile_wg<NH, 4>(acc, epi, y, sy, cur.t0, col0, count, warp, g, q, cs0, cs1);
        else store_tile_wg<NH, 2>(acc, epi, y, sy, cur.t0, col0, count, warp, g, q, cs0, cs1);
        if (!more) break;
        cur = nxt;
        n0 += STEPS;
    }
}
