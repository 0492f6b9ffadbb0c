//! The runtime's first messages: an optional warm-up, then the run's arguments — each read
//! only once it comes from an agent of this build (`agent::app::decode_args`).
//!
//! A warm pool's sandbox waits for its run with the payload blocked on its arguments. A
//! payload forked from the zygote shares the zygote's memory copy-on-write, so once the run
//! starts every first write to a page — the interpreter's reference counts touch most of
//! its heap — is a page fault and a page copy (~470 per run, measured with `opservant
//! bench`). [`RuntimeArgs::Warm`] asks the waiting payload to take those faults now, off the
//! run's path: every resident page of its private writable mappings is populated for
//! writing (`MADV_POPULATE_WRITE`, which copies a shared page and changes no content), and
//! the network facts are read once.
//!
//! Guarantees: a warm-up runs only this trusted code, before any argument of a run exists;
//! it is accepted once, and only as the first message. Pages that are not resident are left
//! alone, so a warmed payload holds privately about the zygote's resident writable set (~3
//! MiB) rather than the pages a run would have copied anyway. A kernel without
//! `MADV_POPULATE_WRITE` (before 5.14) or a seccomp policy without `mincore`/`madvise`
//! makes the warm-up populate nothing — it changes speed, never isolation — and the reply
//! says how much was populated.

use agent::app::{self, FromPayload, RuntimeArgs};
use sandbox::channel::Channel;

/// Read the run's arguments, serving a warm-up request first if one comes.
pub(crate) fn read_args(chan: &Channel) -> Result<RuntimeArgs, String> {
    let mut warmed = false;
    loop {
        let bytes =
            chan.recv_bytes(app::MAX_MESSAGE)?.ok_or("the agent closed the channel before sending arguments")?;
        let args = match app::decode_args(&bytes) {
            Ok(args) => args,
            Err(app::DecodeArgsError::Malformed(e)) => return Err(format!("malformed arguments: {e}")),
            Err(app::DecodeArgsError::WrongBuild(e)) => {
                // Told before anything of the arguments is read: the agent names both builds.
                let _ = chan.send_bytes(&app::wrong_build());
                return Err(e);
            }
        };
        match args {
            RuntimeArgs::Warm if warmed => return Err("a second warm-up request".into()),
            RuntimeArgs::Warm => {
                warmed = true;
                let prefaulted_kib = populate_resident_writable() / 1024;
                crate::native::network_facts();
                chan.send_bytes(&app::encode(&FromPayload::Warmed { prefaulted_kib }))
                    .map_err(|e| format!("agent channel: {}", e.desc()))?;
            }
            args => return Ok(args),
        }
    }
}

/// Populate for writing every resident page of this process's private writable mappings;
/// returns the bytes populated.
fn populate_resident_writable() -> u64 {
    let Ok(maps) = std::fs::read_to_string("/proc/self/maps") else { return 0 };
    // SAFETY: sysconf has no preconditions.
    let page = match unsafe { libc::sysconf(libc::_SC_PAGESIZE) } {
        p if p > 0 => p as usize,
        _ => return 0,
    };
    let mut populated = 0u64;
    let mut resident = Vec::new();
    for line in maps.lines() {
        let mut fields = line.split_ascii_whitespace();
        let (Some(range), Some("rw-p")) = (fields.next(), fields.next()) else { continue };
        let Some((start, end)) = range.split_once('-') else { continue };
        let (Ok(start), Ok(end)) = (usize::from_str_radix(start, 16), usize::from_str_radix(end, 16)) else {
            continue;
        };
        if end <= start {
            continue;
        }
        let pages = (end - start) / page;
        resident.clear();
        resident.resize(pages, 0u8);
        // SAFETY: mincore only writes one byte per page of [start, end) into `resident`,
        // which holds exactly that many; it reads no memory of the range. If the range is no
        // longer mapped (the vector's own allocation may have changed the heap) it fails
        // with ENOMEM and the mapping is skipped.
        if unsafe { libc::mincore(start as *mut libc::c_void, pages * page, resident.as_mut_ptr()) } != 0 {
            continue;
        }
        let mut i = 0;
        while i < pages {
            if resident[i] & 1 == 0 {
                i += 1;
                continue;
            }
            let run = resident[i..].iter().take_while(|r| *r & 1 == 1).count();
            let addr = start + i * page;
            // SAFETY: MADV_POPULATE_WRITE faults the pages in as if written, without
            // changing their contents (a shared page is copied); it touches no memory
            // through any Rust reference, and an unmapped range is only an error.
            if unsafe { libc::madvise(addr as *mut libc::c_void, run * page, libc::MADV_POPULATE_WRITE) } == 0 {
                populated += (run * page) as u64;
            }
            i += run;
        }
    }
    populated
}
