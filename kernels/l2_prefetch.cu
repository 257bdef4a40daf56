// Pull a byte range of global memory into L2 ahead of the kernel that will read it (kernels/qmv_cuda.l2_prefetch).
// Nothing is read into registers and nothing is written: the only effect is on where the bytes are cached, so a
// prefetch can run beside any kernel on a side stream. Thread i takes bytes [i * chunk, (i + 1) * chunk).
//   sm_90+: one cp.async.bulk.prefetch.L2 a thread (the TMA unit fetches the chunk; 16-byte granules, so a range's
//           last < 16 bytes are left out); earlier GPUs: one prefetch.global.L2 per 128-byte line.
// Compiled at run time (CuPy / NVRTC) for the device's architecture.

extern "C" __global__ void l2_prefetch(const char* __restrict__ base, long long nbytes, int chunk) {
  const long long start = ((long long)blockIdx.x * blockDim.x + threadIdx.x) * chunk;
  if (start >= nbytes) return;
  const long long left = nbytes - start;
  const unsigned size = (unsigned)(left < chunk ? left : chunk);
#if __CUDA_ARCH__ >= 900
  const unsigned whole = size & ~15u;  // the bulk copy's size is a multiple of 16 (and the address 16-aligned)
  if (whole) asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(base + start), "r"(whole) : "memory");
#else
  for (unsigned off = 0; off < size; off += 128) asm volatile("prefetch.global.L2 [%0];" ::"l"(base + start + off));
#endif
}
