//! Update-stream messages: any bytes decode or are refused, never panic; what decodes
//! re-encodes to the same bytes (so a replica applies exactly what was published).
#![no_main]
use embank_net::stream::message::{self, Kind};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // Raw bytes, and the same bytes sealed with a correct checksum (so the decoder's
    // checks past the CRC are reached too).
    let mut sealed = data.to_vec();
    sealed.extend_from_slice(&crc32c_of(data).to_le_bytes());
    for bytes in [data, &sealed[..]] {
        let Ok(m) = message::decode(bytes) else { continue };
        let again = match m.kind {
            Kind::Rows => message::encode_rows(m.checkpoint, &m.table, m.dim as usize, &m.keys, &m.rows),
            Kind::Deletes => message::encode_deletes(m.checkpoint, &m.table, &m.keys),
            Kind::Reset => message::encode_reset(m.checkpoint, &m.table, m.dim as usize),
            Kind::Commit => message::encode_commit(m.checkpoint, m.count),
        };
        // The header's element code 0 (f32 before the codes were the records') is read as
        // f32 and written as its code now (1): other bytes, the same message.
        if bytes.get(7) == Some(&0) {
            let m2 = message::decode(&again).expect("a re-encoded message decodes");
            let bits = |r: &[f32]| r.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
            assert!(
                (m2.kind, m2.checkpoint, &m2.table, m2.dim, m2.count, &m2.keys)
                    == (m.kind, m.checkpoint, &m.table, m.dim, m.count, &m.keys)
                    && bits(&m2.rows) == bits(&m.rows),
                "a decoded message of the old element code re-encodes to the same message"
            );
            continue;
        }
        assert_eq!(again, bytes, "a decoded message re-encodes to its bytes");
    }
});

fn crc32c_of(b: &[u8]) -> u32 {
    embank_net::stream::message::checksum(b)
}
