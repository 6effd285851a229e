//! The `.npy` header, byte-identical to `np.save` (numpy 1.26 to 2.x), and a strict
//! parser for the decoder (no eval, no pickle: a tiny grammar for the one dict numpy writes).

/// `\x93NUMPY`
pub const MAGIC: &[u8; 6] = b"\x93NUMPY";
/// numpy pads the preamble + header to this alignment.
const ARRAY_ALIGN: usize = 64;
/// numpy leaves room for the growth axis to reach this many digits.
const GROWTH_AXIS_MAX_DIGITS: usize = 21;
/// numpy 2.x's `NPY_MAXDIMS`.
pub const MAX_NDIM: usize = 64;
/// Largest header the decoder accepts (numpy's own reader refuses > 10,000 by default).
const MAX_HEADER_LEN: usize = 100_000;

/// Decimal digits of `v`, written into `out` (also the ragged lists' integers, `lists.rs`).
pub(crate) fn push_u64(out: &mut Vec<u8>, mut v: u64) {
    let mut digits = [0u8; 20];
    let mut i = digits.len();
    loop {
        i -= 1;
        digits[i] = b'0' + (v % 10) as u8;
        v /= 10;
        if v == 0 {
            break;
        }
    }
    out.extend_from_slice(&digits[i..]);
}

fn decimal_len(mut v: usize) -> usize {
    let mut n = 1;
    while v >= 10 {
        v /= 10;
        n += 1;
    }
    n
}

/// Appends the whole `.npy` preamble + header (magic, version, length, dict, padding, `\n`)
/// exactly as `np.save(..., allow_pickle=False)` writes it for a dtype whose descr is the
/// plain string `descr` (`dtype.str`). `descr` must be ASCII (always true for `dtype.str`),
/// so the version is 1.0 unless the header needs more than 65535 bytes (then 2.0).
pub fn write_header(out: &mut Vec<u8>, descr: &str, fortran_order: bool, shape: &[usize]) {
    let start = out.len();
    // Leave room for the 10-byte v1 preamble; shifted later in the (never seen) v2 case.
    out.extend_from_slice(&[0u8; 10]);
    let dict_start = out.len();
    // repr() of a sorted dict: 'descr', 'fortran_order', 'shape'.
    out.extend_from_slice(b"{'descr': '");
    out.extend_from_slice(descr.as_bytes());
    out.extend_from_slice(b"', 'fortran_order': ");
    out.extend_from_slice(if fortran_order { b"True" as &[u8] } else { b"False" });
    out.extend_from_slice(b", 'shape': (");
    for (i, &d) in shape.iter().enumerate() {
        if i > 0 {
            out.extend_from_slice(b", ");
        }
        push_u64(out, d as u64);
    }
    if shape.len() == 1 {
        out.push(b',');
    }
    out.extend_from_slice(b"), }");
    if !shape.is_empty() {
        let growth = if fortran_order { shape[shape.len() - 1] } else { shape[0] };
        let spare = GROWTH_AXIS_MAX_DIGITS.saturating_sub(decimal_len(growth));
        out.resize(out.len() + spare, b' ');
    }
    let dict_len = out.len() - dict_start;
    let hlen = dict_len + 1; // + '\n'
    let (preamble, v2) = if 10 + hlen + ARRAY_ALIGN <= 65535 + 10 { (10usize, false) } else { (12usize, true) };
    let mut padlen = ARRAY_ALIGN - ((preamble + hlen) % ARRAY_ALIGN);
    if !v2 && hlen + padlen > 65535 {
        padlen = 0; // unreachable for real arrays (ndim <= 64); guarded above
    }
    out.resize(out.len() + padlen, b' ');
    out.push(b'\n');
    let total_hlen = hlen + padlen;
    if v2 {
        // Widen the preamble by two bytes for the u32 length.
        out.splice(start + 10..start + 10, [0u8, 0u8]);
        out[start..start + 6].copy_from_slice(MAGIC);
        out[start + 6] = 2;
        out[start + 7] = 0;
        out[start + 8..start + 12].copy_from_slice(&(total_hlen as u32).to_le_bytes());
    } else {
        out[start..start + 6].copy_from_slice(MAGIC);
        out[start + 6] = 1;
        out[start + 7] = 0;
        out[start + 8..start + 10].copy_from_slice(&(total_hlen as u16).to_le_bytes());
    }
}

/// What the decoder learned from a header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParsedHeader {
    pub descr: String,
    pub fortran_order: bool,
    pub shape: Vec<usize>,
}

/// Length of the preamble (magic, version, header length) and of the header that follows,
/// read from the first bytes of an `.npy` file. Needs at least 12 bytes (or 10 for v1).
pub fn read_preamble(bytes: &[u8]) -> Result<(usize, usize), String> {
    if bytes.len() < 10 || &bytes[..6] != MAGIC {
        return Err("not an .npy payload: missing the \\x93NUMPY magic".into());
    }
    match (bytes[6], bytes[7]) {
        (1, 0) => Ok((10, u16::from_le_bytes([bytes[8], bytes[9]]) as usize)),
        (2, 0) | (3, 0) => {
            if bytes.len() < 12 {
                return Err("truncated .npy preamble".into());
            }
            let n = u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as usize;
            if n > MAX_HEADER_LEN {
                return Err(format!("npy header length {n} exceeds the limit of {MAX_HEADER_LEN}"));
            }
            Ok((12, n))
        }
        (major, minor) => Err(format!("unsupported .npy format version {major}.{minor}")),
    }
}

struct Cursor<'a> {
    s: &'a [u8],
    i: usize,
}

impl<'a> Cursor<'a> {
    fn ws(&mut self) {
        while self.i < self.s.len() && matches!(self.s[self.i], b' ' | b'\t' | b'\n' | b'\r') {
            self.i += 1;
        }
    }
    fn peek(&self) -> Option<u8> {
        self.s.get(self.i).copied()
    }
    fn eat(&mut self, c: u8) -> bool {
        self.ws();
        if self.peek() == Some(c) {
            self.i += 1;
            true
        } else {
            false
        }
    }
    fn expect(&mut self, c: u8) -> Result<(), String> {
        if self.eat(c) {
            Ok(())
        } else {
            Err(format!("malformed npy header: expected {:?} at byte {}", c as char, self.i))
        }
    }
    fn string(&mut self) -> Result<&'a str, String> {
        self.ws();
        let q = match self.peek() {
            Some(q @ (b'\'' | b'"')) => q,
            _ => return Err(format!("malformed npy header: expected a string at byte {}", self.i)),
        };
        let start = self.i + 1;
        let mut j = start;
        while j < self.s.len() && self.s[j] != q {
            if self.s[j] == b'\\' || !(0x20..0x7f).contains(&self.s[j]) {
                return Err("malformed npy header: unsupported character in a string".into());
            }
            j += 1;
        }
        if j >= self.s.len() {
            return Err("malformed npy header: unterminated string".into());
        }
        self.i = j + 1;
        // Checked ASCII above.
        Ok(std::str::from_utf8(&self.s[start..j]).unwrap())
    }
    fn word(&mut self) -> &'a [u8] {
        self.ws();
        let start = self.i;
        while self.i < self.s.len() && self.s[self.i].is_ascii_alphanumeric() {
            self.i += 1;
        }
        &self.s[start..self.i]
    }
}

fn parse_dim(w: &[u8]) -> Result<usize, String> {
    if w.is_empty() || w.len() > 19 || !w.iter().all(u8::is_ascii_digit) {
        return Err(format!("invalid npy shape entry {:?}", String::from_utf8_lossy(&w[..w.len().min(32)])));
    }
    let v: u64 = std::str::from_utf8(w).unwrap().parse().map_err(|_| "invalid npy shape entry")?;
    if v > isize::MAX as u64 {
        return Err(format!("npy shape entry {v} is too large"));
    }
    Ok(v as usize)
}

/// Parses the header dict (`{'descr': ..., 'fortran_order': ..., 'shape': (...), }` plus
/// padding). Accepts any key order and quoting numpy's `literal_eval` reader would; rejects
/// anything else, including structured descrs (lists), with a message.
pub fn parse_header(text: &[u8]) -> Result<ParsedHeader, String> {
    if text.len() > MAX_HEADER_LEN {
        return Err(format!("npy header of {} bytes exceeds the limit of {MAX_HEADER_LEN}", text.len()));
    }
    let mut c = Cursor { s: text, i: 0 };
    c.expect(b'{')?;
    let (mut descr, mut fortran, mut shape) = (None, None, None);
    loop {
        if c.eat(b'}') {
            break;
        }
        let key = c.string()?;
        c.expect(b':')?;
        match key {
            "descr" if descr.is_none() => {
                c.ws();
                if c.peek() == Some(b'[') {
                    return Err("structured dtypes (a list descr) are not supported by the decoder".into());
                }
                descr = Some(c.string()?.to_owned());
            }
            "fortran_order" if fortran.is_none() => {
                fortran = Some(match c.word() {
                    b"True" => true,
                    b"False" => false,
                    _ => return Err("malformed npy header: fortran_order must be True or False".into()),
                });
            }
            "shape" if shape.is_none() => {
                c.expect(b'(')?;
                let mut dims = Vec::new();
                let mut trailing_comma = false;
                loop {
                    if c.eat(b')') {
                        break;
                    }
                    if dims.len() >= MAX_NDIM {
                        return Err(format!("npy shape has more than {MAX_NDIM} dimensions"));
                    }
                    let w = c.word();
                    let w = w.strip_suffix(b"L").unwrap_or(w); // python 2 longs
                    dims.push(parse_dim(w)?);
                    trailing_comma = c.eat(b',');
                    if !trailing_comma {
                        c.expect(b')')?;
                        break;
                    }
                }
                if dims.len() == 1 && !trailing_comma {
                    return Err("malformed npy header: shape (n) is not a tuple".into());
                }
                shape = Some(dims);
            }
            "descr" | "fortran_order" | "shape" => return Err(format!("malformed npy header: duplicate key {key:?}")),
            other => return Err(format!("malformed npy header: unexpected key {other:?}")),
        }
        if !c.eat(b',') {
            c.expect(b'}')?;
            break;
        }
    }
    c.ws();
    if c.i != text.len() {
        return Err("malformed npy header: trailing bytes after the dict".into());
    }
    match (descr, fortran, shape) {
        (Some(descr), Some(fortran_order), Some(shape)) => Ok(ParsedHeader { descr, fortran_order, shape }),
        _ => Err("malformed npy header: needs the keys 'descr', 'fortran_order' and 'shape'".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(descr: &str, f: bool, shape: &[usize]) -> Vec<u8> {
        let mut v = Vec::new();
        write_header(&mut v, descr, f, shape);
        v
    }

    #[test]
    fn routed_experts_header_is_128_bytes_and_matches_numpy() {
        let h = header("|u1", false, &[3, 48, 8]);
        assert_eq!(h.len(), 128);
        assert_eq!(&h[..10], b"\x93NUMPY\x01\x00\x76\x00");
        let dict = b"{'descr': '|u1', 'fortran_order': False, 'shape': (3, 48, 8), }";
        assert_eq!(&h[10..10 + dict.len()], dict);
        // 21 - len("3") spare spaces, then padding, then '\n'.
        assert!(h[10 + dict.len()..127].iter().all(|&b| b == b' '));
        assert_eq!(h[127], b'\n');
    }

    /// Golden headers written by numpy 2.4's np.save (allow_pickle=False).
    #[test]
    fn matches_numpy_golden_headers() {
        let pad = |dict: &str| {
            let mut v = b"\x93NUMPY\x01\x00v\x00".to_vec();
            v.extend_from_slice(dict.as_bytes());
            v.resize(127, b' ');
            v.push(b'\n');
            v
        };
        assert_eq!(
            header("<i4", false, &[1, 123456]),
            pad("{'descr': '<i4', 'fortran_order': False, 'shape': (1, 123456), }")
        );
        assert_eq!(header(">c16", true, &[2, 3]), pad("{'descr': '>c16', 'fortran_order': True, 'shape': (2, 3), }"));
        assert_eq!(header("<f8", false, &[]), pad("{'descr': '<f8', 'fortran_order': False, 'shape': (), }"));
        assert_eq!(
            header("<M8[ns]", false, &[7]),
            pad("{'descr': '<M8[ns]', 'fortran_order': False, 'shape': (7,), }")
        );
    }

    #[test]
    fn spare_space_follows_the_growth_axis() {
        // 21 spare digits minus the growth axis's digits: C order grows axis 0, Fortran the last.
        let c = header("<i4", false, &[1_000_000, 2]);
        let f = header("<i4", true, &[2, 1_000_000]);
        let tail = |h: &[u8]| h.iter().rev().skip(1).take_while(|&&b| b == b' ').count();
        assert_eq!(tail(&c) + 1, tail(&f)); // "True" is one byte shorter than "False"
        assert_eq!(c.len() % 64, 0);
        let many = header("|u1", false, &[7; 64]);
        assert_eq!(many.len() % 64, 0);
        assert_eq!(&many[6..8], &[1, 0]);
    }

    #[test]
    fn header_round_trips_through_parser() {
        for (d, f, s) in [
            ("|u1", false, vec![3usize, 48, 8]),
            ("<c16", true, vec![2, 3]),
            ("<M8[ns]", false, vec![0]),
            (">u2", false, vec![]),
        ] {
            let h = header(d, f, &s);
            let (pre, hlen) = read_preamble(&h).unwrap();
            assert_eq!(pre + hlen, h.len());
            let p = parse_header(&h[pre..]).unwrap();
            assert_eq!(p, ParsedHeader { descr: d.into(), fortran_order: f, shape: s });
        }
    }

    #[test]
    fn parser_rejects_hostile_headers() {
        for bad in [
            &b"{'descr': [('a', '<i4')], 'fortran_order': False, 'shape': (1,), }"[..],
            b"{'descr': '<i4', 'fortran_order': False, 'shape': (99999999999999999999,), }",
            b"{'descr': '<i4', 'fortran_order': False, 'shape': (-1,), }",
            b"{'descr': '<i4', 'fortran_order': False, 'shape': (3), }",
            b"{'descr': '<i4', 'fortran_order': False}",
            b"{'descr': '<i4', 'fortran_order': 0, 'shape': (1,), }",
            b"{'descr': '<i4', 'descr': '<i4', 'fortran_order': False, 'shape': (1,), }",
            b"{'descr': '<i4', 'fortran_order': False, 'shape': (1,), 'x': 1}",
            b"{'descr': '<i4', 'fortran_order': False, 'shape': (1,), } junk",
            b"{'descr': '<i4\\x00', 'fortran_order': False, 'shape': (1,), }",
            b"__import__('os')",
        ] {
            assert!(parse_header(bad).is_err(), "{}", String::from_utf8_lossy(bad));
        }
        let deep = format!("{{'descr': '<i4', 'fortran_order': False, 'shape': ({}), }}", "1, ".repeat(65));
        assert!(parse_header(deep.as_bytes()).is_err());
    }

    #[test]
    fn preamble_versions() {
        assert!(read_preamble(b"\x93NUMPY\x01\x00\x10\x00").is_ok());
        assert!(read_preamble(b"\x93NUMPY\x04\x00\x10\x00").is_err());
        assert!(read_preamble(b"\x93NUMPX\x01\x00\x10\x00").is_err());
        assert!(read_preamble(b"\x93NUMPY\x02\x00\xff\xff\xff\xff").is_err());
    }
}
