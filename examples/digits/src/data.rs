//! The handwritten-digits data: CSV parsing (optionally gzip-compressed),
//! scaling, and the fixed train/test split.
//!
//! The file is scikit-learn's `sklearn/datasets/data/digits.csv.gz`: one
//! sample a line, 64 pixel counts (0..=16, an 8x8 image row by row) and then
//! the digit (0..=9), separated by commas, no header.

use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};

use flate2::read::GzDecoder;
use thiserror::Error;

/// Pixels per image (8x8).
pub const FEATURES: usize = 64;
/// Digits 0..=9.
pub const CLASSES: usize = 10;
/// Largest pixel count: each pixel counts the set bits of a 4x4 block.
pub const MAX_PIXEL: u32 = 16;
/// Samples in scikit-learn's copy of the data set.
pub const SAMPLES: usize = 1797;
/// The last this many samples are the test set (the rest, 1500, train).
pub const DEFAULT_TEST_SIZE: usize = 297;

/// The gzip magic number, to accept both compressed and plain files.
const GZIP_MAGIC: [u8; 2] = [0x1f, 0x8b];

/// Errors of loading the data set.
#[derive(Debug, Error)]
pub enum DataError {
    #[error("cannot read {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} is not UTF-8 text")]
    NotText {
        path: PathBuf,
        #[source]
        source: std::string::FromUtf8Error,
    },
    #[error("line {line}: {reason}")]
    Parse { line: usize, reason: String },
    #[error("the data has no samples")]
    Empty,
    #[error("a test set of {test} samples leaves none of the {total} to train on")]
    Split { test: usize, total: usize },
}

/// Samples with features scaled to [0, 1].
#[derive(Clone, Debug, PartialEq)]
pub struct Dataset {
    /// Features per sample.
    pub features: usize,
    /// Number of classes; every label is below it.
    pub classes: usize,
    /// Row-major, `len() * features` values.
    pub x: Vec<f32>,
    /// One label per sample.
    pub y: Vec<u8>,
}

impl Dataset {
    /// Number of samples.
    pub fn len(&self) -> usize {
        self.y.len()
    }

    /// True if there are no samples.
    pub fn is_empty(&self) -> bool {
        self.y.is_empty()
    }

    /// Features of sample `i`.
    pub fn row(&self, i: usize) -> &[f32] {
        &self.x[i * self.features..(i + 1) * self.features]
    }

    /// Splits off the last `test` samples as the test set: (train, test).
    pub fn split(&self, test: usize) -> Result<(Dataset, Dataset), DataError> {
        let total = self.len();
        if test >= total {
            return Err(DataError::Split { test, total });
        }
        let cut = total - test;
        let part = |range: std::ops::Range<usize>| Dataset {
            features: self.features,
            classes: self.classes,
            x: self.x[range.start * self.features..range.end * self.features].to_vec(),
            y: self.y[range].to_vec(),
        };
        Ok((part(0..cut), part(cut..total)))
    }

    /// A 64-bit FNV-1a hash of the shape, features and labels, so that ranks
    /// can check that they loaded the same data.
    pub fn fingerprint(&self) -> u64 {
        let mut h = Fnv::new();
        h.write(&(self.features as u64).to_le_bytes());
        h.write(&(self.classes as u64).to_le_bytes());
        for v in &self.x {
            h.write(&v.to_bits().to_le_bytes());
        }
        h.write(&self.y);
        h.finish()
    }
}

#[cfg(test)]
impl Dataset {
    /// The models' tests' tiny problem: 3 features, 4 classes, 6 samples
    /// (one of them blank).
    pub(crate) fn six_samples() -> Dataset {
        Dataset {
            features: 3,
            classes: 4,
            x: vec![
                0.1, 0.9, 0.0, //
                1.0, 0.2, 0.5, //
                0.0, 0.0, 0.0, //
                0.7, 0.7, 0.3, //
                0.25, 0.0, 1.0, //
                0.5, 0.5, 0.5,
            ],
            y: vec![0, 3, 1, 2, 3, 0],
        }
    }
}

/// FNV-1a, 64 bit: tiny, deterministic everywhere, and good enough to tell
/// different buffers apart (not a defence against deliberate collisions).
#[derive(Clone, Copy, Debug)]
pub struct Fnv(u64);

impl Fnv {
    pub fn new() -> Self {
        Fnv(0xcbf2_9ce4_8422_2325)
    }

    pub fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 ^= u64::from(b);
            self.0 = self.0.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }

    pub fn finish(&self) -> u64 {
        self.0
    }
}

impl Default for Fnv {
    fn default() -> Self {
        Fnv::new()
    }
}

/// Reads a digits CSV file, gzip-compressed or plain (told apart by the
/// gzip magic number).
pub fn load(path: &Path) -> Result<Dataset, DataError> {
    let read_err = |source| DataError::Read {
        path: path.to_path_buf(),
        source,
    };
    let raw = fs::read(path).map_err(read_err)?;
    let bytes = if raw.starts_with(&GZIP_MAGIC) {
        let mut out = Vec::with_capacity(raw.len() * 4);
        GzDecoder::new(raw.as_slice())
            .read_to_end(&mut out)
            .map_err(read_err)?;
        out
    } else {
        raw
    };
    let text = String::from_utf8(bytes).map_err(|source| DataError::NotText {
        path: path.to_path_buf(),
        source,
    })?;
    parse_csv(&text)
}

/// Parses digits CSV text: 64 pixel counts in 0..=16 and a label in 0..=9
/// a line; blank lines are skipped. Pixels are scaled to [0, 1].
pub fn parse_csv(text: &str) -> Result<Dataset, DataError> {
    let mut x = Vec::new();
    let mut y = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let line_no = n + 1;
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        let err = |reason: String| DataError::Parse {
            line: line_no,
            reason,
        };
        let fields: Vec<&str> = line.split(',').map(str::trim).collect();
        if fields.len() != FEATURES + 1 {
            return Err(err(format!(
                "{} fields, expected {} (64 pixels and the label)",
                fields.len(),
                FEATURES + 1
            )));
        }
        for (i, f) in fields[..FEATURES].iter().enumerate() {
            let v = parse_int(f).ok_or_else(|| err(format!("pixel {i} is not a number: {f:?}")))?;
            if v > MAX_PIXEL {
                return Err(err(format!("pixel {i} is {v}, above {MAX_PIXEL}")));
            }
            // Exact: v is a small integer and 16 a power of two.
            x.push(v as f32 / MAX_PIXEL as f32);
        }
        let label = fields[FEATURES];
        let v = parse_int(label).ok_or_else(|| err(format!("label is not a number: {label:?}")))?;
        let v = u8::try_from(v)
            .ok()
            .filter(|&v| usize::from(v) < CLASSES)
            .ok_or_else(|| err(format!("label {v} is not a digit")))?;
        y.push(v);
    }
    if y.is_empty() {
        return Err(DataError::Empty);
    }
    Ok(Dataset {
        features: FEATURES,
        classes: CLASSES,
        x,
        y,
    })
}

/// Parses a non-negative integer, also written as a float with a zero
/// fraction ("3.0"), as some CSV writers do.
fn parse_int(s: &str) -> Option<u32> {
    if let Ok(v) = s.parse::<u32>() {
        return Some(v);
    }
    let f: f64 = s.parse().ok()?;
    (f >= 0.0 && f.fract() == 0.0 && f <= f64::from(u32::MAX)).then_some(f as u32)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn line(pixels: &[u32], label: u32) -> String {
        let mut fields: Vec<String> = pixels.iter().map(u32::to_string).collect();
        fields.push(label.to_string());
        fields.join(",")
    }

    fn sample(seed: u32, label: u32) -> String {
        let pixels: Vec<u32> = (0..FEATURES as u32).map(|i| (i + seed) % 17).collect();
        line(&pixels, label)
    }

    #[test]
    fn parses_and_scales() {
        let text = format!("{}\n\n{}\n", sample(0, 3), sample(5, 9));
        let d = parse_csv(&text).unwrap();
        assert_eq!(d.len(), 2);
        assert_eq!(d.y, vec![3, 9]);
        assert_eq!(d.x.len(), 2 * FEATURES);
        assert_eq!(d.row(0)[0], 0.0);
        assert_eq!(d.row(0)[16], 1.0);
        assert_eq!(d.row(0)[8], 0.5);
        assert_eq!(d.row(1)[0], 5.0 / 16.0);
        assert!(d.x.iter().all(|v| (0.0..=1.0).contains(v)));
    }

    #[test]
    fn accepts_float_notation_and_crlf() {
        let pixels = vec![0u32; FEATURES];
        let mut text = line(&pixels, 7).replace("0,", "0.0,");
        text.push_str("\r\n");
        let d = parse_csv(&text).unwrap();
        assert_eq!(d.y, vec![7]);
    }

    #[test]
    fn rejects_bad_lines() {
        let short = "1,2,3\n";
        assert!(matches!(
            parse_csv(short),
            Err(DataError::Parse { line: 1, .. })
        ));
        let mut pixels = vec![0u32; FEATURES];
        pixels[3] = 17;
        let text = format!("{}\n{}\n", sample(1, 1), line(&pixels, 1));
        let e = parse_csv(&text).unwrap_err();
        assert!(matches!(e, DataError::Parse { line: 2, .. }), "{e}");
        assert!(e.to_string().contains("pixel 3 is 17"), "{e}");
        let e = parse_csv(&line(&[0; FEATURES], 10)).unwrap_err();
        assert!(e.to_string().contains("label 10"), "{e}");
        let e = parse_csv(&line(&[0; FEATURES], 1).replacen('0', "x", 1)).unwrap_err();
        assert!(e.to_string().contains("pixel 0 is not a number"), "{e}");
        assert!(matches!(parse_csv("\n \n"), Err(DataError::Empty)));
    }

    #[test]
    fn splits_off_the_tail() {
        let text: String = (0..5).map(|i| sample(i, i) + "\n").collect();
        let d = parse_csv(&text).unwrap();
        let (train, test) = d.split(2).unwrap();
        assert_eq!(train.y, vec![0, 1, 2]);
        assert_eq!(test.y, vec![3, 4]);
        assert_eq!(test.row(1), d.row(4));
        assert!(matches!(d.split(5), Err(DataError::Split { .. })));
    }

    #[test]
    fn loads_gzip_and_plain_files() {
        let text: String = (0..3).map(|i| sample(i, i) + "\n").collect();
        let dir = std::env::temp_dir().join(format!("digits-data-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let plain = dir.join("d.csv");
        fs::write(&plain, &text).unwrap();
        let gz = dir.join("d.csv.gz");
        let mut enc = flate2::write::GzEncoder::new(
            fs::File::create(&gz).unwrap(),
            flate2::Compression::default(),
        );
        enc.write_all(text.as_bytes()).unwrap();
        enc.finish().unwrap();
        let a = load(&plain).unwrap();
        let b = load(&gz).unwrap();
        assert_eq!(a, b);
        assert_eq!(a.len(), 3);
        let missing = load(&dir.join("missing.csv")).unwrap_err();
        assert!(missing.to_string().contains("missing.csv"), "{missing}");
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn fingerprint_tells_data_apart() {
        let d = parse_csv(&sample(0, 1)).unwrap();
        let mut e = d.clone();
        assert_eq!(d.fingerprint(), e.fingerprint());
        e.y[0] = 2;
        assert_ne!(d.fingerprint(), e.fingerprint());
    }
}
