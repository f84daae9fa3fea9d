//! JSON bodies as any JSON reader sees them: a strict RFC 8259 parser that writes a
//! canonical form of the text it reads, or refuses it.
//!
//! The canonical form drops insignificant whitespace, sorts each object's members by
//! their names (by the bytes of each name's canonical spelling, one per name), and
//! writes every string one way: `"` and `\` escaped, control characters
//! as `\u00XX`, everything else as itself, so `"\u0041"`, `"A"` and `"\/"`, `"/"`
//! are each one string. Numbers are kept exactly as written: a payment's
//! `9007199254740993` is not the `9007199254740992` a double would read.
//!
//! `None` for what is not one JSON text, and for texts that readers disagree on: an
//! object with a member name twice (one reader keeps the first, another the last), a
//! string with an unpaired surrogate, nesting deeper than [`MAX_DEPTH`] (bounded so
//! that a hostile body cannot exhaust the stack). The caller then compares the bytes.

/// The deepest nesting of arrays and objects read; deeper texts are compared by bytes.
pub(crate) const MAX_DEPTH: usize = 128;

/// The canonical form of `text`; `None` if it is not one JSON text that every reader
/// reads alike.
pub(crate) fn canonical(text: &[u8]) -> Option<Vec<u8>> {
    // Strict: the whole text is UTF-8, so the parser only checks the grammar.
    std::str::from_utf8(text).ok()?;
    let mut parser = Parser { text, at: 0 };
    let mut out = Vec::with_capacity(text.len());
    parser.whitespace();
    parser.value(&mut out, 0)?;
    parser.whitespace();
    (parser.at == text.len()).then_some(out)
}

struct Parser<'a> {
    text: &'a [u8],
    at: usize,
}

impl Parser<'_> {
    fn peek(&self) -> Option<u8> {
        self.text.get(self.at).copied()
    }

    fn whitespace(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\t' | b'\n' | b'\r')) {
            self.at += 1;
        }
    }

    fn eat(&mut self, b: u8) -> Option<()> {
        (self.peek()? == b).then(|| self.at += 1)
    }

    fn literal(&mut self, word: &[u8], out: &mut Vec<u8>) -> Option<()> {
        let end = self.at.checked_add(word.len())?;
        (self.text.get(self.at..end)? == word).then(|| {
            self.at = end;
            out.extend_from_slice(word);
        })
    }

    fn value(&mut self, out: &mut Vec<u8>, depth: usize) -> Option<()> {
        match self.peek()? {
            b'{' => self.object(out, depth + 1),
            b'[' => self.array(out, depth + 1),
            b'"' => self.string(out),
            b't' => self.literal(b"true", out),
            b'f' => self.literal(b"false", out),
            b'n' => self.literal(b"null", out),
            _ => self.number(out),
        }
    }

    /// An object, its members written in place as they come, each name as its
    /// canonical string; put in order of those (the one encoding of each name, so
    /// equal names are equal bytes) only if they came in another.
    fn object(&mut self, out: &mut Vec<u8>, depth: usize) -> Option<()> {
        if depth > MAX_DEPTH {
            return None;
        }
        self.eat(b'{')?;
        self.whitespace();
        out.push(b'{');
        let base = out.len();
        // Each member's name and whole extent in `out`, the comma before it excluded.
        let mut members: Vec<Member> = Vec::new();
        if self.eat(b'}').is_none() {
            loop {
                self.whitespace();
                if self.peek()? != b'"' {
                    return None;
                }
                if !members.is_empty() {
                    out.push(b',');
                }
                let start = out.len();
                self.string(out)?;
                let name_end = out.len();
                self.whitespace();
                self.eat(b':')?;
                self.whitespace();
                out.push(b':');
                self.value(out, depth)?;
                members.push(Member {
                    start,
                    name_end,
                    end: out.len(),
                });
                self.whitespace();
                match self.peek()? {
                    b',' => self.at += 1,
                    b'}' => {
                        self.at += 1;
                        break;
                    }
                    _ => return None,
                }
            }
        }
        let in_order = members
            .windows(2)
            .all(|pair| pair[0].name(out, 0) < pair[1].name(out, 0));
        if !in_order {
            // Rewritten in order from a copy of what was written.
            let written = out[base..].to_vec();
            members.sort_unstable_by(|a, b| a.name(&written, base).cmp(b.name(&written, base)));
            let twice =
                |pair: &[Member]| pair[0].name(&written, base) == pair[1].name(&written, base);
            if members.windows(2).any(twice) {
                return None;
            }
            out.truncate(base);
            for (i, m) in members.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                out.extend_from_slice(&written[m.start - base..m.end - base]);
            }
        }
        out.push(b'}');
        Some(())
    }

    fn array(&mut self, out: &mut Vec<u8>, depth: usize) -> Option<()> {
        if depth > MAX_DEPTH {
            return None;
        }
        self.eat(b'[')?;
        self.whitespace();
        out.push(b'[');
        if self.eat(b']').is_some() {
            out.push(b']');
            return Some(());
        }
        loop {
            self.whitespace();
            self.value(out, depth)?;
            self.whitespace();
            match self.peek()? {
                b',' => {
                    self.at += 1;
                    out.push(b',');
                }
                b']' => {
                    self.at += 1;
                    out.push(b']');
                    return Some(());
                }
                _ => return None,
            }
        }
    }

    /// A number as written, once it is one: `-? (0 | [1-9][0-9]*) (. [0-9]+)? ([eE] [+-]? [0-9]+)?`.
    fn number(&mut self, out: &mut Vec<u8>) -> Option<()> {
        let start = self.at;
        let _ = self.eat(b'-');
        match self.peek()? {
            b'0' => self.at += 1,
            b'1'..=b'9' => self.digits(),
            _ => return None,
        }
        if self.eat(b'.').is_some() {
            self.peek().filter(u8::is_ascii_digit)?;
            self.digits();
        }
        if matches!(self.peek(), Some(b'e' | b'E')) {
            self.at += 1;
            if matches!(self.peek(), Some(b'+' | b'-')) {
                self.at += 1;
            }
            self.peek().filter(u8::is_ascii_digit)?;
            self.digits();
        }
        out.extend_from_slice(&self.text[start..self.at]);
        Some(())
    }

    fn digits(&mut self) {
        while self.peek().is_some_and(|b| b.is_ascii_digit()) {
            self.at += 1;
        }
    }

    /// A string, written as its canonical string: its escapes decoded, and each
    /// character written the one way.
    fn string(&mut self, out: &mut Vec<u8>) -> Option<()> {
        self.eat(b'"')?;
        out.push(b'"');
        loop {
            let run = self.at;
            while self
                .peek()
                .is_some_and(|b| b != b'"' && b != b'\\' && b >= 0x20)
            {
                self.at += 1;
            }
            // Characters written as themselves (the text is UTF-8, checked whole).
            out.extend_from_slice(&self.text[run..self.at]);
            match self.peek()? {
                b'"' => {
                    self.at += 1;
                    out.push(b'"');
                    return Some(());
                }
                b'\\' => {
                    self.at += 1;
                    let escaped = self.peek()?;
                    self.at += 1;
                    let c = match escaped {
                        b'"' => '"',
                        b'\\' => '\\',
                        b'/' => '/',
                        b'b' => '\u{8}',
                        b'f' => '\u{c}',
                        b'n' => '\n',
                        b'r' => '\r',
                        b't' => '\t',
                        b'u' => self.unicode()?,
                        _ => return None,
                    };
                    write_char(c, out);
                }
                // A control character unescaped.
                _ => return None,
            }
        }
    }

    /// The character of a `\u` escape (its `\u` read), a surrogate pair's two escapes
    /// together; `None` for an unpaired surrogate.
    fn unicode(&mut self) -> Option<char> {
        let first = self.hex4()?;
        match first {
            0xd800..=0xdbff => {
                self.eat(b'\\')?;
                self.eat(b'u')?;
                let second = self.hex4()?;
                if !(0xdc00..=0xdfff).contains(&second) {
                    return None;
                }
                char::from_u32(0x10000 + ((first - 0xd800) << 10) + (second - 0xdc00))
            }
            0xdc00..=0xdfff => None,
            _ => char::from_u32(first),
        }
    }

    fn hex4(&mut self) -> Option<u32> {
        let end = self.at.checked_add(4)?;
        let digits = self.text.get(self.at..end)?;
        let mut value = 0;
        for d in digits {
            value = value * 16 + char::from(*d).to_digit(16)?;
        }
        self.at = end;
        Some(value)
    }
}

/// Where an object's member lies in the canonical text: its name from `start` to
/// `name_end`, the whole member to `end`.
struct Member {
    start: usize,
    name_end: usize,
    end: usize,
}

impl Member {
    /// Its name in `text`, a copy of the canonical text from `base` on.
    fn name<'t>(&self, text: &'t [u8], base: usize) -> &'t [u8] {
        &text[self.start - base..self.name_end - base]
    }
}

/// A decoded character of a string, written the one canonical way: `"` and `\`
/// escaped, control characters as `\u00XX`, everything else as itself.
fn write_char(c: char, out: &mut Vec<u8>) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    match c {
        '"' => out.extend_from_slice(b"\\\""),
        '\\' => out.extend_from_slice(b"\\\\"),
        '\u{0}'..='\u{1f}' => {
            let b = c as u8;
            out.extend_from_slice(b"\\u00");
            out.push(HEX[usize::from(b >> 4)]);
            out.push(HEX[usize::from(b & 0xf)]);
        }
        c => out.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes()),
    }
}

#[cfg(test)]
mod tests {
    use super::canonical;

    fn c(text: &str) -> Option<String> {
        canonical(text.as_bytes()).map(|bytes| String::from_utf8(bytes).unwrap())
    }

    #[test]
    fn spelling_does_not_count() {
        let one = c(r#"{"amount":1000,"currency":"EUR"}"#).unwrap();
        assert_eq!(one, r#"{"amount":1000,"currency":"EUR"}"#);
        assert_eq!(
            c(" {\n\t\"currency\" : \"EUR\" , \"amount\" : 1000 } ").unwrap(),
            one
        );
        assert_eq!(
            c(r#"{"amount":1000,"currency":"\u0045U\u0052"}"#).unwrap(),
            one
        );
        assert_eq!(
            c(r#"["\/","\ud83d\ude00","\n"]"#).unwrap(),
            "[\"/\",\"\u{1f600}\",\"\\u000a\"]"
        );
    }

    #[test]
    fn numbers_count_as_written() {
        assert_ne!(c("9007199254740993"), c("9007199254740992"));
        assert_ne!(c("1.0"), c("1"));
        assert_eq!(c(" -0.5e+10 ").unwrap(), "-0.5e+10");
    }

    #[test]
    fn what_readers_disagree_on_or_cannot_read_is_refused() {
        for text in [
            r#"{"a":1,"a":2}"#,
            r#"{"a":1,"\u0061":1}"#,
            r#""\ud800""#,
            r#""\udc00\ud800""#,
            "01",
            "1.",
            ".5",
            "+1",
            "1e",
            "[1,]",
            r#"{"a":1,}"#,
            "{a:1}",
            "'a'",
            "\"\t\"",
            "\"\\x\"",
            "[1] [2]",
            "",
            "nul",
            "\u{feff}{}",
        ] {
            assert_eq!(c(text), None, "{text}");
        }
        assert_eq!(canonical(b"\"\xff\""), None);
    }

    #[test]
    fn nesting_is_bounded() {
        let deep = |n: usize| format!("{}{}", "[".repeat(n), "]".repeat(n));
        assert!(c(&deep(super::MAX_DEPTH)).is_some());
        assert_eq!(c(&deep(super::MAX_DEPTH + 1)), None);
        assert_eq!(c(&deep(1_000_000)), None);
    }
}
