"""Router kernels: the torch reference (CPU path and test oracle) and the fused Triton kernel."""
