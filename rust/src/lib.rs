//! r3srv core: byte-identical, zero-copy `base64(np.save(array))` for routed experts, and its
//! inverse; and CPU kernels: the expert pass (`expert_pairs`), linear layers of a few rows
//! (`linear`; large chunks through `matmul`), rows each projected by its own matrix (`pair_projection`, the LoRA
//! expert pass), paged decode attention (`paged_attn`), prefill attention over a step's prompts (`paged_prefill`), RMSNorm of float32 rows (`rms_norm`),
//! top-k expert selection (`router_cpu`) and an attention layer's q/k norms and RoPE (`qk_rope`).
//! Everything but `python` builds and tests without Python (`cargo test`).
pub mod aligned;
#[cfg(target_arch = "x86_64")]
pub mod amx;
pub mod b64;
#[cfg(target_arch = "x86_64")]
pub mod b64_x86;
#[cfg(target_arch = "x86_64")]
mod bf16_512;
pub mod decode;
pub mod encode;
pub mod expert_pairs;
pub mod flash_amx;
pub mod flash_prefill;
pub mod formats;
pub mod huge_pages;
pub mod layout;
pub mod linear;
pub mod lists;
pub mod matmul;
pub mod matmul_bf16;
pub mod npy_header;
pub mod paged_attn;
#[cfg(target_arch = "x86_64")]
mod paged_attn_512;
#[cfg(target_arch = "x86_64")]
mod paged_attn_dots;
pub mod paged_prefill;
pub mod paged_prefill_bf16;
pub mod paged_prefill_f32;
pub mod pair_panels;
pub mod pair_projection;
mod prefetch;
pub mod qk_rope;
pub mod rms_norm;
pub mod router_cpu;
pub mod row_tiles;
#[cfg(test)]
mod testing;
pub mod workers;

#[cfg(feature = "python")]
mod python;
