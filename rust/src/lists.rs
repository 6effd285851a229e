//! Ragged per-token signals as wire text, in one pass from their CSR form (`values` row after
//! row, `offsets[i]..offsets[i + 1]` the values of row i): sampling masks as a JSON list of
//! integer lists (SGLang's `output_token_sampling_mask`, vLLM's `sampling_mask`), float lists
//! as JSON (SGLang's `output_token_sampling_logprobs`, flat or one list per row).
//!
//! The JSON is what Python's `json.dumps(obj, separators=(",", ":"))` writes for the same lists
//! (`r3srv.serial`'s references): floats as `float.__repr__` writes them (the shortest digits
//! that read back to the same double), `NaN`, `Infinity` and `-Infinity` for the others.

use std::fmt::Write as _;

#[cfg(feature = "python")]
pub mod python;

/// Checks that `offsets` cut `len` values into rows: starts at 0, never decreases, ends at `len`.
pub fn check_offsets(offsets: &[i64], len: usize) -> Result<(), String> {
    let Some((&first, rest)) = offsets.split_first() else {
        return Err("offsets must hold at least one entry (0)".into());
    };
    if first != 0 {
        return Err(format!("offsets must start at 0, not {first}"));
    }
    let mut prev = first;
    for &o in rest {
        if o < prev {
            return Err(format!("offsets must not decrease ({prev} then {o})"));
        }
        prev = o;
    }
    if prev as u64 != len as u64 {
        return Err(format!("offsets end at {prev}, but there are {len} values"));
    }
    Ok(())
}

/// Decimal digits of an integer, written into `out`.
fn push_int(out: &mut Vec<u8>, v: i64) {
    if v < 0 {
        out.push(b'-');
    }
    crate::npy_header::push_u64(out, v.unsigned_abs());
}

/// `[[a,b],[c],[]]`: each row's integers, `json.dumps` of the nested lists.
pub fn write_int_lists<T: Copy + Into<i64>>(values: &[T], offsets: &[i64], out: &mut Vec<u8>) {
    out.push(b'[');
    for (r, w) in offsets.windows(2).enumerate() {
        if r > 0 {
            out.push(b',');
        }
        out.push(b'[');
        for (j, &v) in values[w[0] as usize..w[1] as usize].iter().enumerate() {
            if j > 0 {
                out.push(b',');
            }
            push_int(out, v.into());
        }
        out.push(b']');
    }
    out.push(b']');
}

/// A fixed buffer that `write!` fills (a float's text is at most 24 bytes).
struct Small {
    buf: [u8; 40],
    len: usize,
}

impl std::fmt::Write for Small {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        let end = self.len + s.len();
        if end > self.buf.len() {
            return Err(std::fmt::Error);
        }
        self.buf[self.len..end].copy_from_slice(s.as_bytes());
        self.len = end;
        Ok(())
    }
}

/// `float.__repr__` (and `json.dumps`) of a double: the shortest digits that read back to it
/// (Rust's `{:e}` gives as many digits as Python's repr algorithm; where several strings of
/// that length read back, the choice is made here as Python makes it), laid out as
/// Python lays them out: plain decimals while the exponent is in [-4, 16), with `.0` for whole
/// numbers; otherwise `d.ddde-05` (a sign and at least two exponent digits).
pub fn push_float(out: &mut Vec<u8>, x: f64) {
    if x.is_nan() {
        out.extend_from_slice(b"NaN");
        return;
    }
    if x.is_infinite() {
        out.extend_from_slice(if x > 0.0 { b"Infinity" } else { b"-Infinity" });
        return;
    }
    let mut sci = Small { buf: [0; 40], len: 0 };
    write!(sci, "{:e}", x.abs()).expect("a double's text fits 40 bytes");
    // Several strings of the shortest length can read back to x when its exact decimal value
    // ends in a 5 right after them (float32 values often do); Python writes the correctly
    // rounded one (ties to even), which a fixed precision of that many digits gives, unless x
    // is a power of two whose nearest such string falls outside its narrower lower half-gap.
    let digits = sci.buf[..sci.len].iter().take_while(|&&c| c != b'e').filter(|c| c.is_ascii_digit()).count();
    let mut rounded = Small { buf: [0; 40], len: 0 };
    write!(rounded, "{:.*e}", digits - 1, x.abs()).expect("a double's text fits 40 bytes");
    let exact = std::str::from_utf8(&rounded.buf[..rounded.len]).expect("ASCII");
    if exact.parse::<f64>() == Ok(x.abs()) {
        sci = rounded;
    }
    let text = &sci.buf[..sci.len];
    let e_at = text.iter().position(|&c| c == b'e').expect("{:e} writes an exponent");
    let mut digits = [0u8; 20];
    let mut n = 0;
    for &c in &text[..e_at] {
        if c != b'.' {
            digits[n] = c;
            n += 1;
        }
    }
    let digits = &digits[..n];
    let exp: i32 = std::str::from_utf8(&text[e_at + 1..]).expect("ASCII").parse().expect("an integer exponent");
    if x.is_sign_negative() {
        out.push(b'-');
    }
    let decpt = exp + 1; // the value is 0.<digits> x 10^decpt
    if (-4 < decpt) && (decpt <= 16) {
        if decpt <= 0 {
            out.extend_from_slice(b"0.");
            out.extend(std::iter::repeat_n(b'0', (-decpt) as usize));
            out.extend_from_slice(digits);
        } else if (decpt as usize) < n {
            out.extend_from_slice(&digits[..decpt as usize]);
            out.push(b'.');
            out.extend_from_slice(&digits[decpt as usize..]);
        } else {
            out.extend_from_slice(digits);
            out.extend(std::iter::repeat_n(b'0', decpt as usize - n));
            out.extend_from_slice(b".0");
        }
    } else {
        out.push(digits[0]);
        if n > 1 {
            out.push(b'.');
            out.extend_from_slice(&digits[1..]);
        }
        out.push(b'e');
        out.push(if exp < 0 { b'-' } else { b'+' });
        let e = exp.unsigned_abs();
        if e < 10 {
            out.push(b'0');
        }
        push_int(out, e as i64);
    }
}

/// `[x,y,...]`: `json.dumps` of a list of floats.
pub fn write_float_list<T: Copy + Into<f64>>(values: &[T], out: &mut Vec<u8>) {
    out.push(b'[');
    for (j, &v) in values.iter().enumerate() {
        if j > 0 {
            out.push(b',');
        }
        push_float(out, v.into());
    }
    out.push(b']');
}

/// `[[x,y],[z],[]]`: each row's floats, `json.dumps` of the nested lists.
pub fn write_float_lists<T: Copy + Into<f64>>(values: &[T], offsets: &[i64], out: &mut Vec<u8>) {
    out.push(b'[');
    for (r, w) in offsets.windows(2).enumerate() {
        if r > 0 {
            out.push(b',');
        }
        write_float_list(&values[w[0] as usize..w[1] as usize], out);
    }
    out.push(b']');
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(f: impl FnOnce(&mut Vec<u8>)) -> String {
        let mut out = Vec::new();
        f(&mut out);
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn int_lists_are_compact_json() {
        let ids = [3i32, 7, 11, 0, -5];
        assert_eq!(text(|o| write_int_lists(&ids, &[0, 3, 3, 5], o)), "[[3,7,11],[],[0,-5]]");
        assert_eq!(text(|o| write_int_lists::<i32>(&[], &[0], o)), "[]");
        assert_eq!(
            text(|o| write_int_lists(&[i64::MIN, i64::MAX], &[0, 2], o)),
            format!("[[{},{}]]", i64::MIN, i64::MAX)
        );
    }

    #[test]
    #[allow(clippy::excessive_precision)] // two doubles' exact decimal expansions, their ties the case
    fn floats_are_written_as_python_repr() {
        // Expected strings are Python's repr of the same doubles (fixed by the language).
        for (x, want) in [
            (0.0, "0.0"),
            (-0.0, "-0.0"),
            (1.0, "1.0"),
            (0.5, "0.5"),
            (-2.25, "-2.25"),
            (0.1, "0.1"),
            (1e-4, "0.0001"),
            (1e-5, "1e-05"),
            (1.5e-5, "1.5e-05"),
            (123456.0, "123456.0"),
            (1e15, "1000000000000000.0"),
            (1e16, "1e+16"),
            (1.2345e100, "1.2345e+100"),
            (5e-324, "5e-324"),
            (f64::NAN, "NaN"),
            (f64::INFINITY, "Infinity"),
            (f64::NEG_INFINITY, "-Infinity"),
        ] {
            assert_eq!(text(|o| push_float(o, x)), want, "{x:e}");
        }
        // float32 values read as doubles: every digit of the double
        assert_eq!(text(|o| push_float(o, 0.1f32 as f64)), "0.10000000149011612");
        // exactly -3.71912384033203125 and 8.9930572509765625: ties rounded to even as Python's repr
        assert_eq!(text(|o| push_float(o, -3.71912384033203125)), "-3.7191238403320312");
        assert_eq!(text(|o| push_float(o, 8.9930572509765625)), "8.993057250976562");
    }

    #[test]
    fn float_lists_nest_by_offsets() {
        let v = [0.5f32, -1.0, 2.0];
        assert_eq!(text(|o| write_float_list(&v, o)), "[0.5,-1.0,2.0]");
        assert_eq!(text(|o| write_float_lists(&v, &[0, 1, 1, 3], o)), "[[0.5],[],[-1.0,2.0]]");
    }

    #[test]
    fn offsets_are_checked() {
        assert!(check_offsets(&[0, 2, 3], 3).is_ok());
        assert!(check_offsets(&[0], 0).is_ok());
        assert!(check_offsets(&[], 0).is_err());
        assert!(check_offsets(&[1, 3], 3).unwrap_err().contains("start at 0"));
        assert!(check_offsets(&[0, 2, 1, 3], 3).unwrap_err().contains("decrease"));
        assert!(check_offsets(&[0, 2], 3).unwrap_err().contains("end at 2"));
    }
}
