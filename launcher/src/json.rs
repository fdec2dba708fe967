//! A small JSON reader for the trainer's `--json` reports (RFC 8259 values;
//! the workspace has no JSON crate and the demo needs only reading).

use std::str::Chars;

/// A JSON value. Objects keep their members in order.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    Null,
    Bool(bool),
    Number(f64),
    String(String),
    Array(Vec<Value>),
    Object(Vec<(String, Value)>),
}

/// Errors of this module.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum JsonError {
    #[error("unexpected end of JSON text")]
    End,
    #[error("unexpected character {0:?} in JSON text")]
    Unexpected(char),
    #[error("bad number {0:?} in JSON text")]
    Number(String),
    #[error("bad escape in a JSON string")]
    Escape,
    #[error("text after the JSON value")]
    Trailing,
}

impl Value {
    /// Parses one JSON value (surrounding whitespace allowed).
    pub fn parse(text: &str) -> Result<Value, JsonError> {
        let mut p = Parser {
            chars: text.chars(),
            peeked: None,
        };
        let v = p.value()?;
        p.skip_ws();
        match p.next() {
            None => Ok(v),
            Some(_) => Err(JsonError::Trailing),
        }
    }

    /// Member `key` of an object.
    pub fn get(&self, key: &str) -> Option<&Value> {
        match self {
            Value::Object(members) => members.iter().find(|(k, _)| k == key).map(|(_, v)| v),
            _ => None,
        }
    }

    pub fn as_f64(&self) -> Option<f64> {
        match self {
            Value::Number(n) => Some(*n),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match self {
            Value::Bool(b) => Some(*b),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }
}

struct Parser<'a> {
    chars: Chars<'a>,
    peeked: Option<char>,
}

impl Parser<'_> {
    fn next(&mut self) -> Option<char> {
        self.peeked.take().or_else(|| self.chars.next())
    }

    fn peek(&mut self) -> Option<char> {
        if self.peeked.is_none() {
            self.peeked = self.chars.next();
        }
        self.peeked
    }

    fn skip_ws(&mut self) {
        while matches!(self.peek(), Some(' ' | '\t' | '\n' | '\r')) {
            self.next();
        }
    }

    fn expect(&mut self, want: char) -> Result<(), JsonError> {
        match self.next() {
            Some(c) if c == want => Ok(()),
            Some(c) => Err(JsonError::Unexpected(c)),
            None => Err(JsonError::End),
        }
    }

    fn literal(&mut self, word: &str, v: Value) -> Result<Value, JsonError> {
        for want in word.chars() {
            self.expect(want)?;
        }
        Ok(v)
    }

    fn value(&mut self) -> Result<Value, JsonError> {
        self.skip_ws();
        match self.peek().ok_or(JsonError::End)? {
            'n' => self.literal("null", Value::Null),
            't' => self.literal("true", Value::Bool(true)),
            'f' => self.literal("false", Value::Bool(false)),
            '"' => self.string().map(Value::String),
            '[' => self.array(),
            '{' => self.object(),
            '-' | '0'..='9' => self.number(),
            c => Err(JsonError::Unexpected(c)),
        }
    }

    fn number(&mut self) -> Result<Value, JsonError> {
        let mut s = String::new();
        while let Some(c) = self.peek() {
            if !matches!(c, '-' | '+' | '.' | 'e' | 'E' | '0'..='9') {
                break;
            }
            s.push(c);
            self.next();
        }
        // Rust's float syntax is a superset of JSON's for these characters
        // except a leading '+' or '.', and "inf"/"nan" cannot occur here.
        if s.starts_with('+') || s.starts_with('.') || s.starts_with("-.") {
            return Err(JsonError::Number(s));
        }
        s.parse::<f64>()
            .map(Value::Number)
            .map_err(|_| JsonError::Number(s))
    }

    fn hex4(&mut self) -> Result<u32, JsonError> {
        let mut v = 0;
        for _ in 0..4 {
            let d = self
                .next()
                .and_then(|c| c.to_digit(16))
                .ok_or(JsonError::Escape)?;
            v = v * 16 + d;
        }
        Ok(v)
    }

    fn string(&mut self) -> Result<String, JsonError> {
        self.expect('"')?;
        let mut s = String::new();
        loop {
            match self.next().ok_or(JsonError::End)? {
                '"' => return Ok(s),
                '\\' => {
                    let c = match self.next().ok_or(JsonError::End)? {
                        '"' => '"',
                        '\\' => '\\',
                        '/' => '/',
                        'b' => '\u{8}',
                        'f' => '\u{c}',
                        'n' => '\n',
                        'r' => '\r',
                        't' => '\t',
                        'u' => self.unicode_escape()?,
                        _ => return Err(JsonError::Escape),
                    };
                    s.push(c);
                }
                c if (c as u32) < 0x20 => return Err(JsonError::Unexpected(c)),
                c => s.push(c),
            }
        }
    }

    /// The code point of `\uXXXX`, joining a surrogate pair.
    fn unicode_escape(&mut self) -> Result<char, JsonError> {
        let hi = self.hex4()?;
        let code = if (0xd800..0xdc00).contains(&hi) {
            self.expect('\\').map_err(|_| JsonError::Escape)?;
            self.expect('u').map_err(|_| JsonError::Escape)?;
            let lo = self.hex4()?;
            if !(0xdc00..0xe000).contains(&lo) {
                return Err(JsonError::Escape);
            }
            0x10000 + ((hi - 0xd800) << 10) + (lo - 0xdc00)
        } else {
            hi
        };
        char::from_u32(code).ok_or(JsonError::Escape)
    }

    fn array(&mut self) -> Result<Value, JsonError> {
        self.expect('[')?;
        let mut items = Vec::new();
        self.skip_ws();
        if self.peek() == Some(']') {
            self.next();
            return Ok(Value::Array(items));
        }
        loop {
            items.push(self.value()?);
            self.skip_ws();
            match self.next().ok_or(JsonError::End)? {
                ',' => continue,
                ']' => return Ok(Value::Array(items)),
                c => return Err(JsonError::Unexpected(c)),
            }
        }
    }

    fn object(&mut self) -> Result<Value, JsonError> {
        self.expect('{')?;
        let mut members = Vec::new();
        self.skip_ws();
        if self.peek() == Some('}') {
            self.next();
            return Ok(Value::Object(members));
        }
        loop {
            self.skip_ws();
            let key = self.string()?;
            self.skip_ws();
            self.expect(':')?;
            let v = self.value()?;
            members.push((key, v));
            self.skip_ws();
            match self.next().ok_or(JsonError::End)? {
                ',' => continue,
                '}' => return Ok(Value::Object(members)),
                c => return Err(JsonError::Unexpected(c)),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_a_trainer_report() {
        let text = r#" {"rank":1,"transport":"device","steps":[{"step":0,"loss":2.30,
            "compute_ms":1.5e-1},{"step":1,"loss":null}],"pass":true,"x":{}, "e":[] } "#;
        let v = Value::parse(text).unwrap();
        assert_eq!(v.get("rank").and_then(Value::as_f64), Some(1.0));
        assert_eq!(v.get("transport").and_then(Value::as_str), Some("device"));
        assert_eq!(v.get("pass").and_then(Value::as_bool), Some(true));
        let steps = v.get("steps").and_then(Value::as_array).unwrap();
        assert_eq!(steps.len(), 2);
        assert_eq!(
            steps[0].get("compute_ms").and_then(Value::as_f64),
            Some(0.15)
        );
        assert_eq!(steps[1].get("loss"), Some(&Value::Null));
        assert_eq!(v.get("x"), Some(&Value::Object(vec![])));
        assert_eq!(v.get("e"), Some(&Value::Array(vec![])));
        assert_eq!(v.get("missing"), None);
    }

    #[test]
    fn decodes_escapes() {
        let v = Value::parse(r#""a\"\\\/\n\t\u00e9\ud83d\ude00""#).unwrap();
        assert_eq!(v.as_str(), Some("a\"\\/\n\té\u{1f600}"));
    }

    #[test]
    fn rejects_malformed_text() {
        assert_eq!(Value::parse("{\"a\":1"), Err(JsonError::End));
        assert_eq!(Value::parse("[1,]"), Err(JsonError::Unexpected(']')));
        assert_eq!(Value::parse("1 2"), Err(JsonError::Trailing));
        assert_eq!(Value::parse("+1"), Err(JsonError::Unexpected('+')));
        assert_eq!(Value::parse("-.5"), Err(JsonError::Number("-.5".into())));
        assert_eq!(Value::parse("\"\\ud800x\""), Err(JsonError::Escape));
        assert_eq!(Value::parse("\"\\q\""), Err(JsonError::Escape));
        assert_eq!(Value::parse("tru"), Err(JsonError::End));
        assert!(Value::parse("\"a\nb\"").is_err());
    }
}
