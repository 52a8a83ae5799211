//! Where a webhook URL's scheme and host come from: literal text, or the operator's
//! `{{env.NAME}}`, resolved once when `run` starts. A message's values never reach them, so a
//! payload cannot choose where requests go (SSRF).
//!
//! This module reads URL templates as text; it neither compiles nor renders them.

use std::fmt::Write as _;

/// Percent-encoded when an environment value is spliced into a template's text: braces and
/// backslashes would otherwise read as template syntax, and none of them is valid raw in the
/// scheme or host anyway.
const TEMPLATE_SYNTAX: &[(char, &str)] = &[('{', "%7B"), ('}', "%7D"), ('\\', "%5C")];

/// One piece of a URL template's head.
#[derive(Debug, PartialEq, Eq)]
enum Piece<'a> {
    Text(&'a str),
    /// The whole `{{...}}` expression as written.
    Expression(&'a str),
}

/// Splits a URL template where its authority ends: the head chooses the scheme and host; the
/// rest is empty or starts with `/`, `?` or `#`, so nothing in it can change them. The end is
/// the first `/`, `?` or `#` in literal text, not counting the `//` of the first `://`.
fn split(source: &str) -> (Vec<Piece<'_>>, &str) {
    let mut pieces = Vec::new();
    let (mut start, mut at) = (0, 0);
    let mut scheme_seen = false;
    while at < source.len() {
        let rest = &source[at..];
        if let Some(inner) = rest.strip_prefix("{{") {
            if start < at {
                pieces.push(Piece::Text(&source[start..at]));
            }
            // An unclosed expression is a syntax error the template compiler reports.
            let end = inner.find("}}").map_or(source.len(), |i| at + 2 + i + 2);
            pieces.push(Piece::Expression(&source[at..end]));
            (start, at) = (end, end);
        } else if !scheme_seen && rest.starts_with("://") {
            scheme_seen = true;
            at += 3;
        } else if rest.starts_with(['/', '?', '#']) {
            break;
        } else {
            at += rest.chars().next().map_or(1, char::len_utf8);
        }
    }
    if start < at {
        pieces.push(Piece::Text(&source[start..at]));
    }
    (pieces, &source[at..])
}

/// The variable of an expression that is exactly `{{env.NAME}}` (spaces allowed inside the
/// braces); anything else (a helper, a path into a value, `~` whitespace control) is `None`.
fn env_name(expression: &str) -> Option<&str> {
    let inner = expression.strip_prefix("{{")?.strip_suffix("}}")?.trim();
    let name = inner.strip_prefix("env.")?;
    let mut chars = name.chars();
    let first = chars.next()?;
    (first.is_ascii_alphabetic() || first == '_')
        .then_some(())
        .filter(|()| chars.all(|c| c.is_ascii_alphanumeric() || c == '_'))
        .map(|()| name)
}

/// Checks a webhook URL template at validate time: its scheme and host are literal text or
/// `{{env.NAME}}`, and when they are literal, the URL is an http(s) URL with a host.
pub(super) fn check(source: &str) -> Result<(), String> {
    let (head, rest) = split(source);
    let mut from_env = false;
    for piece in &head {
        if let Piece::Expression(e) = piece {
            if env_name(e).is_none() {
                return Err(format!(
                    "the scheme and host of a webhook URL must be literal text or {{{{env.NAME}}}}, not {e}: \
                     a message may not choose where requests go"
                ));
            }
            from_env = true;
        }
    }
    if from_env {
        // Checked when `run` starts, with the values; validation runs where they are unset.
        return Ok(());
    }
    let head: String = head.iter().map(|p| if let Piece::Text(t) = p { *t } else { "" }).collect();
    check_head(&head)?;
    reqwest::Url::parse(&format!("{head}{}", placeholders(rest))).map_err(|e| format!("not a valid URL: {e}"))?;
    Ok(())
}

/// The head alone must parse as an absolute http(s) URL with a host: otherwise the rest could
/// still supply the host (`http:` followed by `//{{payload.host}}`). The reason names no part
/// of the head, which may hold an environment value.
fn check_head(head: &str) -> Result<(), String> {
    if !head.contains("://") {
        return Err("a webhook URL starts with http:// or https://".into());
    }
    let url = reqwest::Url::parse(head).map_err(|e| format!("not a valid URL: {e}"))?;
    if !matches!(url.scheme(), "http" | "https") {
        return Err(format!("webhook URLs are http or https, not \"{}\"", url.scheme()));
    }
    if url.host_str().is_none_or(str::is_empty) {
        return Err("the URL has no host".into());
    }
    Ok(())
}

/// The template with each `{{...}}` replaced by a plain word, to check the URL's shape.
fn placeholders(template: &str) -> String {
    let mut out = String::new();
    let mut rest = template;
    while let Some(start) = rest.find("{{") {
        out.push_str(&rest[..start]);
        out.push('x');
        rest = rest[start..].find("}}").map(|end| &rest[start + end + 2..]).unwrap_or("");
        rest = rest.trim_start_matches('}');
    }
    out.push_str(rest);
    out
}

/// Why a webhook URL cannot be resolved at start-up.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ResolveError {
    #[error("environment variable {0} is not set")]
    Unset(String),
    #[error("{0}")]
    Invalid(String),
}

/// The template with the environment variables of its scheme and host substituted (`None`
/// when there are none), checked to be an absolute http(s) URL with a host. `lookup` reads a
/// variable (`std::env::var` in the runner).
pub fn resolve(source: &str, lookup: impl Fn(&str) -> Option<String>) -> Result<Option<String>, ResolveError> {
    let (head, rest) = split(source);
    if !head.iter().any(|p| matches!(p, Piece::Expression(_))) {
        return Ok(None);
    }
    let mut resolved = String::new();
    for piece in &head {
        match piece {
            Piece::Text(text) => resolved.push_str(text),
            Piece::Expression(e) => {
                // `check` let nothing else through; a template that skipped it resolves nothing.
                let name = env_name(e).ok_or_else(|| ResolveError::Invalid(format!("{e} is not {{{{env.NAME}}}}")))?;
                let value = lookup(name).ok_or_else(|| ResolveError::Unset(name.to_string()))?;
                for c in value.chars() {
                    match TEMPLATE_SYNTAX.iter().find(|(raw, _)| *raw == c) {
                        Some((_, encoded)) => resolved.push_str(encoded),
                        None => resolved.push(c),
                    }
                }
            }
        }
    }
    check_head(&resolved).map_err(|reason| {
        // The values may hold credentials: name the variables, not what they hold.
        let mut names = String::new();
        for name in head.iter().filter_map(|p| if let Piece::Expression(e) = p { env_name(e) } else { None }) {
            let _ = write!(names, "{}{name}", if names.is_empty() { "" } else { ", " });
        }
        ResolveError::Invalid(format!("with {names} as set, the scheme and host are not usable: {reason}"))
    })?;
    resolved.push_str(rest);
    Ok(Some(resolved))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_ends_the_head_where_the_authority_ends() {
        let cases: &[(&str, &[&str], &str)] = &[
            ("https://h.example/x/{{payload.id}}", &["https://h.example"], "/x/{{payload.id}}"),
            ("https://h.example", &["https://h.example"], ""),
            ("https://h.example?x={{id}}", &["https://h.example"], "?x={{id}}"),
            ("{{env.BASE}}/x", &["{{env.BASE}}"], "/x"),
            ("{{env.URL}}", &["{{env.URL}}"], ""),
            ("{{env.S}}://{{env.H}}:{{env.P}}/x", &["{{env.S}}", "://", "{{env.H}}", ":", "{{env.P}}"], "/x"),
            ("https://{{env.H}}.example.com#f", &["https://", "{{env.H}}", ".example.com"], "#f"),
            ("https://h.example{{payload.p}}", &["https://h.example", "{{payload.p}}"], ""),
            ("{{payload.url}}", &["{{payload.url}}"], ""),
            ("a/b://c", &["a"], "/b://c"),
            ("http://a://b/c", &["http://a:"], "//b/c"),
            ("{{env.X", &["{{env.X"], ""),
            ("é://ü/x", &["é://ü"], "/x"),
        ];
        for (source, head, rest) in cases {
            let (pieces, tail) = split(source);
            let got: Vec<&str> = pieces
                .iter()
                .map(|p| match p {
                    Piece::Text(t) | Piece::Expression(t) => *t,
                })
                .collect();
            assert_eq!((got.as_slice(), tail), (*head, *rest), "{source}");
        }
    }

    #[test]
    fn env_names() {
        let cases = [
            ("{{env.HOOK_BASE}}", Some("HOOK_BASE")),
            ("{{ env._X1 }}", Some("_X1")),
            ("{{env.1X}}", None),
            ("{{env}}", None),
            ("{{env.A.B}}", None),
            ("{{env.[A]}}", None),
            ("{{~env.A}}", None),
            ("{{{env.A}}}", None),
            ("{{urlencode env.A}}", None),
            ("{{payload.host}}", None),
        ];
        for (expression, want) in cases {
            assert_eq!(env_name(expression), want, "{expression}");
        }
    }

    #[test]
    fn scheme_and_host_are_literal_or_env() {
        let cases = [
            ("https://h.example/x/{{payload.id}}", true),
            ("https://h.example", true),
            ("https://h.example?x={{id}}", true),
            ("{{env.HOOK_BASE}}/x/{{payload.id}}", true),
            ("https://{{env.HOST}}/x", true),
            ("{{env.S}}://{{env.H}}:{{env.P}}/x", true),
            ("https://{{payload.host}}/x", false),
            ("{{payload.url}}", false),
            ("{{env.BASE}}{{payload.path}}", false),
            ("https://{{urlencode env.HOST}}/x", false),
            ("https://{{#if payload.a}}a{{else}}b{{/if}}.example/x", false),
            ("https://h.example{{payload.path}}", false),
            ("http:/{{payload.host}}/x", false),
            ("http:{{payload.host}}/x", false),
            ("ftp://h.example/x", false),
            ("https:///x", false),
            ("not a url", false),
        ];
        for (url, ok) in cases {
            assert_eq!(check(url).is_ok(), ok, "{url}: {:?}", check(url));
        }
        // Issue 14: "relative URL without a base" told a new user nothing.
        for url in ["h.example/x", "localhost:8080/x", "not a url"] {
            assert_eq!(check(url), Err("a webhook URL starts with http:// or https://".to_string()), "{url}");
        }
    }

    #[test]
    fn resolve_substitutes_the_head_once() {
        let env = |name: &str| match name {
            "BASE" => Some("http://127.0.0.1:8080".to_string()),
            "HOST" => Some("h.example".to_string()),
            "BRACES" => Some("http://h.example/{{payload.x}}\\".to_string()),
            "FTP" => Some("ftp://h.example".to_string()),
            "EMPTY" => Some(String::new()),
            "SCHEME_ONLY" => Some("http:".to_string()),
            _ => None,
        };
        let cases: &[(&str, Result<Option<&str>, &str>)] = &[
            ("https://h.example/x/{{payload.id}}", Ok(None)),
            ("{{env.BASE}}/x/{{payload.id}}", Ok(Some("http://127.0.0.1:8080/x/{{payload.id}}"))),
            ("https://{{ env.HOST }}/x?t={{env.TOKEN}}", Ok(Some("https://h.example/x?t={{env.TOKEN}}"))),
            ("{{env.BRACES}}", Ok(Some("http://h.example/%7B%7Bpayload.x%7D%7D%5C"))),
            ("{{env.MISSING}}/x", Err("environment variable MISSING is not set")),
            (
                "{{env.FTP}}/x",
                Err("with FTP as set, the scheme and host are not usable: webhook URLs are http or https, not \"ftp\""),
            ),
            ("{{env.EMPTY}}/x", Err("with EMPTY as set")),
            ("{{env.SCHEME_ONLY}}//evil.example/x", Err("with SCHEME_ONLY as set")),
        ];
        for (source, want) in cases {
            let got = resolve(source, env);
            match (want, &got) {
                (Ok(want), Ok(got)) => assert_eq!(got.as_deref(), *want, "{source}"),
                (Err(want), Err(e)) => assert!(e.to_string().contains(want), "{source}: {e}"),
                _ => panic!("{source}: {got:?}"),
            }
        }
    }
}
