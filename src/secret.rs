//! Secrets kept in files (Docker and Kubernetes secrets are files): the one way sluice reads
//! them, for every `*_file` setting and `SLUICE_*_FILE` variable.
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

#[cfg(test)]
mod tests {
    use super::*;

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
