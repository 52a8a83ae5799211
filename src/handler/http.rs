//! What the handlers' HTTP calls share, the webhook's and the OAuth2 token fetch's: how a
//! request that got no response fails (by its innermost cause, never with the URL, which may
//! carry a token; a refused TLS handshake in words, saying which side refused what), and
//! reading no more of an answer than is wanted.

use rustls::{AlertDescription, CertificateError};

use super::HandlerError;

/// Classifies a request that got no response at all.
pub(super) fn send_error(error: &reqwest::Error) -> HandlerError {
    if let Some(tls) = tls_error(error) {
        return HandlerError::unwell(format!("TLS handshake: {}", handshake_failure(tls)), None);
    }
    if error.is_builder() {
        HandlerError::permanent(format!("invalid request: {}", cause(error)))
    } else if error.is_connect() {
        HandlerError::unwell(format!("connect error: {}", cause(error)), None)
    } else {
        // The connection broke mid-exchange: as much the receiver's trouble as a refused one.
        HandlerError::unwell(format!("request error: {}", cause(error)), None)
    }
}

/// The innermost cause says what went wrong ("Connection refused") and, unlike reqwest's
/// own text, does not repeat the URL.
pub(super) fn cause(error: &reqwest::Error) -> String {
    let mut innermost = None;
    let mut next = std::error::Error::source(error);
    while let Some(source) = next {
        innermost = Some(source);
        next = source.source();
    }
    innermost.map_or_else(|| "no detail given".to_owned(), ToString::to_string)
}

/// Appends the start of the response body to `body`, stopping after `limit` bytes.
pub(super) async fn read_bounded(response: &mut reqwest::Response, body: &mut Vec<u8>, limit: usize) {
    while body.len() < limit {
        match response.chunk().await {
            Ok(Some(chunk)) => {
                let room = limit - body.len();
                body.extend_from_slice(&chunk[..chunk.len().min(room)]);
            }
            // A broken body is no reason to lose the status we already have.
            Ok(None) | Err(_) => break,
        }
    }
}

/// The TLS error under `error`, if it is one: rustls's own, or one an I/O error carries.
pub(super) fn tls_error(error: &reqwest::Error) -> Option<&rustls::Error> {
    let mut next: Option<&(dyn std::error::Error + 'static)> = Some(error);
    while let Some(error) = next {
        if let Some(tls) = error.downcast_ref::<rustls::Error>() {
            return Some(tls);
        }
        // An I/O error's `source` skips the error it carries (rustls's, inside one or two I/O
        // errors on the way up): step into that instead.
        next = match error.downcast_ref::<std::io::Error>().and_then(std::io::Error::get_ref) {
            Some(carried) => Some(carried),
            None => error.source(),
        };
    }
    None
}

/// What a failed handshake means for the operator, and what to do about it: rustls says it in
/// its enums' Debug form ("received fatal alert: UnknownCA").
fn handshake_failure(error: &rustls::Error) -> String {
    match error {
        rustls::Error::AlertReceived(alert) => refused_by_the_receiver(*alert),
        rustls::Error::InvalidCertificate(certificate) => {
            format!("the receiver's certificate is refused here: {}", receiver_certificate(certificate))
        }
        other => other.to_string(),
    }
}

/// An alert the receiver ended the handshake with: mostly about the client certificate.
fn refused_by_the_receiver(alert: AlertDescription) -> String {
    let said = format!("(TLS alert \"{}\")", words(&format!("{alert:?}")));
    let issue = "a client certificate must be X.509 version 3 with extendedKeyUsage=clientAuth, \
                 within its validity, and issued by a CA the receiver trusts";
    match alert {
        AlertDescription::CertificateRequired => format!(
            "the receiver requires a client certificate {said}: set tls.client_cert_file and tls.client_key_file"
        ),
        AlertDescription::UnknownCA => format!(
            "the receiver does not trust the CA that issued the client certificate {said}: \
             use one issued by a CA the receiver trusts"
        ),
        AlertDescription::CertificateExpired => {
            format!("the receiver says the client certificate has expired {said}: renew it")
        }
        AlertDescription::CertificateRevoked => {
            format!("the receiver says the client certificate is revoked {said}: issue a new one")
        }
        AlertDescription::BadCertificate
        | AlertDescription::UnsupportedCertificate
        | AlertDescription::CertificateUnknown
        | AlertDescription::DecryptError => format!("the receiver refused the client certificate {said}: {issue}"),
        AlertDescription::HandshakeFailure => format!(
            "the receiver ended the handshake {said}: no TLS version or cipher in common, or it refused the \
             client certificate ({issue})"
        ),
        AlertDescription::ProtocolVersion => {
            format!("no TLS version in common with the receiver {said}: sluice speaks TLS 1.2 and 1.3")
        }
        _ => format!("the receiver ended the handshake {said}"),
    }
}

/// Why the receiver's certificate is refused.
fn receiver_certificate(error: &CertificateError) -> String {
    match error {
        CertificateError::UnknownIssuer => {
            "it is not issued by a CA trusted here; for a private CA, give the CA's certificate in tls.ca_file".into()
        }
        CertificateError::Expired => "it has expired".into(),
        CertificateError::NotValidYet => "it is not valid yet (is either clock wrong?)".into(),
        CertificateError::Revoked => "it is revoked".into(),
        CertificateError::NotValidForName => "it is not valid for the URL's host".into(),
        CertificateError::InvalidPurpose => "its extendedKeyUsage does not allow serving TLS (serverAuth)".into(),
        CertificateError::BadSignature => "its signature does not verify".into(),
        CertificateError::Other(other) => match other.0.downcast_ref::<webpki::Error>() {
            Some(webpki::Error::UnsupportedCertVersion) => {
                "it is X.509 version 1; the receiver needs a version 3 certificate (with subjectAltName)".into()
            }
            Some(webpki::Error::CaUsedAsEndEntity) => "it is a CA's certificate, not a server's".into(),
            _ => words(&other.to_string()),
        },
        // These say it in words already ("certificate expired: verification time ...").
        CertificateError::ExpiredContext { .. }
        | CertificateError::NotValidYetContext { .. }
        | CertificateError::NotValidForNameContext { .. }
        | CertificateError::InvalidPurposeContext { .. } => error.to_string(),
        // The rarer rest, by the variant's name made readable (without its fields).
        _ => {
            let shown = format!("{error:?}");
            words(shown.split([' ', '{', '(']).next().unwrap_or_default())
        }
    }
}

/// An enum variant's name as words: `UnknownCA` as "unknown CA", `BadSignature` as "bad
/// signature" (runs of capitals kept).
fn words(name: &str) -> String {
    let mut out = String::with_capacity(name.len() + 8);
    let mut previous: Option<char> = None;
    for c in name.chars() {
        if c.is_ascii_uppercase() && previous.is_some_and(|p| p.is_ascii_lowercase()) {
            out.push(' ');
        }
        out.push(c);
        previous = Some(c);
    }
    out.split(' ')
        .map(
            |word| {
                if word.chars().skip(1).any(|c| c.is_ascii_uppercase()) {
                    word.to_string()
                } else {
                    word.to_lowercase()
                }
            },
        )
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn enum_names_read_as_words() {
        for (name, expected) in [
            ("UnknownCA", "unknown CA"),
            ("BadSignature", "bad signature"),
            ("CertificateRequired", "certificate required"),
            ("UnsupportedCertVersion", "unsupported cert version"),
            ("Expired", "expired"),
        ] {
            assert_eq!(words(name), expected, "{name}");
        }
    }
}
