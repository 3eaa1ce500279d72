//! What the `embank serve` integration tests share: starting a server process on its
//! config and reading its first line (its addresses), killing it, and an HTTP GET of its
//! admin port.
#![allow(dead_code)] // each test file uses some of these

pub mod replica;

use std::io::{BufRead, BufReader, Read, Write};
use std::path::Path;
use std::process::{Child, Command, Stdio};

/// A started `embank serve`.
pub struct Serve {
    pub child: Child,
    /// Its protocol address.
    pub addr: String,
    /// Its admin (HTTP) address, empty without one.
    pub admin: String,
    /// Its first line ("listening on ...").
    pub line: String,
}

/// Where the server's stderr goes.
#[derive(Clone, Copy, PartialEq)]
pub enum Stderr {
    Shown,
    Hidden,
}

/// Starts `embank serve --config CONFIG [ARGS]` and waits for its "listening" line;
/// `None` if the process ended without one (a port still taken, say).
pub fn try_serve(config: &Path, args: &[&str], stderr: Stderr, env: &[(&str, &str)]) -> Option<Serve> {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_embank"));
    cmd.arg("serve").arg("--config").arg(config).args(args).stdout(Stdio::piped());
    cmd.stderr(if stderr == Stderr::Shown { Stdio::inherit() } else { Stdio::null() });
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.as_mut().unwrap()).read_line(&mut line).unwrap();
    if !line.contains("listening on") {
        let _ = child.wait();
        return None;
    }
    let addr = line.split("listening on ").nth(1).unwrap().split_whitespace().next().unwrap();
    let addr = addr.trim_end_matches(',').to_string();
    let admin = line.split("admin http://").nth(1).map_or(String::new(), |a| a.split(')').next().unwrap().to_string());
    Some(Serve { child, addr, admin, line })
}

/// [`try_serve`] that must start.
pub fn serve(config: &Path, args: &[&str], stderr: Stderr) -> Serve {
    try_serve(config, args, stderr, &[])
        .unwrap_or_else(|| panic!("embank serve --config {} did not start", config.display()))
}

pub fn sigkill(child: &mut Child) {
    // SAFETY: signalling a child this test started.
    unsafe { libc::kill(child.id() as i32, libc::SIGKILL) };
    let _ = child.wait();
}

pub fn http_get(addr: &str, path: &str) -> String {
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    write!(s, "GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out
}
