//! Text from outside (message ids, headers, receivers' errors, file and test names) made safe
//! to show on a terminal: control characters are written as escapes, never raw, so that
//! nothing a message or a pull request carries can move the cursor, restyle or retitle the
//! terminal, or fake a line of output. JSON output needs none of this: JSON escapes them.

use std::borrow::Cow;

/// `text` with each control character written as an escape: `\n`, `\r`, `\t`, `\x1b` (other
/// ASCII controls alike), and `\u{9b}` for the C1 controls and the bidirectional overrides
/// that reorder what a terminal shows ("Trojan Source"). Other text is unchanged.
pub fn visible(text: &str) -> Cow<'_, str> {
    if !text.chars().any(is_hidden) {
        return Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        match c {
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c.is_ascii_control() => out.push_str(&format!("\\x{:02x}", u32::from(c))),
            c if is_hidden(c) => out.extend(c.escape_unicode()),
            c => out.push(c),
        }
    }
    Cow::Owned(out)
}

/// Whether a terminal would act on `c` rather than show it.
pub fn is_hidden(c: char) -> bool {
    c.is_control() || matches!(c, '\u{202A}'..='\u{202E}' | '\u{2066}'..='\u{2069}')
}

#[cfg(test)]
mod tests {
    use super::visible;

    #[test]
    fn control_characters_are_escaped_and_the_rest_left_alone() {
        let cases = [
            ("plain text, ünïcode ✓", "plain text, ünïcode ✓"),
            ("\u{1b}[31mred\u{1b}[0m", r"\x1b[31mred\x1b[0m"),
            ("a\nb\r\tc", r"a\nb\r\tc"),
            ("bell\u{7} nul\u{0} del\u{7f}", r"bell\x07 nul\x00 del\x7f"),
            ("csi\u{9b}2J", r"csi\u{9b}2J"),
            ("rtl\u{202e}txt.exe", r"rtl\u{202e}txt.exe"),
            (r"a literal \x1b stays", r"a literal \x1b stays"),
        ];
        for (text, shown) in cases {
            assert_eq!(visible(text), shown, "{text:?}");
        }
    }
}
