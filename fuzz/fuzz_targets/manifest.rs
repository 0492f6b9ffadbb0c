//! Manifest text, as `opservant run` and `executor lint` read it: any bytes either are refused
//! before parsing (too large, not UTF-8, nested too deep — an error on the path "manifest") or
//! give the same verdict through `check` (lint: every error) and `parse` (run: the first).
//! Never a panic; every error names a key path and a rule.
#![no_main]

use agent::manifest::{text_of, Manifest};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let text = match text_of(data) {
        Ok(t) => t,
        Err(e) => {
            assert_eq!(e.path, "manifest", "{e}");
            assert!(!e.message.is_empty());
            return;
        }
    };
    let (checked, errors, warnings) = Manifest::check(text);
    for e in &errors {
        assert!(!e.path.is_empty() && !e.message.is_empty(), "{e:?}");
    }
    for w in &warnings {
        assert!(!w.path.is_empty() && !w.message.is_empty(), "{w:?}");
    }
    match Manifest::parse(text) {
        Ok((m, w)) => {
            assert!(errors.is_empty(), "parse accepted what check refused: {errors:?}");
            assert_eq!(checked.as_ref(), Some(&m));
            assert_eq!(w, warnings);
            // What validation promises the rest of the agent.
            assert!(agent::manifest::valid_name(&m.name));
            assert!(semver::Version::parse(&m.version).is_ok());
            assert!(!m.supported_actions.is_empty());
            for p in &m.permissions.network.allowed_ports {
                let (lo, hi) = p.range().expect("a validated port entry has a range");
                assert!(1 <= lo && lo <= hi);
            }
            for p in m.permissions.filesystem.read.iter().chain(&m.permissions.filesystem.write) {
                assert!(p.is_absolute(), "{}", p.display());
            }
        }
        Err(e) => assert_eq!(errors.first(), Some(&e), "parse stops at check's first error"),
    }
});
