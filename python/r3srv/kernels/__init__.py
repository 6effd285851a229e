"""The kernels behind the model's layers, one module each: the router (`router.py` picks among
the torch reference in `router_reference.py`, the fused Triton kernel and the Rust one), paged
decode attention, the recurrent layers' decode steps, the expert pass, RMSNorm, linear layers of
a few rows, and the q/k norms with RoPE. Triton kernels (`*_triton.py`, their launch grids in
`launch.py`) run on CUDA and, in tests, in Triton's interpreter on the CPU; the CPU kernels
(`*_cpu.py`) call the Rust core (`rust_core.py` loads its entry points); torch references are
the CPU fallback and the tests' oracles."""
