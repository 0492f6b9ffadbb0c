//! The HTTPS/1.1 server under the test platform and the test Vault: rustls on 127.0.0.1, one
//! thread per connection, one request per connection (`Connection: close`) unless the
//! handler's response keeps the connection alive, the body read by `Content-Length`. Each
//! server supplies its TLS configuration and a handler.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// One request, as the handler gets it.
pub struct Request {
    pub method: String,
    /// The request target (path and query).
    pub target: String,
    /// Header names in lower case.
    headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Request {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
    }

    /// The target without its query.
    pub fn path(&self) -> &str {
        self.target.split('?').next().unwrap_or("")
    }
}

/// The handler's answer.
pub struct Response {
    /// Status line after `HTTP/1.1 `, e.g. `200 OK`.
    pub status: String,
    pub content_type: &'static str,
    pub body: Vec<u8>,
    /// Send `Content-Length` (else the body ends when the connection closes).
    pub length: bool,
    /// A `Location` header (for a redirect).
    pub location: Option<String>,
    /// Keep the connection open for the next request (`Connection: keep-alive`; only with
    /// `length`).
    pub keep_alive: bool,
}

impl Response {
    pub fn json(status: &str, value: &serde_json::Value) -> Response {
        Response {
            status: status.into(),
            content_type: "application/json",
            body: value.to_string().into_bytes(),
            length: true,
            location: None,
            keep_alive: false,
        }
    }
}

pub struct Server {
    pub addr: SocketAddr,
    /// Connections whose TLS handshake failed (with client authentication: also those that
    /// presented no client certificate).
    pub handshake_failures: Arc<AtomicUsize>,
    /// Connections that brought a first request (each one TLS handshake).
    pub connections: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
}

impl Server {
    pub fn start(
        config: rustls::ServerConfig,
        client_auth: bool,
        handler: impl Fn(Request) -> Response + Send + Sync + 'static,
    ) -> Server {
        let config = Arc::new(config);
        let handler = Arc::new(handler);
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let addr = listener.local_addr().unwrap();
        let failures = Arc::new(AtomicUsize::new(0));
        let connections = Arc::new(AtomicUsize::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        {
            let (failures, connections, stop) = (failures.clone(), connections.clone(), stop.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::SeqCst) {
                    match listener.accept() {
                        Ok((tcp, _)) => {
                            let (config, failures, connections, handler) =
                                (config.clone(), failures.clone(), connections.clone(), handler.clone());
                            std::thread::spawn(move || {
                                serve(tcp, config, client_auth, &failures, &connections, &*handler)
                            });
                        }
                        Err(_) => std::thread::sleep(Duration::from_millis(10)),
                    }
                }
            });
        }
        Server { addr, handshake_failures: failures, connections, stop }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

fn serve(
    tcp: std::net::TcpStream,
    config: Arc<rustls::ServerConfig>,
    client_auth: bool,
    failures: &AtomicUsize,
    connections: &AtomicUsize,
    handler: &dyn Fn(Request) -> Response,
) {
    let _ = tcp.set_nonblocking(false);
    let _ = tcp.set_read_timeout(Some(Duration::from_secs(10)));
    let conn = rustls::ServerConnection::new(config).unwrap();
    let mut tls = rustls::StreamOwned::new(conn, tcp);
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    for nth in 0.. {
        // The request head, then the body by Content-Length.
        let head_end = loop {
            if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break i + 4;
            }
            match tls.read(&mut chunk) {
                Ok(0) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
                Err(_) => {
                    if nth == 0
                        && (tls.conn.is_handshaking() || (client_auth && tls.conn.peer_certificates().is_none()))
                    {
                        failures.fetch_add(1, Ordering::SeqCst);
                    }
                    return;
                }
            }
        };
        if nth == 0 {
            connections.fetch_add(1, Ordering::SeqCst);
        }
        let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
        let mut lines = head.lines();
        let first = lines.next().unwrap_or_default().to_string();
        let headers: Vec<(String, String)> = lines
            .filter_map(|l| l.split_once(':'))
            .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
            .collect();
        let len: usize =
            headers.iter().find(|(k, _)| k == "content-length").and_then(|(_, v)| v.parse().ok()).unwrap_or(0);
        while buf.len() < head_end + len {
            match tls.read(&mut chunk) {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        }
        let mut parts = first.split_whitespace();
        let request = Request {
            method: parts.next().unwrap_or("").to_string(),
            target: parts.next().unwrap_or("").to_string(),
            headers,
            body: buf[head_end..head_end + len].to_vec(),
        };
        buf.drain(..head_end + len);
        let r = handler(request);
        let keep_alive = r.keep_alive && r.length;
        let length = if r.length { format!("Content-Length: {}\r\n", r.body.len()) } else { String::new() };
        let location = r.location.map(|l| format!("Location: {l}\r\n")).unwrap_or_default();
        let connection = if keep_alive { "keep-alive" } else { "close" };
        let head = format!(
            "HTTP/1.1 {}\r\nContent-Type: {}\r\n{length}{location}Connection: {connection}\r\n\r\n",
            r.status, r.content_type
        );
        let _ = tls.write_all(head.as_bytes());
        let _ = tls.write_all(&r.body);
        if !keep_alive {
            tls.conn.send_close_notify();
            let _ = tls.flush();
            return;
        }
        let _ = tls.flush();
    }
}
