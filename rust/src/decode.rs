//! Decoder front half without Python: find and parse the `.npy` header inside the base64
//! text; the rows are then decoded straight into the new array's memory (`b64::decode_range`).

use crate::b64::{decode_range, decoded_len};
use crate::npy_header::{parse_header, read_preamble, ParsedHeader};

pub struct DecodePlan {
    pub header: ParsedHeader,
    /// Offset of the first data byte in the decoded payload.
    pub data_start: usize,
    /// Number of data bytes after the header.
    pub data_len: usize,
}

pub fn plan_decode(text: &[u8]) -> Result<DecodePlan, String> {
    let total = decoded_len(text)?;
    let mut pre = [0u8; 12];
    let n = total.min(12);
    decode_range(text, 0, &mut pre[..n])?;
    let (pre_len, hlen) = read_preamble(&pre[..n])?;
    let data_start = pre_len + hlen;
    if data_start > total {
        return Err(format!(
            "routed experts text is truncated: the npy header needs {data_start} bytes, the text holds {total}"
        ));
    }
    let mut header = vec![0u8; hlen];
    decode_range(text, pre_len, &mut header)?;
    let header = parse_header(&header)?;
    Ok(DecodePlan { header, data_start, data_len: total - data_start })
}

/// Checks that the shape and item size account for exactly `data_len` bytes, without
/// overflow, and returns the element count.
pub fn check_size(shape: &[usize], itemsize: usize, data_len: usize) -> Result<usize, String> {
    let count = shape.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d)).filter(|&c| c <= isize::MAX as usize);
    let nbytes = count.and_then(|c| c.checked_mul(itemsize)).filter(|&b| b <= isize::MAX as usize);
    match (count, nbytes) {
        (Some(count), Some(nbytes)) if nbytes == data_len => Ok(count),
        (_, Some(nbytes)) => Err(format!(
            "npy header/size mismatch: shape {shape:?} x {itemsize} bytes needs {nbytes} data bytes, the text holds {data_len}"
        )),
        _ => Err(format!("npy shape {shape:?} is too large")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::encode::Plan;
    use crate::layout::ArrayView;

    fn encode(shape: &[usize], strides: &[isize], data: &[u8]) -> Vec<u8> {
        let view = ArrayView { ptr: data.as_ptr(), shape, strides, itemsize: 1 };
        let plan = Plan::new("|u1", view);
        let mut out = vec![0u8; plan.encoded_len()];
        // SAFETY: the view describes `data`, a live slice of its size that nothing mutates.
        unsafe { plan.write(&mut out, 1) };
        out
    }

    #[test]
    fn round_trip_through_plan_and_range() {
        let data: Vec<u8> = (0..5 * 48 * 8).map(|i| (i % 256) as u8).collect();
        let text = encode(&[5, 48, 8], &[384, 8, 1], &data);
        let p = plan_decode(&text).unwrap();
        assert_eq!(p.header.shape, vec![5, 48, 8]);
        assert_eq!(p.header.descr, "|u1");
        assert_eq!(p.data_start, 128);
        assert_eq!(check_size(&p.header.shape, 1, p.data_len).unwrap(), 1920);
        let mut out = vec![0u8; p.data_len];
        decode_range(&text, p.data_start, &mut out).unwrap();
        assert_eq!(out, data);
    }

    #[test]
    fn hostile_inputs_are_errors() {
        let data = vec![7u8; 10];
        let text = encode(&[10], &[1], &data);
        assert!(plan_decode(b"").is_err());
        assert!(plan_decode(b"QUJD").is_err()); // "ABC": no magic
        assert!(plan_decode(&text[..40]).is_err()); // truncated header
        let p = plan_decode(&text[..text.len() - 4]).unwrap(); // truncated data
        assert!(check_size(&p.header.shape, 1, p.data_len).is_err());
        assert!(check_size(&[usize::MAX / 2, 4], 1, 0).is_err());
        assert!(check_size(&[1 << 40, 1 << 40], 8, 0).is_err());
    }
}
