//! A minimal HTTP/1.1 client over a stream the lab made inside a host (`Connection: close`,
//! `Content-Length` or chunked bodies), enough to drive the gateway's API: a whole response,
//! or a server-sent-event stream with each event's arrival time.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use crate::error::{LabError, Result};

/// A response: status and body.
#[derive(Debug, Clone)]
pub struct Response {
    pub status: u16,
    pub body: String,
}

fn io(e: std::io::Error) -> LabError {
    LabError::io("HTTP exchange", e)
}

fn send(stream: &mut TcpStream, method: &str, path: &str, body: Option<&str>) -> Result<()> {
    stream
        .set_read_timeout(Some(Duration::from_secs(120)))
        .map_err(io)?;
    let mut req = format!("{method} {path} HTTP/1.1\r\nHost: lab\r\nConnection: close\r\n");
    if let Some(b) = body {
        req.push_str(&format!(
            "Content-Type: application/json\r\nContent-Length: {}\r\n",
            b.len()
        ));
    }
    req.push_str("\r\n");
    req.push_str(body.unwrap_or(""));
    stream.write_all(req.as_bytes()).map_err(io)
}

/// An HTTP response the lab cannot read.
fn unreadable(what: &str, message: String) -> LabError {
    LabError::Unreadable {
        process: "the HTTP server".into(),
        what: what.into(),
        message,
    }
}

/// Reads the status line and headers; whether the body is chunked and its length if given.
fn head(r: &mut impl BufRead) -> Result<(u16, bool, Option<usize>)> {
    let mut line = String::new();
    r.read_line(&mut line).map_err(io)?;
    let status = line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| unreadable("status line", format!("{line:?}")))?;
    let (mut chunked, mut len) = (false, None);
    loop {
        line.clear();
        if r.read_line(&mut line).map_err(io)? == 0 || line.trim().is_empty() {
            break;
        }
        let l = line.to_ascii_lowercase();
        if l.starts_with("transfer-encoding:") && l.contains("chunked") {
            chunked = true;
        }
        if let Some(v) = l.strip_prefix("content-length:") {
            len = v.trim().parse().ok();
        }
    }
    Ok((status, chunked, len))
}

/// Reads the next chunk of a chunked body (`None` at the end).
fn chunk(r: &mut impl BufRead) -> Result<Option<Vec<u8>>> {
    let mut line = String::new();
    if r.read_line(&mut line).map_err(io)? == 0 {
        return Ok(None);
    }
    let size = usize::from_str_radix(line.trim().split(';').next().unwrap_or(""), 16)
        .map_err(|_| unreadable("chunk size", format!("{line:?}")))?;
    if size > 64 << 20 {
        return Err(unreadable("chunk", format!("{size} bytes, over 64 MiB")));
    }
    let mut data = vec![0u8; size + 2];
    r.read_exact(&mut data).map_err(io)?;
    data.truncate(size);
    Ok((size > 0).then_some(data))
}

/// One request, the whole response.
pub fn request(
    mut stream: TcpStream,
    method: &str,
    path: &str,
    body: Option<&str>,
) -> Result<Response> {
    send(&mut stream, method, path, body)?;
    let mut r = BufReader::new(stream);
    let (status, chunked, len) = head(&mut r)?;
    let mut bytes = Vec::new();
    if chunked {
        while let Some(c) = chunk(&mut r)? {
            bytes.extend(c);
        }
    } else if let Some(n) = len {
        bytes.resize(n, 0);
        r.read_exact(&mut bytes).map_err(io)?;
    } else {
        r.read_to_end(&mut bytes).map_err(io)?;
    }
    Ok(Response {
        status,
        body: String::from_utf8_lossy(&bytes).into_owned(),
    })
}

/// A streamed request: each server-sent event's `data:` payload with the time it arrived.
pub fn events(
    mut stream: TcpStream,
    path: &str,
    body: &str,
) -> Result<(u16, Vec<(Instant, String)>)> {
    send(&mut stream, "POST", path, Some(body))?;
    let mut r = BufReader::new(stream);
    let (status, chunked, _) = head(&mut r)?;
    let mut out = Vec::new();
    let mut pending = String::new();
    let mut take = |data: &[u8], out: &mut Vec<(Instant, String)>| {
        let at = Instant::now();
        pending.push_str(&String::from_utf8_lossy(data));
        while let Some(i) = pending.find('\n') {
            let line: String = pending.drain(..=i).collect();
            if let Some(d) = line.trim_end().strip_prefix("data:") {
                out.push((at, d.trim().to_string()));
            }
        }
    };
    if chunked {
        while let Some(c) = chunk(&mut r)? {
            take(&c, &mut out);
        }
    } else {
        let mut buf = [0u8; 4096];
        loop {
            let n = r.read(&mut buf).map_err(io)?;
            if n == 0 {
                break;
            }
            take(&buf[..n], &mut out);
        }
    }
    Ok((status, out))
}
