//! `Content-Type` as any reader of it sees it: `Application/JSON; Charset="UTF-8"` and
//! `application/json` are one media type.
//!
//! The type and subtype, and parameter names, are case-insensitive (RFC 9110, 8.3.1);
//! spaces around `;` and `=` do not count; and on JSON (`application/json` or any
//! `+json` type), whose only encoding is UTF-8 (RFC 8259, 8.1), `charset=utf-8` says
//! nothing. Parameter values keep their case (a `boundary` is case-sensitive), and the
//! parameters their order.

/// A `Content-Type` value, normalised, and whether it is a JSON type; the value as it
/// came, and not JSON, when it is not a media type.
pub(crate) fn normalise(value: &[u8]) -> (std::borrow::Cow<'_, [u8]>, bool) {
    match parse(value) {
        Some((normal, json)) => (normal.into_bytes().into(), json),
        None => (value.into(), false),
    }
}

/// Whether the essence `type/subtype` (lower-case) is a JSON type.
fn is_json(essence: &str) -> bool {
    essence == "application/json"
        || essence
            .split_once('/')
            .is_some_and(|(_, subtype)| subtype.len() > "+json".len() && subtype.ends_with("+json"))
}

fn parse(value: &[u8]) -> Option<(String, bool)> {
    let value = std::str::from_utf8(value).ok()?;
    let mut parts = split(value)?.into_iter();
    let essence = parts.next()?.trim().to_ascii_lowercase();
    let (kind, subtype) = essence.split_once('/')?;
    if !token(kind) || !token(subtype) {
        return None;
    }
    let json = is_json(&essence);
    let mut normal = essence.clone();
    for param in parts {
        let (name, value) = param.split_once('=')?;
        let (name, value) = (name.trim().to_ascii_lowercase(), value.trim());
        if !token(&name) || value.is_empty() {
            return None;
        }
        let unquoted = value
            .strip_prefix('"')
            .and_then(|v| v.strip_suffix('"'))
            .unwrap_or(value);
        if json && name == "charset" && unquoted.eq_ignore_ascii_case("utf-8") {
            continue;
        }
        normal.push(';');
        normal.push_str(&name);
        normal.push('=');
        normal.push_str(value);
    }
    Some((normal, json))
}

/// `value` split at each `;` outside a quoted string; `None` if a quote is left open.
fn split(value: &str) -> Option<Vec<&str>> {
    let (mut parts, mut start, mut quoted, mut escaped) = (Vec::new(), 0, false, false);
    for (i, c) in value.char_indices() {
        match c {
            _ if escaped => escaped = false,
            '\\' if quoted => escaped = true,
            '"' => quoted = !quoted,
            ';' if !quoted => {
                parts.push(&value[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    if quoted {
        return None;
    }
    parts.push(&value[start..]);
    // A trailing `;` with nothing after it says nothing.
    if parts.len() > 1 && parts.last().is_some_and(|p| p.trim().is_empty()) {
        parts.pop();
    }
    Some(parts)
}

/// An RFC 9110 token: one or more of its characters.
fn token(s: &str) -> bool {
    !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
}

#[cfg(test)]
mod tests {
    use super::normalise;

    fn n(value: &str) -> (String, bool) {
        let (normal, json) = normalise(value.as_bytes());
        (String::from_utf8(normal.into_owned()).unwrap(), json)
    }

    #[test]
    fn case_spaces_and_a_utf8_charset_on_json_do_not_count() {
        let json = ("application/json".to_owned(), true);
        assert_eq!(n("application/json"), json);
        assert_eq!(n("Application/JSON; charset=UTF-8"), json);
        assert_eq!(n("application/json;CHARSET=\"utf-8\""), json);
        assert_eq!(n(" application/json ; charset = utf-8 ;"), json);
        assert_eq!(
            n("application/problem+json; Charset=utf-8"),
            ("application/problem+json".into(), true)
        );
        assert_eq!(
            n("application/vnd.api+json;ext=\"a;b\""),
            ("application/vnd.api+json;ext=\"a;b\"".into(), true)
        );
    }

    #[test]
    fn other_parameters_and_types_keep_what_counts() {
        assert_eq!(
            n("application/json; charset=latin1"),
            ("application/json;charset=latin1".into(), true)
        );
        assert_eq!(
            n("Text/Plain; Charset=UTF-8"),
            ("text/plain;charset=UTF-8".into(), false)
        );
        assert_eq!(
            n("multipart/form-data; boundary=AbC"),
            ("multipart/form-data;boundary=AbC".into(), false)
        );
        assert!(!n("application/+json").1);
        assert!(!n("application/jsonx").1);
    }

    #[test]
    fn what_is_not_a_media_type_is_kept_as_it_came() {
        for value in [
            "json",
            "application/json; charset",
            "a/b; x=\"open",
            "a b/c",
            "",
        ] {
            assert_eq!(n(value), (value.to_owned(), false), "{value}");
        }
    }
}
