// Quantized GEMV / skinny GEMM on the tensor cores: out[t, n] = sum_k x[t, k] W[n, k] for T <= 8 rows of x,
// W in the packed q8_g32 / q5_g64 / q4_g64 formats of kernels/quant.py, read in place (no repacking).
//
// Compiled at run time (CuPy / NVRTC) once per (FMT, HALF); no headers, so it builds with any CUDA toolkit:
//   FMT   0 = q8_g32_fp16, 1 = q5_g64_fp16, 2 = q4_g64_fp16, 3 = dense 16-bit weights in x's dtype (K a multiple
//         of 64; the same tiles and sums, the weights go into the MMA as they are)
//   HALF  0: x and out are bf16 (mma .bf16), 1: fp16 (mma .f16)
//   EVEN  1: K == Kp (whole groups) and x's rows 16-byte aligned, 0: x read element by element, 0 past K
//
// One block = NW warps = one tile of 16 weight rows; the warps take the tile's groups in turn (warp w: groups
// w, w + NW, ...), a grid y > 1 splits the groups over blocks (split-K, summed in-kernel in a fixed order, see
// tile_store: results are deterministic and do not depend on T or on the other rows of x); PIECES > 1 walks a split
// launch's pieces in one block and gives its sums (pieces_store).
// A warp step is one group of its 16 rows: lane (g = lane / 4, c = lane % 4) loads 8 code bytes (two 32-bit
// words) of row g and of row g + 8, and turns each word into four register pairs for mma.m16n8k16:
//   pair i of word w = the codes in nibble i of bytes 0 and 2 (q4/q5: k0+i' , k4+i'), placed in the mantissa of
//   128.0 (bf16) / 1024.0 (fp16) by one mask-and-or (LOP3): the float is BASE + u exactly, and one packed
//   subtraction gives the signed code. The codes' order along K does not matter to a dot product as long as x
//   is gathered the same way: the B fragment pairs x[k] and x[k + 4] (q8: x[k] and x[k + 2]) with PRMT.
// The A fragment holds the exact codes; the MMA multiplies them by x exactly and sums in fp32, and the group's
// fp16 scale multiplies the fp32 sums once per step (4 FFMA per lane), so the only rounding besides fp32
// summation is x's own. q8 splits each code byte into a low nibble (0..15) and a signed high nibble times 16,
// both exact in bf16/fp16, in the two halves of the fragment.
// Column n of the MMA is token t = n: lane (g, c) loads x[t = g] (zero for t >= T) and holds out[t = 2c, 2c + 1]
// of rows g and g + 8.
// NCOL > 1 (up to 64 rows of x in one launch): the tile's A fragments of a step are made once and multiplied by
// NCOL column groups of 8 tokens (group j: tokens 8 j .. 8 j + 7), each group's MMAs, scale step and warp / split
// sums exactly those of a launch of its 8 tokens alone - so every row keeps its one-token bits while the weight is
// read once for all of them.
// TPW > 1 (with NCOL > 1): a block takes TPW consecutive tiles and each warp its groups of all of them, so one load
// of x feeds TPW tiles' fragments (x crosses L2 once per 16 TPW weight rows instead of once per 16); each tile's
// MMAs, scale steps, warp order and split-K sums are those of a block of that tile alone (the same bits).
// ASYNC = S > 0 (TILED 2): each warp streams its steps' code words, scales and q5 high bits into a ring of S steps in
// shared memory with cp.async, S - 1 steps ahead of its arithmetic, instead of loading them into registers; each lane
// copies and reads back only its own pieces, so no barrier is needed. A wide launch (8 column groups) holds about
// 100 accumulators and one step of loads in registers; from registers it keeps one step (6 KB an SM) in flight and
// runs at the bandwidth that latency allows. The arithmetic, its order and so the bits are those of ASYNC 0.

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;

#ifndef FMT
#define FMT 2
#endif
#ifndef HALF
#define HALF 0
#endif
#ifndef EVEN
#define EVEN 1  // K is a whole number of groups and x rows are 16-byte aligned: vector loads of x
#endif
#ifndef NW
#define NW 8       // warps per block (they take a tile's groups in turn: NW fixes the order of the sums)
#endif
#ifndef UNROLL
#define UNROLL 4      // steps whose loads are issued together
#endif
#ifndef XLATE
#define XLATE 0       // 1: x loaded one step ahead of the arithmetic instead of with the codes (see steps)
#endif
#ifndef FOLD
#define FOLD 0        // 1 (q4/q5): the MMA takes BASE + u, and one more MMA per x fragment adds -(BASE + zero) *
#endif                // sum(x), instead of a packed subtraction per code pair (16 fewer instructions a step, but
                      // the longer-lived x fragments spill at 80 registers: slower on the H200)
#ifndef TAIL
#define TAIL 0        // 1: a warp's last groups (fewer than UNROLL) as one predicated batch, all loads in flight
#endif                // together, instead of one step (one load round trip) each; the same sums in the same order
#ifndef PIPE
#define PIPE 0        // 1: software pipeline - a batch's loads are issued while the previous batch is multiplied
#endif
#ifndef PDL
#define PDL 0         // 1 (sm_90+, launched with programmatic stream serialization): the first step batch's code
#endif                // loads are issued before griddepcontrol.wait, i.e. while the kernel before is finishing;
                      // x (the previous kernel's output) is read after it, not through the read-only path (XL1);
                      // the kernel after may launch as soon as all blocks run (griddepcontrol.launch_dependents)
#ifndef XL1
#define XL1 1         // with PDL: x (read after griddepcontrol.wait, which makes the kernel before's writes visible to
#endif                // this grid) through L1 (ld.global.ca), so the warps of an SM share its lines; 0: through L2
                      // only (ld.global.cg), which at 4-64 rows costs every warp its own L2 reads of all T rows
#ifndef TILED
#define TILED 0       // 1: the weight sections are tiled (qmv_cuda.TiledWeight): codes [N/16][NG][16][CB], scales
#endif                // [N/16][NG][16], q5 high bits [N/16][NG][16][8] - a warp's loads are contiguous;
                      // 2 (q formats): within a (tile, group) the lanes' pieces of rows g and g + 8 side by side,
                      // codes [g][c][2][8 bytes], scales [g][2], high bits [g][c][2][2 bytes]: one load each a
                      // step; and each code word's codes reordered so that pair i meets x's own pair i (no PRMT):
                      // q4/q5 nibbles k0 k2 k4 k6 | k1 k3 k5 k7 (q5 high bits alike), q8 bytes k0 k2 k1 k3
#ifndef ACT
#define ACT 0     // 1: the weight is a gate / up pair whose rows alternate in runs of 8 (engine/model/weights.py's
#endif            // interleaved gate_up): tile j's rows g and g + 8 are gate and up of output column 8 j + g, and the
                  // kernel stores silu(gate) * up, [T, N / 2] (no split-K)
#ifndef OUT_F32
#define OUT_F32 0 // 1: out is fp32, each value rounded to x's dtype first (the 16-bit store's value, widened): a
#endif            // caller that wants fp32 (the logits) gets the 16-bit result's values without a copy kernel
#if OUT_F32 && ACT
#error "OUT_F32 widens a projection's output: the gate / up epilogue (ACT) stores x's dtype"
#endif
#ifndef CLUSTER
#define CLUSTER 0 // 1 (sm_90+, launched with cluster dims (1, splits, 1)): a split-K tile's blocks are one cluster, and
#endif            // the first adds the others' sums from their shared memory (DSMEM) in piece order - the same sums
                  // as the workspace's, without its global round trips, fence and counter
#if CLUSTER && ACT
#error "CLUSTER is split-K's reduction: the gate / up epilogue (ACT) takes K in one pass"
#endif
#ifndef NCOL
#define NCOL 1    // column groups of 8 tokens a launch (T <= 8 NCOL); x read per step from L1 / L2 when > 1
#endif
#if NCOL > 1 && (XLATE || PIPE || TAIL)
#error "NCOL > 1 loads x inside each step: XLATE, PIPE and TAIL are for NCOL 1"
#endif
#ifndef TPW
#define TPW 1     // tiles a block takes, each warp its groups of every one (x loaded once for all; NCOL > 1 only)
#endif
#if TPW > 1 && NCOL == 1
#error "TPW > 1 shares x between the tiles of column groups: NCOL > 1"
#endif
#ifndef ASYNC
#define ASYNC 0   // steps of a warp's cp.async ring in shared memory (0: loads into registers, UNROLL steps at once)
#endif
#if ASYNC && TILED != 2
#error "ASYNC streams the lanes layout (TILED 2): one 16-byte code piece, one scale pair, one high-bit pair a lane"
#endif
#if ASYNC && (XLATE || PIPE || TAIL)
#error "ASYNC has its own pipeline: XLATE, PIPE and TAIL are for register loads"
#endif
#ifndef MIN_BLOCKS
#define MIN_BLOCKS 2  // blocks per SM to fit: lets ptxas keep all of a step batch's loads in flight
#endif                // (it interleaves them with the arithmetic, one step at a time, when it aims at more blocks)
#ifndef PIECES
#define PIECES 1  // > 1: one block walks all PIECES pieces of a split-K tile (launched with grid y 1): each warp keeps
#endif            // each piece's sums apart and the block adds them up as a split launch's blocks and reduction do
                  // (warps in order within a piece, then the pieces from 0 in order): a split launch's bits at a
                  // one-pass launch's cost, where the split buys no parallelism (groups_per_split a multiple of NW)
#if PIECES > 1 && (NCOL > 1 || TPW > 1 || ASYNC || XLATE || PIPE || TAIL || ACT || CLUSTER)
#error "PIECES walks one column group's steps from registers: no NCOL > 1, TPW, ASYNC, XLATE, PIPE, TAIL, ACT, CLUSTER"
#endif

#if HALF
#define MAGIC 0x64006400u                    // 1024.0, 1024.0
#define SUB_Q4 0xE408E408u                   // -1032 = -(1024 + 8)
#define SUB_Q5 0xE410E410u                   // -1040 = -(1024 + 16)
#define SUB_LO 0xE400E400u                   // -1024
#define SIXTEEN 0x4C004C00u                  // 16.0
#define SUB_HI16 0xF408F408u                 // -16512 = -16 * 1032
#define MMA_TYPE "f16"
#define FMA2 "fma.rn.f16x2"
#else
#define MAGIC 0x43004300u                    // 128.0, 128.0
#define SUB_Q4 0xC308C308u                   // -136 = -(128 + 8)
#define SUB_Q5 0xC310C310u                   // -144 = -(128 + 16)
#define SUB_LO 0xC300C300u                   // -128
#define SIXTEEN 0x41804180u                  // 16.0
#define SUB_HI16 0xC508C508u                 // -2176 = -16 * 136
#define MMA_TYPE "bf16"
#define FMA2 "fma.rn.bf16x2"
#endif
#define ONE2 (HALF ? 0x3C003C00u : 0x3F803F80u)
#define ZSUB (FMT == 1 ? SUB_Q5 : SUB_Q4)      // -(BASE + zero point) for the folded q4 / q5 sums

__device__ __forceinline__ u32 fma2(u32 a, u32 b, u32 c) {
  u32 d;
  asm(FMA2 " %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}

__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 sel) {
  u32 d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}

__device__ __forceinline__ void mma(float* d, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." MMA_TYPE "." MMA_TYPE ".f32 "
               "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ float half_to_float(u16 h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}

__device__ __forceinline__ float out_to_float(u16 h) {
#if HALF
  return half_to_float(h);
#else
  return __uint_as_float((u32)h << 16);
#endif
}

__device__ __forceinline__ u16 float_to_out(float f) {
  u16 h;
#if HALF
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
#else
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
#endif
  return h;
}

// an output element as stored: x's dtype, or (OUT_F32) that value widened to fp32
#if OUT_F32
typedef float out_t;
__device__ __forceinline__ out_t store_value(float f) { return out_to_float(float_to_out(f)); }
#else
typedef u16 out_t;
__device__ __forceinline__ out_t store_value(float f) { return float_to_out(f); }
#endif

// (a & MASK) op c in one LOP3 (c a register: with two immediates the compiler splits it into two instructions)
template <u32 MASK>
__device__ __forceinline__ u32 and_or(u32 a, u32 c) {
  u32 d;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(a), "n"(MASK), "r"(c));
  return d;
}
template <u32 MASK>
__device__ __forceinline__ u32 and_xor(u32 a, u32 c) {
  u32 d;
  asm("lop3.b32 %0, %1, %2, %3, 0x6A;" : "=r"(d) : "r"(a), "n"(MASK), "r"(c));
  return d;
}

// The four A pairs of one code word (see the top); `magic` = MAGIC in a register. q5: `hb` is the word's
// high-bit byte (bit b = bit 4 of code b).
__device__ __forceinline__ void word_pairs(u32 w, u32 hb, u32 magic, u32* p) {
#if FMT == 0
  // bytes b0..b3 = codes k0..k3 (int8): low nibbles (k0, k2), high nibbles (k0, k2) signed x 16, then (k1, k3);
  // the high nibble's top bit is flipped (u ^ 8 = signed + 8) by xor-ing it in with the magic
  const u32 magic8 = magic | 0x00080008u;
  p[0] = fma2(and_or<0x000F000Fu>(w, magic), ONE2, SUB_LO);
  p[1] = fma2(and_xor<0x000F000Fu>(w >> 4, magic8), SIXTEEN, SUB_HI16);
  p[2] = fma2(and_or<0x000F000Fu>(w >> 8, magic), ONE2, SUB_LO);
  p[3] = fma2(and_xor<0x000F000Fu>(w >> 12, magic8), SIXTEEN, SUB_HI16);
#elif FMT == 1
  // bit i of hb goes to bit 4 of pair i's low half, bit i + 4 to bit 4 of its high half (bits 4 and 20)
  const u32 s = hb * 0x1001u;  // hb | hb << 12
#if FOLD
  p[0] = and_or<0x00100010u>(s << 4, and_or<0x000F000Fu>(w, magic));
  p[1] = and_or<0x00100010u>(s << 3, and_or<0x000F000Fu>(w >> 4, magic));
  p[2] = and_or<0x00100010u>(s << 2, and_or<0x000F000Fu>(w >> 8, magic));
  p[3] = and_or<0x00100010u>(s << 1, and_or<0x000F000Fu>(w >> 12, magic));
#else
  p[0] = fma2(and_or<0x00100010u>(s << 4, and_or<0x000F000Fu>(w, magic)), ONE2, SUB_Q5);
  p[1] = fma2(and_or<0x00100010u>(s << 3, and_or<0x000F000Fu>(w >> 4, magic)), ONE2, SUB_Q5);
  p[2] = fma2(and_or<0x00100010u>(s << 2, and_or<0x000F000Fu>(w >> 8, magic)), ONE2, SUB_Q5);
  p[3] = fma2(and_or<0x00100010u>(s << 1, and_or<0x000F000Fu>(w >> 12, magic)), ONE2, SUB_Q5);
#endif
#elif FOLD
  p[0] = and_or<0x000F000Fu>(w, magic);
  p[1] = and_or<0x000F000Fu>(w >> 4, magic);
  p[2] = and_or<0x000F000Fu>(w >> 8, magic);
  p[3] = and_or<0x000F000Fu>(w >> 12, magic);
#else
  p[0] = fma2(and_or<0x000F000Fu>(w, magic), ONE2, SUB_Q4);
  p[1] = fma2(and_or<0x000F000Fu>(w >> 4, magic), ONE2, SUB_Q4);
  p[2] = fma2(and_or<0x000F000Fu>(w >> 8, magic), ONE2, SUB_Q4);
  p[3] = fma2(and_or<0x000F000Fu>(w >> 12, magic), ONE2, SUB_Q4);
#endif
}

#define GROUP (FMT == 0 ? 32 : 64)        // codes per group (FMT 3: 64 weights a step, no scale)
#define XPL (FMT == 0 ? 8 : 16)           // x values per lane and step (2 words of codes)
#define CB (FMT == 3 ? 128 : 32)          // code bytes of one row in one group
#define LB (CB / 4)                       // ... of which one lane loads (4 lanes a row)
// how far a lane's pointers move from one group to the next: along the row, or past a tile's 16 rows (TILED)
#define CSTEP (TILED ? 16 * CB : CB)
#define SSTEP (TILED ? 16 : 1)
#define HSTEP (TILED ? 16 * 8 : 8)

// The code bytes one lane loads for one row and step: 8 (q formats: two 32-bit words) or 32 (FMT 3: 16 weights)
#if FMT == 3
struct CodeT {
  uint4 a, b;
};
__device__ __forceinline__ CodeT load_codes(const u8* p) {
  return {__ldg(reinterpret_cast<const uint4*>(p)), __ldg(reinterpret_cast<const uint4*>(p) + 1)};
}
#else
typedef uint2 CodeT;
__device__ __forceinline__ CodeT load_codes(const u8* p) { return __ldg(reinterpret_cast<const uint2*>(p)); }
#endif

// The lane's pointers at its current group (all loads of a step are at constant offsets from them).
struct Lane {
  const u8 *cp0, *cp1;    // the lane's 8 code bytes of rows g and g + 8 (32 code bytes a group)
  const u16 *sp0, *sp1;   // the two rows' scales
  const u8 *hp0, *hp1;    // q5: the high-bit bytes of the lane's two words
  const u16* xp;          // x[t, k] where the lane's codes start
  int xo[NCOL];           // column group n's row of x: elements past xp's (0 for n = 0)
};

// one x element (the element-wise path); with PDL as XL1 says
__device__ __forceinline__ u32 ldx(const u16* p) {
#if PDL && XL1
  return __ldca(p);
#elif PDL
  return __ldcg(p);
#else
  return __ldg(p);
#endif
}

// PDL: wait for the kernel before this one to finish and its writes to be visible (x is its output); a second
// wait returns at once
__device__ __forceinline__ void grid_wait() {
#if PDL
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

#if TILED == 2 && FMT == 3
#error "TILED 2 is for the q formats"
#endif
// Step u's code words of rows g and g + 8, their scales and (q5) high-bit pairs
__device__ __forceinline__ void load_step(const Lane& L, int u, CodeT& w0, CodeT& w1, u32& s0, u32& s1, u32& h0,
                                          u32& h1) {
#if TILED == 2
  const uint4 v = __ldg(reinterpret_cast<const uint4*>(L.cp0 + CSTEP * NW * u));
  w0 = make_uint2(v.x, v.y);
  w1 = make_uint2(v.z, v.w);
  const u32 s = __ldg(reinterpret_cast<const u32*>(L.sp0 + SSTEP * NW * u));
  s0 = s & 0xFFFFu;
  s1 = s >> 16;
#if FMT == 1
  const u32 h = __ldg(reinterpret_cast<const u32*>(L.hp0 + HSTEP * NW * u));
  h0 = h & 0xFFFFu;
  h1 = h >> 16;
#else
  h0 = h1 = 0;
#endif
#else
  w0 = load_codes(L.cp0 + CSTEP * NW * u);
  w1 = load_codes(L.cp1 + CSTEP * NW * u);
#if FMT == 3
  s0 = s1 = 0;
#else
  s0 = __ldg(L.sp0 + SSTEP * NW * u);
  s1 = __ldg(L.sp1 + SSTEP * NW * u);
#endif
#if FMT == 1
  h0 = __ldg(reinterpret_cast<const u16*>(L.hp0 + HSTEP * NW * u));
  h1 = __ldg(reinterpret_cast<const u16*>(L.hp1 + HSTEP * NW * u));
#else
  h0 = h1 = 0;
#endif
#endif
}

// x[t, k] for step u (group gi + u NW) as XPL / 2 packed pairs (0 past K on the element-wise path)
// (`off`: elements from row min(g, T - 1) of x to the row this column group's lane reads)
__device__ __forceinline__ void load_x(const Lane& L, const u16* __restrict__ xrow, int gi, int u, int K, int c,
                                       u32* xv, int off = 0) {
#if EVEN
  const uint4* p = reinterpret_cast<const uint4*>(L.xp + off + GROUP * NW * u);
#pragma unroll
  for (int i = 0; i < XPL / 8; ++i) {
#if PDL && XL1
    const uint4 v = __ldca(p + i);  // written by the kernel before, which may still have been running at launch
#elif PDL
    const uint4 v = __ldcg(p + i);
#else
    const uint4 v = __ldg(p + i);
#endif
    xv[4 * i] = v.x; xv[4 * i + 1] = v.y; xv[4 * i + 2] = v.z; xv[4 * i + 3] = v.w;
  }
#else
  const int k0 = (gi + u * NW) * GROUP + XPL * c;
#pragma unroll
  for (int i = 0; i < XPL / 2; ++i) {
    const u32 lo = k0 + 2 * i < K ? ldx(xrow + off + k0 + 2 * i) : 0;
    const u32 hi = k0 + 2 * i + 1 < K ? ldx(xrow + off + k0 + 2 * i + 1) : 0;
    xv[i] = lo | (hi << 16);
  }
#endif
}

// One step's arithmetic: step_math turns the two rows' code words (w0, w1), high-bit bytes and scales into the MMA's
// A fragments and multiplies them by x's pairs (one column group of 8 tokens) into acc's 4 sums. With NCOL > 1
// make_frags makes the fragments once a step and col_math does one column group's part: the same operations in the
// same order for each column group.
#if FMT == 3
// FMT 3, dense 16-bit weights: the lane's 16 consecutive weights of each row are 8 pairs (k, k + 1), x's 8 pairs
// the same k: MMA j takes pairs 2j and 2j + 1 of both rows and of x, no conversion and no scale
struct Frags {
  u32 r0[8], r1[8];
};
__device__ __forceinline__ Frags make_frags(CodeT w0, CodeT w1, u32, u32, u32, u32, u32) {
  return {{w0.a.x, w0.a.y, w0.a.z, w0.a.w, w0.b.x, w0.b.y, w0.b.z, w0.b.w},
          {w1.a.x, w1.a.y, w1.a.z, w1.a.w, w1.b.x, w1.b.y, w1.b.z, w1.b.w}};
}
__device__ __forceinline__ void col_math(const Frags& F, const u32* xv, float* acc) {
#pragma unroll
  for (int j = 0; j < 4; ++j)
    mma(acc, F.r0[2 * j], F.r1[2 * j], F.r0[2 * j + 1], F.r1[2 * j + 1], xv[2 * j], xv[2 * j + 1]);
}
__device__ __forceinline__ void step_math(CodeT w0, CodeT w1, u32, u32, const u32* xv, u32, u32, u32, float* acc) {
  col_math(make_frags(w0, w1, 0, 0, 0, 0, 0), xv, acc);
}
#else
// word wd's two MMAs: its A pairs of row g (pa) and row g + 8 (pb) times x's pairs of the same k -> d
__device__ __forceinline__ void word_math(const u32* pa, const u32* pb, const u32* xv, int wd, float* d) {
#if FMT == 0
  // word wd holds k = 4 wd .. 4 wd + 3 of the lane's 8: x pairs (x0, x2) and (x1, x3)
  const u32 xa = xv[2 * wd], xb = xv[2 * wd + 1];
#if TILED == 2  // the word's codes are stored k0, k2, k1, k3: x's own pairs
  const u32 x02 = xa, x13 = xb;
#else
  const u32 x02 = prmt(xa, xb, 0x5410), x13 = prmt(xa, xb, 0x7632);
#endif
  mma(d, pa[0], pb[0], pa[1], pb[1], x02, x02);
  mma(d, pa[2], pb[2], pa[3], pb[3], x13, x13);
#else
  // word wd holds k = 8 wd .. 8 wd + 7 of the lane's 16: x pairs (x0, x4), (x1, x5), (x2, x6), (x3, x7)
  const u32* xw = xv + 4 * wd;
#if TILED == 2  // the word's nibbles are stored k0, k2, k4, k6 | k1, k3, k5, k7: pair i is x's own pair i
  const u32 b0 = xw[0], b1 = xw[1], b2 = xw[2], b3 = xw[3];
#else
  const u32 b0 = prmt(xw[0], xw[2], 0x5410), b1 = prmt(xw[0], xw[2], 0x7632);
  const u32 b2 = prmt(xw[1], xw[3], 0x5410), b3 = prmt(xw[1], xw[3], 0x7632);
#endif
  mma(d, pa[0], pb[0], pa[1], pb[1], b0, b1);
  mma(d, pa[2], pb[2], pa[3], pb[3], b2, b3);
#if FOLD
  // the codes went in as BASE + u: every row takes (BASE + zero) * sum(x) back off, BASE + zero (136 / 144,
  // 1032 / 1040 in fp16) being exact, in the same fp32 sums
  mma(d, ZSUB, ZSUB, ZSUB, ZSUB, b0, b1);
  mma(d, ZSUB, ZSUB, ZSUB, ZSUB, b2, b3);
#endif
#endif
}

// the step's sums d times the two rows' group scales, into acc
__device__ __forceinline__ void scale_add(const float* d, float sa, float sb, float* acc) {
  acc[0] += sa * d[0];
  acc[1] += sa * d[1];
  acc[2] += sb * d[2];
  acc[3] += sb * d[3];
}

// One step, one column group: each word's pairs made just before its MMAs (not make_frags + col_math, which makes
// all pairs first: that reorders the one-group kernel's instructions, which keeps the PTX it had before NCOL)
__device__ __forceinline__ void step_math(uint2 w0, uint2 w1, u32 h0, u32 h1, const u32* xv, u32 s0, u32 s1,
                                          u32 magic, float* acc) {
  float d[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int wd = 0; wd < 2; ++wd) {
    u32 pa[4], pb[4];
    word_pairs(wd ? w0.y : w0.x, (h0 >> (8 * wd)) & 0xFFu, magic, pa);
    word_pairs(wd ? w1.y : w1.x, (h1 >> (8 * wd)) & 0xFFu, magic, pb);
    word_math(pa, pb, xv, wd, d);
  }
  scale_add(d, half_to_float((u16)s0), half_to_float((u16)s1), acc);
}

// NCOL > 1: one step's A fragments, made once for all column groups, and one column group's part of the step
struct Frags {
  u32 pa[2][4], pb[2][4];  // word wd's four A pairs of row g (pa) and row g + 8 (pb)
  float sa, sb;            // the two rows' group scales
};
__device__ __forceinline__ Frags make_frags(uint2 w0, uint2 w1, u32 h0, u32 h1, u32 s0, u32 s1, u32 magic) {
  Frags F;
#pragma unroll
  for (int wd = 0; wd < 2; ++wd) {
    word_pairs(wd ? w0.y : w0.x, (h0 >> (8 * wd)) & 0xFFu, magic, F.pa[wd]);
    word_pairs(wd ? w1.y : w1.x, (h1 >> (8 * wd)) & 0xFFu, magic, F.pb[wd]);
  }
  F.sa = half_to_float((u16)s0);
  F.sb = half_to_float((u16)s1);
  return F;
}
__device__ __forceinline__ void col_math(const Frags& F, const u32* xv, float* acc) {
  float d[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int wd = 0; wd < 2; ++wd) word_math(F.pa[wd], F.pb[wd], xv, wd, d);
  scale_add(d, F.sa, F.sb, acc);
}
#endif

// PIECES > 1: where a warp's walk is - steps left in its current piece, the piece, steps a piece (groups_per_split /
// NW) - and its finished pieces' sums, in registers (0 for pieces it has not reached); piece_turn, before each step's
// arithmetic, keeps a finished piece's sums and starts the next from 0, as the next piece's block would
struct PieceWalk {
  int left, piece, per;
#if PIECES > 1
  float part[PIECES][4];
#endif
};
__device__ __forceinline__ void piece_keep(PieceWalk& P, const float* acc) {
#if PIECES > 1
#pragma unroll
  for (int q = 0; q < PIECES; ++q) {  // (a register array: the piece by selection, not by index)
    if (q == P.piece) {
      P.part[q][0] = acc[0]; P.part[q][1] = acc[1]; P.part[q][2] = acc[2]; P.part[q][3] = acc[3];
    }
  }
#endif
}
__device__ __forceinline__ void piece_turn(PieceWalk& P, float* acc) {
#if PIECES > 1
  if (P.left == 0) {
    piece_keep(P, acc);
    acc[0] = acc[1] = acc[2] = acc[3] = 0.f;
    ++P.piece;
    P.left = P.per;
  }
  --P.left;
#endif
}

// U steps (groups gi, gi + NW, ..., all < NG): every code load issued first, then the arithmetic; acc += the sums.
// x is loaded with the codes (XLATE 0), or one step ahead of the arithmetic (XLATE 1: x comes from L1 / L2, and the
// registers it would hold for U steps carry more code bytes in flight instead). FEW (NCOL 1, XLATE 0): only the
// steps whose group is below g_hi, all of a warp that has fewer than U (with WAIT: every code load before the wait,
// so a short walk keeps one round trip to memory after it instead of one a step).
template <int U, bool WAIT = false, bool FEW = false>
__device__ __forceinline__ void steps(const Lane& L, const u16* __restrict__ xrow, int gi, int K, int c, u32 magic,
                                      float* acc, PieceWalk& P, int g_hi = 0) {
  static_assert(!FEW || (NCOL == 1 && !XLATE), "FEW steps are one column group's, x loaded with the codes");
  CodeT w0[U], w1[U];
  u32 s0[U], s1[U], h0[U], h1[U];
#pragma unroll
  for (int u = 0; u < U; ++u) {
    if (!FEW || gi + u * NW < g_hi) load_step(L, u, w0[u], w1[u], s0[u], s1[u], h0[u], h1[u]);
  }
  if (WAIT) grid_wait();  // the code loads above are in flight; x comes from the kernel before
#if NCOL > 1
  // every column group's x for one step at a time (U steps of all groups would not fit in registers)
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const Frags F = make_frags(w0[u], w1[u], h0[u], h1[u], s0[u], s1[u], magic);
#pragma unroll
    for (int n = 0; n < NCOL; ++n) {
      u32 xv[XPL / 2];
      load_x(L, xrow, gi, u, K, c, xv, L.xo[n]);
      col_math(F, xv, acc + 4 * n);
    }
  }
#elif XLATE
  u32 xv[2][XPL / 2];
  load_x(L, xrow, gi, 0, K, c, xv[0]);
#pragma unroll
  for (int u = 0; u < U; ++u) {
    if (u + 1 < U) load_x(L, xrow, gi, u + 1, K, c, xv[(u + 1) & 1]);
    step_math(w0[u], w1[u], h0[u], h1[u], xv[u & 1], s0[u], s1[u], magic, acc);
  }
#else
  u32 xv[U][XPL / 2];
#pragma unroll
  for (int u = 0; u < U; ++u) {
    if (!FEW || gi + u * NW < g_hi) load_x(L, xrow, gi, u, K, c, xv[u]);
  }
#pragma unroll
  for (int u = 0; u < U; ++u) {
    if (!FEW || gi + u * NW < g_hi) {
      piece_turn(P, acc);
      step_math(w0[u], w1[u], h0[u], h1[u], xv[u], s0[u], s1[u], magic, acc);
    }
  }
#endif
}

#if TPW > 1 || ASYNC
// Step u's column groups for the block's TPW tiles: each group's x (L: the first tile's lane, one load for all tiles)
// times every tile's fragments F, into tile i's sums at acc + 4 NCOL i
__device__ __forceinline__ void tiles_cols(const Lane& L, const u16* __restrict__ xrow, int gi, int u, int K, int c,
                                           const Frags* F, float* acc) {
#pragma unroll
  for (int n = 0; n < NCOL; ++n) {
    u32 xv[XPL / 2];
    load_x(L, xrow, gi, u, K, c, xv, L.xo[n]);
#pragma unroll
    for (int i = 0; i < TPW; ++i) col_math(F[i], xv, acc + 4 * (NCOL * i + n));
  }
}
#endif

#if TPW > 1
// U steps of TPW tiles (lane pointers Ls[i], x through Ls[0]): every tile's code loads issued first, then per step
// each tile's fragments and, per column group, one load of x for all of them; tile i's sums go to acc + 4 NCOL i
template <int U, bool WAIT = false>
__device__ __forceinline__ void steps_tiles(const Lane* Ls, const u16* __restrict__ xrow, int gi, int K, int c,
                                            u32 magic, float* acc) {
  CodeT w0[TPW][U], w1[TPW][U];
  u32 s0[TPW][U], s1[TPW][U], h0[TPW][U], h1[TPW][U];
#pragma unroll
  for (int i = 0; i < TPW; ++i) {
#pragma unroll
    for (int u = 0; u < U; ++u) load_step(Ls[i], u, w0[i][u], w1[i][u], s0[i][u], s1[i][u], h0[i][u], h1[i][u]);
  }
  if (WAIT) grid_wait();
#pragma unroll
  for (int u = 0; u < U; ++u) {
    Frags F[TPW];
#pragma unroll
    for (int i = 0; i < TPW; ++i) F[i] = make_frags(w0[i][u], w1[i][u], h0[i][u], h1[i][u], s0[i][u], s1[i][u], magic);
    tiles_cols(Ls[0], xrow, gi, u, K, c, F, acc);
  }
}
#endif

// PIPE: one batch of U steps in registers; steps past the warp's last group (g_hi) are neither loaded nor summed
// (the conditions are the same for the whole warp)
template <int U>
struct Batch {
  CodeT w0[U], w1[U];
  u32 s0[U], s1[U], h0[U], h1[U];
  u32 xv[U][XPL / 2];
};

template <int U>
__device__ __forceinline__ void load_batch(Batch<U>& B, const Lane& L, const u16* __restrict__ xrow, int gi, int g_hi,
                                           int K, int c) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
    if (gi + u * NW < g_hi) {
      load_step(L, u, B.w0[u], B.w1[u], B.s0[u], B.s1[u], B.h0[u], B.h1[u]);
      load_x(L, xrow, gi, u, K, c, B.xv[u]);
    }
  }
}

template <int U>
__device__ __forceinline__ void math_batch(const Batch<U>& B, int gi, int g_hi, u32 magic, float* acc) {
#pragma unroll
  for (int u = 0; u < U; ++u)
    if (gi + u * NW < g_hi) step_math(B.w0[u], B.w1[u], B.h0[u], B.h1[u], B.xv[u], B.s0[u], B.s1[u], magic, acc);
}

__device__ __forceinline__ void advance(Lane& L, int groups) {
  L.cp0 += CSTEP * groups; L.cp1 += CSTEP * groups;
  L.sp0 += SSTEP * groups; L.sp1 += SSTEP * groups;
#if FMT == 1
  L.hp0 += HSTEP * groups; L.hp1 += HSTEP * groups;
#endif
  L.xp += GROUP * groups;
}

// Lane (g, c)'s pointers at tile `tile`, group gi (its first), and x's rows
__device__ __forceinline__ Lane make_lane(const u16* __restrict__ x, const u8* __restrict__ codes,
                                          const u8* __restrict__ high, const u16* __restrict__ scales, int T, int N,
                                          int NG, long long stride_x, long long stride_c, long long stride_h,
                                          long long stride_s, int tile, int gi, int g, int c) {
  const int r0 = min(tile * 16 + g, N - 1), r1 = min(tile * 16 + g + 8, N - 1);  // clamped: loads stay in bounds
  // lanes of tokens t >= T read row T - 1 of x: their MMA columns are never stored, and no zeroing is needed
  const u16* xrow = x + min(g, T - 1) * stride_x;
  Lane L;
#if TILED == 2  // rows past N are zero padding of the last tile: no clamping; cp1, sp1, hp1 unused
  const long long chunk = (long long)tile * NG + gi;
  L.cp0 = L.cp1 = codes + chunk * 16 * CB + (g * 4 + c) * 2 * LB;
  L.sp0 = L.sp1 = scales + chunk * 16 + 2 * g;
#if FMT == 1
  L.hp0 = L.hp1 = high + chunk * 16 * 8 + (g * 4 + c) * 4;
#endif
#elif TILED  // rows past N are zero padding of the last tile: no clamping
  const long long chunk = (long long)tile * NG + gi;  // (tile, group): 16 rows in a row
  L.cp0 = codes + (chunk * 16 + g) * CB + LB * c;
  L.cp1 = L.cp0 + 8 * CB;
  L.sp0 = scales + chunk * 16 + g;
  L.sp1 = L.sp0 + 8;
#if FMT == 1
  L.hp0 = high + (chunk * 16 + g) * 8 + 2 * c;
  L.hp1 = L.hp0 + 64;
#endif
#else
  L.cp0 = codes + r0 * stride_c + CB * gi + LB * c;
  L.cp1 = codes + r1 * stride_c + CB * gi + LB * c;
  L.sp0 = scales + r0 * stride_s + gi;
  L.sp1 = scales + r1 * stride_s + gi;
#if FMT == 1
  L.hp0 = high + r0 * stride_h + 8 * gi + 2 * c;
  L.hp1 = high + r1 * stride_h + 8 * gi + 2 * c;
#endif
#endif
  L.xp = xrow + GROUP * gi + XPL * c;
#pragma unroll
  for (int n = 0; n < NCOL; ++n) L.xo[n] = (min(8 * n + g, T - 1) - min(g, T - 1)) * (int)stride_x;
  return L;
}

// The warp's share of tile `tile`'s groups g_lo .. g_hi - 1 (groups g_lo + warp, + NW, ...): acc += its sums.
__device__ __forceinline__ void tile_sums(const u16* __restrict__ x, const u8* __restrict__ codes,
                                          const u8* __restrict__ high, const u16* __restrict__ scales, int T, int N,
                                          int K, int NG, long long stride_x, long long stride_c, long long stride_h,
                                          long long stride_s, int tile, int g_lo, int g_hi, float* acc,
                                          PieceWalk& P) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, c = lane & 3;
  int gi = g_lo + warp;  // this warp's first group; then every NW-th
  const u16* xrow = x + min(g, T - 1) * stride_x;
  Lane L = make_lane(x, codes, high, scales, T, N, NG, stride_x, stride_c, stride_h, stride_s, tile, gi, g, c);
  u32 magic;
  asm volatile("mov.b32 %0, %1;" : "=r"(magic) : "n"(MAGIC));  // kept in a register (see and_or)
#if PIPE
  grid_wait();
  // two batches in registers: batch b + 1's loads are in flight while batch b is multiplied; the last batch may
  // be partial (predicated), so no step waits on its own loads alone
  Batch<UNROLL> A, B;
  if (gi < g_hi) load_batch<UNROLL>(A, L, xrow, gi, g_hi, K, c);
  while (gi < g_hi) {
    advance(L, NW * UNROLL);
    const int gb = gi + NW * UNROLL;
    if (gb < g_hi) load_batch<UNROLL>(B, L, xrow, gb, g_hi, K, c);
    math_batch<UNROLL>(A, gi, g_hi, magic, acc);
    if (gb >= g_hi) break;
    advance(L, NW * UNROLL);
    gi = gb + NW * UNROLL;
    if (gi < g_hi) load_batch<UNROLL>(A, L, xrow, gi, g_hi, K, c);
    math_batch<UNROLL>(B, gb, g_hi, magic, acc);
  }
#else
#if PDL
  // the first batch's code loads go out before the wait (while the kernel before finishes), the rest after it; a
  // warp of fewer steps than a batch issues all of them before it (steps' FEW)
  if (gi + (UNROLL - 1) * NW < g_hi) {
    steps<UNROLL, true>(L, xrow, gi, K, c, magic, acc, P);
    advance(L, NW * UNROLL);
    gi += NW * UNROLL;
  } else if (gi < g_hi) {
#if NCOL == 1 && !XLATE
    steps<UNROLL, true, true>(L, xrow, gi, K, c, magic, acc, P, g_hi);  // all of them: nothing is left
    gi = g_hi;
#else
    steps<1, true>(L, xrow, gi, K, c, magic, acc, P);
    advance(L, NW);
    gi += NW;
#endif
  }
#endif
  for (; gi + (UNROLL - 1) * NW < g_hi; gi += NW * UNROLL) {
    steps<UNROLL>(L, xrow, gi, K, c, magic, acc, P);
    advance(L, NW * UNROLL);
  }
#if TAIL
  if (gi < g_hi) {
    Batch<UNROLL> B;
    load_batch<UNROLL>(B, L, xrow, gi, g_hi, K, c);
    math_batch<UNROLL>(B, gi, g_hi, magic, acc);
  }
#else
  for (; gi < g_hi; gi += NW) {
    steps<1>(L, xrow, gi, K, c, magic, acc, P);
    advance(L, NW);
  }
#endif
#endif
}

#if TPW > 1 || ASYNC
// The parameters of a block's sums over its TPW tiles tile0 .. (tiles_sums, and ring_sums through a cp.async ring)
#define TILES_SUMS_PARAMS                                                                                           \
  const u16 *__restrict__ x, const u8 *__restrict__ codes, const u8 *__restrict__ high,                            \
      const u16 *__restrict__ scales, int T, int N, int K, int NG, long long stride_x, long long stride_c,         \
      long long stride_h, long long stride_s, int tile0, int tiles, int g_lo, int g_hi, float *acc
// Lane (g, c)'s pointers for each of the block's TPW tiles tile0 .. tile0 + TPW - 1 (past the last tile: the last
// one's bytes, never stored) at group gi; returns MAGIC held in a register (see and_or)
__device__ __forceinline__ u32 tile_lanes(Lane* Ls, const u16* __restrict__ x, const u8* __restrict__ codes,
                                          const u8* __restrict__ high, const u16* __restrict__ scales, int T, int N,
                                          int NG, long long stride_x, long long stride_c, long long stride_h,
                                          long long stride_s, int tile0, int tiles, int gi, int g, int c) {
#pragma unroll
  for (int i = 0; i < TPW; ++i)
    Ls[i] = make_lane(x, codes, high, scales, T, N, NG, stride_x, stride_c, stride_h, stride_s,
                      min(tile0 + i, tiles - 1), gi, g, c);
  u32 magic;
  asm volatile("mov.b32 %0, %1;" : "=r"(magic) : "n"(MAGIC));
  return magic;
}
#endif

#if TPW > 1
// tile_sums for the block's TPW tiles tile0 .. tile0 + TPW - 1 (past the last tile: the last one's bytes, never
// stored): the same groups in the same order for each, x loaded once a step and column group for all
__device__ __forceinline__ void tiles_sums(TILES_SUMS_PARAMS) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, c = lane & 3;
  int gi = g_lo + warp;
  const u16* xrow = x + min(g, T - 1) * stride_x;
  Lane Ls[TPW];
  const u32 magic = tile_lanes(Ls, x, codes, high, scales, T, N, NG, stride_x, stride_c, stride_h, stride_s, tile0,
                               tiles, gi, g, c);
#if PDL
  if (gi + (UNROLL - 1) * NW < g_hi) {
    steps_tiles<UNROLL, true>(Ls, xrow, gi, K, c, magic, acc);
#pragma unroll
    for (int i = 0; i < TPW; ++i) advance(Ls[i], NW * UNROLL);
    gi += NW * UNROLL;
  } else if (gi < g_hi) {
    steps_tiles<1, true>(Ls, xrow, gi, K, c, magic, acc);
#pragma unroll
    for (int i = 0; i < TPW; ++i) advance(Ls[i], NW);
    gi += NW;
  }
#endif
  for (; gi + (UNROLL - 1) * NW < g_hi; gi += NW * UNROLL) {
    steps_tiles<UNROLL>(Ls, xrow, gi, K, c, magic, acc);
#pragma unroll
    for (int i = 0; i < TPW; ++i) advance(Ls[i], NW * UNROLL);
  }
  for (; gi < g_hi; gi += NW) {
    steps_tiles<1>(Ls, xrow, gi, K, c, magic, acc);
#pragma unroll
    for (int i = 0; i < TPW; ++i) advance(Ls[i], NW);
  }
}
#endif

// a shared-memory address as cp.async and mapa take it
__device__ __forceinline__ u32 smem_addr(const void* p) {
  u32 a;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
  return a;
}

#if ASYNC
__device__ __forceinline__ void cp_async16(u32 dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async4(u32 dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// The ring in dynamic shared memory (qmv_cuda.async_shared_bytes): code pieces uint4 [NW][ASYNC][TPW][32], then
// scale pairs u32 [NW][ASYNC][TPW][32], then (q5) high-bit pairs u32 alike
extern __shared__ uint4 qmv_ring[];
#define RING_SLOTS (NW * ASYNC * TPW * 32)

// Step j of the warp (group gi0 + NW j) of tile i: its pieces into stage j % ASYNC (one commit group a step, empty
// past the warp's last step, so that a wait for "all but ASYNC - 1 groups" always means step j's)
__device__ __forceinline__ void ring_issue(const Lane* Ls, int j, int steps, int warp, int lane) {
  if (j < steps) {
    const int s = j % ASYNC;
#pragma unroll
    for (int i = 0; i < TPW; ++i) {
      const int slot = ((warp * ASYNC + s) * TPW + i) * 32 + lane;
      cp_async16(smem_addr(qmv_ring + slot), Ls[i].cp0 + CSTEP * NW * j);
      cp_async4(smem_addr(reinterpret_cast<u32*>(qmv_ring + RING_SLOTS) + slot), Ls[i].sp0 + SSTEP * NW * j);
#if FMT == 1
      cp_async4(smem_addr(reinterpret_cast<u32*>(qmv_ring + RING_SLOTS) + RING_SLOTS + slot),
                Ls[i].hp0 + HSTEP * NW * j);
#endif
    }
  }
  cp_commit();
}

// tiles_sums with the ring: the warp's steps j = 0, 1, ... (groups gi0 + NW j < g_hi) of tiles tile0 .. tile0 + TPW - 1
// (TPW 1: one tile), the copies ASYNC - 1 steps ahead; per step the same fragments, x loads, MMAs and sums in the same
// order as steps / steps_tiles
__device__ __forceinline__ void ring_sums(TILES_SUMS_PARAMS) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, c = lane & 3;
  const int gi0 = g_lo + warp;
  const int steps = gi0 < g_hi ? (g_hi - gi0 + NW - 1) / NW : 0;
  const u16* xrow = x + min(g, T - 1) * stride_x;
  Lane Ls[TPW];
  const u32 magic = tile_lanes(Ls, x, codes, high, scales, T, N, NG, stride_x, stride_c, stride_h, stride_s, tile0,
                               tiles, gi0, g, c);
#pragma unroll
  for (int j = 0; j < ASYNC - 1; ++j) ring_issue(Ls, j, steps, warp, lane);
  grid_wait();  // the first steps' weights are in flight; x comes from the kernel before
  const u32* ring_s = reinterpret_cast<const u32*>(qmv_ring + RING_SLOTS);
  for (int j = 0; j < steps; ++j) {
    ring_issue(Ls, j + ASYNC - 1, steps, warp, lane);  // into the stage step j - 1 used (read into registers)
    cp_wait<ASYNC - 1>();                                // this lane's copies of step j have landed
    const int s = j % ASYNC;
    Frags F[TPW];
#pragma unroll
    for (int i = 0; i < TPW; ++i) {
      const int slot = ((warp * ASYNC + s) * TPW + i) * 32 + lane;
      const uint4 v = qmv_ring[slot];
      const u32 sc = ring_s[slot];
#if FMT == 1
      const u32 h = ring_s[RING_SLOTS + slot];
#else
      const u32 h = 0;
#endif
      F[i] = make_frags(make_uint2(v.x, v.y), make_uint2(v.z, v.w), h & 0xFFFFu, h >> 16, sc & 0xFFFFu, sc >> 16,
                        magic);
    }
    tiles_cols(Ls[0], xrow, gi0, j, K, c, F, acc);
  }
  cp_wait<0>();  // (only empty groups remain: nothing still writes to the ring when the block moves on)
}
#endif

// One warp's finished sums of tile `tile` (acc: its NCOL column groups, rows g and g + 8) to the output; a tile whose
// groups `pieces` blocks share (split-K) goes through the workspace, piece `piece` in slice `piece`, and the last of
// its blocks to arrive adds the slices up in piece order (a fixed order: the result does not depend on which block
// finishes first) and leaves the counter at zero for the next launch (no memset in a CUDA graph).
__device__ __forceinline__ void tile_out(float* acc, int tile, int piece, int pieces, out_t* __restrict__ out,
                                         float* __restrict__ ws, int* __restrict__ counters, int T, int N,
                                         long long stride_o) {
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2, c = lane & 3;
  const int row[2] = {tile * 16 + g, tile * 16 + g + 8};
  if (pieces == 1) {
#pragma unroll
    for (int m = 0; m < NCOL; ++m) {  // column group m: tokens 8 m + 2 c and 8 m + 2 c + 1
      const float* a = acc + 4 * m;
      const int tt[2] = {8 * m + 2 * c, 8 * m + 2 * c + 1};
#if ACT
      // gate and up rounded as the projection would store them, then silu(g) * u in fp32 as fused.silu_mul takes
      // it (not to the bit: expf here, Triton's exp there)
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const float gate = out_to_float(float_to_out(a[i])), up = out_to_float(float_to_out(a[2 + i]));
        if (row[1] < N && tt[i] < T)
          out[tt[i] * stride_o + tile * 8 + g] = float_to_out(gate / (1.f + expf(-gate)) * up);
      }
#else
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int n = row[i >> 1], t = tt[i & 1];
        if (n < N && t < T) out[t * stride_o + n] = store_value(a[i]);
      }
#endif
    }
  } else {
#pragma unroll
    for (int m = 0; m < NCOL; ++m) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int n = row[i >> 1], t = 8 * m + 2 * c + (i & 1);
        if (n < N && t < T) ws[((long long)piece * T + t) * N + n] = acc[4 * m + i];
      }
    }
    __threadfence();
    __syncwarp();
    int last = 0;
    if (lane == 0) last = atomicAdd(counters + tile, 1) == pieces - 1;
    last = __shfl_sync(0xFFFFFFFFu, last, 0);
    if (last) {
      __threadfence();
#pragma unroll
      for (int m = 0; m < NCOL; ++m) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int n = row[i >> 1], t = 8 * m + 2 * c + (i & 1);
          if (n < N && t < T) {
            float sum = 0.f;
            for (int y = 0; y < pieces; ++y) sum += __ldcg(ws + ((long long)y * T + t) * N + n);
            out[t * stride_o + n] = store_value(sum);
          }
        }
      }
      if (lane == 0) counters[tile] = 0;
    }
  }
}

#if CLUSTER
// every thread of every block of the cluster: arrive (the block's shared writes released), then wait (the others'
// acquired)
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release;\n\tbarrier.cluster.wait.acquire;" ::: "memory");
}

// a float4 at this block's shared address `p` in the shared memory of the cluster's block `rank`
__device__ __forceinline__ float4 cluster_load(const float4* p, u32 rank) {
  u32 remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(smem_addr(p)), "r"(rank));
  float4 v;
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(remote) : "memory");
  return v;
}
#endif

// The block's sums of tile `tile` (acc, one share a warp) to the output: added up over the warps in shared memory
// (warp 0's share, then warp 1's, ...), then tile_out. Every thread of the block calls it, once: the block ends after
// it. CLUSTER with pieces > 1: each block leaves its sums in its shared memory (red[0]), and the cluster's block 0
// (piece 0; the cluster's blocks are the tile's pieces in order, rank = piece) adds them up from 0 in piece order, as
// tile_out adds the workspace's slices, and stores them.
__device__ __forceinline__ void tile_store(float* acc, int tile, int piece, int pieces, out_t* __restrict__ out,
                                           float* __restrict__ ws, int* __restrict__ counters, int T, int N,
                                           long long stride_o) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  grid_wait();  // a warp without groups still writes the output below: only after the kernel before is done
  __shared__ float4 red[NW][NCOL][32];
#pragma unroll
  for (int m = 0; m < NCOL; ++m)
    red[warp][m][lane] = make_float4(acc[4 * m], acc[4 * m + 1], acc[4 * m + 2], acc[4 * m + 3]);
  __syncthreads();
  if (warp == 0) {
#pragma unroll
    for (int w = 1; w < NW; ++w) {
#pragma unroll
      for (int m = 0; m < NCOL; ++m) {
        const float4 v = red[w][m][lane];
        acc[4 * m] += v.x; acc[4 * m + 1] += v.y; acc[4 * m + 2] += v.z; acc[4 * m + 3] += v.w;
      }
    }
#if CLUSTER
    if (pieces > 1) {
#pragma unroll
      for (int m = 0; m < NCOL; ++m)
        red[0][m][lane] = make_float4(acc[4 * m], acc[4 * m + 1], acc[4 * m + 2], acc[4 * m + 3]);
    } else
#endif
    tile_out(acc, tile, piece, pieces, out, ws, counters, T, N, stride_o);
  }
#if CLUSTER
  if (pieces > 1) {
    cluster_sync();  // every piece's sums are in its block's red[0]
    if (piece == 0 && warp == 0) {
#pragma unroll
      for (int m = 0; m < NCOL; ++m) {
        float* a = acc + 4 * m;
        a[0] = a[1] = a[2] = a[3] = 0.f;
        for (int y = 0; y < pieces; ++y) {
          const float4 v = cluster_load(&red[0][m][lane], (u32)y);
          a[0] += v.x; a[1] += v.y; a[2] += v.z; a[3] += v.w;
        }
      }
      tile_out(acc, tile, 0, 1, out, ws, counters, T, N, stride_o);  // the pieces' sum, stored as one pass's
    }
    cluster_sync();  // no block leaves (or reuses red) before block 0 has read its sums
  }
#endif
}

#if PIECES > 1
// The block's sums of tile `tile` walked in PIECES pieces (piece_turn) to the output: each warp keeps its last piece's
// sums; then, a piece at a time through 4 KB of shared memory (a one-pass launch's), warp 0 adds the piece's warps in
// order (tile_store's order) and the pieces from 0 in order (the workspace's and the cluster's), and stores the total
// as one pass's. A warp with no groups in a piece adds its 0, as a split block's warp without groups there does.
__device__ __forceinline__ void pieces_store(float* acc, PieceWalk& P, int tile, out_t* __restrict__ out, int T, int N,
                                             long long stride_o) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  grid_wait();  // (as tile_store: the output is written only after the kernel before is done)
  piece_keep(P, acc);
  __shared__ float4 red[NW][32];
  float sum[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int p = 0; p < PIECES; ++p) {
    red[warp][lane] = make_float4(P.part[p][0], P.part[p][1], P.part[p][2], P.part[p][3]);
    __syncthreads();
    if (warp == 0) {
      float v[4] = {P.part[p][0], P.part[p][1], P.part[p][2], P.part[p][3]};
#pragma unroll
      for (int w = 1; w < NW; ++w) {
        const float4 u = red[w][lane];
        v[0] += u.x; v[1] += u.y; v[2] += u.z; v[3] += u.w;
      }
      sum[0] += v[0]; sum[1] += v[1]; sum[2] += v[2]; sum[3] += v[3];
    }
    if (p + 1 < PIECES) __syncthreads();  // warp 0 has read this piece before the next is written
  }
  if (warp == 0) tile_out(sum, tile, 0, 1, out, nullptr, nullptr, T, N, stride_o);
}
#endif

// the next kernel may launch once every block of this one is running: it waits for this one to finish before it
// reads our output (the Triton kernels' first act, and qmv's grid_wait), so its launch overlaps our loads
__device__ __forceinline__ void let_next_launch() {
#if PDL
  asm volatile("griddepcontrol.launch_dependents;");
#endif
}

// Block (tile, split): one 16-row tile (TPW > 1: tiles TPW x .. TPW x + TPW - 1), split y's groups (split-K over
// grid y), for all NCOL column groups.
extern "C" __global__ void __launch_bounds__(NW * 32, MIN_BLOCKS)
qmv(const u16* __restrict__ x, const u8* __restrict__ codes, const u8* __restrict__ high,
    const u16* __restrict__ scales, out_t* __restrict__ out, float* __restrict__ ws, int* __restrict__ counters,
    int T, int N, int K, int NG, int groups_per_split, long long stride_x, long long stride_o,
    long long stride_c, long long stride_h, long long stride_s) {
  let_next_launch();
  float acc[4 * NCOL * TPW];
#pragma unroll
  for (int i = 0; i < 4 * NCOL * TPW; ++i) acc[i] = 0.f;
#if PIECES > 1
  const int g_lo = 0, g_hi = NG;  // every piece, walked in turn
#else
  const int g_lo = blockIdx.y * groups_per_split, g_hi = min(NG, g_lo + groups_per_split);
#endif
  PieceWalk P{groups_per_split / NW, 0, groups_per_split / NW};  // (part: zeros)
#if TPW > 1 || ASYNC
  const int tiles = (N + 15) / 16, tile0 = blockIdx.x * TPW;
#if ASYNC
  ring_sums(x, codes, high, scales, T, N, K, NG, stride_x, stride_c, stride_h, stride_s, tile0, tiles, g_lo, g_hi,
            acc);
#else
  tiles_sums(x, codes, high, scales, T, N, K, NG, stride_x, stride_c, stride_h, stride_s, tile0, tiles, g_lo, g_hi,
             acc);
#endif
#pragma unroll
  for (int i = 0; i < TPW; ++i) {
    if (tile0 + i < tiles)  // (the same for the whole block)
      tile_store(acc + 4 * NCOL * i, tile0 + i, blockIdx.y, gridDim.y, out, ws, counters, T, N, stride_o);
    __syncthreads();  // tile_store's shared sums are read before the next tile's are written
  }
#else
  tile_sums(x, codes, high, scales, T, N, K, NG, stride_x, stride_c, stride_h, stride_s, blockIdx.x, g_lo, g_hi,
            acc, P);
#if PIECES > 1
  pieces_store(acc, P, blockIdx.x, out, T, N, stride_o);
#else
  tile_store(acc, blockIdx.x, blockIdx.y, gridDim.y, out, ws, counters, T, N, stride_o);
#endif
#endif
}
