//! What a member offers as its input, summarised: for `dmlc-ctl inspect`
//! on a held collective, and for the scan before any data moves that
//! freeze-on-error makes of a checked collective (spec 5.X.6.15).

use half::{bf16, f16};
use virtio_dmlc::Dtype;

use crate::chain::Request;
use crate::datapath::HostSeg;

/// A summary of one member's input: its size, its extremes, and for the
/// float dtypes its NaNs, infinities and lowest non-finite element.
#[derive(Clone, Debug, Default, PartialEq)]
pub(super) struct InputSummary {
    pub(super) elems: u64,
    /// Least and greatest element as text (floats: of the finite ones;
    /// `None` when there is none).
    pub(super) min: Option<String>,
    pub(super) max: Option<String>,
    pub(super) nan: u64,
    pub(super) inf: u64,
    /// Index of the lowest NaN or infinity in the input.
    pub(super) first_bad: Option<u64>,
}

impl InputSummary {
    pub(super) fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "elements": self.elems,
            "min": self.min,
            "max": self.max,
            "nan": self.nan,
            "inf": self.inf,
            "first_non_finite": self.first_bad,
        })
    }
}

/// The segments that hold `req`'s input, in element order: its input
/// segments, or, in place, its output buffer from the input's offset for
/// `count` elements.
fn input_segs(req: &Request) -> Vec<HostSeg> {
    let Some(off) = req.in_place_offset else {
        return req.inputs.clone();
    };
    let mut skip = off;
    let mut left = req.count_bytes();
    let mut segs = Vec::new();
    for s in &req.outputs {
        if left == 0 {
            break;
        }
        if skip >= s.len {
            skip -= s.len;
            continue;
        }
        let len = (s.len - skip).min(left);
        segs.push(HostSeg {
            ptr: s.ptr.wrapping_add(skip),
            len,
        });
        left -= len;
        skip = 0;
    }
    segs
}

/// One element decoded: a float widened to f64, or an integer.
enum Value {
    Float(f64),
    Int(i128),
}

/// Element `w` (its little-endian bits, zero-extended) of `dtype`.
fn decode(dtype: Dtype, w: u64) -> Value {
    match dtype {
        Dtype::F32 => Value::Float(f64::from(f32::from_bits(w as u32))),
        Dtype::F64 => Value::Float(f64::from_bits(w)),
        Dtype::F16 => Value::Float(f64::from(f16::from_bits(w as u16))),
        Dtype::Bf16 => Value::Float(f64::from(bf16::from_bits(w as u16))),
        Dtype::I8 => Value::Int(i128::from(w as u8 as i8)),
        Dtype::U8 => Value::Int(i128::from(w as u8)),
        Dtype::I32 => Value::Int(i128::from(w as u32 as i32)),
        Dtype::U32 => Value::Int(i128::from(w as u32)),
        Dtype::I64 => Value::Int(i128::from(w as i64)),
        Dtype::U64 => Value::Int(i128::from(w)),
    }
}

/// Summarises `req`'s input; `None` for a request without data (barrier)
/// or without an input.
///
/// # Safety
/// The request's guest memory must still be mapped (its arrival keeps its
/// `GuestMem`), and no data movement of its collective may have started:
/// bounced elements are loaded here into their private copies.
pub(super) unsafe fn summarise(req: &Request) -> Option<InputSummary> {
    let dtype = req.dtype?;
    let size = dtype.size();
    for b in req
        .bounces
        .iter()
        .filter(|b| !b.output || req.in_place_offset.is_some())
    {
        // SAFETY: mapped, and nothing moves this collective's data yet
        // (caller's promise); `launch` loads them again before it does.
        unsafe { b.fill() };
    }
    let mut s = InputSummary::default();
    let (mut fmin, mut fmax) = (f64::INFINITY, f64::NEG_INFINITY);
    let (mut imin, mut imax) = (i128::MAX, i128::MIN);
    for seg in input_segs(req) {
        for at in (0..seg.len / size * size).step_by(size) {
            let p = seg.ptr.wrapping_add(at);
            // SAFETY: the element lies in mapped guest memory (caller's
            // promise) or in a bounce copy; guest memory is only read
            // through unaligned raw reads, and every bit pattern is valid.
            let w = unsafe {
                match size {
                    1 => u64::from(p.read()),
                    2 => u64::from(u16::from_le(p.cast::<u16>().read_unaligned())),
                    4 => u64::from(u32::from_le(p.cast::<u32>().read_unaligned())),
                    _ => u64::from_le(p.cast::<u64>().read_unaligned()),
                }
            };
            match decode(dtype, w) {
                Value::Float(x) if x.is_finite() => {
                    fmin = fmin.min(x);
                    fmax = fmax.max(x);
                }
                Value::Float(x) => {
                    if x.is_nan() {
                        s.nan += 1;
                    } else {
                        s.inf += 1;
                    }
                    s.first_bad.get_or_insert(s.elems);
                }
                Value::Int(i) => {
                    imin = imin.min(i);
                    imax = imax.max(i);
                }
            }
            s.elems += 1;
        }
    }
    if dtype.is_float() {
        if fmin <= fmax {
            s.min = Some(format!("{fmin:e}"));
            s.max = Some(format!("{fmax:e}"));
        }
    } else if imin <= imax {
        s.min = Some(imin.to_string());
        s.max = Some(imax.to_string());
    }
    Some(s)
}
