//! x86-64 base64 encoding kernel, chosen at run time: AVX-512 VBMI, after Muła and Lemire,
//! "Base64 encoding and decoding at almost the speed of a memory copy" (2019). Per 48 input
//! bytes, one byte permute puts each 3-byte group into a 32-bit lane, one multishift pulls out
//! the four 6-bit fields, one byte permute maps them to the alphabet.
//!
//! It is about twice as fast as base64-simd 0.8's AVX2 path (docs/benchmarks.md). Our AVX2
//! kernel (Muła's shuffle/multiply scheme) is no faster than base64-simd's, so without AVX-512
//! VBMI base64-simd does the whole job except streaming stores for large outputs.
//!
//! The kernels handle whole blocks only; `b64` finishes the tails with base64-simd. Decoding
//! uses the same paper's AVX-512 VBMI scheme (a 128-entry two-register byte lookup that also
//! flags invalid characters, two multiply-adds to pack 6-bit fields, one byte permute).

use std::arch::x86_64::*;
use std::sync::OnceLock;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    Avx512Vbmi,
    /// Our AVX2 kernel, for outputs large enough to stream; base64-simd below that.
    Avx2,
    /// base64-simd's own dispatch (AVX2, SSSE3) only.
    Portable,
}

impl Isa {
    pub const ALL: [Isa; 3] = [Isa::Avx512Vbmi, Isa::Avx2, Isa::Portable];

    /// The name `r3srv.settings.base64_isa` and `r3srv.serial.encoder_isa()` use.
    pub fn name(self) -> &'static str {
        match self {
            Isa::Avx512Vbmi => "avx512vbmi",
            Isa::Avx2 => "avx2",
            Isa::Portable => "portable",
        }
    }

    pub fn from_name(name: &str) -> Option<Isa> {
        Isa::ALL.into_iter().find(|isa| isa.name() == name)
    }
}

fn has_avx512_vbmi() -> bool {
    is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vbmi")
}

/// Every kernel this CPU can run, fastest first.
pub fn supported_isas() -> Vec<Isa> {
    let mut v = Vec::new();
    if has_avx512_vbmi() {
        v.push(Isa::Avx512Vbmi);
    }
    if is_x86_feature_detected!("avx2") {
        v.push(Isa::Avx2);
    }
    v.push(Isa::Portable);
    v
}

static ACTIVE: OnceLock<Isa> = OnceLock::new();

/// Fixes the kernel every later encode and decode uses, once per process: `wanted` when this
/// CPU has it (a slower one, to measure or to rule a kernel out), else the fastest. The first
/// call wins (r3srv.settings makes it on import of r3srv.serial); returns the kernel in use.
pub fn choose_isa(wanted: Option<Isa>) -> Isa {
    *ACTIVE.get_or_init(|| {
        let supported = supported_isas();
        match wanted {
            Some(isa) if supported.contains(&isa) => isa,
            _ => supported[0],
        }
    })
}

/// The kernel in use: the chosen one, or the fastest when none was chosen.
pub fn active_isa() -> Isa {
    choose_isa(None)
}

/// Encodes the longest prefix of `src` that is a multiple of 48 bytes; returns its length.
/// With `STREAM`, stores are non-temporal.
///
/// # Safety
/// The CPU must support AVX-512 F, BW and VBMI; `dst` must hold `src.len() / 3 * 4` bytes
/// and, with `STREAM`, be 64-byte aligned.
#[target_feature(enable = "avx512f,avx512bw,avx512vbmi")]
pub unsafe fn avx512_blocks<const STREAM: bool>(src: &[u8], dst: &mut [u8]) -> usize {
    let blocks = src.len() / 48;
    assert!(dst.len() >= blocks * 64);
    let shuffle = _mm512_setr_epi32(
        0x01020001, 0x04050304, 0x07080607, 0x0a0b090a, 0x0d0e0c0d, 0x10110f10, 0x13141213, 0x16171516, 0x191a1819,
        0x1c1d1b1c, 0x1f201e1f, 0x22232122, 0x25262425, 0x28292728, 0x2b2c2a2b, 0x2e2f2d2e,
    );
    let shifts = _mm512_set1_epi64(0x3036242a1016040a);
    let alphabet =
        _mm512_loadu_si512(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/".as_ptr() as *const _);
    let mut s = src.as_ptr();
    let mut d = dst.as_mut_ptr();
    let mut i = 0;
    macro_rules! block {
        ($k:expr) => {{
            let v = _mm512_loadu_si512(s.add(48 * $k) as *const _);
            let v = _mm512_permutexvar_epi8(shuffle, v);
            let v = _mm512_multishift_epi64_epi8(shifts, v);
            let out = _mm512_permutexvar_epi8(v, alphabet);
            if STREAM {
                _mm512_stream_si512(d.add(64 * $k) as *mut _, out);
            } else {
                _mm512_storeu_si512(d.add(64 * $k) as *mut _, out);
            }
        }};
    }
    // 64-byte loads read 16 bytes past the block: only while they stay inside src.
    while i + 4 < blocks {
        block!(0);
        block!(1);
        block!(2);
        block!(3);
        s = s.add(192);
        d = d.add(256);
        i += 4;
    }
    while i + 1 < blocks {
        block!(0);
        s = s.add(48);
        d = d.add(64);
        i += 1;
    }
    if STREAM {
        _mm_sfence(); // order the streaming stores before anyone reads the text
    }
    if i < blocks {
        // The last block: a masked load that reads exactly its 48 bytes.
        let v = _mm512_maskz_loadu_epi8(0x0000_ffff_ffff_ffff, s as *const i8);
        let v = _mm512_permutexvar_epi8(shuffle, v);
        let v = _mm512_multishift_epi64_epi8(shifts, v);
        _mm512_storeu_si512(d as *mut _, _mm512_permutexvar_epi8(v, alphabet));
    }
    blocks * 48
}

/// Encodes 24-byte blocks while a 28-byte read stays inside `src`; returns the bytes encoded.
/// With `STREAM`, stores are non-temporal.
///
/// # Safety
/// The CPU must support AVX2; `dst` must hold `src.len() / 3 * 4` bytes and, with `STREAM`,
/// be 32-byte aligned.
#[target_feature(enable = "avx2")]
pub unsafe fn avx2_blocks<const STREAM: bool>(src: &[u8], dst: &mut [u8]) -> usize {
    let blocks = if src.len() >= 28 { (src.len() - 4) / 24 } else { 0 };
    assert!(dst.len() >= blocks * 32);
    // Per 128-bit lane: input bytes [a b c] become the 32-bit word [b a c b].
    let shuffle = _mm256_setr_epi8(
        1, 0, 2, 1, 4, 3, 5, 4, 7, 6, 8, 7, 10, 9, 11, 10, 1, 0, 2, 1, 4, 3, 5, 4, 7, 6, 8, 7, 10, 9, 11, 10,
    );
    let mask_ac = _mm256_set1_epi32(0x0fc0fc00);
    let mul_ac = _mm256_set1_epi32(0x04000040);
    let mask_bd = _mm256_set1_epi32(0x003f03f0);
    let mul_bd = _mm256_set1_epi32(0x01000010);
    // Offset from a 6-bit value to its character, by range: A-Z +65, a-z +71, 0-9 -4, '+' -19, '/' -16.
    let offsets = _mm256_setr_epi8(
        65, 71, -4, -4, -4, -4, -4, -4, -4, -4, -4, -4, -19, -16, 0, 0, 65, 71, -4, -4, -4, -4, -4, -4, -4, -4, -4, -4,
        -19, -16, 0, 0,
    );
    let c51 = _mm256_set1_epi8(51);
    let c25 = _mm256_set1_epi8(25);
    let mut s = src.as_ptr();
    let mut d = dst.as_mut_ptr();
    for _ in 0..blocks {
        let lo = _mm_loadu_si128(s as *const __m128i);
        let hi = _mm_loadu_si128(s.add(12) as *const __m128i);
        let v = _mm256_inserti128_si256::<1>(_mm256_castsi128_si256(lo), hi);
        let v = _mm256_shuffle_epi8(v, shuffle);
        let ac = _mm256_mulhi_epu16(_mm256_and_si256(v, mask_ac), mul_ac);
        let bd = _mm256_mullo_epi16(_mm256_and_si256(v, mask_bd), mul_bd);
        let idx = _mm256_or_si256(ac, bd);
        // Range: 0 for A-Z, 1 for a-z, 2..11 for digits, 12 '+', 13 '/'.
        let range = _mm256_sub_epi8(_mm256_subs_epu8(idx, c51), _mm256_cmpgt_epi8(idx, c25));
        let out = _mm256_add_epi8(idx, _mm256_shuffle_epi8(offsets, range));
        if STREAM {
            _mm256_stream_si256(d as *mut __m256i, out);
        } else {
            _mm256_storeu_si256(d as *mut __m256i, out);
        }
        s = s.add(24);
        d = d.add(32);
    }
    if STREAM {
        _mm_sfence();
    }
    blocks * 24
}

/// ASCII -> 6-bit value for the standard alphabet; 0x80 marks every other character.
const fn decode_lut() -> [u8; 128] {
    let alphabet = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut lut = [0x80u8; 128];
    let mut i = 0;
    while i < 64 {
        lut[alphabet[i] as usize] = i as u8;
        i += 1;
    }
    lut
}
static DECODE_LUT: [u8; 128] = decode_lut();

/// Decodes whole 64-char blocks of unpadded base64 (48 bytes each); returns the chars
/// consumed, or `Err` at the first block holding a character outside the alphabet ('='
/// included).
///
/// # Safety
/// The CPU must support AVX-512 F, BW and VBMI; `dst` must hold `src.len() / 4 * 3` bytes.
#[target_feature(enable = "avx512f,avx512bw,avx512vbmi")]
pub unsafe fn avx512_decode_blocks(src: &[u8], dst: &mut [u8]) -> Result<usize, crate::b64::InvalidBase64> {
    let blocks = src.len() / 64;
    assert!(dst.len() >= blocks * 48);
    let lut_lo = _mm512_loadu_si512(DECODE_LUT.as_ptr() as *const _);
    let lut_hi = _mm512_loadu_si512(DECODE_LUT.as_ptr().add(64) as *const _);
    // [a b c d] 6-bit values -> 16-bit (a << 6 | b), (c << 6 | d) -> 32-bit 24-bit group.
    let merge_pairs = _mm512_set1_epi32(0x01400140);
    let merge_quads = _mm512_set1_epi32(0x00011000);
    // The 24-bit group of dword i is bytes 2, 1, 0 of it, big end first.
    let mut pack = [0u8; 64];
    for i in 0..16 {
        pack[3 * i] = (4 * i + 2) as u8;
        pack[3 * i + 1] = (4 * i + 1) as u8;
        pack[3 * i + 2] = (4 * i) as u8;
    }
    let pack = _mm512_loadu_si512(pack.as_ptr() as *const _);
    let mut s = src.as_ptr();
    let mut d = dst.as_mut_ptr();
    for _ in 0..blocks {
        let chars = _mm512_loadu_si512(s as *const _);
        // Index bit 6 picks the register, bit 7 (non-ASCII) is caught by the check below.
        let values = _mm512_permutex2var_epi8(lut_lo, chars, lut_hi);
        if _mm512_movepi8_mask(_mm512_or_si512(values, chars)) != 0 {
            return Err(crate::b64::InvalidBase64);
        }
        let pairs = _mm512_maddubs_epi16(values, merge_pairs);
        let groups = _mm512_madd_epi16(pairs, merge_quads);
        let bytes = _mm512_permutexvar_epi8(pack, groups);
        _mm512_mask_storeu_epi8(d as *mut i8, 0x0000_ffff_ffff_ffff, bytes);
        s = s.add(64);
        d = d.add(48);
    }
    Ok(blocks * 64)
}
