//! The bearer token that writes on the admin port need: where it comes from (a file the
//! operator names, `$SLUICE_ADMIN_TOKEN`, else one the runner generates into its state
//! directory, mode 0600, and the local CLI reads from there), and comparing it in constant time.
//! It never reads the network and never logs the token itself.

use std::fmt;
use std::io::Write as _;
use std::os::unix::fs::{OpenOptionsExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use subtle::ConstantTimeEq as _;

/// The environment variable holding the token (for `run` and for the CLI alike).
pub const ENV: &str = "SLUICE_ADMIN_TOKEN";

/// The file, in the state directory, of the token a runner generates.
pub const FILE: &str = "admin-token";

/// Where a token came from, for messages (never the token itself).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// A file the operator named (`--admin-token-file`).
    File(PathBuf),
    /// `$SLUICE_ADMIN_TOKEN`.
    Env,
    /// The file a runner generated (or an earlier run of it did) in its state directory.
    Generated(PathBuf),
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Source::File(path) => write!(f, "{}", path.display()),
            Source::Env => write!(f, "${ENV}"),
            Source::Generated(path) => write!(f, "{} (generated)", path.display()),
        }
    }
}

/// Why no token could be had.
#[derive(Debug, thiserror::Error)]
pub enum TokenError {
    #[error("cannot read the admin token from {path}: {error}")]
    Read { path: PathBuf, error: std::io::Error },
    #[error("cannot write an admin token into {dir}: {error}")]
    Write { dir: PathBuf, error: std::io::Error },
    #[error("the admin token in {0} must be printable ASCII without spaces, and not empty")]
    Malformed(Source),
    #[error("${ENV} is not valid UTF-8")]
    NotUnicode,
    #[error(
        "{path} can be read by others (mode {mode:o}): `chmod 600 {path}`, or delete it for a new token",
        path = .path.display()
    )]
    Exposed { path: PathBuf, mode: u32 },
}

/// A bearer token. Its `Debug` never shows it.
#[derive(Clone)]
pub struct Token(Arc<str>);

impl fmt::Debug for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Token(***)")
    }
}

impl Token {
    /// `text` without surrounding whitespace (a file's trailing newline), when what is left can
    /// be a header value's token: printable ASCII without spaces.
    fn parse(text: &str, source: &Source) -> Result<Token, TokenError> {
        let text = text.trim();
        if text.is_empty() || !text.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(TokenError::Malformed(source.clone()));
        }
        Ok(Token(text.into()))
    }

    /// A new random token: 32 bytes from the thread's CSPRNG (seeded by the OS), in hex.
    fn random() -> Token {
        let bytes: [u8; 32] = rand::random();
        Token(bytes.iter().map(|b| format!("{b:02x}")).collect::<String>().into())
    }

    /// Whether `presented` is this token, taking as long whatever its bytes (only a length
    /// that differs answers sooner).
    pub fn matches(&self, presented: &[u8]) -> bool {
        self.0.as_bytes().ct_eq(presented).into()
    }

    /// The token, for an `Authorization` header.
    pub fn secret(&self) -> &str {
        &self.0
    }
}

/// What the operator gave: `--admin-token-file` and `$SLUICE_ADMIN_TOKEN` (the file first).
#[derive(Debug, Clone, Default)]
pub struct Given {
    pub file: Option<PathBuf>,
    pub env: Option<std::ffi::OsString>,
}

impl Given {
    /// The file, else the variable; `None` when neither is given.
    fn token(&self) -> Result<Option<(Token, Source)>, TokenError> {
        if let Some(path) = &self.file {
            let source = Source::File(path.clone());
            let text = std::fs::read_to_string(path).map_err(|error| TokenError::Read { path: path.clone(), error })?;
            return Ok(Some((Token::parse(&text, &source)?, source)));
        }
        let Some(env) = &self.env else { return Ok(None) };
        let text = env.to_str().ok_or(TokenError::NotUnicode)?;
        Ok(Some((Token::parse(text, &Source::Env)?, Source::Env)))
    }

    /// The runner's token: the one given, else the one in `state` (generated there once, and
    /// kept, so that runners sharing the directory and restarts agree on it).
    pub fn for_runner(&self, state: &Path) -> Result<(Token, Source), TokenError> {
        if let Some(given) = self.token()? {
            return Ok(given);
        }
        let path = state.join(FILE);
        match read_private(&path) {
            Err(TokenError::Read { error, .. }) if error.kind() == std::io::ErrorKind::NotFound => {}
            other => return other.map(|token| (token, Source::Generated(path))),
        }
        let token = Token::random();
        let written =
            write_new(state, &path, &token).map_err(|error| TokenError::Write { dir: state.to_path_buf(), error })?;
        if written {
            Ok((token, Source::Generated(path)))
        } else {
            // Another runner of this directory wrote one first: that one stands.
            Ok((read_private(&path)?, Source::Generated(path)))
        }
    }

    /// The token a command sends: the one given, else the one a runner generated in `state`.
    pub fn for_client(&self, state: &Path) -> Result<(Token, Source), TokenError> {
        if let Some(given) = self.token()? {
            return Ok(given);
        }
        let path = state.join(FILE);
        read_private(&path).map(|token| (token, Source::Generated(path)))
    }
}

/// The token in a generated file, which nobody but its owner may read.
fn read_private(path: &Path) -> Result<Token, TokenError> {
    let read = |error| TokenError::Read { path: path.to_path_buf(), error };
    let mode = std::fs::metadata(path).map_err(read)?.permissions().mode();
    if mode & 0o077 != 0 {
        return Err(TokenError::Exposed { path: path.to_path_buf(), mode: mode & 0o777 });
    }
    let text = std::fs::read_to_string(path).map_err(read)?;
    Token::parse(&text, &Source::Generated(path.to_path_buf()))
}

/// Writes `token` to `path` (mode 0600) unless a file is there already; whether it wrote. The
/// token goes into a file of this process's own first and is then linked into place, so that
/// nobody ever reads a half-written token.
fn write_new(dir: &Path, path: &Path, token: &Token) -> std::io::Result<bool> {
    std::fs::create_dir_all(dir)?;
    let partial = dir.join(format!(".{FILE}.{}", std::process::id()));
    // One left by a killed process of the same pid.
    let _ = std::fs::remove_file(&partial);
    let mut file = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&partial)?;
    let linked = file
        .write_all(format!("{}\n", token.secret()).as_bytes())
        .and_then(|()| file.sync_all())
        .and_then(|()| std::fs::hard_link(&partial, path));
    let _ = std::fs::remove_file(&partial);
    match linked {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(false),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_runner_generates_a_private_token_once_and_the_client_reads_it() {
        let state = tempfile::tempdir().expect("tempdir");
        let dir = state.path().join("nested");
        let (token, source) = Given::default().for_runner(&dir).expect("generated");
        let path = dir.join(FILE);
        assert_eq!(source, Source::Generated(path.clone()));
        assert_eq!(token.secret().len(), 64);
        assert_eq!(std::fs::metadata(&path).expect("file").permissions().mode() & 0o777, 0o600);
        let (again, _) = Given::default().for_runner(&dir).expect("kept");
        assert_eq!(again.secret(), token.secret(), "a second runner takes the same token");
        let (client, _) = Given::default().for_client(&dir).expect("read");
        assert_eq!(client.secret(), token.secret());
        assert_eq!(std::fs::read_dir(&dir).expect("dir").count(), 1, "nothing left beside the token");
    }

    #[test]
    fn a_given_token_comes_first_and_nothing_is_generated() {
        let state = tempfile::tempdir().expect("tempdir");
        let file = state.path().join("given");
        std::fs::write(&file, "from-file\n").expect("write");
        let both = Given { file: Some(file.clone()), env: Some("from-env".into()) };
        let (token, source) = both.for_runner(state.path()).expect("token");
        assert_eq!((token.secret(), source), ("from-file", Source::File(file)));
        let env = Given { file: None, env: Some("from-env".into()) };
        let (token, source) = env.for_runner(state.path()).expect("token");
        assert_eq!((token.secret(), source), ("from-env", Source::Env));
        assert!(!state.path().join(FILE).exists());
    }

    #[test]
    fn unusable_tokens_are_refused_naming_where_they_came_from() {
        let state = tempfile::tempdir().expect("tempdir");
        let cases: [(&str, &str); 4] = [
            ("", "the admin token in $SLUICE_ADMIN_TOKEN must be printable ASCII"),
            ("  \n", "the admin token in $SLUICE_ADMIN_TOKEN must be printable ASCII"),
            ("two words", "the admin token in $SLUICE_ADMIN_TOKEN must be printable ASCII"),
            ("caf\u{e9}", "the admin token in $SLUICE_ADMIN_TOKEN must be printable ASCII"),
        ];
        for (env, expected) in cases {
            let given = Given { file: None, env: Some(env.into()) };
            let error = given.for_runner(state.path()).expect_err(env).to_string();
            assert!(error.starts_with(expected), "{env:?}: {error}");
        }
        let missing = Given { file: Some(state.path().join("none")), env: None };
        let error = missing.for_runner(state.path()).expect_err("missing").to_string();
        assert!(
            error.starts_with(&format!("cannot read the admin token from {}", state.path().join("none").display()))
        );
        let error = Given::default().for_client(state.path()).expect_err("none generated").to_string();
        assert!(error.starts_with(&format!("cannot read the admin token from {}", state.path().join(FILE).display())));
    }

    #[test]
    fn a_generated_file_others_can_read_is_refused() {
        let state = tempfile::tempdir().expect("tempdir");
        let path = state.path().join(FILE);
        std::fs::write(&path, "readable\n").expect("write");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).expect("chmod");
        let error = Given::default().for_runner(state.path()).expect_err("exposed").to_string();
        assert_eq!(
            error,
            format!(
                "{p} can be read by others (mode 644): `chmod 600 {p}`, or delete it for a new token",
                p = path.display()
            )
        );
    }

    #[test]
    fn matching_takes_the_whole_token() {
        let token = Token("abc123".into());
        for (presented, expected) in
            [("abc123", true), ("abc12", false), ("abc1234", false), ("abc124", false), ("", false)]
        {
            assert_eq!(token.matches(presented.as_bytes()), expected, "{presented:?}");
        }
        assert_eq!(format!("{token:?}"), "Token(***)");
    }
}
