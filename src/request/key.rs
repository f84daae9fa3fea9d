//! Parsing the `Idempotency-Key` header and the key handed to handlers.
//!
//! The IETF draft defines the field as an RFC 8941 Item whose value is a String
//! (`Idempotency-Key: "8e03978e-40d5-43e8-bc93-6894a57f9324"`). Many clients send the
//! bare value instead (`Idempotency-Key: 8e03978e-...`), so both forms are accepted and
//! name the same key: the String's value.
//!
//! Rules, each with its own [`KeyError`]:
//! - exactly one `Idempotency-Key` field ([`KeyError::Multiple`]);
//! - the value is 1–255 visible ASCII characters (`!` to `~`);
//! - a quoted value is a well-formed sf-string: escapes only `\"` and `\\`, a closing
//!   quote, nothing after it;
//! - a bare value contains no `"`.
//!
//! Optional whitespace around the field value is ignored, as HTTP prescribes.

use std::{fmt, sync::Arc};

use http::{HeaderMap, HeaderName};
use sha2::{Digest, Sha256};

use crate::request::scope::Scope;

/// The default header name, `Idempotency-Key`.
pub const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");

/// The longest key accepted, in characters.
pub const MAX_KEY_LEN: usize = 255;

/// Why an `Idempotency-Key` header was rejected.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum KeyError {
    /// The header was required on this request but not sent.
    Missing,
    /// More than one `Idempotency-Key` field was sent.
    Multiple,
    /// The value is empty (`""` or nothing at all).
    Empty,
    /// The value is longer than [`MAX_KEY_LEN`] characters.
    TooLong {
        /// Length of the value that was sent.
        len: usize,
    },
    /// A byte outside visible ASCII (or a `"` in a bare value).
    InvalidCharacter {
        /// Offset of the byte in the field value.
        at: usize,
    },
    /// A quoted value without its closing quote.
    UnterminatedString,
    /// A backslash in a quoted value not followed by `"` or `\`.
    InvalidEscape {
        /// Offset of the backslash in the field value.
        at: usize,
    },
    /// Characters after the closing quote (parameters are not accepted either).
    TrailingCharacters {
        /// Offset of the first trailing byte in the field value.
        at: usize,
    },
}

impl fmt::Display for KeyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.naming("Idempotency-Key"))
    }
}

impl KeyError {
    /// The error's message, naming the key's field `header` (the layer's
    /// [`header_name`](crate::IdempotencyLayer::header_name)).
    pub(crate) fn naming(&self, header: &str) -> String {
        match self {
            Self::Missing => format!("the {header} header is required on this request"),
            Self::Multiple => format!("more than one {header} field was sent"),
            Self::Empty => format!("the {header} is empty"),
            Self::TooLong { len } => {
                format!("the {header} is {len} characters long; at most {MAX_KEY_LEN} are allowed")
            }
            Self::InvalidCharacter { at } => format!(
                "the {header} has an invalid character at byte {at}; only visible ASCII is allowed, and a double quote only around a quoted key"
            ),
            Self::UnterminatedString => format!("the quoted {header} has no closing quote"),
            Self::InvalidEscape { at } => format!(
                "the quoted {header} has an invalid escape at byte {at}; only \\\" and \\\\ are allowed"
            ),
            Self::TrailingCharacters { at } => {
                format!("the {header} has characters after its closing quote at byte {at}")
            }
        }
    }
}

impl std::error::Error for KeyError {}

/// Parses one `Idempotency-Key` field value (sf-string or bare) into the key it names.
///
/// # Errors
///
/// A [`KeyError`] for a value that is empty, longer than [`MAX_KEY_LEN`], holds a byte
/// outside visible ASCII (or a `"` in a bare value), or is not a well-formed sf-string
/// (no closing quote, an escape other than `\"` or `\\`, anything after the closing
/// quote); each variant says which, as the layer's `400` does.
///
/// ```
/// use tower_idempotency::parse_key;
///
/// assert_eq!(parse_key(b"\"order-42\"").unwrap(), "order-42");
/// assert_eq!(parse_key(b"order-42").unwrap(), "order-42");
/// assert_eq!(parse_key(br#""a\"b""#).unwrap(), "a\"b");
/// assert!(parse_key(b"").is_err());
/// ```
pub fn parse_key(field: &[u8]) -> Result<String, KeyError> {
    let (start, end) = trim_ows(field);
    let value = &field[start..end];
    if value.first() == Some(&b'"') {
        parse_sf_string(value, start)
    } else {
        parse_bare(value, start)
    }
}

/// Reads the key from `headers`: `Ok(None)` when the field is absent.
pub(crate) fn key_from_headers(
    headers: &HeaderMap,
    name: &HeaderName,
) -> Result<Option<String>, KeyError> {
    let mut values = headers.get_all(name).iter();
    let Some(first) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err(KeyError::Multiple);
    }
    parse_key(first.as_bytes()).map(Some)
}

fn trim_ows(field: &[u8]) -> (usize, usize) {
    let is_ows = |b: &u8| *b == b' ' || *b == b'\t';
    let start = field.iter().position(|b| !is_ows(b)).unwrap_or(field.len());
    let end = field
        .iter()
        .rposition(|b| !is_ows(b))
        .map_or(start, |i| i + 1);
    (start, end)
}

fn is_visible(b: u8) -> bool {
    (0x21..=0x7e).contains(&b)
}

fn parse_bare(value: &[u8], offset: usize) -> Result<String, KeyError> {
    if value.is_empty() {
        return Err(KeyError::Empty);
    }
    if let Some(at) = value.iter().position(|&b| !is_visible(b) || b == b'"') {
        return Err(KeyError::InvalidCharacter { at: offset + at });
    }
    if value.len() > MAX_KEY_LEN {
        return Err(KeyError::TooLong { len: value.len() });
    }
    Ok(ascii(value))
}

/// `bytes`, checked to be visible ASCII, as a `String`: one allocation of its length
/// and a copy, where collecting it `char` by `char` grew the string as it went.
fn ascii(bytes: &[u8]) -> String {
    match std::str::from_utf8(bytes) {
        Ok(s) => s.to_owned(),
        // Not reached: the bytes were checked.
        Err(_) => bytes.iter().map(|&b| char::from(b)).collect(),
    }
}

fn parse_sf_string(value: &[u8], offset: usize) -> Result<String, KeyError> {
    // The quoted value's length, up to the longest key allowed: no growing as it is read.
    let mut out = String::with_capacity(value.len().saturating_sub(2).min(MAX_KEY_LEN));
    let mut i = 1;
    loop {
        let Some(&b) = value.get(i) else {
            return Err(KeyError::UnterminatedString);
        };
        match b {
            b'"' => break,
            b'\\' => match value.get(i + 1) {
                Some(&e @ (b'"' | b'\\')) => {
                    out.push(char::from(e));
                    i += 2;
                    continue;
                }
                None => return Err(KeyError::UnterminatedString),
                Some(_) => return Err(KeyError::InvalidEscape { at: offset + i }),
            },
            b if is_visible(b) => out.push(char::from(b)),
            _ => return Err(KeyError::InvalidCharacter { at: offset + i }),
        }
        i += 1;
    }
    if i + 1 < value.len() {
        return Err(KeyError::TrailingCharacters { at: offset + i + 1 });
    }
    if out.is_empty() {
        return Err(KeyError::Empty);
    }
    if out.len() > MAX_KEY_LEN {
        return Err(KeyError::TooLong { len: out.len() });
    }
    Ok(out)
}

/// The idempotency key of the request being handled, with the scope it belongs to.
///
/// The layer puts it in the request extensions before calling the inner service; in Axum
/// it is also an extractor. Use [`derive`](Self::derive) to get keys for the calls the
/// handler makes to other systems, so those are idempotent too.
///
/// ```
/// use tower_idempotency::{IdempotencyKey, Scope};
///
/// let key = IdempotencyKey::new(Scope::new("tenant-1"), "order-42");
/// assert_eq!(key.as_str(), "order-42");
/// // Deterministic: a retry of the same request passes the same key downstream.
/// assert_eq!(key.derive("psp"), key.derive("psp"));
/// assert_ne!(key.derive("psp"), key.derive("broker"));
/// ```
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct IdempotencyKey {
    key: Arc<str>,
    scope: Scope,
    /// The steps of the run it was handed to, if a layer or job runner handed it over
    /// ([`step`](Self::step)); not part of its identity.
    steps: crate::run::steps::Steps,
}

impl IdempotencyKey {
    /// A key in a scope. The layer builds these; tests and job runners may too.
    pub fn new(scope: Scope, key: impl Into<Arc<str>>) -> Self {
        Self {
            key: key.into(),
            scope,
            steps: crate::run::steps::Steps::default(),
        }
    }

    /// The steps of the run it was handed to.
    pub(crate) fn steps(&self) -> &crate::run::steps::Steps {
        &self.steps
    }

    /// Hands it the steps of the run it goes to.
    pub(crate) fn set_steps(&mut self, steps: crate::run::steps::Steps) {
        self.steps = steps;
    }

    /// The key as the client sent it (the sf-string's value).
    pub fn as_str(&self) -> &str {
        &self.key
    }

    /// The scope the key was claimed in.
    pub fn scope(&self) -> &Scope {
        &self.scope
    }

    /// A deterministic key for another system, unique per (scope, key, `label`).
    ///
    /// The result is 64 lowercase hex characters (SHA-256), fit for any provider's
    /// idempotency-key field. A retry of the same request derives the same key, so a
    /// payment provider that honours its own keys charges once.
    pub fn derive(&self, label: &str) -> String {
        let mut h = Sha256::new();
        for part in [self.scope.as_str(), &self.key, label] {
            h.update((part.len() as u64).to_be_bytes());
            h.update(part.as_bytes());
        }
        crate::hex::encode(&h.finalize())
    }
}

impl fmt::Debug for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyKey")
            .field("key", &self.key)
            .field("scope", &self.scope)
            .finish()
    }
}

impl fmt::Display for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.key)
    }
}

#[cfg(test)]
mod tests {
    use http::HeaderValue;

    use super::*;

    fn ok(field: &[u8]) -> String {
        parse_key(field)
            .unwrap_or_else(|e| panic!("{:?} rejected: {e}", String::from_utf8_lossy(field)))
    }

    #[test]
    fn quoted_and_bare_name_the_same_key() {
        assert_eq!(ok(b"\"abc\""), "abc");
        assert_eq!(ok(b"abc"), "abc");
        assert_eq!(
            ok(b"8e03978e-40d5-43e8-bc93-6894a57f9324"),
            "8e03978e-40d5-43e8-bc93-6894a57f9324"
        );
    }

    #[test]
    fn surrounding_whitespace_is_ignored() {
        assert_eq!(ok(b"  \"abc\"\t"), "abc");
        assert_eq!(ok(b"\tabc "), "abc");
    }

    #[test]
    fn escapes_in_quoted_keys() {
        assert_eq!(ok(br#""a\"b""#), "a\"b");
        assert_eq!(ok(br#""a\\b""#), "a\\b");
        assert_eq!(
            parse_key(br#""a\nb""#),
            Err(KeyError::InvalidEscape { at: 2 })
        );
        assert_eq!(parse_key(br#""ab\"#), Err(KeyError::UnterminatedString));
    }

    #[test]
    fn empty_is_rejected() {
        assert_eq!(parse_key(b""), Err(KeyError::Empty));
        assert_eq!(parse_key(b"   "), Err(KeyError::Empty));
        assert_eq!(parse_key(b"\"\""), Err(KeyError::Empty));
    }

    #[test]
    fn length_bounds() {
        let max = "k".repeat(MAX_KEY_LEN);
        assert_eq!(ok(max.as_bytes()), max);
        assert_eq!(ok(format!("\"{max}\"").as_bytes()), max);
        let long = "k".repeat(MAX_KEY_LEN + 1);
        assert_eq!(
            parse_key(long.as_bytes()),
            Err(KeyError::TooLong { len: 256 })
        );
        assert_eq!(
            parse_key(format!("\"{long}\"").as_bytes()),
            Err(KeyError::TooLong { len: 256 })
        );
        // Escapes count as the one character they stand for.
        let escaped = format!("\"{}\"", "\\\\".repeat(MAX_KEY_LEN));
        assert_eq!(
            parse_key(escaped.as_bytes()).map(|k| k.len()),
            Ok(MAX_KEY_LEN)
        );
        assert_eq!(ok(b"k").len(), 1);
    }

    #[test]
    fn only_visible_ascii() {
        assert_eq!(parse_key(b"a b"), Err(KeyError::InvalidCharacter { at: 1 }));
        assert_eq!(
            parse_key(b"\"a b\""),
            Err(KeyError::InvalidCharacter { at: 2 })
        );
        assert_eq!(
            parse_key(b"ab\x7f"),
            Err(KeyError::InvalidCharacter { at: 2 })
        );
        assert_eq!(
            parse_key(b"\xc3\xa9t\xc3\xa9"),
            Err(KeyError::InvalidCharacter { at: 0 })
        );
        assert_eq!(
            parse_key(b"\"\xff\""),
            Err(KeyError::InvalidCharacter { at: 1 })
        );
        assert_eq!(
            parse_key(b"a\tb"),
            Err(KeyError::InvalidCharacter { at: 1 })
        );
        assert_eq!(
            ok(b"!#$%&'()*+,-./:;<=>?@[\\]^_`{|}~"),
            "!#$%&'()*+,-./:;<=>?@[\\]^_`{|}~"
        );
    }

    #[test]
    fn bare_values_cannot_hold_quotes() {
        assert_eq!(
            parse_key(b"ab\"c"),
            Err(KeyError::InvalidCharacter { at: 2 })
        );
    }

    #[test]
    fn nothing_after_the_closing_quote() {
        assert_eq!(
            parse_key(b"\"abc\"x"),
            Err(KeyError::TrailingCharacters { at: 5 })
        );
        assert_eq!(
            parse_key(b"\"abc\";p=1"),
            Err(KeyError::TrailingCharacters { at: 5 })
        );
        assert_eq!(
            parse_key(b"\"abc\" \"d\""),
            Err(KeyError::TrailingCharacters { at: 5 })
        );
        assert_eq!(parse_key(b"\"abc"), Err(KeyError::UnterminatedString));
        assert_eq!(parse_key(b"\""), Err(KeyError::UnterminatedString));
    }

    #[test]
    fn a_second_field_is_rejected() {
        let name = HeaderName::from_static("idempotency-key");
        let mut headers = HeaderMap::new();
        assert_eq!(key_from_headers(&headers, &name), Ok(None));
        headers.append(&name, HeaderValue::from_static("a"));
        assert_eq!(key_from_headers(&headers, &name), Ok(Some("a".into())));
        headers.append(&name, HeaderValue::from_static("a"));
        assert_eq!(key_from_headers(&headers, &name), Err(KeyError::Multiple));
    }

    #[test]
    fn derived_keys_are_distinct_per_label_and_scope() {
        let a = IdempotencyKey::new(Scope::new("a"), "k");
        let b = IdempotencyKey::new(Scope::new("b"), "k");
        assert_eq!(a.derive("psp").len(), 64);
        assert_ne!(a.derive("psp"), a.derive("mq"));
        assert_ne!(a.derive("psp"), b.derive("psp"));
        // Length framing: ("ab", "c") and ("a", "bc") differ.
        let x = IdempotencyKey::new(Scope::new("ab"), "c");
        let y = IdempotencyKey::new(Scope::new("a"), "bc");
        assert_ne!(x.derive(""), y.derive(""));
    }
}
