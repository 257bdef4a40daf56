// One-shot collectives between the NR ranks of a tensor-parallel group, each rank one process, over CUDA IPC
// (kernels/ipc_collectives.py): every rank reads the others' buffers directly (NVLink / PCIe peer access, or the same
// GPU), so a small message costs one kernel and one flag exchange instead of NCCL's protocol, and the launch can be
// captured in a CUDA graph (fixed buffers, the epochs counted on the device).
//
// Each rank's IPC region: flags [NBLK][NR] u32 (flags[b][r]: the last epoch rank r's block b reached), counters
// [NBLK] u32 (this rank's block b's own epoch), padded to HEAD bytes; then two data buffers of MAXB bytes, used by
// epoch parity. Every call runs NBLK blocks on every rank, block b taking the same elements on every rank:
//   1. block b copies its elements of x into its rank's buffer (e & 1), e = its counter + 1;
//   2. it writes e into flags[b][rank] of every rank (release, system scope) and waits until each rank's flag for b
//      reached e (acquire);
//   3. it reads the NR buffers' elements (L2, not L1) and combines them: reduce - the sum in rank order 0 .. NR - 1 in
//      fp32, rounded once to x's dtype (every rank the same bits); gather - rank r's [rows, cols] beside the others'
//      in out's rows.
// One barrier a call is enough: a rank writes buffer (e & 1) again only at epoch e + 2, after every rank's block b
// reached epoch e + 1, that is after their epoch-e kernels ended (a stream's kernels run in order), reads included.
//   DT  0 bf16, 1 fp16, 2 fp32 (the element type)
//   VEC 1: x / out 16-byte aligned with a whole number of 16-byte vectors (reduce), 0: element by element

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned long long u64;

#ifndef NR
#define NR 2
#endif
#ifndef DT
#define DT 0
#endif
#ifndef VEC
#define VEC 1
#endif
#ifndef NBLK
#define NBLK 32
#endif
#ifndef HEAD
#define HEAD 4096
#endif
#ifndef MAXB
#define MAXB (8 << 20)
#endif

#if DT == 2
typedef float T;
__device__ __forceinline__ float to_f(T v) { return v; }
__device__ __forceinline__ T from_f(float v) { return v; }
#else
typedef u16 T;
#if DT == 0
__device__ __forceinline__ float to_f(T v) { return __uint_as_float(((u32)v) << 16); }
__device__ __forceinline__ T from_f(float v) {  // round to nearest even, as torch's bf16 conversion
  u32 b = __float_as_uint(v);
  if ((b & 0x7fffffffu) > 0x7f800000u) return (T)((b >> 16) | 0x40u);  // NaN stays NaN
  b += 0x7fffu + ((b >> 16) & 1u);
  return (T)(b >> 16);
}
#else
__device__ __forceinline__ float to_f(T v) {
  float f;
  asm("{ .reg .f16 h; mov.b16 h, %1; cvt.f32.f16 %0, h; }" : "=f"(f) : "h"(v));
  return f;
}
__device__ __forceinline__ T from_f(float v) {
  T h;
  asm("{ .reg .f16 r; cvt.rn.f16.f32 r, %1; mov.b16 %0, r; }" : "=h"(h) : "f"(v));
  return h;
}
#endif
#endif

__device__ __forceinline__ void store_release(u32* p, u32 v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ u32 load_acquire(const u32* p) {
  u32 v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// step 2 for block b, after the caller's loop wrote the block's part of x into its buffer (step 1): the flag
// exchange; the caller reads the buffers after it (step 3)
__device__ __forceinline__ void exchange(const u64* regions, int rank, u32 e) {
  const int b = blockIdx.x;
  __syncthreads();  // the block's copies are done
  if (threadIdx.x < NR) {
    __threadfence_system();
    store_release((u32*)regions[threadIdx.x] + b * NR + rank, e);
    const u32* mine = (const u32*)regions[rank] + b * NR + threadIdx.x;
    while ((int)(load_acquire(mine) - e) < 0) {
    }
  }
  __syncthreads();
}

// this rank's block b's epoch counter (after the flags [NBLK][NR])
__device__ __forceinline__ volatile u32* counter(const u64* regions, int rank) {
  return (volatile u32*)((char*)regions[rank] + NBLK * NR * 4) + blockIdx.x;
}
__device__ __forceinline__ u32 epoch(const u64* regions, int rank) { return *counter(regions, rank) + 1; }
__device__ __forceinline__ void epoch_done(const u64* regions, int rank, u32 e) {
  __syncthreads();
  if (threadIdx.x == 0) *counter(regions, rank) = e;
}
__device__ __forceinline__ char* buffer(const u64* regions, int r, u32 e) {
  return (char*)regions[r] + HEAD + (size_t)(e & 1u) * MAXB;
}

// x [n] (in place) = the sum over ranks of their x, in rank order
extern "C" __global__ void __launch_bounds__(512) ipc_reduce(T* x, long long n, const u64* regions, int rank) {
  const u32 e = epoch(regions, rank);
  const long long stride = (long long)NBLK * blockDim.x, first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
#if VEC
  const long long nv = n / (16 / sizeof(T));
  uint4* mine = (uint4*)buffer(regions, rank, e);
  for (long long i = first; i < nv; i += stride) mine[i] = ((const uint4*)x)[i];
  exchange(regions, rank, e);
  constexpr int PER = 16 / sizeof(T);
  for (long long i = first; i < nv; i += stride) {
    float acc[PER];
#pragma unroll
    for (int r = 0; r < NR; ++r) {
      const uint4 v = __ldcg((const uint4*)buffer(regions, r, e) + i);
      const T* t = (const T*)&v;
#pragma unroll
      for (int j = 0; j < PER; ++j) acc[j] = r == 0 ? to_f(t[j]) : acc[j] + to_f(t[j]);
    }
    uint4 o;
    T* t = (T*)&o;
#pragma unroll
    for (int j = 0; j < PER; ++j) t[j] = from_f(acc[j]);
    ((uint4*)x)[i] = o;
  }
#else
  T* mine = (T*)buffer(regions, rank, e);
  for (long long i = first; i < n; i += stride) mine[i] = x[i];
  exchange(regions, rank, e);
  for (long long i = first; i < n; i += stride) {
    float acc = 0.f;
#pragma unroll
    for (int r = 0; r < NR; ++r) {
      const float v = to_f(__ldcg((const T*)buffer(regions, r, e) + i));
      acc = r == 0 ? v : acc + v;
    }
    x[i] = from_f(acc);
  }
#endif
  epoch_done(regions, rank, e);
}

// every rank's x [rows, cols] side by side: rank r's row i at out + i stride + r part (out's row stride and the
// columns between two ranks' parts, in elements: a column block of a wider gather). Each block reads back the
// elements it wrote, from every rank: the elements its flags cover
extern "C" __global__ void __launch_bounds__(512) ipc_gather(const T* x, T* out, long long rows, long long cols,
                                                            long long stride, long long part, const u64* regions,
                                                            int rank) {
  const u32 e = epoch(regions, rank);
  const long long step = (long long)NBLK * blockDim.x, first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  const long long n = rows * cols;
  T* mine = (T*)buffer(regions, rank, e);
  for (long long i = first; i < n; i += step) mine[i] = x[i];
  exchange(regions, rank, e);
  for (long long i = first; i < n; i += step) {
    const long long row = i / cols, c = i - row * cols;
#pragma unroll
    for (int r = 0; r < NR; ++r) out[row * stride + r * part + c] = __ldcg((const T*)buffer(regions, r, e) + i);
  }
  epoch_done(regions, rank, e);
}
