//! `embank serve`'s TOML config: any text is a config or an error naming the problem.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        if let Ok(c) = embank_net::config::ServeConfig::parse(text) {
            let _ = c.server_options();
            let _ = c.store_options();
            let _ = c.table_options();
        }
    }
});
