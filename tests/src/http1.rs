//! A deliberately small HTTP/1.1 message reader shared by `lab-backend` and
//! `lab-client`. It only understands what the lab needs: a start line,
//! headers, and an optional `Content-Length` body.

use std::io;

use tokio::io::{AsyncRead, AsyncReadExt as _};

/// Largest message head (start line + headers) accepted.
pub const MAX_HEAD: usize = 64 * 1024;

/// A parsed message head (request or response).
#[derive(Debug, Clone)]
pub struct Head {
    /// `GET /x HTTP/1.1` or `HTTP/1.1 200 OK`.
    pub start_line: String,
    /// Header names as sent, values trimmed.
    pub headers: Vec<(String, String)>,
}

impl Head {
    /// First header with this name (case-insensitive).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }

    /// Whether a `Connection` header lists `token` (case-insensitive).
    pub fn connection_has(&self, token: &str) -> bool {
        self.headers
            .iter()
            .filter(|(k, _)| k.eq_ignore_ascii_case("connection"))
            .flat_map(|(_, v)| v.split(','))
            .any(|t| t.trim().eq_ignore_ascii_case(token))
    }

    /// `Content-Length`, 0 when absent.
    pub fn content_length(&self) -> io::Result<usize> {
        match self.header("content-length") {
            None => Ok(0),
            Some(v) => v.trim().parse().map_err(|_| invalid(format!("bad Content-Length {v:?}"))),
        }
    }

    /// Request line split into (method, target, version).
    pub fn request_parts(&self) -> io::Result<(&str, &str, &str)> {
        let mut it = self.start_line.split_ascii_whitespace();
        match (it.next(), it.next(), it.next(), it.next()) {
            (Some(m), Some(t), Some(v), None) if v.starts_with("HTTP/") => Ok((m, t, v)),
            _ => Err(invalid(format!("bad request line {:?}", self.start_line))),
        }
    }

    /// Status code of a response head.
    pub fn status(&self) -> io::Result<u16> {
        let mut it = self.start_line.split_ascii_whitespace();
        match (it.next(), it.next()) {
            (Some(v), Some(code)) if v.starts_with("HTTP/") => {
                code.parse().map_err(|_| invalid(format!("bad status line {:?}", self.start_line)))
            }
            _ => Err(invalid(format!("bad status line {:?}", self.start_line))),
        }
    }
}

fn invalid(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg)
}

fn find_head_end(buf: &[u8], from: usize) -> Option<usize> {
    let start = from.saturating_sub(3);
    buf.get(start..)?.windows(4).position(|w| w == b"\r\n\r\n").map(|p| start + p + 4)
}

/// Reads one message head. Bytes already in `buf` are consumed first; bytes
/// read past the head stay in `buf` for the next call (body or a pipelined
/// message). Returns `Ok(None)` on EOF before the first byte of a message.
pub async fn read_head<R: AsyncRead + Unpin>(r: &mut R, buf: &mut Vec<u8>) -> io::Result<Option<Head>> {
    let mut scanned = 0;
    loop {
        // Tolerate stray CRLFs between messages (RFC 9112 §2.2).
        while buf.starts_with(b"\r\n") {
            buf.drain(..2);
        }
        if let Some(end) = find_head_end(buf, scanned) {
            let head_bytes: Vec<u8> = buf.drain(..end).collect();
            return parse_head(&head_bytes[..end - 4]).map(Some);
        }
        scanned = buf.len();
        if buf.len() > MAX_HEAD {
            return Err(invalid(format!("message head larger than {MAX_HEAD} bytes")));
        }
        let mut chunk = [0u8; 8192];
        let n = r.read(&mut chunk).await?;
        if n == 0 {
            if buf.is_empty() {
                return Ok(None);
            }
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!("connection closed inside a message head ({} bytes read)", buf.len()),
            ));
        }
        buf.extend_from_slice(&chunk[..n]);
    }
}

/// Reads exactly `len` body bytes, using what is already buffered first.
pub async fn read_body<R: AsyncRead + Unpin>(r: &mut R, buf: &mut Vec<u8>, len: usize) -> io::Result<Vec<u8>> {
    while buf.len() < len {
        let mut chunk = [0u8; 8192];
        let n = r.read(&mut chunk).await?;
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!("connection closed inside a body ({} of {len} bytes)", buf.len()),
            ));
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    Ok(buf.drain(..len).collect())
}

fn parse_head(bytes: &[u8]) -> io::Result<Head> {
    let text = std::str::from_utf8(bytes).map_err(|_| invalid("message head is not UTF-8".into()))?;
    let mut lines = text.split("\r\n");
    let start_line = lines.next().unwrap_or_default().to_string();
    if start_line.is_empty() {
        return Err(invalid("empty start line".into()));
    }
    let mut headers = Vec::new();
    for line in lines {
        let (k, v) = line.split_once(':').ok_or_else(|| invalid(format!("bad header line {line:?}")))?;
        headers.push((k.trim().to_string(), v.trim().to_string()));
    }
    Ok(Head { start_line, headers })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn parses_pipelined_requests_and_bodies() {
        let data: &[u8] =
            b"GET /a HTTP/1.1\r\nHost: x\r\nConnection: keep-alive, close\r\n\r\nGET /b HTTP/1.1\r\nContent-Length: 3\r\n\r\nabc";
        let mut r = data;
        let mut buf = Vec::new();
        let h = read_head(&mut r, &mut buf).await.unwrap().unwrap();
        assert_eq!(h.request_parts().unwrap(), ("GET", "/a", "HTTP/1.1"));
        assert!(h.connection_has("close"));
        assert_eq!(h.header("HOST"), Some("x"));
        let h = read_head(&mut r, &mut buf).await.unwrap().unwrap();
        assert_eq!(h.content_length().unwrap(), 3);
        assert_eq!(read_body(&mut r, &mut buf, 3).await.unwrap(), b"abc");
        assert!(read_head(&mut r, &mut buf).await.unwrap().is_none());
    }

    #[tokio::test]
    async fn truncated_head_is_an_error() {
        let mut r: &[u8] = b"HTTP/1.1 200 OK\r\nX-Backend: be1\r\n";
        let mut buf = Vec::new();
        assert!(read_head(&mut r, &mut buf).await.is_err());
    }
}
