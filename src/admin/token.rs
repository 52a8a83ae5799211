//! The bearer token the admin port needs: where it comes from (a file the operator names,
//! `$SLUICE_ADMIN_TOKEN`, else one the runner generates into its state directory, mode 0600,
//! and the local CLI reads from there), and comparing it in constant time. A file another user
//! could change is refused. It never reads the network and never logs the token itself.

use std::fmt;
use std::io::Write as _;
use std::os::unix::fs::{MetadataExt as _, OpenOptionsExt as _, PermissionsExt as _};
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
    #[error(
        "{path} can be changed by others (mode {mode:o}), who could set the admin token: `chmod go-w {path}`",
        path = .path.display()
    )]
    Writable { path: PathBuf, mode: u32 },
    #[error(
        "{path} belongs to another user (uid {owner}), who could set the admin token: use a file of your own",
        path = .path.display()
    )]
    NotOwned { path: PathBuf, owner: u32 },
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
            trusted(path)?;
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

/// The file at `path`'s metadata, when no one but this user (or root, who could anyway) can
/// change it: its owner, not writable by group or others. A token someone else can set would
/// let them in.
fn trusted(path: &Path) -> Result<std::fs::Metadata, TokenError> {
    let metadata = std::fs::metadata(path).map_err(|error| TokenError::Read { path: path.to_path_buf(), error })?;
    let mode = metadata.permissions().mode();
    if mode & 0o022 != 0 {
        return Err(TokenError::Writable { path: path.to_path_buf(), mode: mode & 0o777 });
    }
    // SAFETY: geteuid(2) takes nothing and cannot fail.
    let me = unsafe { libc::geteuid() };
    if metadata.uid() != me && metadata.uid() != 0 {
        return Err(TokenError::NotOwned { path: path.to_path_buf(), owner: metadata.uid() });
    }
    Ok(metadata)
}

/// The token in a generated file, which nobody but its owner may read or change.
fn read_private(path: &Path) -> Result<Token, TokenError> {
    let mode = trusted(path)?.permissions().mode();
    if mode & 0o077 != 0 {
        return Err(TokenError::Exposed { path: path.to_path_buf(), mode: mode & 0o777 });
    }
    let text = std::fs::read_to_string(path).map_err(|error| TokenError::Read { path: path.to_path_buf(), error })?;
    Token::parse(&text, &Source::Generated(path.to_path_buf()))
}

/// Writes `token` to `path` (mode 0600) unless a file is there already; whether it wrote. The
/// token goes into a file of this process's own first and is then linked into place, so that
/// nobody ever reads a half-written token.
fn write_new(dir: &Path, path: &Path, token: &Token) -> std::io::Result<bool> {
    crate::file::create_private_dir(dir)?;
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

    /// Issue 31 (low): a token file another user could change (writable by group or others, or
    /// owned by another user but root) is refused, naming the fix; one readable by others
    /// (a Kubernetes secret's 0644) is taken.
    #[test]
    fn a_token_file_others_can_change_is_refused() {
        let state = tempfile::tempdir().expect("tempdir");
        let file = state.path().join("given");
        std::fs::write(&file, "given-token\n").expect("write");
        let given = Given { file: Some(file.clone()), env: None };
        for mode in [0o600, 0o644, 0o400] {
            std::fs::set_permissions(&file, std::fs::Permissions::from_mode(mode)).expect("chmod");
            assert_eq!(given.for_runner(state.path()).expect("taken").0.secret(), "given-token", "mode {mode:o}");
        }
        for mode in [0o620, 0o602, 0o666] {
            std::fs::set_permissions(&file, std::fs::Permissions::from_mode(mode)).expect("chmod");
            let error = given.for_client(state.path()).expect_err("writable").to_string();
            let p = file.display();
            assert_eq!(
                error,
                format!(
                    "{p} can be changed by others (mode {mode:o}), who could set the admin token: `chmod go-w {p}`"
                )
            );
        }
        // The generated file too.
        let generated = state.path().join(FILE);
        std::fs::write(&generated, "generated\n").expect("write");
        std::fs::set_permissions(&generated, std::fs::Permissions::from_mode(0o600)).expect("chmod");
        assert_eq!(Given::default().for_client(state.path()).expect("taken").0.secret(), "generated");
        // SAFETY: geteuid(2) takes nothing and cannot fail.
        if unsafe { libc::geteuid() } == 0 {
            // Only root can give a file away: as another user the case cannot be made.
            std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).expect("chmod");
            let expected = |p: &Path| {
                format!(
                    "{} belongs to another user (uid 65534), who could set the admin token: use a file of your own",
                    p.display()
                )
            };
            std::os::unix::fs::chown(&file, Some(65534), None).expect("chown");
            let error = given.for_runner(state.path()).expect_err("owned by another user").to_string();
            assert_eq!(error, expected(&file));
            std::os::unix::fs::chown(&generated, Some(65534), None).expect("chown");
            let error = Given::default().for_runner(state.path()).expect_err("owned by another user").to_string();
            assert_eq!(error, expected(&generated));
        }
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
