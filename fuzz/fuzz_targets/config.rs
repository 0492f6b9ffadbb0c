//! The agent configuration (YAML) as `opservant agent --check-config` reads it: any bytes give
//! a configuration or an error naming a key path, never a panic; YAML bombs (aliases, depth,
//! documents) are refused within the parser's budget. A configuration that parses is
//! internally consistent (its limit policy resolves) and survives a YAML round trip.
#![no_main]

use agent::config::Config;
use agent::limits::LimitPolicy;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    match Config::parse_bytes(data) {
        Err(e) => {
            assert!(!e.path.is_empty(), "{e}");
            assert!(!e.message.is_empty(), "{e}");
        }
        Ok(c) => {
            let policy = c.limit_policy(LimitPolicy::builtin()).expect("a parsed config's limits resolve");
            assert!(policy.defaults.max_memory_mb <= policy.ceilings.max_memory_mb);
            let _ = c.public_view();
            let yaml = serde_saphyr::to_string(&c).expect("a parsed config serialises");
            if let Err(e) = Config::parse(&yaml) {
                panic!("a parsed config does not parse again: {e}\n{yaml}");
            }
        }
    }
});
