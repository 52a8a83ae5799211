//! Secrets kept in files (Docker and Kubernetes secrets are files): the one way sluice reads
//! them, for every `*_file` setting and `SLUICE_*_FILE` variable; and masking what a URL in
//! text shown to people may carry as a credential.
//!
//! It must never put what it read into an error: errors name the file and the problem only.

use std::path::{Path, PathBuf};

use crate::file::{ReadError, read_regular};

/// The most a secret file may hold: a URL with a password, a client secret, a key.
const MAX_SECRET_BYTES: u64 = 64 << 10;

/// A secret file could not be used; the text names the file, never its content.
#[derive(Debug, thiserror::Error)]
pub enum SecretFileError {
    #[error("cannot read secret file {}: {error}", path.display())]
    Read { path: PathBuf, error: ReadError },
    #[error("secret file {} is empty", path.display())]
    Empty { path: PathBuf },
}

/// The secret in `path`: the file's text without its trailing line break(s), as editors and
/// `echo` leave one and `kubectl create secret --from-file` keeps it.
pub fn read_secret_file(path: &Path) -> Result<String, SecretFileError> {
    let text = read_regular(path, MAX_SECRET_BYTES)
        .map_err(|error| SecretFileError::Read { path: path.to_path_buf(), error })?;
    let secret = text.trim_end_matches(['\n', '\r']);
    if secret.is_empty() {
        return Err(SecretFileError::Empty { path: path.to_path_buf() });
    }
    Ok(secret.to_string())
}

/// What a masked credential reads as.
pub const MASK: &str = "***";

/// `text` with what each URL in it may carry as a credential masked: its userinfo's password
/// (`https://user:***@host`, or `https://***@host` for a user alone, which is often a token)
/// and every value of its query (`?api_key=***&page=***`). A URL starts at a `://` and runs to
/// the next whitespace or quote; the scheme, host, port, path and fragment stay as they are.
pub fn mask_urls(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find("://") {
        let (before, after) = rest.split_at(at + "://".len());
        out.push_str(before);
        let end =
            after.find(|c: char| c.is_whitespace() || matches!(c, '"' | '\'' | '`' | '<' | '>')).unwrap_or(after.len());
        let (url, tail) = after.split_at(end);
        mask_after_scheme(url, &mut out);
        rest = tail;
    }
    out.push_str(rest);
    out
}

/// A webhook URL masked as [`mask_urls`] masks one, also when its scheme and host come from a
/// template (`{{env.BASE}}/x?key=***`).
pub fn mask_url(url: &str) -> String {
    if url.contains("://") {
        return mask_urls(url);
    }
    let mut out = String::with_capacity(url.len());
    mask_after_scheme(url, &mut out);
    out
}

/// Appends `url` (what follows its `://`) to `out`, masked as [`mask_urls`] says.
fn mask_after_scheme(url: &str, out: &mut String) {
    let (authority, rest) = url.split_at(url.find(['/', '?', '#']).unwrap_or(url.len()));
    match authority.rsplit_once('@') {
        Some((userinfo, host)) => {
            match userinfo.split_once(':') {
                Some((user, _)) => out.push_str(&format!("{user}:{MASK}")),
                None => out.push_str(MASK),
            }
            out.push('@');
            out.push_str(host);
        }
        None => out.push_str(authority),
    }
    let (before_fragment, fragment) = rest.split_at(rest.find('#').unwrap_or(rest.len()));
    match before_fragment.split_once('?') {
        Some((path, query)) => {
            out.push_str(path);
            out.push('?');
            let pairs: Vec<String> = query
                .split('&')
                .map(|pair| match pair.split_once('=') {
                    Some((name, _)) => format!("{name}={MASK}"),
                    None if pair.is_empty() => String::new(),
                    None => MASK.to_string(),
                })
                .collect();
            out.push_str(&pairs.join("&"));
        }
        None => out.push_str(before_fragment),
    }
    out.push_str(fragment);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 31 item 1: URL credentials in any text are masked, whatever stands around them.
    #[test]
    fn url_passwords_and_query_values_are_masked() {
        let cases = [
            ("https://hooks.example/x", "https://hooks.example/x"),
            ("https://u:pw@hooks.example:8443/x", "https://u:***@hooks.example:8443/x"),
            ("https://token@github.com/o/r", "https://***@github.com/o/r"),
            ("https://u:p@ss@h/x", "https://u:***@h/x"),
            ("https://h/x?api_key=k1&page=2", "https://h/x?api_key=***&page=***"),
            ("https://h/x?bare&&k=", "https://h/x?***&&k=***"),
            ("https://h/x?k=v#frag", "https://h/x?k=***#frag"),
            ("https://u:{{env.PW}}@h/{{id}}?t={{env.T}}", "https://u:***@h/{{id}}?t=***"),
            ("https://u:${PW}@h", "https://u:***@h"),
            ("DSN=postgres://u:pw@db/x?sslmode=require", "DSN=postgres://u:***@db/x?sslmode=***"),
            (
                r#"{"a": "http://u:p@h?k=v", "b": 'ftp://x:y@z' http://h2?q=1 done"#,
                r#"{"a": "http://u:***@h?k=***", "b": 'ftp://x:***@z' http://h2?q=*** done"#,
            ),
            ("no url: a=b?c=d", "no url: a=b?c=d"),
            ("://u:p@h", "://u:***@h"),
            ("", ""),
        ];
        for (text, expected) in cases {
            assert_eq!(mask_urls(text), expected, "{text}");
        }
        // A URL field whose scheme and host come from a template.
        for (url, expected) in [
            ("{{env.BASE}}/x?api_key=k1", "{{env.BASE}}/x?api_key=***"),
            ("{{env.U}}:{{env.P}}@h/x", "{{env.U}}:***@h/x"),
            ("https://u:p@h/x?k=v", "https://u:***@h/x?k=***"),
        ] {
            assert_eq!(mask_url(url), expected, "{url}");
        }
    }

    #[test]
    fn a_trailing_line_break_is_trimmed_and_nothing_else() {
        let dir = tempfile::tempdir().expect("tempdir");
        let cases = [
            ("s3cret\n", Some("s3cret")),
            ("s3cret\r\n", Some("s3cret")),
            ("s3cret", Some("s3cret")),
            (" pad ded \n\n", Some(" pad ded ")),
            ("\n", None),
            ("", None),
        ];
        for (i, (text, expected)) in cases.into_iter().enumerate() {
            let path = dir.path().join(format!("s{i}"));
            std::fs::write(&path, text).expect("write");
            let got = read_secret_file(&path);
            match expected {
                Some(secret) => assert_eq!(got.expect(text), secret),
                None => assert!(matches!(got, Err(SecretFileError::Empty { .. })), "{text:?}: {got:?}"),
            }
        }
    }

    #[test]
    fn errors_name_the_file_never_the_secret() {
        let dir = tempfile::tempdir().expect("tempdir");
        let missing = dir.path().join("absent");
        let error = read_secret_file(&missing).expect_err("missing").to_string();
        assert!(error.starts_with(&format!("cannot read secret file {}: ", missing.display())), "{error}");
        let binary = dir.path().join("binary");
        std::fs::write(&binary, b"pass\xffword").expect("write");
        let error = read_secret_file(&binary).expect_err("not UTF-8").to_string();
        assert!(!error.contains("pass"), "{error}");
    }
}
