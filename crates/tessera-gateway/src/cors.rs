//! Cross-origin requests from web pages (CORS): which pages may call the API, and the
//! preflight `OPTIONS` a browser sends before a request with a JSON body or a key.
//!
//! A page on a loopback origin (`http://localhost:3000`, `http://127.0.0.1:5173`...) may always
//! call: it runs on this machine, which the API trusts already. Other origins only when named
//! with `--cors-origin` (or `*` for any). The API key is still required where one is set: CORS
//! only lets a page read the answers its own requests get, and the preflight, which a browser
//! sends without the key, carries no data.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::server::Gateway;

/// How long a browser may cache a preflight's answer, in seconds.
pub const PREFLIGHT_MAX_AGE_S: u32 = 600;
/// Longest `Access-Control-Request-Headers` echoed back; a longer list is refused.
pub const MAX_REQUEST_HEADERS_BYTES: usize = 1024;

/// The methods the API answers.
const METHODS: &str = "GET, POST, OPTIONS";

/// Whether `origin` (`scheme://host[:port]`) is a page served from this machine.
pub fn is_loopback_origin(origin: &str) -> bool {
    let Some(rest) = origin
        .strip_prefix("http://")
        .or_else(|| origin.strip_prefix("https://"))
    else {
        return false;
    };
    // The host, without a port: `[::1]:8080`, `localhost:3000`, `127.0.0.1`.
    let host = if let Some(v6) = rest.strip_prefix('[') {
        match v6.split_once(']') {
            Some((h, tail)) if tail.is_empty() || tail.starts_with(':') => h,
            _ => return false,
        }
    } else {
        rest.split(':').next().unwrap_or_default()
    };
    host.eq_ignore_ascii_case("localhost")
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// Whether a page from `origin` may call the API, given the `--cors-origin` list.
pub fn origin_allowed(origin: &str, allowed: &[String]) -> bool {
    is_loopback_origin(origin)
        || allowed
            .iter()
            .any(|a| a == "*" || a.trim_end_matches('/').eq_ignore_ascii_case(origin))
}

/// The headers every answer to an allowed origin carries.
fn allow(headers: &mut HeaderMap, origin: &HeaderValue) {
    headers.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, origin.clone());
    headers.append(header::VARY, HeaderValue::from_static("Origin"));
    headers.insert(
        header::ACCESS_CONTROL_EXPOSE_HEADERS,
        HeaderValue::from_static("retry-after"),
    );
}

/// The middleware: answers preflights, and marks answers to allowed origins readable.
pub(crate) async fn layer(State(gw): State<Arc<Gateway>>, req: Request, next: Next) -> Response {
    let Some(origin) = req.headers().get(header::ORIGIN).cloned() else {
        return next.run(req).await;
    };
    let allowed = origin
        .to_str()
        .is_ok_and(|o| origin_allowed(o, &gw.config.cors_origins));
    let preflight = req.method() == Method::OPTIONS
        && req
            .headers()
            .contains_key(header::ACCESS_CONTROL_REQUEST_METHOD);
    if preflight {
        if !allowed {
            return (
                StatusCode::FORBIDDEN,
                "this origin may not call the API (see --cors-origin)",
            )
                .into_response();
        }
        let asked = req
            .headers()
            .get(header::ACCESS_CONTROL_REQUEST_HEADERS)
            .cloned()
            .unwrap_or_else(|| HeaderValue::from_static(""));
        if asked.len() > MAX_REQUEST_HEADERS_BYTES {
            return (
                StatusCode::BAD_REQUEST,
                "too many request headers asked for",
            )
                .into_response();
        }
        let mut r = StatusCode::NO_CONTENT.into_response();
        let h = r.headers_mut();
        allow(h, &origin);
        h.insert(
            header::ACCESS_CONTROL_ALLOW_METHODS,
            HeaderValue::from_static(METHODS),
        );
        // Any header the page asks to send (authorization, content-type, x-api-key,
        // anthropic-version, the SDKs' x-stainless-*): none of them widens what it may do.
        if !asked.is_empty() {
            h.insert(header::ACCESS_CONTROL_ALLOW_HEADERS, asked);
        }
        h.insert(
            header::ACCESS_CONTROL_MAX_AGE,
            HeaderValue::from(PREFLIGHT_MAX_AGE_S),
        );
        return r;
    }
    let mut r = next.run(req).await;
    if allowed {
        allow(r.headers_mut(), &origin);
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_pages_are_allowed_and_others_only_when_named() {
        for o in [
            "http://localhost:3000",
            "http://127.0.0.1",
            "https://127.0.0.2:8443",
            "http://[::1]:5173",
            "http://LOCALHOST",
        ] {
            assert!(origin_allowed(o, &[]), "{o}");
        }
        for o in [
            "http://localhost.evil.com",
            "http://127.0.0.1.evil.com",
            "null",
            "file://",
            "http://[::1]evil",
            "https://app.example.com",
        ] {
            assert!(!origin_allowed(o, &[]), "{o}");
        }
        let named = vec!["https://app.example.com/".to_string()];
        assert!(origin_allowed("https://app.example.com", &named));
        assert!(!origin_allowed("https://app.example.org", &named));
        assert!(origin_allowed("https://any.where", &["*".to_string()]));
    }
}
