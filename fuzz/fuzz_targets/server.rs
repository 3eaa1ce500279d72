//! `embank serve`'s request loop fed arbitrary bytes over a real socket: the server
//! answers or closes, never dies, and serves the next client.
#![no_main]
use std::io::{Read, Write};
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use embank_net::{Server, ServerOptions};
use libfuzzer_sys::fuzz_target;

#[path = "common.rs"]
mod common;

fn server() -> &'static str {
    static ADDR: OnceLock<String> = OnceLock::new();
    ADDR.get_or_init(|| {
        let store = embank_core::Store::open(common::scratch().join("store"), Default::default()).unwrap();
        let t = store.create_table("t", embank_core::TableOptions::new(4)).unwrap();
        t.push(&[1, 2, 3], &[1.0; 12]).unwrap();
        let opts = ServerOptions { frame_timeout: Duration::from_millis(200), ..Default::default() };
        let server = Server::bind("127.0.0.1:0", Arc::new(store), opts).unwrap();
        let addr = server.local_addr().to_string();
        std::thread::spawn(move || {
            let stop = Arc::new(AtomicBool::new(false));
            server.run(&stop, Duration::from_secs(1)).unwrap();
        });
        addr
    })
}

fuzz_target!(|data: &[u8]| {
    let addr = server();
    let mut s = TcpStream::connect(addr).unwrap();
    // Close with a reset, not TIME_WAIT: thousands of connections a second would use
    // up the ephemeral ports.
    let linger = libc::linger { l_onoff: 1, l_linger: 0 };
    // SAFETY: setsockopt on a socket we own with a correctly sized value.
    unsafe {
        use std::os::fd::AsRawFd;
        libc::setsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            &linger as *const libc::linger as *const libc::c_void,
            std::mem::size_of::<libc::linger>() as libc::socklen_t,
        );
    }
    s.set_read_timeout(Some(Duration::from_millis(500))).unwrap();
    let _ = s.write_all(data);
    let _ = s.shutdown(Shutdown::Write);
    let mut sink = Vec::new();
    let _ = s.read_to_end(&mut sink);
});
