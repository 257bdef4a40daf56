// Decode / verify attention over an int8 KV cache on the tensor cores: the split pass of flash-decoding
// (kernels/attention_triton.py's decode_attention for int8 caches and 16-bit queries; its _attn_combine merges
// the splits). Compiled at run time (CuPy / NVRTC), no headers:
//   HD     head dim, a multiple of 64 up to 256 (NG = HD / 64 scale groups a key)
//   HALF   0: q is bf16 (converted to fp16 as it is loaded), 1: fp16
//   POS64 / SLOT64   q_pos / slots are int64 (1) or int32 (0)
//   VDEPTH attn_verify: steps of K / V in flight (cp.async stages in shared memory, >= 2)
//   QSMEM  attn_verify: q's A fragments in registers (0) or in shared memory (1), VMAXREG its register cap (unset:
//          255); the same bits either way (kernels/attn_cuda.py builds one of each and picks by the block's warps)
// Two kernels, one arithmetic:
//   attn_split   one warp a block = one query token's G <= 8 heads of one kv head over one key range (decode steps,
//                batched or not);
//   attn_verify  a block = all T x G query rows of one (row b, kv head) over one key range, one warp a 16-row m tile
//                (a verify: the cache is read once for the T tokens).
//
// attn_split: 16 keys a step, online softmax in fp32. The MMAs are transposed so that the query heads are the MMA's
// 8 columns (a decode step has G = 6 rows, not the 16 an m tile wants) and the keys / head dims its 16 rows:
//   S^T [16 keys x 8 heads] = K [16 keys x HD] . Q^T, one m16n8k16 per 16 head dims;
//   O^T [HD x 8 heads]    += V^T [HD x 16 keys] . P^T, one m16n8k16 per 16 head dims.
// A dot product does not depend on the order of its terms, so each MMA's 16 "k" values are a permutation of the
// head dims chosen for the loads: lane (g = lane / 4, c = lane % 4) holds keys g and g + 8 and, of scale group G,
// the 16 contiguous head dims 64 G + 16 c .. + 15 (one 16-byte load a key and group), and the query's B fragments
// take the same permutation. K's A fragments hold the exact codes (c XOR 0x80 = c + 128 put in the mantissa of
// 1024.0 by a byte permute, then one packed subtraction of 1152), the MMA sums them against q in fp32, and each
// group's sums are multiplied by the key's group scale: no rounding besides fp32 summation and q's conversion to
// fp16.
// For V^T the 16 rows of an m tile are head dims and the 16 "k" values keys; m tile (G, i) row r < 8 is head dim
// 64 G + 8 r + 2 i and row r + 8 is the next one, so lane (g, c) reads 8 contiguous bytes (64 G + 8 g ..) of each of
// its four keys 2c, 2c + 1, 2c + 8, 2c + 9, pairs two keys' codes by byte permutes, and multiplies the exact codes by
// their keys' scales in fp16 (one rounding, as the Triton kernel's dequantized tile). P^T's B fragments come from
// S^T's accumulators through movmatrix (an 8 x 8 transpose in registers). The warp loads its K / V into a register
// double buffer, each step's loads for the next step issued as soon as the current registers are used.
//
// attn_verify: the same products in the other orientation, with the T x G query rows (row r = token r / G, head
// r % G) as the MMA's 16 rows:
//   S [16 rows x 8 keys] = Q . K^T, two n tiles a step (keys 0-7, 8-15), one m16n8k16 per 16 head dims each;
//   O [16 rows x 8 head dims] += P . V, two n tiles per (scale group G, i): head dims 64 G + 8 n + 2 i (+ 1).
// A lane's K fragment of attn_split (rows = keys g, g + 8) is, register for register, its B fragments of the two S
// n tiles here (column = key g, g + 8), and its V^T fragment of m tile (G, i) its B fragments of the two O n tiles;
// q's fragments are attn_split's B fragments of rows g and g + 8 interleaved, and P's A fragments come straight from
// S's accumulators. Each S and O element so gets the same 16 products at the same k positions, into the same
// accumulator, in the same order as in attn_split, and the softmax follows it element for element: the same fmas,
// masks and ex2, and the running sums kept as attn_split's lanes keep them (a lane here holds, per row, the partial
// sums of key pairs (2c, 2c + 8) and (2c + 1, 2c + 9), which attn_split's lanes g = 2c and 2c + 1 hold) and reduced
// in its tree. Both move a row's running max only when a step's max passes it by more than 2^8 (RESCALE_LAG), so
// most steps skip the rescale of O. A row meets the union of the block's rows' key ranges: steps outside its own
// range leave its running max, sums and output as they are (scale 1, p = 0), so a T = 8 verify gives each row the
// bits a T = 1 step gives (token invariance). That an MMA element's bits do not depend on which operand holds which
// vector is the tensor cores' behaviour (on the H200), not a documented guarantee: the GPU tests check it bit for
// bit. The block streams each step's raw codes and
// scales into shared memory with cp.async (VDEPTH steps in flight, rows padded against bank conflicts), and every
// warp makes its fragments from there.
// Both write the normalised partial output [B, T, H, splits, HD] (fp16 under PART16, the default: each element
// its sum times the row's reciprocal sum, rounded once; store_part8) and its log2-sum-exp in fp32 of every row whose
// key range reaches this split, also for a single split: the combine merges exactly those rows' splits in fp32,
// rounds the output to q's dtype and applies the gate. A T = 1 step and a verify write a row alike, so token
// invariance holds; against the Triton path (fp32 partials) the output agrees to within the rounding of the sums.

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned long long u64;

#ifndef HD
#define HD 256
#endif
#ifndef HALF
#define HALF 0
#endif
#ifndef POS64
#define POS64 1
#endif
#ifndef SLOT64
#define SLOT64 1
#endif
#ifndef VDEPTH
#define VDEPTH 4  // attn_verify: cp.async stages (steps of K / V in flight)
#endif
#ifndef QSMEM
#define QSMEM 0  // attn_verify: q's A fragments in registers (0) or in shared memory (1: fewer registers)
#endif
#ifndef PART16
#define PART16 1  // the partial outputs in fp16 (0: fp32); kernels/attn_cuda.py sizes the buffer to match (part_dtype)
#endif
#if VDEPTH < 2
#error "VDEPTH must be at least 2"
#endif
#define NG (HD / 64)
#define STEP 16
#if HD % 64 || HD > 256
#error "HD must be a multiple of 64 up to 256"
#endif

#define NEG_INF __int_as_float(0xff800000)

struct __align__(16) U4 { u32 x, y, z, w; };
struct __align__(8) U2 { u32 x, y; };
#if PART16
typedef u16 part_t;
#else
typedef float part_t;
#endif

__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 sel) {
  u32 d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}

__device__ __forceinline__ u32 hsub2(u32 a, u32 b) {
  u32 d;
  asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

__device__ __forceinline__ u32 hmul2(u32 a, u32 b) {
  u32 d;
  asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

__device__ __forceinline__ u32 pack_f16(float lo, float hi) {  // {lo, hi} rounded to fp16, lo in the low half
  u32 d;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  return d;
}

// A partial output element is its row's sum times the row's reciprocal sum (one IEEE division a row, not one an
// element), rounded to fp16 (PART16) as it is stored: every kernel stores its rows so, the combine reads them back
// exactly. A row's normalised sums are a convex combination of its keys' values, which the cache holds as fp16
// products (codes times fp16 scales), so they are within fp16's range.
__device__ __forceinline__ void store_part8(part_t* dst, float v0, float v1, float v2, float v3, float v4, float v5,
                                            float v6, float v7) {  // 8 contiguous elements, dst 16-byte aligned
#if PART16
  *(U4*)dst = U4{pack_f16(v0, v1), pack_f16(v2, v3), pack_f16(v4, v5), pack_f16(v6, v7)};
#else
  *(U4*)dst = U4{__float_as_uint(v0), __float_as_uint(v1), __float_as_uint(v2), __float_as_uint(v3)};
  *(U4*)(dst + 4) = U4{__float_as_uint(v4), __float_as_uint(v5), __float_as_uint(v6), __float_as_uint(v7)};
#endif
}

__device__ __forceinline__ void store_part2(part_t* dst, float v0, float v1) {  // 2 contiguous, dst 4-byte aligned
#if PART16
  *(u32*)dst = pack_f16(v0, v1);
#else
  *(float2*)dst = make_float2(v0, v1);
#endif
}

__device__ __forceinline__ float f16_to_f32(u16 h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}

__device__ __forceinline__ float bf16_to_f32(u16 h) { return __uint_as_float(((u32)h) << 16); }

__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float lg2(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ u32 movtrans(u32 x) {  // the 8 x 8 b16 fragment transposed
  u32 d;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(d) : "r"(x));
  return d;
}

__device__ __forceinline__ void mma(float* d, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
               "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// codes c (int8) of a word's bytes lo, lo + 1 as the fp16 pair 1152 + c: c ^ 0x80 = c + 128 in the mantissa of 1024.0
#define FLIP 0x80808080u
#define MAGIC_BYTES 0x64646464u
#define C1152 0x64806480u  // 1152.0, 1152.0

// mg: MAGIC_BYTES in a register (magic_reg): with the magic as prmt's immediate, ptxas takes the selector from a
// register it refills from a uniform one at almost every use under the kernels' register caps (100-130 refills a
// 16-key step at hd 256: scripts/sass_loops.py)
__device__ __forceinline__ u32 codes01(u32 flipped, u32 mg) { return hsub2(prmt(flipped, mg, 0x4140u), C1152); }
__device__ __forceinline__ u32 codes23(u32 flipped, u32 mg) { return hsub2(prmt(flipped, mg, 0x4342u), C1152); }
// MAGIC_BYTES from a kernel argument the compiler cannot fold (n < 2^30: a head count)
__device__ __forceinline__ u32 magic_reg(int n) { return MAGIC_BYTES | ((u32)n >> 30); }

__device__ __forceinline__ long long load_index(const void* p, long long i, bool wide) {
  return wide ? ((const long long*)p)[i] : (long long)((const int*)p)[i];
}

__device__ __forceinline__ int row_chunk(int pos, int chunk, int min_chunk, int splits) {
  // keys a split for a token at pos: _row_chunk of kernels/attention_triton_kernels.py with BLOCK_N = STEP
  int want = ((pos + splits) / splits + STEP - 1) / STEP * STEP;  // cdiv(cdiv(pos + 1, splits), STEP) * STEP
  return min(max(want, min_chunk), chunk);
}

// the key range [lo, hi) split s covers of a token at pos (empty when hi <= lo: the split is past the token)
__device__ __forceinline__ void key_range(int pos, int s, int chunk, int min_chunk, int splits, int kv_len, int& lo,
                                          int& hi) {
  const int c = row_chunk(pos, chunk, min_chunk, splits);
  lo = s * c;
  hi = min(min(lo + c, kv_len), pos + 1);
}

// The fragments of one 16-key step. K: chunk j of scale group gr, from word j of keys g and g + 8 (raw codes).
__device__ __forceinline__ void k_frag(u32 w0, u32 w1, u32* a, u32 mg) {
  w0 ^= FLIP;
  w1 ^= FLIP;
  a[0] = codes01(w0, mg);
  a[1] = codes01(w1, mg);
  a[2] = codes23(w0, mg);
  a[3] = codes23(w1, mg);
}

// V: m tile (gr, i) from the 8 bytes of keys 2c, 2c + 1 (x, y) and 2c + 8, 2c + 9 (xb, yb) at 64 gr + 8 g, times
// their scales (s01: keys 2c, 2c + 1; s89: keys 2c + 8, 2c + 9)
__device__ __forceinline__ void v_frag(const U2& x, const U2& y, const U2& xb, const U2& yb, u32 s01, u32 s89, int i,
                                       u32* a, u32 mg) {
  const u32 sel = (i & 1) ? 0x7362u : 0x5140u;  // head dims 2i, 2i + 1 of the word: the two keys interleaved
  const u32 za = prmt((i >> 1 ? x.y : x.x) ^ FLIP, (i >> 1 ? y.y : y.x) ^ FLIP, sel);
  const u32 zb = prmt((i >> 1 ? xb.y : xb.x) ^ FLIP, (i >> 1 ? yb.y : yb.x) ^ FLIP, sel);
  a[0] = hmul2(codes01(za, mg), s01);
  a[1] = hmul2(codes23(za, mg), s01);
  a[2] = hmul2(codes01(zb, mg), s89);
  a[3] = hmul2(codes23(zb, mg), s89);
}

__device__ __forceinline__ u32 word4(const U4& v, int j) { return j == 0 ? v.x : j == 1 ? v.y : j == 2 ? v.z : v.w; }

__device__ __forceinline__ u32 pair16(u16 lo, u16 hi) { return (u32)lo | ((u32)hi << 16); }

// A lane's loads of one step (zero for keys from `end` on): K's 16 bytes of key start + g + 8 r in scale group gr,
// V's 8 bytes of key start + 2c + (r & 1) + 8 (r >> 1), and a key's group scale
__device__ __forceinline__ int k_key(int start, int g, int r) { return start + g + 8 * r; }
__device__ __forceinline__ int v_key(int start, int c, int r) { return start + 2 * c + (r & 1) + 8 * (r >> 1); }

__device__ __forceinline__ U4 load_k(const signed char* kb, int key, int end, int gr, int c) {
  return key < end ? *(const U4*)(kb + (long long)key * HD + 64 * gr + 16 * c) : U4{0, 0, 0, 0};
}

__device__ __forceinline__ U2 load_v(const signed char* vb, int key, int end, int gr, int g) {
  return key < end ? *(const U2*)(vb + (long long)key * HD + 64 * gr + 8 * g) : U2{0, 0};
}

__device__ __forceinline__ u16 load_scale(const u16* sb, int key, int end, int gr) {
  return key < end ? sb[(long long)key * NG + gr] : (u16)0;
}

// a q row's head dims 64 gr + 16 c .. + 15 as 8 fp16 pairs (zero when !ok): a lane's B fragments of attn_split
__device__ __forceinline__ void q_words(const u16* qrow, bool ok, int gr, int c, u32 (&w)[8]) {
  U4 h0 = {0, 0, 0, 0}, h1 = {0, 0, 0, 0};
  if (ok) {
    h0 = *(const U4*)(qrow + 64 * gr + 16 * c);
    h1 = *(const U4*)(qrow + 64 * gr + 16 * c + 8);
  }
  const u32 raw[8] = {h0.x, h0.y, h0.z, h0.w, h1.x, h1.y, h1.z, h1.w};
#pragma unroll
  for (int i = 0; i < 8; ++i) {
#if HALF
    w[i] = raw[i];
#else
    w[i] = pack_f16(bf16_to_f32((u16)(raw[i] & 0xffffu)), bf16_to_f32((u16)(raw[i] >> 16)));
#endif
  }
}

// The online softmax's running max moves only when a step's max passes it by more than RESCALE_LAG (log2 units): then
// p = 2^(s - max) <= 2^RESCALE_LAG (fp16 holds it exactly as well as any p <= 1), and O and the sums are rescaled on
// few steps rather than on most
#define RESCALE_LAG 8.0f
__device__ __forceinline__ float run_max(float m, float x) { return x > m + RESCALE_LAG ? x : m; }
__device__ __forceinline__ float rescale(float m, float n) { return n == m ? 1.f : ex2(m - n); }

// One token's 16-key step from [start, start + 16), keys from `hi` on masked: S^T, the online softmax, O^T.
// kfrag(gr, j, a) / vfrag(gr, i, a) give the step's A fragments, kscale(gr, r) key g + 8 r's group scale (fp16 bits)
// from the register double buffer; k_done() runs once K's fragments and scales are used (it reloads them there).
template <class KF, class VF, class KSC, class KD>
__device__ __forceinline__ void token_step(KF kfrag, VF vfrag, KSC kscale, KD k_done, const u32 (&qf)[NG][8],
                                           float (&o)[NG][4][4], float& m0, float& m1, float& l0, float& l1,
                                           int start, int hi, float qk_scale, int g) {
  float sv[4] = {0.f, 0.f, 0.f, 0.f};  // (key g, head 2c), (key g, 2c + 1), (key g + 8, 2c), (key g + 8, 2c + 1)
#pragma unroll
  for (int gr = 0; gr < NG; ++gr) {
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      u32 a[4];
      kfrag(gr, j, a);
      mma(acc, a[0], a[1], a[2], a[3], qf[gr][2 * j], qf[gr][2 * j + 1]);
    }
    const float s0 = f16_to_f32(kscale(gr, 0)), s1 = f16_to_f32(kscale(gr, 1));
    sv[0] = fmaf(acc[0], s0, sv[0]);
    sv[1] = fmaf(acc[1], s0, sv[1]);
    sv[2] = fmaf(acc[2], s1, sv[2]);
    sv[3] = fmaf(acc[3], s1, sv[3]);
  }
  k_done();
  const bool ok0 = start + g < hi, ok1 = start + g + 8 < hi;
  sv[0] = ok0 ? sv[0] * qk_scale : NEG_INF;
  sv[1] = ok0 ? sv[1] * qk_scale : NEG_INF;
  sv[2] = ok1 ? sv[2] * qk_scale : NEG_INF;
  sv[3] = ok1 ? sv[3] * qk_scale : NEG_INF;
  float x0 = fmaxf(sv[0], sv[2]), x1 = fmaxf(sv[1], sv[3]);
#pragma unroll
  for (int d = 4; d < 32; d <<= 1) {
    x0 = fmaxf(x0, __shfl_xor_sync(0xffffffffu, x0, d));
    x1 = fmaxf(x1, __shfl_xor_sync(0xffffffffu, x1, d));
  }
  const float n0 = run_max(m0, x0), n1 = run_max(m1, x1);  // finite: key `start` is live for every row
  const float a0 = rescale(m0, n0), a1 = rescale(m1, n1);
  const float p0 = ex2(sv[0] - n0), p1 = ex2(sv[1] - n1), p2 = ex2(sv[2] - n0), p3 = ex2(sv[3] - n1);
  l0 = fmaf(l0, a0, p0 + p2);
  l1 = fmaf(l1, a1, p1 + p3);
  m0 = n0;
  m1 = n1;
  // P^T's B fragments: keys 2c, 2c + 1 (and + 8) of head g
  const u32 pb0 = movtrans(pack_f16(p0, p1)), pb1 = movtrans(pack_f16(p2, p3));
  if (__any_sync(0xffffffffu, a0 != 1.f || a1 != 1.f)) {  // x * 1 = x: skipping it changes no bits
#pragma unroll
    for (int gr = 0; gr < NG; ++gr)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        float* acc = o[gr][i];
        acc[0] *= a0;
        acc[1] *= a1;
        acc[2] *= a0;
        acc[3] *= a1;
      }
  }
#pragma unroll
  for (int gr = 0; gr < NG; ++gr) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      u32 a[4];
      vfrag(gr, i, a);
      mma(o[gr][i], a[0], a[1], a[2], a[3], pb0, pb1);
    }
  }
}

// both kernels' arguments (kernels/attn_cuda.py's split passes them)
#define ATTN_ARGS                                                                                                   \
  const u16 *__restrict__ Q, const signed char *__restrict__ K, const signed char *__restrict__ V,                  \
      const u16 *__restrict__ KS, const u16 *__restrict__ VS, const void *__restrict__ SLOTS,                      \
      const void *__restrict__ QPOS, part_t *__restrict__ OP, float *__restrict__ LSE, long long sqb,             \
      long long sqt, long long sqh, long long sks, long long skh, long long svs, long long svh, long long ssks,     \
      long long sskh, long long ssvs, long long ssvh, long long spb, long long spt, long long ssl, float qk_scale, \
      int T, int H, int HKV, int G, int KV_LEN, int CHUNK, int MIN_CHUNK, int NUM_SPLITS

extern "C" __global__ void __launch_bounds__(32, 8)  // 8 warps an SM
attn_split(ATTN_ARGS) {
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2, c = lane & 3;
  const int t = blockIdx.z;
  const int s = blockIdx.x;
  const int b = blockIdx.y / HKV, hkv = blockIdx.y % HKV;
  const u32 mg = magic_reg(HKV);
  // this token's key range of split s (empty past the token)
  int lo, hi;
  key_range((int)load_index(QPOS, b * spb + t * spt, POS64), s, CHUNK, MIN_CHUNK, NUM_SPLITS, KV_LEN, lo, hi);
  if (hi <= lo) return;  // this split is past the token: the combine does not read it
  const long long slot = load_index(SLOTS, b * ssl, SLOT64);
  const signed char* kb = K + slot * sks + hkv * skh;
  const signed char* vb = V + slot * svs + hkv * svh;
  const u16* ksb = KS + slot * ssks + hkv * sskh;
  const u16* vsb = VS + slot * ssvs + hkv * ssvh;

  // q row g (head hkv * G + g; zero past G) as fp16, dims 64 G + 16 c .. + 15 of each group: the B fragments
  u32 qf[NG][8];
  {
    const u16* qrow = Q + b * sqb + (long long)t * sqt + (long long)(hkv * G + min(g, G - 1)) * sqh;
#pragma unroll
    for (int gr = 0; gr < NG; ++gr) q_words(qrow, g < G, gr, c, qf[gr]);
  }
  float o[NG][4][4];
#pragma unroll
  for (int gr = 0; gr < NG; ++gr)
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[gr][i][e] = 0.f;
  float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.f, l1 = 0.f;  // rows 2c, 2c + 1: running max, this lane's share of the sum

  // its K and V in a register double buffer, each step's loads issued as soon as the step before has
  // used the registers. K codes of keys g, g + 8 (16 bytes a group) and their scales; V codes of keys 2c, 2c + 1,
  // 2c + 8, 2c + 9 (8 bytes a group) and their scales
  U4 kc[2][NG];
  u16 ksc[2][NG];
  U2 vc[4][NG];
  u16 vsc[4][NG];
  auto load_k_step = [&](int start) {
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
      for (int gr = 0; gr < NG; ++gr) {
        kc[r][gr] = load_k(kb, k_key(start, g, r), hi, gr, c);
        ksc[r][gr] = load_scale(ksb, k_key(start, g, r), hi, gr);
      }
  };
  auto load_v_step = [&](int start) {
#pragma unroll
    for (int r = 0; r < 4; ++r)
#pragma unroll
      for (int gr = 0; gr < NG; ++gr) {
        vc[r][gr] = load_v(vb, v_key(start, c, r), hi, gr, g);
        vsc[r][gr] = load_scale(vsb, v_key(start, c, r), hi, gr);
      }
  };
  load_k_step(lo);
  load_v_step(lo);
  for (int start = lo; start < hi; start += STEP) {
    const int next = start + STEP;
    auto kfrag = [&](int gr, int j, u32* a) { k_frag(word4(kc[0][gr], j), word4(kc[1][gr], j), a, mg); };
    auto kscale = [&](int gr, int r) { return ksc[r][gr]; };
    auto k_done = [&]() {
      if (next < hi) load_k_step(next);
    };
    auto vfrag = [&](int gr, int i, u32* a) {
      v_frag(vc[0][gr], vc[1][gr], vc[2][gr], vc[3][gr], pair16(vsc[0][gr], vsc[1][gr]),
             pair16(vsc[2][gr], vsc[3][gr]), i, a, mg);
    };
    token_step(kfrag, vfrag, kscale, k_done, qf, o, m0, m1, l0, l1, start, hi, qk_scale, g);
    if (next < hi) load_v_step(next);
  }
#pragma unroll
  for (int d = 4; d < 32; d <<= 1) {
    l0 += __shfl_xor_sync(0xffffffffu, l0, d);
    l1 += __shfl_xor_sync(0xffffffffu, l1, d);
  }
  // lane holds, of heads 2c and 2c + 1, head dims 64 G + 8 g + (0 .. 7): o[G][i][0 / 2] and o[G][i][1 / 3]
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int n = 2 * c + r;
    if (n >= G) continue;
    const int h = hkv * G + n;
    const float l = r ? l1 : l0, m = r ? m1 : m0, inv = 1.f / l;
    const long long ri = ((long long)(b * T + t) * H + h) * NUM_SPLITS + s;
    part_t* dst = OP + ri * HD;
#pragma unroll
    for (int gr = 0; gr < NG; ++gr) {
      float v[8];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        v[2 * i] = o[gr][i][r] * inv;
        v[2 * i + 1] = o[gr][i][2 + r] * inv;
      }
      store_part8(dst + 64 * gr + 8 * g, v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7]);
    }
    if (g == 0) LSE[ri] = m + lg2(l);
  }
}

// ---------------------------------------------------------------------------------------------------------------
// attn_verify: all T x G query rows of one (row b, kv head) over one key range, one warp a 16-row m tile
#define KSTR (HD % 128 ? HD : HD + 64)  // bytes a key in a K stage: keys g, g + 1 of a load phase on other banks
#define VSTR (HD + 16)                   // in a V stage: keys 2c (c = 0 .. 3) of a load phase on four bank groups
// the dynamic shared memory of a block of `nw` warps: VDEPTH stages (K codes, V codes, K scales, V scales), then
// (QSMEM) q's fragments [warp][group][j][lane]
#define STAGE_BYTES (STEP * KSTR + STEP * VSTR + 4 * STEP * NG)
#define QFRAG_BYTES(nw) (QSMEM ? (nw) * NG * 4 * 32 * 16 : 0)
#define VERIFY_SMEM(nw) (VDEPTH * STAGE_BYTES + QFRAG_BYTES(nw))
// (kernels/attn_cuda.py's verify_smem mirrors it; a launch with less traps)

__device__ __forceinline__ u32 smem_addr(const void* p) {
  u32 a;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
  return a;
}

// a 16-byte / 4-byte asynchronous copy to shared address `dst`, `bytes` of it read (the rest zero-filled)
__device__ __forceinline__ void cp16(u32 dst, const void* src, int bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(bytes));
}

__device__ __forceinline__ void cp4(u32 dst, const void* src, int bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst), "l"(src), "r"(bytes));
}

__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(VDEPTH - 2) : "memory"); }


// The verify kernels' shared parts (attn_verify, and on sm_90a attn_verify_wg).
// The arguments that place a block's query rows: batch row b, kv head hkv, split s, T x G rows from r0
#define VERIFY_ROW_ARGS Q, QPOS, sqb, sqt, sqh, spb, spt, b, hkv, s, G, rows, r0, CHUNK, MIN_CHUNK, NUM_SPLITS, KV_LEN
#define VERIFY_ROW_PARAMS                                                                                        \
  const u16 *__restrict__ Q, const void *__restrict__ QPOS, long long sqb, long long sqt, long long sqh,         \
      long long spb, long long spt, int b, int hkv, int s, int G, int rows, int r0, int CHUNK, int MIN_CHUNK,    \
      int NUM_SPLITS, int KV_LEN

// Row b's cache slot, kv head hkv: its K and V codes and scales
#define VERIFY_CACHE_ARGS K, V, KS, VS, SLOTS, b, ssl, hkv, sks, skh, svs, svh, ssks, sskh, ssvs, ssvh
__device__ __forceinline__ void verify_cache(const signed char* K, const signed char* V, const u16* KS, const u16* VS,
                                             const void* SLOTS, int b, long long ssl, int hkv, long long sks,
                                             long long skh, long long svs, long long svh, long long ssks,
                                             long long sskh, long long ssvs, long long ssvh, const signed char*& kb,
                                             const signed char*& vb, const u16*& ksb, const u16*& vsb) {
  const long long slot = load_index(SLOTS, b * ssl, SLOT64);
  kb = K + slot * sks + hkv * skh;
  vb = V + slot * svs + hkv * svh;
  ksb = KS + slot * ssks + hkv * sskh;
  vsb = VS + slot * ssvs + hkv * ssvh;
}

// This lane's rows rb + g (h = 0) and rb + g + 8 (h = 1): token, head, key range of split s, and q's A fragments
// [group][mma j][a0 .. a3] (rows g, g + 8's words 2j, 2j + 1)
__device__ __forceinline__ void verify_rows(VERIFY_ROW_PARAMS, int rb, int g, int c, int (&rlo)[2], int (&rhi)[2],
                                            u32 (&qa)[NG][4][4]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = rb + g + 8 * h;
    const bool ok = r < rows;
    const int t = ok ? r / G : 0, n = ok ? r % G : 0;
    rlo[h] = rhi[h] = 0;
    if (ok)
      key_range((int)load_index(QPOS, b * spb + t * spt, POS64), s, CHUNK, MIN_CHUNK, NUM_SPLITS, KV_LEN, rlo[h],
                rhi[h]);
    const u16* qrow = Q + b * sqb + (long long)t * sqt + (long long)(hkv * G + n) * sqh;
#pragma unroll
    for (int gr = 0; gr < NG; ++gr) {
      u32 w[8];
      q_words(qrow, ok, gr, c, w);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        qa[gr][j][h] = w[2 * j];
        qa[gr][j][2 + h] = w[2 * j + 1];
      }
    }
  }
}

// The union of the key ranges of rows r0 .. r_end - 1, which the block walks (each starts on a multiple of STEP, so
// a row meets whole steps of its own range and whole steps outside it); false when it is empty
__device__ __forceinline__ bool verify_union(VERIFY_ROW_PARAMS, int r_end, int& ulo, int& uhi) {
  ulo = KV_LEN;
  uhi = 0;
  const int t_end = (min(rows, r_end) - 1) / G;
  for (int t = r0 / G; t <= t_end; ++t) {
    int lw, hw;
    key_range((int)load_index(QPOS, b * spb + t * spt, POS64), s, CHUNK, MIN_CHUNK, NUM_SPLITS, KV_LEN, lw, hw);
    if (hw > lw) {
      ulo = min(ulo, lw);
      uhi = max(uhi, hw);
    }
  }
  return uhi > ulo;
}

// Step `step`'s codes and scales into stage step % VDEPTH at shared address sm0, keys from uhi on zero (as
// attn_split loads them); one commit group a call (empty past the last step). NT: the block's threads when the
// caller knows them (the copies' loop unrolled), 0: blockDim.x
template <int NT = 0>
__device__ __forceinline__ void verify_issue(int step, int nsteps, int ulo, int uhi, const signed char* kb,
                                             const signed char* vb, const u16* ksb, const u16* vsb, u32 sm0) {
  if (step < nsteps) {
    const int start = ulo + step * STEP, live = uhi - start;
    const u32 st = sm0 + (step % VDEPTH) * STAGE_BYTES;
    constexpr int KC = HD / 16;  // 16-byte chunks a key: chunk j = key j / KC, bytes 16 (j % KC) ..
    const int live_chunks = live * KC;
    const signed char* ksrc = kb + (long long)start * HD;
    const signed char* vsrc = vb + (long long)start * HD;
    auto chunk = [&](int j) {
      const bool ok = j < live_chunks;  // else nothing read (from an address in bounds), zeros written
      cp16(st + 16 * j + (j / KC) * (KSTR - HD), ok ? ksrc + 16 * j : kb, ok ? 16 : 0);
      cp16(st + STEP * KSTR + 16 * j + (j / KC) * (VSTR - HD), ok ? vsrc + 16 * j : vb, ok ? 16 : 0);
    };
    if (NT) {
#pragma unroll
      for (int i = 0; i < (STEP * KC + (NT ? NT : 1) - 1) / (NT ? NT : 1); ++i) {
        const int j = threadIdx.x + i * NT;
        if (STEP * KC % (NT ? NT : 1) == 0 || j < STEP * KC) chunk(j);
      }
    } else {
      for (int j = threadIdx.x; j < STEP * KC; j += blockDim.x) chunk(j);
    }
    constexpr int SW = STEP * NG / 2;  // 4-byte words of a step's scales (<= 32)
    if (threadIdx.x < SW) {
      const int j = threadIdx.x;
      // the word's two halves are keys 2j / NG and (2j + 1) / NG: copy the live ones (a prefix)
      const int bytes = ((2 * j) / NG < live ? 2 : 0) + ((2 * j + 1) / NG < live ? 2 : 0);
      const long long src = (long long)start * NG + (bytes ? 2 * j : 0);
      cp4(st + STEP * (KSTR + VSTR) + 4 * j, ksb + src, bytes);
      cp4(st + STEP * (KSTR + VSTR) + 2 * STEP * NG + 4 * j, vsb + src, bytes);
    }
  }
  cp_commit();
}

// Scale group gr's sums (acc0: keys 2c, 2c + 1 of rows g, g + 8; acc1: keys 2c + 8, 2c + 9) times their keys'
// scales (kss: the stage's K scales [key][group]) into the step's scores sv
__device__ __forceinline__ void verify_scale(float (&sv)[2][4], const float* acc0, const float* acc1, const u16* kss,
                                             int gr, int c) {
  const float s0 = f16_to_f32(kss[2 * c * NG + gr]), s1 = f16_to_f32(kss[(2 * c + 1) * NG + gr]);
  const float s8 = f16_to_f32(kss[(2 * c + 8) * NG + gr]), s9 = f16_to_f32(kss[(2 * c + 9) * NG + gr]);
  sv[0][0] = fmaf(acc0[0], s0, sv[0][0]);
  sv[0][1] = fmaf(acc0[1], s1, sv[0][1]);
  sv[0][2] = fmaf(acc0[2], s0, sv[0][2]);
  sv[0][3] = fmaf(acc0[3], s1, sv[0][3]);
  sv[1][0] = fmaf(acc1[0], s8, sv[1][0]);
  sv[1][1] = fmaf(acc1[1], s9, sv[1][1]);
  sv[1][2] = fmaf(acc1[2], s8, sv[1][2]);
  sv[1][3] = fmaf(acc1[3], s9, sv[1][3]);
}

// The step's online softmax for the lane's two rows: masks (a row's keys outside [lo, hi) are -inf; a step outside
// its range leaves the row as it is: scale 1, p = 0, the steps attn_split does not take), the running max m, the
// key-pair sums lp; al: each row's rescale of O, pa: P's A fragments (rows g, g + 8 x keys 2c, 2c + 1 and 2c + 8,
// 2c + 9 in fp16). True when a row of the warp moved its max: O needs its rescale (x * 1 = x: skipping it changes no
// bits)
__device__ __forceinline__ bool verify_softmax(float (&sv)[2][4], int start, const int (&rlo)[2], const int (&rhi)[2],
                                               float qk_scale, int c, float (&m)[2], float (&lp)[2][2], float (&al)[2],
                                               u32 (&pa)[4]) {
  float pr[2][4];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const bool live = start >= rlo[h] && start < rhi[h];  // key `start` is the row's: the max is finite
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int key = start + 8 * nt + 2 * c + e;
        float& x = sv[nt][2 * h + e];
        x = key < rhi[h] ? x * qk_scale : NEG_INF;
      }
    float x = fmaxf(fmaxf(sv[0][2 * h], sv[0][2 * h + 1]), fmaxf(sv[1][2 * h], sv[1][2 * h + 1]));
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
    const float n = live ? run_max(m[h], x) : m[h];
    al[h] = rescale(m[h], n);
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) pr[nt][2 * h + e] = live ? ex2(sv[nt][2 * h + e] - n) : 0.f;
    if (live) {
      lp[h][0] = fmaf(lp[h][0], al[h], pr[0][2 * h] + pr[1][2 * h]);
      lp[h][1] = fmaf(lp[h][1], al[h], pr[0][2 * h + 1] + pr[1][2 * h + 1]);
    }
    m[h] = n;
  }
  pa[0] = pack_f16(pr[0][0], pr[0][1]);
  pa[1] = pack_f16(pr[0][2], pr[0][3]);
  pa[2] = pack_f16(pr[1][0], pr[1][1]);
  pa[3] = pack_f16(pr[1][2], pr[1][3]);
  return __any_sync(0xffffffffu, al[0] != 1.f || al[1] != 1.f);
}

// The rows' sums in attn_split's tree: key pairs g' and g' ^ 1 (in the lane), then g' ^ 2 (lane c ^ 1), g' ^ 4 (c ^ 2)
__device__ __forceinline__ void verify_sums(const float (&lp)[2][2], float (&l)[2]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l[h] = lp[h][0] + lp[h][1];
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
  }
}

// The end of a verify block: the lane's rows rb + g + 8 h (h = 0, 1) summed (verify_sums: l), each one's
// log2-sum-exp written and its partial output row returned in out[h] (null: no row, or no keys of it in split s:
// nothing to write, the combine skips it)
__device__ __forceinline__ void verify_finish(const float (&lp)[2][2], const float (&m)[2], int rb, int c, int rows,
                                              const int (&rlo)[2], const int (&rhi)[2], int b, int T, int H, int hkv,
                                              int G, int NUM_SPLITS, int s, part_t* OP, float* LSE, float (&l)[2],
                                              part_t* (&out)[2]) {
  verify_sums(lp, l);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = rb + 8 * h;
    out[h] = nullptr;
    if (r >= rows || rhi[h] <= rlo[h]) continue;
    const long long ri = ((long long)(b * T + r / G) * H + hkv * G + r % G) * NUM_SPLITS + s;
    out[h] = OP + ri * HD;
    if (c == 0) LSE[ri] = m[h] + lg2(l[h]);
  }
}

#ifdef VMAXREG
#define VERIFY_BOUNDS __maxnreg__(VMAXREG)
#else
#define VERIFY_BOUNDS __launch_bounds__(256, 1)
#endif
extern "C" __global__ void VERIFY_BOUNDS
attn_verify(ATTN_ARGS) {
  extern __shared__ __align__(16) unsigned char dsm[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
  {
    u32 dyn;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn));
    if (dyn < (u32)VERIFY_SMEM(nw)) __trap();
  }
  // stage b: K codes at dsm + b * STAGE_BYTES, then V codes, K scales, V scales
#define KSM(b) ((const signed char*)dsm + (b) * STAGE_BYTES)
#define VSM(b) (KSM(b) + STEP * KSTR)
#define KSSM(b) ((const u16*)(VSM(b) + STEP * VSTR))
#define VSSM(b) (KSSM(b) + STEP * NG)
#if QSMEM
  U4* qsm = (U4*)(dsm + VDEPTH * STAGE_BYTES);  // [warp][group][j][lane]: each lane's own
#endif
  const int g = lane >> 2, c = lane & 3;
  const int s = blockIdx.x;
  const int b = blockIdx.y / HKV, hkv = blockIdx.y % HKV;
  const int rows = T * G, r0 = blockIdx.z * 16 * nw;
  const u32 mg = magic_reg(HKV);
  int rlo[2], rhi[2];
  u32 qa[NG][4][4];  // A fragments: [group][mma j][a0 .. a3] = rows g, g + 8's words 2j, 2j + 1
  verify_rows(VERIFY_ROW_ARGS, r0 + 16 * warp, g, c, rlo, rhi, qa);
#if QSMEM
#pragma unroll
  for (int gr = 0; gr < NG; ++gr)
#pragma unroll
    for (int j = 0; j < 4; ++j)
      qsm[((warp * NG + gr) * 4 + j) * 32 + lane] = U4{qa[gr][j][0], qa[gr][j][1], qa[gr][j][2], qa[gr][j][3]};
#endif
  int ulo, uhi;
  if (!verify_union(VERIFY_ROW_ARGS, r0 + 16 * nw, ulo, uhi)) return;  // uniform over the block
  const signed char *kb, *vb;
  const u16 *ksb, *vsb;
  verify_cache(VERIFY_CACHE_ARGS, kb, vb, ksb, vsb);
  const int nsteps = (uhi - ulo + STEP - 1) / STEP;

  const u32 sm0 = smem_addr(dsm);
  auto issue = [&](int step) { verify_issue(step, nsteps, ulo, uhi, kb, vb, ksb, vsb, sm0); };

  float o[NG][4][2][4];  // O n tiles (group, i, head dim + 0 / 1): rows g, g + 8 x head dims 64 gr + 16 c + 2 i (+ 8)
#pragma unroll
  for (int gr = 0; gr < NG; ++gr)
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int e = 0; e < 8; ++e) o[gr][i][e >> 2][e & 3] = 0.f;
  float m[2] = {NEG_INF, NEG_INF};
  float lp[2][2] = {{0.f, 0.f}, {0.f, 0.f}};  // row h's sums of key pairs (2c, 2c + 8) and (2c + 1, 2c + 9)

#pragma unroll 1
  for (int e = 0; e < VDEPTH - 1; ++e) issue(e);
#pragma unroll 1
  for (int step = 0; step < nsteps; ++step) {
    cp_wait();
    __syncthreads();  // step's stage is in; every warp is done with the stage the next issue overwrites
    issue(step + VDEPTH - 1);
    const int buf = step % VDEPTH, start = ulo + step * STEP;
    const signed char* ks = KSM(buf);
    const signed char* vs = VSM(buf);
    const u16* kss = KSSM(buf);
    const u16* vss = VSSM(buf);
    // S: n tile 0 = keys 2c, 2c + 1 (rows g, g + 8), n tile 1 = keys 2c + 8, 2c + 9
    float sv[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
    for (int gr = 0; gr < NG; ++gr) {
      const U4 k0 = *(const U4*)(ks + g * KSTR + 64 * gr + 16 * c);
      const U4 k1 = *(const U4*)(ks + (g + 8) * KSTR + 64 * gr + 16 * c);
      float acc0[4] = {0.f, 0.f, 0.f, 0.f}, acc1[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        u32 a[4];
        k_frag(word4(k0, j), word4(k1, j), a, mg);
#if QSMEM
        const U4 qv = qsm[((warp * NG + gr) * 4 + j) * 32 + lane];
        mma(acc0, qv.x, qv.y, qv.z, qv.w, a[0], a[2]);
        mma(acc1, qv.x, qv.y, qv.z, qv.w, a[1], a[3]);
#else
        mma(acc0, qa[gr][j][0], qa[gr][j][1], qa[gr][j][2], qa[gr][j][3], a[0], a[2]);
        mma(acc1, qa[gr][j][0], qa[gr][j][1], qa[gr][j][2], qa[gr][j][3], a[1], a[3]);
#endif
      }
      verify_scale(sv, acc0, acc1, kss, gr, c);
    }
    float al[2];
    u32 pa[4];
    if (verify_softmax(sv, start, rlo, rhi, qk_scale, c, m, lp, al, pa)) {
#pragma unroll
      for (int gr = 0; gr < NG; ++gr)
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
          for (int hh = 0; hh < 2; ++hh) {
            float* acc = o[gr][i][hh];
            acc[0] *= al[0];
            acc[1] *= al[0];
            acc[2] *= al[1];
            acc[3] *= al[1];
          }
    }
#pragma unroll
    for (int gr = 0; gr < NG; ++gr) {
      const U2 x = *(const U2*)(vs + 2 * c * VSTR + 64 * gr + 8 * g);
      const U2 y = *(const U2*)(vs + (2 * c + 1) * VSTR + 64 * gr + 8 * g);
      const U2 xb = *(const U2*)(vs + (2 * c + 8) * VSTR + 64 * gr + 8 * g);
      const U2 yb = *(const U2*)(vs + (2 * c + 9) * VSTR + 64 * gr + 8 * g);
      const u32 s01 = pair16(vss[2 * c * NG + gr], vss[(2 * c + 1) * NG + gr]);
      const u32 s89 = pair16(vss[(2 * c + 8) * NG + gr], vss[(2 * c + 9) * NG + gr]);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        u32 a[4];
        v_frag(x, y, xb, yb, s01, s89, i, a, mg);
        mma(o[gr][i][0], pa[0], pa[1], pa[2], pa[3], a[0], a[2]);
        mma(o[gr][i][1], pa[0], pa[1], pa[2], pa[3], a[1], a[3]);
      }
    }
  }
  float l[2];
  part_t* out[2];
  verify_finish(lp, m, r0 + 16 * warp + g, c, rows, rlo, rhi, b, T, H, hkv, G, NUM_SPLITS, s, OP, LSE, l, out);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    part_t* dst = out[h];
    if (!dst) continue;
    const float inv = 1.f / l[h];
#pragma unroll
    for (int gr = 0; gr < NG; ++gr) {
      float v[16];  // head dims 64 gr + 16 c + (0 .. 15)
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          v[2 * i + hh] = o[gr][i][hh][2 * h] * inv;
          v[8 + 2 * i + hh] = o[gr][i][hh][2 * h + 1] * inv;
        }
      store_part8(dst + 64 * gr + 16 * c, v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7]);
      store_part8(dst + 64 * gr + 16 * c + 8, v[8], v[9], v[10], v[11], v[12], v[13], v[14], v[15]);
    }
  }
}

#if WGV
// ---------------------------------------------------------------------------------------------------------------
// attn_verify_wg (sm_90a: kernels/attn_cuda.py builds it through NVRTC with WGV=1): attn_verify's products and softmax
// on Hopper's wgmma. A block is one warpgroup, 64 query rows (warp w: rows 16 w .., attn_verify's m tiles), and each
// step's K and V are made into fp16 once for the block in shared memory, not once a warp, in the layouts wgmma reads
// its B operand from (K-major, no swizzle: 8 x 8 core matrices, the two along k 128 bytes apart, 8-column groups 256):
//  - K' for S = Q K^T, a k16 block per (scale group gr, chunk j): key n's core-matrix row q holds the head dims that
//    attn_verify's MMA (gr, j) pairs with k = 2c', 2c' + 1 (q = 0) and 2c' + 8, 2c' + 9 (q = 1) for c' = 0 .. 3, i.e.
//    64 gr + 16 c' + 4 j + 2 q + (0, 1): the exact codes, as k_frag makes them.
//  - V' for O += P V: head dim d's row q holds keys 8 q .. 8 q + 7, their codes times their scales in fp16 (v_frag's
//    values).
// S per (gr, j) is wgmma.m64n16k16 with q's A fragments in registers (attn_verify's qa), the four of a group chained
// from zero; the group's sums then take their keys' scales (verify_scale) in group order. The softmax is
// verify_softmax; O per 64 head dims is wgmma.m64n64k16 with P's A fragments (attn_verify's pa), onto O. Every element
// so gets attn_verify's products, sums and order: its bits wherever wgmma gives mma.sync's.
#define WGV_KB (NG * 4 * 512)  // K': (gr, j) blocks of [key half][q][8 keys][16 bytes]
#define WGV_VB (HD * 32)       // V': [head dim / 8][q][8 dims][8 keys x 2 bytes]
#define WGV_SMEM (VDEPTH * STAGE_BYTES + WGV_KB + WGV_VB)  // (kernels/attn_cuda.py's wgv_smem mirrors it)

__device__ __forceinline__ unsigned long long wgv_desc(u32 addr) {  // B at addr: LBO 128 (along k), SBO 256 (along n)
  return (unsigned long long)((addr & 0x3FFFF) >> 4) | (8ull << 16) | (16ull << 32);
}
// d = A B (acc 0) or A B + d (acc 1), A from registers: 64 rows x 16 keys (S) ...
__device__ __forceinline__ void wgv_mma16(float* d, u32 a0, u32 a1, u32 a2, u32 a3, unsigned long long desc, int acc) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n16k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7}, "
               "{%8, %9, %10, %11}, %12, p, 1, 1, 0;\n}\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc), "r"(acc));
}
// ... and 64 rows x 64 head dims (O), always onto d
__device__ __forceinline__ void wgv_mma64(float* d, u32 a0, u32 a1, u32 a2, u32 a3, unsigned long long desc) {
  asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
               "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
               "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
               "{%32, %33, %34, %35}, %36, 1, 1, 1, 0;\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                 "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]),
                 "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]),
                 "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]),
                 "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc));
}
__device__ __forceinline__ void wgv_wait() {
  asm volatile("wgmma.commit_group.sync.aligned;\nwgmma.wait_group.sync.aligned 0;" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wgv_hold(float* d) {  // d is read only after wgv_wait (the compiler sees it written)
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// The step's K' and V' from the raw stage (ks, vs: codes; vss: V scales) at kp / vp, shared by the block's threads
__device__ __forceinline__ void wgv_convert(const signed char* ks, const signed char* vs, const u16* vss,
                                            unsigned char* kp, unsigned char* vp) {
  // K': item (key n, group gr, 16-byte chunk c') reads the chunk once and writes its pairs of the four (gr, j) blocks
#pragma unroll
  for (int i = 0; i < (STEP * NG * 4 + 127) / 128; ++i) {
    const int t = threadIdx.x + 128 * i;
    if (STEP * NG * 4 % 128 && t >= STEP * NG * 4) break;
    const int cc = t & 3, gr = (t >> 2) % NG, n = t / (4 * NG);
    const U4 v = *(const U4*)(ks + n * KSTR + 64 * gr + 16 * cc);
    unsigned char* row = kp + (gr * 4) * 512 + (n >> 3) * 256 + (n & 7) * 16 + 4 * cc;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const u32 w = word4(v, j) ^ FLIP;
      *(u32*)(row + j * 512) = codes01(w, MAGIC_BYTES);
      *(u32*)(row + j * 512 + 128) = codes23(w, MAGIC_BYTES);
    }
  }
  // V': item (4-byte word dw of head dims, key half kh) reads the word of its 8 keys and writes 4 rows of 8 keys
#pragma unroll
  for (int i = 0; i < (HD / 2 + 127) / 128; ++i) {
    const int t = threadIdx.x + 128 * i;
    if (HD / 2 % 128 && t >= HD / 2) break;
    const int dw = t % (HD / 4), kh = t / (HD / 4), gr = (4 * dw) / 64;
    u32 w[8], sp[4];
#pragma unroll
    for (int k = 0; k < 8; ++k) w[k] = *(const u32*)(vs + (8 * kh + k) * VSTR + 4 * dw) ^ FLIP;
#pragma unroll
    for (int p = 0; p < 4; ++p) sp[p] = pair16(vss[(8 * kh + 2 * p) * NG + gr], vss[(8 * kh + 2 * p + 1) * NG + gr]);
#pragma unroll
    for (int ee = 0; ee < 4; ++ee) {
      const int e = (ee + (dw >> 1)) & 3, d = 4 * dw + e;  // (rotated: a warp's stores on eight bank groups)
      const u32 sel = (u32)e | ((u32)(4 + e) << 4);       // byte e of keys 2p, 2p + 1 -> bytes 0, 1
      U4 r;
      r.x = hmul2(codes01(prmt(w[0], w[1], sel), MAGIC_BYTES), sp[0]);
      r.y = hmul2(codes01(prmt(w[2], w[3], sel), MAGIC_BYTES), sp[1]);
      r.z = hmul2(codes01(prmt(w[4], w[5], sel), MAGIC_BYTES), sp[2]);
      r.w = hmul2(codes01(prmt(w[6], w[7], sel), MAGIC_BYTES), sp[3]);
      *(U4*)(vp + (d >> 3) * 256 + kh * 128 + (d & 7) * 16) = r;
    }
  }
}

extern "C" __global__ void __launch_bounds__(128, 1)
attn_verify_wg(ATTN_ARGS) {
  extern __shared__ __align__(16) unsigned char dsm[];
  {
    u32 dyn;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn));
    if (dyn < (u32)WGV_SMEM) __trap();
  }
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, c = lane & 3;
  const int s = blockIdx.x;
  const int b = blockIdx.y / HKV, hkv = blockIdx.y % HKV;
  const int rows = T * G, r0 = blockIdx.z * 64;
  int rlo[2], rhi[2];
  u32 qa[NG][4][4];
  verify_rows(VERIFY_ROW_ARGS, r0 + 16 * warp, g, c, rlo, rhi, qa);
  int ulo, uhi;
  if (!verify_union(VERIFY_ROW_ARGS, r0 + 64, ulo, uhi)) return;  // uniform over the block
  const signed char *kb, *vb;
  const u16 *ksb, *vsb;
  verify_cache(VERIFY_CACHE_ARGS, kb, vb, ksb, vsb);
  const int nsteps = (uhi - ulo + STEP - 1) / STEP;
  const u32 sm0 = smem_addr(dsm);
  unsigned char* kp = dsm + VDEPTH * STAGE_BYTES;
  unsigned char* vp = kp + WGV_KB;
  // K' and V' descriptors: a block's start address field (16-byte units) moved on from these
  const unsigned long long kdesc = wgv_desc(sm0 + VDEPTH * STAGE_BYTES);
  const unsigned long long vdesc = wgv_desc(sm0 + VDEPTH * STAGE_BYTES + WGV_KB);
  float o[NG][32];  // O per 64 head dims cc: [4 j + i] = rows g (i < 2) / g + 8, head dims 64 cc + 8 j + 2 c + (i & 1)
#pragma unroll
  for (int cc = 0; cc < NG; ++cc)
#pragma unroll
    for (int i = 0; i < 32; ++i) o[cc][i] = 0.f;
  float m[2] = {NEG_INF, NEG_INF};
  float lp[2][2] = {{0.f, 0.f}, {0.f, 0.f}};
#pragma unroll 1
  for (int e = 0; e < VDEPTH - 1; ++e) verify_issue<128>(e, nsteps, ulo, uhi, kb, vb, ksb, vsb, sm0);
#pragma unroll 1
  for (int step = 0; step < nsteps; ++step) {
    cp_wait();
    __syncthreads();  // the step's stage is in; every warp's MMAs of the step before (K', V') are done
    verify_issue<128>(step + VDEPTH - 1, nsteps, ulo, uhi, kb, vb, ksb, vsb, sm0);
    const int buf = step % VDEPTH, start = ulo + step * STEP;
    wgv_convert(KSM(buf), VSM(buf), VSSM(buf), kp, vp);
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // the stores, seen by the MMAs
    __syncthreads();
    const u16* kss = KSSM(buf);
    float sv[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
    for (int gr = 0; gr < NG; ++gr) {
      float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};  // (overwritten: the first MMA does not add)
      asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
      for (int j = 0; j < 4; ++j)
        wgv_mma16(acc, qa[gr][j][0], qa[gr][j][1], qa[gr][j][2], qa[gr][j][3],
                  kdesc + (gr * 4 + j) * (512 >> 4), j > 0);
      wgv_wait();
      wgv_hold<8>(acc);
      verify_scale(sv, acc, acc + 4, kss, gr, c);
    }
    float al[2];  // the rows' rescales, P's A fragments; O rescaled when a row of the warp moved its max
    u32 pa[4];
    if (verify_softmax(sv, start, rlo, rhi, qk_scale, c, m, lp, al, pa)) {
#pragma unroll
      for (int i = 0; i < 32 * NG; ++i) o[i / 32][i % 32] *= al[(i >> 1) & 1];
    }
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
    for (int cc = 0; cc < NG; ++cc) wgv_mma64(o[cc], pa[0], pa[1], pa[2], pa[3], vdesc + cc * (2048 >> 4));
    wgv_wait();
#pragma unroll
    for (int cc = 0; cc < NG; ++cc) wgv_hold<32>(o[cc]);
  }
  float l[2];  // the rows' sums, their partial output rows (written when not null)
  part_t* out[2];
  verify_finish(lp, m, r0 + 16 * warp + g, c, rows, rlo, rhi, b, T, H, hkv, G, NUM_SPLITS, s, OP, LSE, l, out);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float inv = 1.f / l[h];
#pragma unroll
    for (int cc = 0; cc < NG && out[h]; ++cc)
#pragma unroll
      for (int j = 0; j < 8; ++j)  // head dims 64 cc + 8 j + 2 c, + 1 of row g + 8 h
        store_part2(out[h] + 64 * cc + 8 * j + 2 * c, o[cc][4 * j + 2 * h] * inv, o[cc][4 * j + 2 * h + 1] * inv);
  }
}
#endif
