// Does Hopper's warpgroup MMA (wgmma.m64n8k16, A from registers, B from shared memory) give every output element
// the bits of the warp MMA (mma.sync.m16n8k16) that qmv uses? Issue 33's 64-row projections would move to wgmma; token
// invariance needs a 64-row verify row to keep a one-row launch's bits, so either the answer is yes, or the one-row
// kernel has to move to wgmma as well.
//
// Each block is one warpgroup (4 warps) and one trial: A [64 x 16 STEPS], B [16 STEPS x 8], bf16 (qmv's type) and
// fp16 (the attention kernels'), an fp32 start C.
// wgmma: warp w holds rows 16 w .. 16 w + 15 of A in mma.sync's A-fragment registers; B's K x 8 slice of a step sits in
// shared memory K-major without swizzle (two 8 x 8 core matrices, 128 bytes apart); D accumulates over the steps.
// mma.sync: each warp multiplies its own 16 rows, step by step, into its C-fragment registers. Both start from C
// (case "acc") or from zero (case "zero", wgmma's scale-d 0 on the first step).
// The host compares the two bit for bit, and each against an fp64 product (so a wrong fragment or descriptor layout
// reads as "layout WRONG", not as differing bits).
//
// Last, an m64n16k16 step says which of the descriptor's two byte offsets is the one along K when B has two core
// matrices along N (qmv's wgmma build assumes the leading one: WG_LBO / WG_SBO in kernels/qmv_cuda.cu).
//
// Build and run on an sm_90 GPU (gpu_check.sh wgmma):
//   nvcc -arch=sm_90a -O2 -o /tmp/probe_wgmma_bits scripts/probe_wgmma_bits.cu && /tmp/probe_wgmma_bits [trials]

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

typedef unsigned int u32;
typedef unsigned short u16;

#define STEPS 4  // k16 steps chained in one accumulator (a q4 / q5 group of 64 is four)

// F16: the inputs are fp16 (the attention kernels' type), else bf16 (qmv's); TY is the PTX type name
#define MMA16816(TY)                                                                                       \
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." TY "." TY ".f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, " \
               "{%8, %9}, {%0, %1, %2, %3};"                                                               \
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])                                            \
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1))
template <bool F16>
__device__ __forceinline__ void mma16816(float* d, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  if (F16)
    MMA16816("f16");
  else
    MMA16816("bf16");
}

__device__ __forceinline__ u32 smem_addr(const void* p) {
  u32 a;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
  return a;
}

// Shared-memory matrix descriptor, no swizzle: start address, leading and stride byte offsets (all >> 4). Both offsets
// are 128 bytes: B's two core matrices along K are 128 bytes apart and it has one along N, so the descriptor reads the
// same whichever of the two offsets the hardware takes for K.
__device__ __forceinline__ unsigned long long desc_of(const void* p) {
  const unsigned long long a = (smem_addr(p) & 0x3FFFF) >> 4;
  const unsigned long long off = 128 >> 4;
  return a | (off << 16) | (off << 32);
}

#define WGMMA_M64N8K16(TY)                                                                                 \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %9, 0;\n"                                                 \
               "wgmma.mma_async.sync.aligned.m64n8k16.f32." TY "." TY                                      \
               " {%0, %1, %2, %3}, {%4, %5, %6, %7}, %8, p, 1, 1, 0;\n}\n"                                 \
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])                                            \
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc), "r"(scale_d))
template <bool F16>
__device__ __forceinline__ void wgmma_m64n8k16(float* d, u32 a0, u32 a1, u32 a2, u32 a3, unsigned long long desc,
                                               int scale_d) {
  if (F16)
    WGMMA_M64N8K16("f16");
  else
    WGMMA_M64N8K16("bf16");
}

// A [trial][64][16 STEPS], B [trial][8][16 STEPS] (column n's K values in a row: the .col operand), C / outputs
// [trial][64][8]
template <bool F16>
__global__ void __launch_bounds__(128) probe(const u16* __restrict__ A, const u16* __restrict__ B,
                                             const float* __restrict__ C, float* __restrict__ out_w,
                                             float* __restrict__ out_m, int from_zero) {
  const int trial = blockIdx.x, tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, c = lane & 3;
  const int K = 16 * STEPS;
  const u16* a = A + (size_t)trial * 64 * K;
  const u16* b = B + (size_t)trial * 8 * K;
  const float* cc = C + (size_t)trial * 64 * 8;
  __shared__ __align__(128) u16 bs[STEPS][2][8][8];  // step, core matrix (k 0-7 / 8-15), n, k: K-major, no swizzle
  for (int i = tid; i < STEPS * 2 * 8 * 8; i += 128) {
    const int s = i / 128, cm = (i / 64) % 2, n = (i / 8) % 8, k = i % 8;
    bs[s][cm][n][k] = b[n * K + 16 * s + 8 * cm + k];
  }
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // generic-proxy stores, seen by the async proxy
  __syncthreads();
  const int r0 = 16 * warp + g, r1 = r0 + 8;
  auto pair = [](u16 lo, u16 hi) { return (u32)lo | ((u32)hi << 16); };
  float dw[4], dm[4];
  const float start[4] = {cc[r0 * 8 + 2 * c], cc[r0 * 8 + 2 * c + 1], cc[r1 * 8 + 2 * c], cc[r1 * 8 + 2 * c + 1]};
  for (int i = 0; i < 4; ++i) dw[i] = dm[i] = from_zero ? 0.f : start[i];
  for (int s = 0; s < STEPS; ++s) {
    const int k0 = 16 * s + 2 * c;
    const u32 a0 = pair(a[r0 * K + k0], a[r0 * K + k0 + 1]), a1 = pair(a[r1 * K + k0], a[r1 * K + k0 + 1]);
    const u32 a2 = pair(a[r0 * K + k0 + 8], a[r0 * K + k0 + 9]), a3 = pair(a[r1 * K + k0 + 8], a[r1 * K + k0 + 9]);
    const u32 b0 = pair(b[g * K + k0], b[g * K + k0 + 1]), b1 = pair(b[g * K + k0 + 8], b[g * K + k0 + 9]);
    mma16816<F16>(dm, a0, a1, a2, a3, b0, b1);
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
    wgmma_m64n8k16<F16>(dw, a0, a1, a2, a3, desc_of(&bs[s][0][0][0]), !(from_zero && s == 0));
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
  }
  float* ow = out_w + (size_t)trial * 64 * 8;
  float* om = out_m + (size_t)trial * 64 * 8;
  const int idx[4] = {r0 * 8 + 2 * c, r0 * 8 + 2 * c + 1, r1 * 8 + 2 * c, r1 * 8 + 2 * c + 1};
  for (int i = 0; i < 4; ++i) {
    ow[idx[i]] = dw[i];
    om[idx[i]] = dm[i];
  }
}

// The descriptor's two byte offsets with more than one core matrix along N (qmv's wgmma build, 8 NCOL tokens): B for
// 16 tokens [token group j][core matrix q along K][8 tokens][8 values], j 256 bytes apart and q 128. "swap" 0 puts
// 128 in the leading-offset field and 256 in the stride field (CUTLASS's reading of K-major without swizzle), 1 the
// other way round. One k16 step, from zero; out [trial][64][16].
__global__ void __launch_bounds__(128) probe_n16(const u16* __restrict__ A, const u16* __restrict__ B,
                                                 float* __restrict__ out, int swap) {
  const int trial = blockIdx.x, tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, c = lane & 3;
  const u16* a = A + (size_t)trial * 64 * 16;
  const u16* b = B + (size_t)trial * 16 * 16;
  __shared__ __align__(128) u16 bs[2][2][8][8];  // j, q, token, value
  for (int i = tid; i < 256; i += 128) {
    const int j = i / 128, q = (i / 64) % 2, n = (i / 8) % 8, k = i % 8;
    bs[j][q][n][k] = b[(8 * j + n) * 16 + 8 * q + k];
  }
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  __syncthreads();
  const int r0 = 16 * warp + g, r1 = r0 + 8;
  auto pair = [](u16 lo, u16 hi) { return (u32)lo | ((u32)hi << 16); };
  const u32 a0 = pair(a[r0 * 16 + 2 * c], a[r0 * 16 + 2 * c + 1]);
  const u32 a1 = pair(a[r1 * 16 + 2 * c], a[r1 * 16 + 2 * c + 1]);
  const u32 a2 = pair(a[r0 * 16 + 2 * c + 8], a[r0 * 16 + 2 * c + 9]);
  const u32 a3 = pair(a[r1 * 16 + 2 * c + 8], a[r1 * 16 + 2 * c + 9]);
  const unsigned long long lo = swap ? 256 : 128, st = swap ? 128 : 256;
  const unsigned long long desc = ((smem_addr(&bs[0][0][0][0]) & 0x3FFFF) >> 4) | ((lo >> 4) << 16) | ((st >> 4) << 32);
  float d[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, "
      "%12, 0, 1, 1, 0;\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc));
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
  asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
  float* o = out + (size_t)trial * 64 * 16;
  for (int j = 0; j < 2; ++j) {  // accumulator layout: per 8 columns j, rows g / g + 8, columns 8 j + 2 c, + 1
    o[r0 * 16 + 8 * j + 2 * c] = d[4 * j];
    o[r0 * 16 + 8 * j + 2 * c + 1] = d[4 * j + 1];
    o[r1 * 16 + 8 * j + 2 * c] = d[4 * j + 2];
    o[r1 * 16 + 8 * j + 2 * c + 1] = d[4 * j + 3];
  }
}

static u16 to_bf16(float f) {  // round to nearest even
  u32 u;
  std::memcpy(&u, &f, 4);
  u += 0x7FFF + ((u >> 16) & 1);
  return (u16)(u >> 16);
}

static u16 to_f16(float f) { return __half_as_ushort(__float2half_rn(f)); }  // (host functions of cuda_fp16.h)
static float from_f16(u16 h) { return __half2float(__ushort_as_half(h)); }

static float from_bf16(u16 h) {
  const u32 u = (u32)h << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

#define CHECK(x)                                                                            \
  do {                                                                                      \
    cudaError_t e = (x);                                                                    \
    if (e != cudaSuccess) {                                                                 \
      std::printf("probe_wgmma_bits: %s: %s\n", #x, cudaGetErrorString(e));                \
      return 1;                                                                             \
    }                                                                                       \
  } while (0)

int main(int argc, char** argv) {
  const int trials = argc > 1 ? std::atoi(argv[1]) : 2048;
  const int K = 16 * STEPS;
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device %s (sm_%d%d), %d trials of A [64 x %d] x B [%d x 8], %d k16 steps chained\n", prop.name,
              prop.major, prop.minor, trials, K, K, STEPS);
  std::mt19937 rng(1234);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::uniform_int_distribution<int> expo(-12, 12), code(-8, 7);
  // data: "mixed" has entries of widely spread magnitude (the sums round at many points); "codes" is qmv's case, A
  // holding exact small integers (weight codes) and B activations
  // (fp16 inputs for the attention kernels, bf16 for qmv)
  for (int run = 0; run < 4; ++run) {
    const int kind = run & 1;
    const bool f16 = run >= 2;
    auto to_h = [f16](float x) { return f16 ? to_f16(x) : to_bf16(x); };
    auto from_h = [f16](u16 h) { return f16 ? from_f16(h) : from_bf16(h); };
    std::vector<u16> a((size_t)trials * 64 * K), b((size_t)trials * 8 * K);
    std::vector<float> c((size_t)trials * 64 * 8);
    for (auto& v : a) v = to_h(kind ? (float)code(rng) : std::ldexp(normal(rng), expo(rng)));
    for (auto& v : b) v = to_h(std::ldexp(normal(rng), kind ? 0 : expo(rng)));
    for (auto& v : c) v = std::ldexp(normal(rng), expo(rng));
    u16 *da, *db;
    float *dc, *dw, *dm;
    CHECK(cudaMalloc(&da, a.size() * 2));
    CHECK(cudaMalloc(&db, b.size() * 2));
    CHECK(cudaMalloc(&dc, c.size() * 4));
    CHECK(cudaMalloc(&dw, c.size() * 4));
    CHECK(cudaMalloc(&dm, c.size() * 4));
    CHECK(cudaMemcpy(da, a.data(), a.size() * 2, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(db, b.data(), b.size() * 2, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(dc, c.data(), c.size() * 4, cudaMemcpyHostToDevice));
    for (int from_zero = 1; from_zero >= 0; --from_zero) {
      if (f16)
        probe<true><<<trials, 128>>>(da, db, dc, dw, dm, from_zero);
      else
        probe<false><<<trials, 128>>>(da, db, dc, dw, dm, from_zero);
      CHECK(cudaGetLastError());
      CHECK(cudaDeviceSynchronize());
      std::vector<float> w(c.size()), m(c.size());
      CHECK(cudaMemcpy(w.data(), dw, w.size() * 4, cudaMemcpyDeviceToHost));
      CHECK(cudaMemcpy(m.data(), dm, m.size() * 4, cudaMemcpyDeviceToHost));
      size_t same = 0, w_bad = 0, m_bad = 0;
      double worst_w = 0, worst_m = 0;
      for (int t = 0; t < trials; ++t)
        for (int r = 0; r < 64; ++r)
          for (int n = 0; n < 8; ++n) {
            const size_t o = ((size_t)t * 64 + r) * 8 + n;
            double ref = from_zero ? 0.0 : c[o], mag = from_zero ? 0.0 : std::fabs(c[o]);
            for (int k = 0; k < K; ++k) {
              const double p = (double)from_h(a[((size_t)t * 64 + r) * K + k]) *
                               (double)from_h(b[((size_t)t * 8 + n) * K + k]);
              ref += p;
              mag += std::fabs(p);
            }
            // fp32 accumulation over K products and a start: a bound of a few units of fp32 rounding of the
            // magnitudes summed
            const double tol = 1e-5 * mag + 1e-30;
            const double ew = std::fabs(w[o] - ref) / (mag + 1e-30), em = std::fabs(m[o] - ref) / (mag + 1e-30);
            worst_w = std::fmax(worst_w, ew);
            worst_m = std::fmax(worst_m, em);
            w_bad += std::fabs(w[o] - ref) > tol;
            m_bad += std::fabs(m[o] - ref) > tol;
            u32 bw, bm;
            std::memcpy(&bw, &w[o], 4);
            std::memcpy(&bm, &m[o], 4);
            same += bw == bm;
          }
      const size_t total = (size_t)trials * 64 * 8;
      std::printf("%-4s %-6s %-5s: wgmma == mma.sync bits in %zu of %zu elements (%.4f %%); vs fp64: wgmma %s "
                  "(worst %.2e of the magnitudes, %zu past 1e-5), mma.sync %s (worst %.2e, %zu past)\n",
                  f16 ? "f16" : "bf16", kind ? "codes" : "mixed", from_zero ? "zero" : "acc", same, total,
                  100.0 * same / total,
                  w_bad ? "layout WRONG?" : "ok", worst_w, w_bad, m_bad ? "WRONG?" : "ok", worst_m, m_bad);
    }
    cudaFree(da);
    cudaFree(db);
    cudaFree(dc);
    cudaFree(dw);
    cudaFree(dm);
  }
  {  // which way the descriptor's offsets go with two core matrices along N (and the accumulator layout at n16)
    std::vector<u16> a((size_t)trials * 64 * 16), b((size_t)trials * 16 * 16);
    for (auto& v : a) v = to_bf16(normal(rng));
    for (auto& v : b) v = to_bf16(normal(rng));
    u16 *da, *db;
    float* dout;
    CHECK(cudaMalloc(&da, a.size() * 2));
    CHECK(cudaMalloc(&db, b.size() * 2));
    CHECK(cudaMalloc(&dout, (size_t)trials * 64 * 16 * 4));
    CHECK(cudaMemcpy(da, a.data(), a.size() * 2, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(db, b.data(), b.size() * 2, cudaMemcpyHostToDevice));
    for (int swap = 0; swap < 2; ++swap) {
      probe_n16<<<trials, 128>>>(da, db, dout, swap);
      CHECK(cudaGetLastError());
      CHECK(cudaDeviceSynchronize());
      std::vector<float> o((size_t)trials * 64 * 16);
      CHECK(cudaMemcpy(o.data(), dout, o.size() * 4, cudaMemcpyDeviceToHost));
      size_t bad = 0;
      for (int t = 0; t < trials; ++t)
        for (int r = 0; r < 64; ++r)
          for (int n = 0; n < 16; ++n) {
            double ref = 0, mag = 0;
            for (int k = 0; k < 16; ++k) {
              const double p = (double)from_bf16(a[((size_t)t * 64 + r) * 16 + k]) *
                               (double)from_bf16(b[((size_t)t * 16 + n) * 16 + k]);
              ref += p;
              mag += std::fabs(p);
            }
            bad += std::fabs(o[((size_t)t * 64 + r) * 16 + n] - ref) > 1e-5 * mag + 1e-30;
          }
      std::printf("n16 descriptor, leading offset %s, stride offset %s: %s (%zu of %zu elements off the fp64 product)"
                  "\n", swap ? "256 (N)" : "128 (K)", swap ? "128 (K)" : "256 (N)", bad ? "WRONG" : "right", bad,
                  (size_t)trials * 64 * 16);
    }
    cudaFree(da);
    cudaFree(db);
    cudaFree(dout);
  }
  return 0;
}
