"""The model: its config, the hybrid forward (eager and through fused kernels), the per-slot caches, the weights bound
to a device, the vision tower, rotary tables, the DFlash drafter network, and the forwards captured as CUDA graphs."""
