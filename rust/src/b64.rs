//! Base64 seams: encoding a byte stream that arrives in pieces (header, then rows) straight
//! into one output buffer, and decoding a padded base64 text at an arbitrary byte offset.
//! The SIMD kernels are in `b64_x86` (encoding) and base64-simd (decoding, tails, other CPUs);
//! this module stitches 3-byte groups across pieces.

use base64_simd::{Out, STANDARD};

/// Length of the padded base64 text for `n` input bytes.
pub const fn encoded_len(n: usize) -> usize {
    n.div_ceil(3) * 4
}

/// Encodes `src` (any length) into the front of `dst`, with padding; returns chars written.
///
/// On CPUs with AVX-512 VBMI the bulk goes through `b64_x86` (faster than base64-simd 0.8,
/// docs/encoding.md); the tail, and every byte on other CPUs, goes through base64-simd.
#[inline]
pub fn encode_into(src: &[u8], dst: &mut [u8]) -> usize {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: active_isa() only returns kernels this CPU supports (runtime detection).
        unsafe { encode_with(crate::b64_x86::active_isa(), src, dst) }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        encode_into_portable(src, dst)
    }
}

/// `encode_into` with a chosen kernel; for tests and measurement.
///
/// # Safety
/// The CPU must support `isa` (it must come from `b64_x86::supported_isas()` or
/// `active_isa()`): the kernels are compiled for AVX-512/AVX2 and are undefined behaviour
/// (SIGILL at best) elsewhere, so a safe signature would be unsound.
#[cfg(target_arch = "x86_64")]
pub unsafe fn encode_with(isa: crate::b64_x86::Isa, src: &[u8], dst: &mut [u8]) -> usize {
    use crate::b64_x86::{avx2_blocks, avx512_blocks, Isa};
    let mut done = 0;
    // Align dst to `align` with a few 3-byte groups (4 chars each; dst is 4-aligned in
    // practice), for streaming stores; returns the input bytes so encoded, or None.
    let align_head = |dst: &mut [u8], align: usize| -> Option<usize> {
        let misalign = dst.as_ptr().align_offset(align);
        misalign.is_multiple_of(4).then(|| {
            let groups = misalign / 4;
            encode_into_portable(&src[..groups * 3], &mut dst[..groups * 4]);
            groups * 3
        })
    };
    match isa {
        Isa::Avx512Vbmi if src.len() >= 96 => {
            // Outputs far larger than the caches: non-temporal stores skip reading every
            // destination line first.
            let head = if src.len() >= STREAM_MIN_LEN { align_head(dst, 64) } else { None };
            // SAFETY: the caller guarantees AVX-512 VBMI (this function's contract); `dst` holds
            // encoded_len(src.len()) >= src.len() / 3 * 4 chars from each start, and align_head
            // aligned it to 64 bytes for the streaming stores.
            done = match head {
                Some(head) => head + unsafe { avx512_blocks::<true>(&src[head..], &mut dst[head / 3 * 4..]) },
                None => unsafe { avx512_blocks::<false>(src, dst) },
            };
        }
        Isa::Avx2 if src.len() >= STREAM_MIN_LEN => {
            // Below the streaming size our AVX2 kernel is no faster than base64-simd's.
            if let Some(head) = align_head(dst, 32) {
                // SAFETY: the caller guarantees AVX2; `dst` is long enough (as above) and
                // align_head aligned it to 32 bytes for the streaming stores.
                done = head + unsafe { avx2_blocks::<true>(&src[head..], &mut dst[head / 3 * 4..]) };
            }
        }
        _ => {}
    }
    done / 3 * 4 + encode_into_portable(&src[done..], &mut dst[done / 3 * 4..])
}

/// From this input size on, the AVX-512 kernel uses non-temporal stores: they skip reading
/// every destination line of outputs far larger than the caches, but are slower for
/// cache-resident ones (docs/benchmarks.md), so small outputs keep plain stores.
pub const STREAM_MIN_LEN: usize = 1 << 20;

/// base64-simd alone (its own AVX2/SSSE3/NEON dispatch), for the tail and other CPUs.
pub fn encode_into_portable(src: &[u8], dst: &mut [u8]) -> usize {
    STANDARD.encode(src, Out::from_slice(dst)).len()
}

/// Writes base64 of the concatenation of every `write`n piece into `out`, which must be
/// exactly `encoded_len(total)` long. Pieces need not be multiples of 3: up to two bytes are
/// carried over to the next piece.
pub struct Base64Stream<'a> {
    out: &'a mut [u8],
    pos: usize,
    carry: [u8; 3],
    ncarry: usize,
}

impl<'a> Base64Stream<'a> {
    pub fn new(out: &'a mut [u8]) -> Self {
        Base64Stream { out, pos: 0, carry: [0; 3], ncarry: 0 }
    }

    pub fn write(&mut self, mut data: &[u8]) {
        if self.ncarry > 0 {
            let take = (3 - self.ncarry).min(data.len());
            self.carry[self.ncarry..self.ncarry + take].copy_from_slice(&data[..take]);
            self.ncarry += take;
            data = &data[take..];
            if self.ncarry < 3 {
                return;
            }
            self.pos += encode_into(&self.carry, &mut self.out[self.pos..]);
            self.ncarry = 0;
        }
        let whole = data.len() / 3 * 3;
        if whole > 0 {
            self.pos += encode_into(&data[..whole], &mut self.out[self.pos..]);
        }
        let rest = &data[whole..];
        self.carry[..rest.len()].copy_from_slice(rest);
        self.ncarry = rest.len();
    }

    /// Bytes needed to complete the carried 3-byte group (0 when none is open).
    pub fn open_group_needs(&self) -> usize {
        (3 - self.ncarry) % 3
    }

    /// Hands back the unwritten tail of the output, for a caller that encodes a large
    /// 3-aligned piece itself (e.g. on two threads). Only valid with no open group.
    pub fn split_tail(&mut self, chars: usize) -> &mut [u8] {
        debug_assert_eq!(self.ncarry, 0);
        let start = self.pos;
        self.pos += chars;
        &mut self.out[start..start + chars]
    }

    /// Flushes the open group with padding; returns the number of chars written in all.
    pub fn finish(mut self) -> usize {
        if self.ncarry > 0 {
            let n = self.ncarry;
            let carry = self.carry;
            self.pos += encode_into(&carry[..n], &mut self.out[self.pos..]);
        }
        self.pos
    }
}

/// Decodes the bytes `[start, start + dst.len())` of the payload that the padded base64 `text`
/// encodes, into `dst`. `text` must be a whole padded base64 text (length a multiple of 4),
/// and the range must lie within its decoded length.
pub fn decode_range(text: &[u8], start: usize, dst: &mut [u8]) -> Result<(), String> {
    let bad = || "invalid base64 in routed experts text".to_string();
    let short = || "routed experts text is truncated".to_string();
    let total_quads = text.len() / 4;
    let mut quad = start / 3;
    let mut skip = start % 3;
    let mut done = 0;
    // Quads before the last one carry no padding, so they decode straight into dst.
    if skip == 0 {
        let direct = (dst.len() / 3).min(total_quads.saturating_sub(1).saturating_sub(quad));
        if direct > 0 {
            decode_whole_quads(&text[quad * 4..(quad + direct) * 4], &mut dst[..direct * 3]).map_err(|_| bad())?;
            done = direct * 3;
            quad += direct;
        }
    }
    // The rest (a leading partial group, the padded last quad, a short tail): quad by quad.
    while done < dst.len() {
        let q = text.get(quad * 4..quad * 4 + 4).ok_or_else(short)?;
        let mut tmp = [0u8; 3];
        let got = STANDARD.decode(q, Out::from_slice(&mut tmp)).map_err(|_| bad())?.len();
        if got <= skip {
            return Err(short());
        }
        if got != 3 && quad + 1 != total_quads {
            return Err(bad()); // padding before the end
        }
        let take = (got - skip).min(dst.len() - done);
        dst[done..done + take].copy_from_slice(&tmp[skip..skip + take]);
        done += take;
        quad += 1;
        if skip != 0 {
            skip = 0;
            // Now 3-aligned: decode the unpadded middle directly.
            let direct = ((dst.len() - done) / 3).min(total_quads.saturating_sub(1).saturating_sub(quad));
            if direct > 0 {
                let chars = &text[quad * 4..(quad + direct) * 4];
                decode_whole_quads(chars, &mut dst[done..done + direct * 3]).map_err(|_| bad())?;
                done += direct * 3;
                quad += direct;
            }
        }
    }
    Ok(())
}

/// A character outside the base64 alphabet, or padding where none may be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InvalidBase64;

/// Decodes base64 that must hold whole, unpadded quads (`chars.len()` a multiple of 4) into
/// `out` (`chars.len() / 4 * 3` bytes).
pub fn decode_whole_quads(chars: &[u8], out: &mut [u8]) -> Result<(), InvalidBase64> {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: active_isa() only returns kernels this CPU supports (runtime detection).
        unsafe { decode_whole_quads_with(crate::b64_x86::active_isa(), chars, out) }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        decode_portable(chars, out, 0)
    }
}

/// `decode_whole_quads` with a chosen kernel; for tests and measurement.
///
/// # Safety
/// The CPU must support `isa`, as for `encode_with`.
#[cfg(target_arch = "x86_64")]
pub unsafe fn decode_whole_quads_with(
    isa: crate::b64_x86::Isa,
    chars: &[u8],
    out: &mut [u8],
) -> Result<(), InvalidBase64> {
    debug_assert!(chars.len().is_multiple_of(4) && out.len() == chars.len() / 4 * 3);
    let mut done = 0;
    if chars.len() >= 64 && isa == crate::b64_x86::Isa::Avx512Vbmi {
        // SAFETY: the caller guarantees AVX-512 VBMI; `out` holds chars.len() / 4 * 3 bytes.
        done = unsafe { crate::b64_x86::avx512_decode_blocks(chars, out)? };
    }
    decode_portable(chars, out, done)
}

/// base64-simd for `chars[done..]` (whole quads), after a SIMD kernel did `done` chars.
fn decode_portable(chars: &[u8], out: &mut [u8], done: usize) -> Result<(), InvalidBase64> {
    let rest = &chars[done..];
    if rest.is_empty() {
        return Ok(());
    }
    let n = STANDARD.decode(rest, Out::from_slice(&mut out[done / 4 * 3..])).map_err(|_| InvalidBase64)?.len();
    if n == rest.len() / 4 * 3 {
        Ok(())
    } else {
        Err(InvalidBase64) // padding inside the text
    }
}

/// Exact decoded length of a padded base64 text, or an error if its length or padding is wrong.
pub fn decoded_len(text: &[u8]) -> Result<usize, String> {
    if !text.len().is_multiple_of(4) {
        return Err(format!(
            "routed experts text has length {}, not a multiple of 4 (truncated or unpadded base64)",
            text.len()
        ));
    }
    let pad = text.iter().rev().take(2).take_while(|&&c| c == b'=').count();
    Ok(text.len() / 4 * 3 - pad)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reference(data: &[u8]) -> Vec<u8> {
        // A plain scalar encoder, independent of base64-simd.
        const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
        let mut out = Vec::new();
        for g in data.chunks(3) {
            let b = [g[0], *g.get(1).unwrap_or(&0), *g.get(2).unwrap_or(&0)];
            let n = (b[0] as u32) << 16 | (b[1] as u32) << 8 | b[2] as u32;
            for k in 0..4 {
                if k <= g.len() {
                    out.push(A[(n >> (18 - 6 * k) & 63) as usize]);
                } else {
                    out.push(b'=');
                }
            }
        }
        out
    }

    fn bytes(n: usize, seed: u32) -> Vec<u8> {
        let mut x = seed.wrapping_mul(2654435761).wrapping_add(1);
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                x as u8
            })
            .collect()
    }

    #[test]
    fn stream_equals_one_shot_for_every_split() {
        for n in [0usize, 1, 2, 3, 4, 5, 127, 128, 129, 130, 1000] {
            let data = bytes(n, n as u32);
            let want = reference(&data);
            for a in 0..=n.min(7) {
                for b in a..=n.min(a + 5) {
                    let mut out = vec![0u8; encoded_len(n)];
                    let mut s = Base64Stream::new(&mut out);
                    s.write(&data[..a]);
                    s.write(&data[a..b]);
                    s.write(&data[b..]);
                    assert_eq!(s.finish(), want.len());
                    assert_eq!(out, want, "n={n} a={a} b={b}");
                }
            }
        }
    }

    #[test]
    fn simd_paths_equal_scalar_reference() {
        #[cfg(target_arch = "x86_64")]
        let isas = crate::b64_x86::supported_isas();
        for n in
            [0usize, 1, 27, 28, 31, 32, 33, 47, 48, 95, 96, 97, 143, 144, 145, 1000, 4096, 65536 + 7, (1 << 20) + 5]
        {
            let data = bytes(n, 11 + n as u32);
            let want = reference(&data);
            let mut b = vec![0u8; encoded_len(n)];
            assert_eq!(encode_into_portable(&data, &mut b), want.len());
            assert!(b == want, "n={n}");
            // Every kernel this CPU has, at several destination alignments (the streaming
            // path aligns itself).
            let mut a = vec![0u8; encoded_len(n) + 64];
            for shift in [0, 4, 8, 60] {
                let dst = &mut a[shift..shift + encoded_len(n)];
                assert_eq!(encode_into(&data, dst), want.len());
                assert!(*dst == want[..], "n={n} shift={shift}");
                #[cfg(target_arch = "x86_64")]
                for &isa in &isas {
                    dst.fill(0);
                    // SAFETY: `isa` comes from supported_isas(): this CPU runs it.
                    assert_eq!(unsafe { encode_with(isa, &data, dst) }, want.len());
                    assert!(*dst == want[..], "n={n} shift={shift} isa={isa:?}");
                    if isa == crate::b64_x86::Isa::Avx2 {
                        // The plain-store AVX2 kernel (used only by measurements) as well.
                        dst.fill(0);
                        // SAFETY: this CPU has AVX2 (supported_isas() listed it).
                        let done = unsafe { crate::b64_x86::avx2_blocks::<false>(&data, dst) };
                        encode_into_portable(&data[done..], &mut dst[done / 3 * 4..]);
                        assert!(*dst == want[..], "n={n} shift={shift} avx2 plain");
                    }
                }
            }
        }
    }

    /// A plain scalar decoder of whole quads, independent of base64-simd and the kernels.
    fn reference_decode(chars: &[u8]) -> Option<Vec<u8>> {
        const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
        let value = |c: u8| A.iter().position(|&a| a == c).map(|v| v as u32);
        let mut out = Vec::new();
        for quad in chars.chunks(4) {
            let mut n = 0u32;
            for &c in quad {
                n = n << 6 | value(c)?;
            }
            out.extend_from_slice(&n.to_be_bytes()[1..]);
        }
        Some(out)
    }

    /// Kernels this CPU has; the others are named on stderr as skipped (`cargo test -- --nocapture`).
    #[cfg(target_arch = "x86_64")]
    fn kernels_to_test(what: &str) -> Vec<crate::b64_x86::Isa> {
        let supported = crate::b64_x86::supported_isas();
        for isa in crate::b64_x86::Isa::ALL {
            if !supported.contains(&isa) {
                eprintln!("{what}: skipped the {} kernel: this CPU does not have it", isa.name());
            }
        }
        supported
    }

    /// Random lengths (with the kernels' block edges) and random bytes, from a fixed seed.
    fn random_cases() -> Vec<Vec<u8>> {
        let mut x = 0x9e37_79b9u32;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x
        };
        let mut lengths: Vec<usize> = vec![0, 1, 2, 3, 47, 48, 49, 95, 96, 97, 191, 192, 193, (1 << 20) + 2];
        lengths.extend((0..200).map(|_| (next() % 5000) as usize));
        lengths.into_iter().map(|n| bytes(n, next())).collect()
    }

    #[test]
    #[cfg(target_arch = "x86_64")]
    fn every_encode_kernel_equals_scalar_on_random_inputs() {
        let kernels = kernels_to_test("encode");
        for data in random_cases() {
            let want = reference(&data);
            let mut dst = vec![0u8; want.len()];
            for &isa in &kernels {
                dst.fill(0);
                // SAFETY: `isa` comes from supported_isas(): this CPU runs it.
                assert_eq!(unsafe { encode_with(isa, &data, &mut dst) }, want.len());
                assert!(dst == want, "n={} isa={}", data.len(), isa.name());
            }
        }
    }

    #[test]
    #[cfg(target_arch = "x86_64")]
    fn every_decode_kernel_equals_scalar_on_random_inputs() {
        let kernels = kernels_to_test("decode");
        for (case, data) in random_cases().into_iter().enumerate() {
            let mut text = reference(&data[..data.len() / 3 * 3]); // whole quads, no padding
            let mut out = vec![0u8; text.len() / 4 * 3];
            for &isa in &kernels {
                // SAFETY: `isa` comes from supported_isas(): this CPU runs it.
                unsafe { decode_whole_quads_with(isa, &text, &mut out) }.unwrap();
                assert_eq!(Some(out.clone()), reference_decode(&text), "n={} isa={}", text.len(), isa.name());
            }
            if text.is_empty() {
                continue;
            }
            // One byte of the text replaced by a random one: the kernels agree with the scalar
            // decoder on whether it is still base64, and on the bytes when it is.
            let pos = (case * 7919) % text.len();
            text[pos] = data.get(case % data.len().max(1)).copied().unwrap_or(0) ^ (case as u8);
            let want = reference_decode(&text);
            for &isa in &kernels {
                // SAFETY: as above.
                let got = unsafe { decode_whole_quads_with(isa, &text, &mut out) };
                assert_eq!(got.ok().map(|()| out.clone()), want, "n={} pos={pos} isa={}", text.len(), isa.name());
            }
        }
    }

    #[test]
    fn stream_of_single_bytes() {
        let data = bytes(301, 7);
        let mut out = vec![0u8; encoded_len(data.len())];
        let mut s = Base64Stream::new(&mut out);
        for b in &data {
            s.write(std::slice::from_ref(b));
        }
        s.finish();
        assert_eq!(out, reference(&data));
    }

    #[test]
    fn decode_any_range() {
        for n in [1usize, 2, 3, 4, 5, 6, 7, 64, 128, 200, 385] {
            let data = bytes(n, 3 + n as u32);
            let text = reference(&data);
            assert_eq!(decoded_len(&text).unwrap(), n);
            for start in 0..n {
                for len in [0, 1, 2, 3, 4, n - start] {
                    if start + len > n {
                        continue;
                    }
                    let mut dst = vec![0u8; len];
                    decode_range(&text, start, &mut dst).unwrap();
                    assert_eq!(dst, &data[start..start + len], "n={n} start={start} len={len}");
                }
            }
        }
    }

    #[test]
    fn whole_quads_decode_and_reject_every_bad_character() {
        for n in [0usize, 3, 45, 48, 96, 99, 480, 3000] {
            let data = bytes(n, 5 + n as u32);
            let text = reference(&data);
            let mut out = vec![0u8; n];
            decode_whole_quads(&text, &mut out).unwrap();
            assert_eq!(out, data, "n={n}");
            // One bad character anywhere (in a SIMD block or in the tail) is an error.
            for pos in (0..text.len()).step_by(7) {
                for bad in [b'=', b'!', b'\n', 0x80u8, 0xff, b'-', b'_'] {
                    let mut t = text.clone();
                    t[pos] = bad;
                    assert!(decode_whole_quads(&t, &mut out).is_err(), "n={n} pos={pos} bad={bad}");
                }
            }
        }
        // Every one of the 256 byte values in a 64-char block.
        let text = reference(&bytes(48, 9));
        let valid: Vec<u8> = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/".to_vec();
        let mut out = vec![0u8; 48];
        for c in 0..=255u8 {
            let mut t = text.clone();
            t[17] = c;
            assert_eq!(decode_whole_quads(&t, &mut out).is_ok(), valid.contains(&c), "byte {c}");
        }
    }

    #[test]
    fn decode_rejects_garbage_and_short_text() {
        let text = reference(&bytes(30, 1));
        let mut bad = text.clone();
        bad[9] = b'!';
        let mut dst = vec![0u8; 30];
        assert!(decode_range(&bad, 0, &mut dst).is_err());
        assert!(decoded_len(&text[..text.len() - 1]).is_err());
        let mut dst = vec![0u8; 31];
        assert!(decode_range(&text, 0, &mut dst).is_err());
        let mut dst = vec![0u8; 2];
        assert!(decode_range(&text, 29, &mut dst).is_err());
    }
}
