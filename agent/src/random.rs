//! Random bytes from the kernel (`getrandom(2)`, blocking until the pool is initialised);
//! the one place the agent asks for them (keys, nonces, DNS ids).

/// Fill `buf` entirely, or fail.
pub fn fill(buf: &mut [u8]) -> std::io::Result<()> {
    let mut done = 0;
    while done < buf.len() {
        let rest = &mut buf[done..];
        // SAFETY: `rest` is a live, exclusively borrowed byte slice; getrandom writes at most
        // `rest.len()` bytes starting at its pointer.
        let n = unsafe { libc::getrandom(rest.as_mut_ptr().cast(), rest.len(), 0) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        done += n.unsigned_abs();
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn fills_everything() {
        let mut a = [0u8; 64];
        let mut b = [0u8; 64];
        super::fill(&mut a).unwrap();
        super::fill(&mut b).unwrap();
        assert_ne!(a, b);
    }
}
