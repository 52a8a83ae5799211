//! "Did you mean": the known word closest to a misspelt one, for unknown keys, enum values,
//! exchange and queue names.

/// The word of `known` closest to `word`: one differing only in case, else the nearest by edit
/// distance when it is near enough to be a typo (about a third of the letters). Ties go to
/// the first in order.
pub fn closest<'a>(word: &str, known: impl IntoIterator<Item = &'a str>) -> Option<&'a str> {
    let known: Vec<&str> = known.into_iter().collect();
    if let Some(same) = known.iter().find(|k| k.eq_ignore_ascii_case(word)) {
        return Some(same);
    }
    known
        .into_iter()
        .map(|k| (edit_distance(k, word), k))
        .filter(|(d, k)| *d <= k.len().max(word.len()) / 3 + 1)
        .min_by_key(|(d, _)| *d)
        .map(|(_, k)| k)
}

/// `; did you mean "x"?` naming the word of `known` closest to `word`, or nothing.
pub fn did_you_mean<'a>(word: &str, known: impl IntoIterator<Item = &'a str>) -> String {
    closest(word, known).map(|close| format!("; did you mean \"{close}\"?")).unwrap_or_default()
}

fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut prev = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let cur = row[j + 1];
            row[j + 1] = (prev + usize::from(ca != *cb)).min(row[j] + 1).min(cur + 1);
            prev = cur;
        }
    }
    row[b.len()]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn edit_distances() {
        for (a, b, d) in [("concurrency", "concurency", 1), ("retry", "retyr", 2), ("", "abc", 3), ("same", "same", 0)]
        {
            assert_eq!(edit_distance(a, b), d, "{a} {b}");
        }
    }

    #[test]
    fn closest_words() {
        let methods = ["GET", "POST", "PUT"];
        let cases = [
            ("post", &methods[..], Some("POST")),
            ("topc", &["direct", "fanout", "topic", "headers"][..], Some("topic")),
            ("order", &["orders", "billing"][..], Some("orders")),
            ("zzzzzz", &methods[..], None),
            ("x", &[][..], None),
        ];
        for (word, known, want) in cases {
            assert_eq!(closest(word, known.iter().copied()), want, "{word}");
        }
    }
}
