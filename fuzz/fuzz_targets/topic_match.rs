//! `pattern NUL key` through the topic matcher, checked against a plain reference: the
//! definition of `*` and `#` written as a recursion over words (memoised, so that many `#`
//! cannot make the reference itself exponential).
#![no_main]

use std::collections::HashMap;

use libfuzzer_sys::fuzz_target;
use sluice::topology::route::topic_match;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let (pattern, key) = text.split_once('\0').unwrap_or((text, ""));
    let expected = reference(&words(pattern), &words(key));
    assert_eq!(topic_match(pattern, key), expected, "pattern {pattern:?} key {key:?}");
});

/// A topic's words, as RabbitMQ splits them: the empty topic has none.
fn words(s: &str) -> Vec<&str> {
    if s.is_empty() { Vec::new() } else { s.split('.').collect() }
}

fn reference(pattern: &[&str], key: &[&str]) -> bool {
    fn go<'a>(p: &[&'a str], k: &[&'a str], seen: &mut HashMap<(usize, usize), bool>) -> bool {
        let at = (p.len(), k.len());
        if let Some(&known) = seen.get(&at) {
            return known;
        }
        let matched = match p.split_first() {
            None => k.is_empty(),
            // `#`: no word, or one word and `#` again.
            Some((&"#", rest)) => go(rest, k, seen) || (!k.is_empty() && go(p, &k[1..], seen)),
            Some((&segment, rest)) => {
                k.first().is_some_and(|&word| segment == "*" || segment == word) && go(rest, &k[1..], seen)
            }
        };
        seen.insert(at, matched);
        matched
    }
    go(pattern, key, &mut HashMap::new())
}
