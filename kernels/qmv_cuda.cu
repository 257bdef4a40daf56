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
// tile_store: results are deterministic and do not depend on T or on the other rows of x).
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
#ifndef WGMMA
#define WGMMA 0   // 1 or 2 (sm_90a): warpgroups a block of the wgmma build (see "The wgmma build" below): a warp's
#endif            // tile is one quarter of wgmma.m64nNk16's A, x is its B in shared memory, the sums those of ASYNC
#ifndef MIN_BLOCKS
#define MIN_BLOCKS 2  // blocks per SM to fit: lets ptxas keep all of a step batch's loads in flight
#endif                // (it interleaves them with the arithmetic, one step at a time, when it aims at more blocks)

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

// U steps (groups gi, gi + NW, ..., all < NG): every code load issued first, then the arithmetic; acc += the sums.
// x is loaded with the codes (XLATE 0), or one step ahead of the arithmetic (XLATE 1: x comes from L1 / L2, and the
// registers it would hold for U steps carry more code bytes in flight instead).
template <int U, bool WAIT = false>
__device__ __forceinline__ void steps(const Lane& L, const u16* __restrict__ xrow, int gi, int K, int c, u32 magic,
                                      float* acc) {
  CodeT w0[U], w1[U];
  u32 s0[U], s1[U], h0[U], h1[U];
#pragma unroll
  for (int u = 0; u < U; ++u) {
    load_step(L, u, w0[u], w1[u], s0[u], s1[u], h0[u], h1[u]);
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
  for (int u = 0; u < U; ++u) load_x(L, xrow, gi, u, K, c, xv[u]);
#pragma unroll
  for (int u = 0; u < U; ++u) step_math(w0[u], w1[u], h0[u], h1[u], xv[u], s0[u], s1[u], magic, acc);
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
                                          long long stride_s, int tile, int g_lo, int g_hi, float* acc) {
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
  // the first batch's code loads go out before the wait (while the kernel before finishes), the rest after it
  if (gi + (UNROLL - 1) * NW < g_hi) {
    steps<UNROLL, true>(L, xrow, gi, K, c, magic, acc);
    advance(L, NW * UNROLL);
    gi += NW * UNROLL;
  } else if (gi < g_hi) {
    steps<1, true>(L, xrow, gi, K, c, magic, acc);
    advance(L, NW);
    gi += NW;
  }
#endif
  for (; gi + (UNROLL - 1) * NW < g_hi; gi += NW * UNROLL) {
    steps<UNROLL>(L, xrow, gi, K, c, magic, acc);
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
    steps<1>(L, xrow, gi, K, c, magic, acc);
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

#if ASYNC
__device__ __forceinline__ u32 smem_addr(const void* p) {  // a shared-memory address as cp.async takes it
  u32 a;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
  return a;
}
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
__device__ __forceinline__ void tile_out(float* acc, int tile, int piece, int pieces, u16* __restrict__ out,
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
        if (n < N && t < T) out[t * stride_o + n] = float_to_out(a[i]);
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
            out[t * stride_o + n] = float_to_out(sum);
          }
        }
      }
      if (lane == 0) counters[tile] = 0;
    }
  }
}

#if !WGMMA
// The block's sums of tile `tile` (acc, one share a warp) to the output: added up over the warps in shared memory
// (warp 0's share, then warp 1's, ...), then tile_out. Every thread of the block calls it, once: the block ends after
// it.
__device__ __forceinline__ void tile_store(float* acc, int tile, int piece, int pieces, u16* __restrict__ out,
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
    tile_out(acc, tile, piece, pieces, out, ws, counters, T, N, stride_o);
  }
}
#endif

// the next kernel may launch once every block of this one is running: it waits for this one to finish before it
// reads our output (the Triton kernels' first act, and qmv's grid_wait), so its launch overlaps our loads
__device__ __forceinline__ void let_next_launch() {
#if PDL
  asm volatile("griddepcontrol.launch_dependents;");
#endif
}

#if WGMMA
// ---- The wgmma build (sm_90a): WGMMA warpgroups a block (1 or 2) ------------------------------------------------
// Warp w of block x holds row tile 4 WGMMA x + w, and the block walks its tiles' groups as the mma.sync build's NW
// warps would, one slot after another: slot 0's groups (g_lo, g_lo + NW, ...), then slot 1's, ... (WgSteps).
// - A: each warp makes its tile's fragments as make_frags does. wgmma.m64nNk16's A registers are, warp by warp,
//   mma.m16n8k16's A fragment, so a warpgroup's four tiles are one 64-row A.
// - B: x, staged by the block in shared memory, K-major without swizzle. A group is 4 k16 steps; in step s token n's
//   row holds the 16 values of x that mma.sync's B fragments pair with A in its MMA s (wg_stage_x).
// - A step is one wgmma.m64n<8 NCOL>k16 over every token, the four chained from zero as the four mma.sync MMAs are;
//   then the group's scale step, the slots' sums in slot order and split-K exactly as the mma.sync build has them.
//   So a row's sums are a one-row launch's wherever wgmma gives an element mma.sync's bits
//   (scripts/probe_wgmma_bits.cu measures that).
// - The weights come through each lane's cp.async ring (ASYNC stages), and so does x: each lane copies its own 16-byte
//   pieces of x (the ones load_x would read) and rewrites them into B once they have landed.
// - Two B buffers (WG_DEFER 0): every warpgroup waits for its MMAs before it starts the next step, so the buffer a
//   step writes was last read two steps before, by MMAs that all finished before the block's barrier one step before.
#if TILED != 2 || !EVEN || ASYNC < 2 || TPW != 1 || FMT == 3 || WGMMA > 2
#error "WGMMA (1 or 2 warpgroups): a q format's lanes layout (TILED 2), whole groups (EVEN), a ring (ASYNC >= 2)"
#endif
#define WG_WARPS (4 * WGMMA)
#define WG_XCOLS ((NCOL + WG_WARPS - 1) / WG_WARPS)  // column groups of x a warp stages (group j: warp j % WG_WARPS)
#define WG_XP (XPL / 8)                             // 16-byte pieces of x a lane and column group (q8 1, q4 / q5 2)
#define WG_STEP_B (NCOL * 256)                      // bytes of one k16 step of B: 8 NCOL tokens x 16 values x 2
#define WG_GROUP_B (4 * WG_STEP_B)                  // one group's B
#ifndef WG_LBO
#define WG_LBO 128  // the descriptor's leading byte offset: B's two 8 x 8 core matrices along K are 128 bytes apart
#endif              // (K-major without swizzle as CUTLASS reads it); WG_LBO 256 / WG_SBO 128 swap the two fields
#ifndef WG_SBO
#define WG_SBO 256  // stride byte offset: 8-token core matrices along N, 256 bytes apart
#endif
#ifndef WG_DEFER
#define WG_DEFER 0  // 1: step j + 1's copies, B and fragments are made while step j's MMAs run (three B buffers:
#endif              // the one a step writes was last read three steps before, by MMAs every warpgroup waited for
                    // before the barrier two steps before); 0: each step waits for its MMAs first (two buffers)
#ifndef WG_BUFS
#define WG_BUFS (WG_DEFER ? 3 : 2)  // B buffers (qmv_cuda.wgmma_shared_bytes passes its count)
#endif
#if WG_BUFS < 2 + WG_DEFER
#error "WG_DEFER needs three B buffers, the build without it two"
#endif
#ifndef WG_TMA
#define WG_TMA 0    // 1: a producer warp brings each step's bytes with bulk copies (see "The bulk-copy build" below)
#endif
#ifndef WG_FENCE
#define WG_FENCE 1  // 0 is for timing only: without the proxy fence the MMAs may read B before it is written (the cost
#endif              // of fence.proxy.async, which is MEMBAR.ALL.CTA + FENCE.VIEW.ASYNC.S in SASS)
// Dynamic shared memory (qmv_cuda.wgmma_shared_bytes), byte offsets: B [WG_BUFS][WG_GROUP_B], then the ring: code
// pieces uint4 [WG_WARPS][ASYNC][32], x pieces uint4 [WG_WARPS][ASYNC][WG_XCOLS][WG_XP][32], scale pairs u32
// [WG_WARPS][ASYNC][32], q5 high-bit pairs u32 alike
#define WG_RING_C (WG_BUFS * WG_GROUP_B)
#define WG_RING_X (WG_RING_C + WG_WARPS * ASYNC * 32 * 16)
#define WG_RING_S (WG_RING_X + WG_WARPS * ASYNC * WG_XCOLS * WG_XP * 32 * 16)
#define WG_RING_H (WG_RING_S + WG_WARPS * ASYNC * 32 * 4)

// wgmma.m64n<8 NCOL>k16 with A from registers: its accumulator operands, A and descriptor, scale-d predicate
#if NCOL == 1
#define WG_SHAPE "m64n8k16"
#define WG_D "{%0, %1, %2, %3}"
#define WG_A "{%4, %5, %6, %7}, %8"
#define WG_SCALE "%9"
#define WG_DOUT "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
#elif NCOL == 2
#define WG_SHAPE "m64n16k16"
#define WG_D "{%0, %1, %2, %3, %4, %5, %6, %7}"
#define WG_A "{%8, %9, %10, %11}, %12"
#define WG_SCALE "%13"
#define WG_DOUT "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
#elif NCOL == 4
#define WG_SHAPE "m64n32k16"
#define WG_D "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}"
#define WG_A "{%16, %17, %18, %19}, %20"
#define WG_SCALE "%21"
#define WG_DOUT                                                                                                 \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),  \
      "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
#elif NCOL == 8
#define WG_SHAPE "m64n64k16"
#define WG_D "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
             "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define WG_A "{%32, %33, %34, %35}, %36"
#define WG_SCALE "%37"
#define WG_DOUT                                                                                                 \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),  \
      "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),   \
      "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),  \
      "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#else
#error "WGMMA takes 1, 2, 4 or 8 column groups"
#endif

// d = A B (acc 0) or A B + d (acc 1): one k16 step of the warpgroup's 64 rows over all 8 NCOL tokens
__device__ __forceinline__ void wg_mma(float* d, u32 a0, u32 a1, u32 a2, u32 a3, unsigned long long desc, int acc) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " WG_SCALE ", 0;\n"
               "wgmma.mma_async.sync.aligned." WG_SHAPE ".f32." MMA_TYPE "." MMA_TYPE " " WG_D ", " WG_A
               ", p, 1, 1, 0;\n}\n"
               : WG_DOUT
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc), "r"(acc));
}
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wg_wait() { asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); }
// the accumulators are read only after wg_wait (the compiler sees them written here)
__device__ __forceinline__ void wg_hold(float* d) {
#pragma unroll
  for (int i = 0; i < 4 * NCOL; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
// A's registers are read by the MMAs until wg_wait: kept as they are until then
__device__ __forceinline__ void wg_hold_frags(Frags& F) {
#pragma unroll
  for (int w = 0; w < 2; ++w) {
#pragma unroll
    for (int i = 0; i < 4; ++i) asm volatile("" : "+r"(F.pa[w][i]), "+r"(F.pb[w][i])::"memory");
  }
}
// this thread's writes to shared memory, seen by the MMAs (the async proxy) after the next barrier
__device__ __forceinline__ void wg_publish() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// B's descriptor at shared address `addr` (no swizzle)
__device__ __forceinline__ unsigned long long wg_desc(u32 addr) {
  return (unsigned long long)((addr & 0x3FFFF) >> 4) | ((unsigned long long)(WG_LBO >> 4) << 16) |
         ((unsigned long long)(WG_SBO >> 4) << 32);
}

// Lane (g, c)'s x pairs of column group j for one group (xv: what load_x gives it, x[8 j + g][16 c .. 16 c + 15] of
// the group, q8 [8 c .. 8 c + 7]) into B at `bb`. Step s takes from the lane what mma.sync's MMA s takes as its B
// fragment: (b0, b1) = xv[2 s], xv[2 s + 1] (q8: xv[s] twice). b0 holds k = 2 c, 2 c + 1 of the step (core matrix
// 0) and b1 k = 2 c + 8, 2 c + 9 (core matrix 1), so each goes to column c of token 8 j + g's 16-byte row. A store
// of the warp covers one core matrix: 8 tokens x 4 columns, 32 banks.
__device__ __forceinline__ void wg_stage_x(unsigned char* bb, int j, const u32* xv, int g, int c) {
#pragma unroll
  for (int s = 0; s < 4; ++s) {
#pragma unroll
    for (int q = 0; q < 2; ++q) {
#if FMT == 0
      const u32 v = xv[s];
#else
      const u32 v = xv[2 * s + q];
#endif
      *reinterpret_cast<u32*>(bb + s * WG_STEP_B + j * 256 + q * 128 + g * 16 + 4 * c) = v;
    }
  }
}

// A block's steps: warp slot w's groups g_lo + w, + NW, ..., then slot w + 1's (mma.sync's warp w takes slot w)
struct WgSteps {
  int gi;
  __device__ __forceinline__ void next(int g_lo, int g_hi) {
    gi += NW;
    if (gi >= g_hi) gi = g_lo + (gi - g_lo) % NW + 1;  // the next slot's first group
  }
};

// Step j (group gi) of this warp's tile into ring stage j % ASYNC: its code piece, scale pair (q5: high-bit pair),
// and (wg_issue_x) its x pieces
__device__ __forceinline__ void wg_issue_w(const Lane& L, int gi, int j, int wi, int lane, u32 sbase) {
  const int slot = (wi * ASYNC + j % ASYNC) * 32 + lane;
  cp_async16(sbase + WG_RING_C + 16 * slot, L.cp0 + CSTEP * gi);
  cp_async4(sbase + WG_RING_S + 4 * slot, L.sp0 + SSTEP * gi);
#if FMT == 1
  cp_async4(sbase + WG_RING_H + 4 * slot, L.hp0 + HSTEP * gi);
#endif
}
// (xs[m]: the lane's x at group 0 for its column group wi + WG_WARPS m, null past the last one)
__device__ __forceinline__ void wg_issue_x(const u16* const* xs, int gi, int j, int wi, int lane, u32 sbase) {
#pragma unroll
  for (int m = 0; m < WG_XCOLS; ++m) {
    if (xs[m]) {
#pragma unroll
      for (int p = 0; p < WG_XP; ++p)
        cp_async16(sbase + WG_RING_X + 16 * ((((wi * ASYNC + j % ASYNC) * WG_XCOLS + m) * WG_XP + p) * 32 + lane),
                   xs[m] + GROUP * gi + 8 * p);
    }
  }
}

#if WG_TMA
// The bulk-copy build (WG_TMA 1): one more warp, the producer, brings each step's bytes into a stage with
// cp.async.bulk (the copy engine: the async proxy, completion counted in bytes on the stage's "full" mbarrier), and
// the consumer warps give the stage back on its "empty" mbarrier once they have read it into registers. The consumers
// then issue no copies of their own, so the proxy fence before the MMAs waits on nothing but their stores of B.
// A stage: the tiles' code chunks (16 rows x 32 bytes, the lanes layout's (tile, group) chunk), scale chunks (16 x 2
// bytes) and q5 high-bit chunks (16 x 8), then the 8 NCOL rows of x's group, each padded to WG_XROW bytes.
#define WG_XROW (2 * GROUP + 16)
#define WG_TC (WG_WARPS * 16 * CB)
#define WG_TS (WG_WARPS * 32)
#define WG_TH (FMT == 1 ? WG_WARPS * 128 : 0)
#define WG_TSTAGE (WG_TC + WG_TS + WG_TH + 8 * NCOL * WG_XROW)
#define WG_TX_BYTES (WG_TC + WG_TS + WG_TH + 8 * NCOL * 2 * GROUP)  // what a stage's copies bring
#define WG_T0 (WG_BUFS * WG_GROUP_B)                              // the stages, after B
#define WG_MBAR (WG_T0 + ASYNC * WG_TSTAGE)                       // full[ASYNC], then empty[ASYNC], 8 bytes each
#define WG_THREADS (128 * WGMMA + 32)

__device__ __forceinline__ void mbar_init(u32 a, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(a), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect(u32 a, int bytes) {  // the phase's one arrival, with its bytes to come
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(a), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(u32 a) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(a) : "memory");
}
__device__ __forceinline__ void mbar_wait(u32 a, int parity) {  // until the phase of this parity has completed
  asm volatile(
      "{\n.reg .pred done;\nWG_WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WG_WAIT;\n}\n" ::"r"(a),
      "r"(parity)
      : "memory");
}
__device__ __forceinline__ void bulk_copy(u32 dst, const void* src, int bytes, u32 mbar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(mbar)
               : "memory");
}
__device__ __forceinline__ void wg_sync() {  // the consumer warps only (the producer runs ahead)
  asm volatile("bar.sync 1, %0;" ::"n"(128 * WGMMA) : "memory");
}
#else
#define WG_THREADS (128 * WGMMA)
__device__ __forceinline__ void wg_sync() { __syncthreads(); }
#endif

// step j's four k16 MMAs (fragments F, B at shared address b), chained from zero into d
__device__ __forceinline__ void wg_multiply(float* d, const Frags& F, u32 b) {
  wg_fence();
  const unsigned long long desc = wg_desc(b);  // step s: its start address field (16-byte units) moved on
  wg_mma(d, F.pa[0][0], F.pb[0][0], F.pa[0][1], F.pb[0][1], desc, 0);
  wg_mma(d, F.pa[0][2], F.pb[0][2], F.pa[0][3], F.pb[0][3], desc + (WG_STEP_B >> 4), 1);
  wg_mma(d, F.pa[1][0], F.pb[1][0], F.pa[1][1], F.pb[1][1], desc + 2 * (WG_STEP_B >> 4), 1);
  wg_mma(d, F.pa[1][2], F.pb[1][2], F.pa[1][3], F.pb[1][3], desc + 3 * (WG_STEP_B >> 4), 1);
  wg_commit();
}
// wait for them; the group's scale step; at a slot's last group (slot_end) its sums join the slots before it
// (tile_store's order)
__device__ __forceinline__ void wg_finish(float* d, Frags& F, float* acc, float* sum, bool slot_end) {
  wg_wait();
  wg_hold(d);
  wg_hold_frags(F);
#pragma unroll
  for (int n = 0; n < NCOL; ++n) scale_add(d + 4 * n, F.sa, F.sb, acc + 4 * n);
  if (slot_end) {
#pragma unroll
    for (int i = 0; i < 4 * NCOL; ++i) {
      sum[i] += acc[i];
      acc[i] = 0.f;
    }
  }
}
// the lane's x pieces of column group j (xp: its first, XPL values) into B buffer bb
__device__ __forceinline__ void wg_stage_pieces(unsigned char* bb, int j, const uint4* xp, int pstride, int g, int c) {
  u32 xv[XPL / 2];
#pragma unroll
  for (int p = 0; p < WG_XP; ++p) {
    const uint4 v = xp[p * pstride];
    xv[4 * p] = v.x; xv[4 * p + 1] = v.y; xv[4 * p + 2] = v.z; xv[4 * p + 3] = v.w;
  }
  wg_stage_x(bb, j, xv, g, c);
}

// The end of a step's preparation: this thread's stores of B published to the MMAs (WG_FENCE), the A fragments made
// from the lane's code piece v, scale pair sc and (q5) high-bit pair h, then the consumers' barrier (every warp's
// part of B in place)
__device__ __forceinline__ Frags wg_frags(uint4 v, u32 sc, u32 h, u32 magic) {
#if WG_FENCE
  wg_publish();
#endif
  const Frags F = make_frags(make_uint2(v.x, v.y), make_uint2(v.z, v.w), h & 0xFFFFu, h >> 16, sc & 0xFFFFu, sc >> 16,
                             magic);
  wg_sync();
  return F;
}

// Block (x, split y): row tiles 4 WGMMA x .. 4 WGMMA x + 4 WGMMA - 1, split y's groups, all 8 NCOL tokens.
extern "C" __global__ void __launch_bounds__(WG_THREADS, MIN_BLOCKS)
qmv(const u16* __restrict__ x, const u8* __restrict__ codes, const u8* __restrict__ high,
    const u16* __restrict__ scales, u16* __restrict__ out, float* __restrict__ ws, int* __restrict__ counters,
    int T, int N, int K, int NG, int groups_per_split, long long stride_x, long long stride_o,
    long long stride_c, long long stride_h, long long stride_s) {
  let_next_launch();
  const int lane = threadIdx.x & 31, wi = threadIdx.x >> 5;
  const int g = lane >> 2, c = lane & 3;
  const int tiles = (N + 15) / 16, tile = blockIdx.x * WG_WARPS + wi;
  const int g_lo = blockIdx.y * groups_per_split, g_hi = min(NG, g_lo + groups_per_split);
  const int steps = max(0, g_hi - g_lo);  // every group of the split is one slot's
  u32 magic;
  asm volatile("mov.b32 %0, %1;" : "=r"(magic) : "n"(MAGIC));
  unsigned char* sm = reinterpret_cast<unsigned char*>(qmv_ring);
  const u32 sbase = smem_addr(sm);
#if WG_TMA
  if (threadIdx.x == 0) {
    for (int i = 0; i < ASYNC; ++i) {
      mbar_init(sbase + WG_MBAR + 8 * i, 1);                      // full: the producer's arrival and its bytes
      mbar_init(sbase + WG_MBAR + 8 * (ASYNC + i), WG_WARPS);    // empty: one arrival a consumer warp
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (wi == WG_WARPS) {  // the producer warp
    // step j's copies into stage j % ASYNC: the weights of the block's tiles (past the last tile: the last one's),
    // and x's rows of the group (row min(r, T - 1), as load_x reads)
    auto issue = [&](int j, int gi, bool weights, bool xrows) {
      const u32 stage = sbase + WG_T0 + (j % ASYNC) * WG_TSTAGE, full = sbase + WG_MBAR + 8 * (j % ASYNC);
      if (weights) {
        for (int t = lane; t < WG_WARPS * (FMT == 1 ? 3 : 2); t += 32) {
          const int w = t % WG_WARPS, kind = t / WG_WARPS;
          const long long chunk = (long long)min((int)blockIdx.x * WG_WARPS + w, tiles - 1) * NG + gi;
          if (kind == 0)
            bulk_copy(stage + w * 16 * CB, codes + chunk * 16 * CB, 16 * CB, full);
          else if (kind == 1)
            bulk_copy(stage + WG_TC + w * 32, scales + chunk * 16, 32, full);
          else
            bulk_copy(stage + WG_TC + WG_TS + w * 128, high + chunk * 128, 128, full);
        }
      }
      if (xrows) {
        for (int r = lane; r < 8 * NCOL; r += 32)
          bulk_copy(stage + WG_TC + WG_TS + WG_TH + r * WG_XROW, x + min(r, T - 1) * stride_x + GROUP * gi,
                    2 * GROUP, full);
      }
    };
    // the first stages' weights before griddepcontrol.wait, their x (the kernel before's output) after it
    WgSteps ps = {g_lo}, pw = {g_lo};
    const int first = min(steps, ASYNC);
    for (int j = 0; j < first; ++j) {
      if (lane == 0) mbar_expect(sbase + WG_MBAR + 8 * j, WG_TX_BYTES);
      __syncwarp();
      issue(j, pw.gi, true, false);
      pw.next(g_lo, g_hi);
    }
    grid_wait();
    for (int j = 0; j < first; ++j) {
      issue(j, ps.gi, false, true);
      ps.next(g_lo, g_hi);
    }
    for (int j = ASYNC; j < steps; ++j) {
      mbar_wait(sbase + WG_MBAR + 8 * (ASYNC + j % ASYNC), (j / ASYNC - 1) & 1);  // its consumers are done with it
      if (lane == 0) mbar_expect(sbase + WG_MBAR + 8 * (j % ASYNC), WG_TX_BYTES);
      __syncwarp();
      issue(j, ps.gi, true, true);
      ps.next(g_lo, g_hi);
    }
    return;  // (the consumers wait for every copy on its stage's full barrier)
  }
  // a consumer's step j: its pieces from stage j % ASYNC into registers, the stage given back, x into B
  auto prepare = [&](int j) -> Frags {
    const int st = j % ASYNC;
    mbar_wait(sbase + WG_MBAR + 8 * st, (j / ASYNC) & 1);
    const unsigned char* stage = sm + WG_T0 + st * WG_TSTAGE;
    const uint4 v = *reinterpret_cast<const uint4*>(stage + wi * 16 * CB + (g * 4 + c) * 16);
    const u32 sc = *reinterpret_cast<const u32*>(stage + WG_TC + wi * 32 + 4 * g);
#if FMT == 1
    const u32 h = *reinterpret_cast<const u32*>(stage + WG_TC + WG_TS + wi * 128 + (g * 4 + c) * 4);
#else
    const u32 h = 0;
#endif
    unsigned char* bb = sm + (j % WG_BUFS) * WG_GROUP_B;
#pragma unroll
    for (int m = 0; m < WG_XCOLS; ++m) {
      const int jc = wi + WG_WARPS * m;
      if (jc < NCOL)
        wg_stage_pieces(bb, jc,
                        reinterpret_cast<const uint4*>(stage + WG_TC + WG_TS + WG_TH + (8 * jc + g) * WG_XROW +
                                                       2 * XPL * c),
                        1, g, c);
    }
    __syncwarp();
    if (lane == 0) mbar_arrive(sbase + WG_MBAR + 8 * (ASYNC + st));  // the warp's reads of the stage are done
    return wg_frags(v, sc, h, magic);
  };
#else
  // the lane's pointers at group 0 of its tile (past the last tile: the last one's bytes, never stored)
  const Lane L = make_lane(x, codes, high, scales, T, N, NG, stride_x, stride_c, stride_h, stride_s,
                           min(tile, tiles - 1), 0, g, c);
  const u16* xs[WG_XCOLS];  // the lane's x for the column groups it stages: row min(8 j + g, T - 1), as load_x reads
#pragma unroll
  for (int m = 0; m < WG_XCOLS; ++m) {
    const int jc = wi + WG_WARPS * m;
    xs[m] = jc < NCOL ? x + min(8 * jc + g, T - 1) * stride_x + XPL * c : nullptr;
  }
  // the first ASYNC - 1 steps: weights before griddepcontrol.wait, x (the kernel before's output) after it; step 0's
  // commit group holds all of their weights
  WgSteps is = {g_lo};
  {
    WgSteps w = is;
#pragma unroll
    for (int j = 0; j < ASYNC - 1; ++j) {
      if (j < steps) wg_issue_w(L, w.gi, j, wi, lane, sbase);
      w.next(g_lo, g_hi);
    }
  }
  grid_wait();
#pragma unroll
  for (int j = 0; j < ASYNC - 1; ++j) {
    if (j < steps) wg_issue_x(xs, is.gi, j, wi, lane, sbase);
    is.next(g_lo, g_hi);
    cp_commit();
  }
  const uint4* ring_c = reinterpret_cast<const uint4*>(sm + WG_RING_C);
  const uint4* ring_x = reinterpret_cast<const uint4*>(sm + WG_RING_X);
  const u32* ring_s = reinterpret_cast<const u32*>(sm + WG_RING_S);
  // step j's copies out, its x into B (buffer j % WG_BUFS), its A fragments made; then the block's barrier
  auto prepare = [&](int j) -> Frags {
    if (j + ASYNC - 1 < steps) {  // into the stage step j - 1 used (read into registers)
      wg_issue_w(L, is.gi, j + ASYNC - 1, wi, lane, sbase);
      wg_issue_x(xs, is.gi, j + ASYNC - 1, wi, lane, sbase);
    }
    is.next(g_lo, g_hi);
    cp_commit();
    cp_wait<ASYNC - 1>();  // this lane's copies of step j have landed
    const int st = j % ASYNC;
    unsigned char* bb = sm + (j % WG_BUFS) * WG_GROUP_B;
#pragma unroll
    for (int m = 0; m < WG_XCOLS; ++m) {
      if (xs[m])
        wg_stage_pieces(bb, wi + WG_WARPS * m, ring_x + (((wi * ASYNC + st) * WG_XCOLS + m) * WG_XP) * 32 + lane, 32,
                        g, c);
    }
    const int slot = (wi * ASYNC + st) * 32 + lane;
#if FMT == 1
    const u32 h = reinterpret_cast<const u32*>(sm + WG_RING_H)[slot];
#else
    const u32 h = 0;
#endif
    return wg_frags(ring_c[slot], ring_s[slot], h, magic);
  };
#endif
  float acc[4 * NCOL], sum[4 * NCOL], d[4 * NCOL];
#pragma unroll
  for (int i = 0; i < 4 * NCOL; ++i) acc[i] = sum[i] = d[i] = 0.f;
  WgSteps cs = {g_lo};
  auto finish = [&](Frags& F) {
    wg_finish(d, F, acc, sum, cs.gi + NW >= g_hi);
    cs.next(g_lo, g_hi);
  };
#if WG_DEFER
  // step j + 1's copies, B and fragments while step j's MMAs run
  Frags F = steps > 0 ? prepare(0) : Frags{};
  for (int j = 0; j < steps; ++j) {
    wg_multiply(d, F, sbase + (j % WG_BUFS) * WG_GROUP_B);
    Frags next = j + 1 < steps ? prepare(j + 1) : F;
    finish(F);
    F = next;
  }
#else
  for (int j = 0; j < steps; ++j) {
    Frags F = prepare(j);
    wg_multiply(d, F, sbase + (j % WG_BUFS) * WG_GROUP_B);
    finish(F);
  }
#endif
#if !WG_TMA
  cp_wait<0>();
#endif
  grid_wait();
  if (tile < tiles) tile_out(sum, tile, blockIdx.y, gridDim.y, out, ws, counters, T, N, stride_o);
}
#else
// Block (tile, split): one 16-row tile (TPW > 1: tiles TPW x .. TPW x + TPW - 1), split y's groups (split-K over
// grid y), for all NCOL column groups.
extern "C" __global__ void __launch_bounds__(NW * 32, MIN_BLOCKS)
qmv(const u16* __restrict__ x, const u8* __restrict__ codes, const u8* __restrict__ high,
    const u16* __restrict__ scales, u16* __restrict__ out, float* __restrict__ ws, int* __restrict__ counters,
    int T, int N, int K, int NG, int groups_per_split, long long stride_x, long long stride_o,
    long long stride_c, long long stride_h, long long stride_s) {
  let_next_launch();
  float acc[4 * NCOL * TPW];
#pragma unroll
  for (int i = 0; i < 4 * NCOL * TPW; ++i) acc[i] = 0.f;
  const int g_lo = blockIdx.y * groups_per_split, g_hi = min(NG, g_lo + groups_per_split);
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
            acc);
  tile_store(acc, blockIdx.x, blockIdx.y, gridDim.y, out, ws, counters, T, N, stride_o);
#endif
}
#endif
