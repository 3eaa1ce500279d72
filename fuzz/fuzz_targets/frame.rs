//! The wire format's pure parts: a frame header from any 32 bytes, and the length rules
//! derived from it. Never panics; what decodes re-encodes to the same bytes.
#![no_main]
use embank_net::proto::{self, Header, Op, HEADER_BYTES};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if data.len() < HEADER_BYTES {
        return;
    }
    let head: [u8; HEADER_BYTES] = data[..HEADER_BYTES].try_into().unwrap();
    if let Ok(h) = Header::decode(&head) {
        assert_eq!(h.encode(), head, "a decoded header re-encodes to its bytes");
        if let Some(op) = Op::from_u16(h.opcode) {
            let _ = proto::keyed_body_len(op, h.count, (h.body_len % 5000) as usize);
            let _ = op.name();
        }
    }
    let _ = proto::token_eq(&data[HEADER_BYTES..], b"secret");
    let _ = proto::mask_bytes(data.len());
});
