//! Audit log verification (`opservant audit verify`) of arbitrary file contents, as one file
//! and split into a rotated file and the live one: never a panic; a report is consistent
//! (intact exactly when there is no problem and no recorded gap, every line it names inside
//! its file, the gaps' records counted); and a file
//! that verifies in memory verifies the same when written out and read back by path.
#![no_main]

use agent::audit::verify::{verify, verify_bytes, VerifyReport};
use libfuzzer_sys::fuzz_target;

fn consistent(report: &VerifyReport, files: &[(&str, &[u8])]) {
    assert_eq!(report.intact, report.problem.is_none() && report.gaps.is_empty());
    for p in report.problem.iter().chain(&report.gaps) {
        let (_, bytes) = files.iter().find(|(n, _)| *n == p.file).expect("the problem names a given file");
        let lines = bytes.split(|b| *b == b'\n').count();
        assert!(p.line >= 1 && p.line <= lines, "{p:?}");
    }
    // Each gap is reported at a record that was verified (counted).
    assert!(report.gaps.len() as u64 <= report.records, "{report:?}");
    let total_lines: usize = files.iter().map(|(_, b)| b.split(|c| *c == b'\n').count()).sum();
    assert!(report.records as usize <= total_lines);
    let _ = report.render();
    serde_json::to_string(report).expect("the report serialises");
}

fuzz_target!(|data: &[u8]| {
    let one = [("audit.jsonl", data)];
    let report = verify_bytes(&one);
    consistent(&report, &one);
    if report.intact {
        let dir = std::env::temp_dir().join(format!("opservant-fuzz-audit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let path = dir.join("audit.jsonl");
        std::fs::write(&path, data).expect("write");
        let again = verify(std::slice::from_ref(&path)).expect("read back");
        assert!(again.intact, "{}", again.render());
        assert_eq!((again.records, &again.head), (report.records, &report.head));
        // libFuzzer ends the process with exit(): nothing would remove the directory later.
        let _ = std::fs::remove_dir_all(&dir);
    }

    // The same bytes as a rotated file and the live one, cut after the middle line.
    if let Some(cut) = data[data.len() / 2..].iter().position(|b| *b == b'\n').map(|p| data.len() / 2 + p + 1) {
        let two = [("audit.jsonl.1", &data[..cut]), ("audit.jsonl", &data[cut..])];
        let split = verify_bytes(&two);
        consistent(&split, &two);
        // Cutting a file in two at a line boundary changes no record.
        if report.intact && split.intact {
            assert_eq!((split.records, &split.head), (report.records, &report.head));
        }
    }
});
