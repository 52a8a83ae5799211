//! The operator console: one page of plain HTML, CSS and JavaScript, compiled into the binary
//! and served at `/`, that reads and writes through the JSON API (`api`) and nothing else. No
//! framework, no CDN, no inline script: a strict Content-Security-Policy on every answer of the
//! admin port lets the browser run only these files and reach only this port. The script puts
//! whatever came from outside (messages, errors, response bodies) into the page as text, never
//! as markup.

use axum::Router;
use axum::http::{HeaderValue, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;

const INDEX: &str = include_str!("console/index.html");
const SCRIPT: &str = include_str!("console/console.js");
const STYLE: &str = include_str!("console/console.css");

/// What every answer of the admin port carries: scripts, styles and requests of this origin
/// only, no framing, no referrer, and no guessing of content types.
pub const SECURITY_HEADERS: [(header::HeaderName, &str); 4] = [
    (
        header::CONTENT_SECURITY_POLICY,
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; \
         base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    ),
    (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
    (header::REFERRER_POLICY, "no-referrer"),
    (header::X_FRAME_OPTIONS, "DENY"),
];

/// Adds [`SECURITY_HEADERS`] to an answer.
pub async fn secure(mut response: Response) -> Response {
    for (name, value) in SECURITY_HEADERS {
        response.headers_mut().insert(name, HeaderValue::from_static(value));
    }
    response
}

fn asset(content_type: &'static str, text: &'static str) -> Response {
    ([(header::CONTENT_TYPE, content_type), (header::CACHE_CONTROL, "no-cache")], text).into_response()
}

/// The page and its two files.
pub fn routes() -> Router {
    Router::new()
        .route("/", get(|| async { asset("text/html; charset=utf-8", INDEX) }))
        .route("/console.js", get(|| async { asset("text/javascript; charset=utf-8", SCRIPT) }))
        .route("/console.css", get(|| async { asset("text/css; charset=utf-8", STYLE) }))
}
