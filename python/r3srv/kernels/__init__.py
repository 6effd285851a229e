"""The kernels the backends (r3srv.ops) choose from: torch references (test oracles), the Rust
core's CPU kernels (their thin wrappers here) and Triton kernels. Nothing here imports the
models or the ops, nor reads the settings: a backend passes what a kernel needs (its threads)."""
