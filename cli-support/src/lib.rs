//! What the command-line programs of the virtio-dmlc project share, so that
//! each is written once:
//!
//! - [`error_text`]: an error and its causes as one line;
//! - [`parse_size`] (and [`parse_size_with_default_unit`]): byte counts such
//!   as `16M`, with [`SizeError`] when the text is not one;
//! - [`daemon`]: the backend daemon's socket names ([`daemon::socket_path`])
//!   and the wait for a daemon just started to serve them
//!   ([`daemon::Sockets`]); one request to its control socket
//!   ([`daemon::control_request`]).

pub mod daemon;

use std::error::Error;
use std::fmt;

/// An error and its [`source()`](Error::source) chain on one line:
/// `outer: cause: root cause`.
///
/// A cause whose text the line already ends with (a wrapper whose message
/// prints its source itself, such as `#[error("{0}")]` over a `#[source]`)
/// is left out, and so is a cause with no text, so that no part is said
/// twice and no `: ` dangles.
pub fn error_text(e: &dyn Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        let part = cause.to_string();
        if !ends_with_part(&text, &part) {
            text.push_str(": ");
            text.push_str(&part);
        }
        source = cause.source();
    }
    text
}

/// Whether `text` ends with `part` as a whole (not inside a longer word):
/// `"a: b"` ends with the part `"b"`, `"ab"` does not.
fn ends_with_part(text: &str, part: &str) -> bool {
    if part.is_empty() {
        return true;
    }
    match text.strip_suffix(part) {
        Some(head) => !head.ends_with(char::is_alphanumeric),
        None => false,
    }
}

/// Parses a byte count.
///
/// The grammar, after leading and trailing whitespace is trimmed:
///
/// - a decimal integer of ASCII digits (no sign, no `_`, no fraction, no
///   exponent), then
/// - an optional unit, case-insensitive and with no space before it: `K`,
///   `M` or `G` for 2^10, 2^20 or 2^30 bytes, each optionally followed by
///   `i`, `iB` or `B` (so `16M`, `16m`, `16MiB`, `16MB` and `16mib` are all
///   16 × 2^20: `KB`, `MB` and `GB` are powers of 1024 here too), or `B`
///   alone for bytes (`64B` is 64).
///
/// Zero is a size (a caller that needs at least one byte says so itself).
/// Rejected, each with a [`SizeError`] that quotes the text: the empty
/// text; anything that does not start with a digit (`G`, `-1`, `+5`,
/// `lots`); a fraction or inner space (`1.5G`, `16 M`); an unknown unit
/// (`12X`, `1T`, `4KiBs`); and a size over `u64::MAX` bytes.
///
/// ```
/// use dmlc_cli_support::parse_size;
/// assert_eq!(parse_size("16M"), Ok(16 << 20));
/// assert_eq!(parse_size("4k"), Ok(4096));
/// assert_eq!(parse_size("1GiB"), Ok(1 << 30));
/// assert_eq!(parse_size("64B"), Ok(64));
/// assert_eq!(
///     parse_size("12X").unwrap_err().to_string(),
///     "\"12X\" is not a size: unknown unit \"X\" (use K, M or G, optionally \
///      followed by i, iB or B; or B for bytes)"
/// );
/// ```
pub fn parse_size(text: &str) -> Result<u64, SizeError> {
    parse_size_with_default_unit(text, 1)
}

/// Parses a byte count as [`parse_size`] does, except that a number without
/// a unit counts `default_unit` bytes each: with `1 << 20`, `512` is 512
/// MiB, and `512M`, `524288K` and `536870912B` are the same size.
pub fn parse_size_with_default_unit(text: &str, default_unit: u64) -> Result<u64, SizeError> {
    let error = |kind| SizeError {
        text: text.to_owned(),
        kind,
    };
    let trimmed = text.trim();
    if trimmed.is_empty() {
        return Err(error(SizeErrorKind::Empty));
    }
    let digits_end = trimmed
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(trimmed.len());
    let (digits, unit) = trimmed.split_at(digits_end);
    if digits.is_empty() || !unit.chars().all(|c| c.is_ascii_alphabetic()) {
        return Err(error(SizeErrorKind::NotANumber));
    }
    let multiplier = match unit.to_ascii_lowercase().as_str() {
        "" => default_unit,
        "b" => 1,
        "k" | "ki" | "kib" | "kb" => 1 << 10,
        "m" | "mi" | "mib" | "mb" => 1 << 20,
        "g" | "gi" | "gib" | "gb" => 1 << 30,
        _ => return Err(error(SizeErrorKind::UnknownUnit(unit.to_owned()))),
    };
    // All ASCII digits: the parse fails only by overflowing.
    digits
        .parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(multiplier))
        .ok_or_else(|| error(SizeErrorKind::TooLarge))
}

/// A text that [`parse_size`] rejected, and why.
///
/// It prints as the quoted text followed by [`SizeError::reason`], for
/// example `"12X" is not a size: unknown unit "X" (...)`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SizeError {
    text: String,
    kind: SizeErrorKind,
}

/// Why a text is not a size.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SizeErrorKind {
    /// Nothing but whitespace.
    Empty,
    /// No decimal integer at the start (`G`, `-1`, `lots`), or something
    /// other than letters after it (`1.5G`, `16 M`).
    NotANumber,
    /// Letters after the number that are not a unit (`12X`, `1T`); the
    /// field is those letters.
    UnknownUnit(String),
    /// More than `u64::MAX` bytes.
    TooLarge,
}

impl SizeError {
    /// The text as given (untrimmed).
    pub fn text(&self) -> &str {
        &self.text
    }

    /// Why it is not a size.
    pub fn kind(&self) -> &SizeErrorKind {
        &self.kind
    }

    /// The message without the text, for a caller that names the text
    /// itself (`invalid DMLC_DMA_BYTES="lots": not a size: ...`).
    pub fn reason(&self) -> String {
        const HINT: &str = "give a whole number with an optional K, M or G suffix";
        match &self.kind {
            SizeErrorKind::Empty => format!("not a size: it is empty ({HINT})"),
            SizeErrorKind::NotANumber => format!("not a size: {HINT}"),
            SizeErrorKind::UnknownUnit(unit) => format!(
                "not a size: unknown unit {unit:?} (use K, M or G, optionally followed by i, \
                 iB or B; or B for bytes)"
            ),
            SizeErrorKind::TooLarge => "too large a size (at most 2^64 - 1 bytes)".to_owned(),
        }
    }
}

impl fmt::Display for SizeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?} is {}", self.text, self.reason())
    }
}

impl Error for SizeError {}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct Layer {
        text: &'static str,
        source: Option<Box<Layer>>,
    }

    impl fmt::Display for Layer {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str(self.text)
        }
    }

    impl Error for Layer {
        fn source(&self) -> Option<&(dyn Error + 'static)> {
            self.source.as_deref().map(|l| l as &(dyn Error + 'static))
        }
    }

    /// Layers from the outermost in.
    fn layers(texts: &[&'static str]) -> Layer {
        let mut source = None;
        for text in texts.iter().rev() {
            source = Some(Box::new(Layer { text, source }));
        }
        *source.unwrap()
    }

    #[test]
    fn error_text_joins_the_chain() {
        assert_eq!(error_text(&layers(&["alone"])), "alone");
        assert_eq!(
            error_text(&layers(&[
                "cannot open the device",
                "connect",
                "No such file"
            ])),
            "cannot open the device: connect: No such file"
        );
        let boxed: Box<dyn Error> = Box::new(layers(&["a", "b"]));
        assert_eq!(error_text(boxed.as_ref()), "a: b");
    }

    #[test]
    fn error_text_says_each_part_once() {
        // A wrapper that prints its cause itself.
        assert_eq!(
            error_text(&layers(&["--timing: bad file", "bad file", "line 3"])),
            "--timing: bad file: line 3"
        );
        assert_eq!(error_text(&layers(&["same", "same"])), "same");
        // An empty cause adds no dangling separator.
        assert_eq!(error_text(&layers(&["outer", "", "root"])), "outer: root");
        // Only a whole part counts as said: "rank 12" does not say "2".
        assert_eq!(error_text(&layers(&["rank 12", "2"])), "rank 12: 2");
    }

    #[test]
    fn sizes_with_and_without_units() {
        for (text, bytes) in [
            ("0", 0),
            ("4096", 4096),
            ("64B", 64),
            ("64b", 64),
            ("4k", 4 << 10),
            ("4K", 4 << 10),
            ("4Ki", 4 << 10),
            ("4KiB", 4 << 10),
            ("4KB", 4 << 10),
            ("4kib", 4 << 10),
            ("16M", 16 << 20),
            ("16MiB", 16 << 20),
            ("16MB", 16 << 20),
            ("16mb", 16 << 20),
            ("1G", 1 << 30),
            ("2GiB", 2 << 30),
            ("1gB", 1 << 30),
            ("491520K\n", 491_520 << 10),
            ("  8M  ", 8 << 20),
            ("017", 17),
            ("16383G", 16383 << 30),
            ("18446744073709551615", u64::MAX),
            ("18446744073709551615B", u64::MAX),
        ] {
            assert_eq!(parse_size(text), Ok(bytes), "{text:?}");
        }
    }

    #[test]
    fn a_default_unit_applies_to_bare_numbers_only() {
        const MIB: u64 = 1 << 20;
        assert_eq!(parse_size_with_default_unit("512", MIB), Ok(512 * MIB));
        assert_eq!(parse_size_with_default_unit("512M", MIB), Ok(512 * MIB));
        assert_eq!(parse_size_with_default_unit("262144K", MIB), Ok(256 * MIB));
        assert_eq!(parse_size_with_default_unit("64B", MIB), Ok(64));
        assert_eq!(
            parse_size_with_default_unit("17592186044416", MIB)
                .unwrap_err()
                .kind(),
            &SizeErrorKind::TooLarge
        );
    }

    #[test]
    fn rejected_sizes_say_why() {
        let kind = |text: &str| parse_size(text).unwrap_err().kind().clone();
        assert_eq!(kind(""), SizeErrorKind::Empty);
        assert_eq!(kind(" \n"), SizeErrorKind::Empty);
        for text in [
            "G", "-1", "+5", "lots", "1.5G", "16 M", "1_000", "1e6", "0x10", "4K!",
        ] {
            assert_eq!(kind(text), SizeErrorKind::NotANumber, "{text:?}");
        }
        for (text, unit) in [
            ("12X", "X"),
            ("1T", "T"),
            ("4KiBs", "KiBs"),
            ("3bytes", "bytes"),
        ] {
            assert_eq!(
                kind(text),
                SizeErrorKind::UnknownUnit(unit.into()),
                "{text:?}"
            );
        }
        for text in [
            "18446744073709551616",
            "18446744073709551615G",
            "99999999999999999999999",
        ] {
            assert_eq!(kind(text), SizeErrorKind::TooLarge, "{text:?}");
        }
    }

    #[test]
    fn size_errors_quote_the_text() {
        let e = parse_size("lots").unwrap_err();
        assert_eq!(e.text(), "lots");
        assert_eq!(
            e.to_string(),
            "\"lots\" is not a size: give a whole number with an optional K, M or G suffix"
        );
        assert_eq!(
            e.reason(),
            "not a size: give a whole number with an optional K, M or G suffix"
        );
        assert_eq!(
            parse_size("").unwrap_err().to_string(),
            "\"\" is not a size: it is empty (give a whole number with an optional K, M or G \
             suffix)"
        );
        assert_eq!(
            parse_size("12X").unwrap_err().to_string(),
            "\"12X\" is not a size: unknown unit \"X\" (use K, M or G, optionally followed by \
             i, iB or B; or B for bytes)"
        );
        assert_eq!(
            parse_size("18446744073709551615G").unwrap_err().to_string(),
            "\"18446744073709551615G\" is too large a size (at most 2^64 - 1 bytes)"
        );
        // What clap needs of a value parser's error.
        let boxed: Box<dyn Error + Send + Sync> = e.into();
        assert!(boxed.to_string().contains("not a size"));
    }
}
