//! Precompiles the default seccomp profile (`policies/seccomp/default.json`) with the same
//! compiler the crate uses at run time, so starting a sandbox does no JSON parsing or code
//! generation. Skipped when cross-compiling (syscall numbers are per architecture); the
//! crate then compiles the profile at run time.

#[allow(dead_code)]
#[path = "src/seccomp/compiler.rs"]
mod compiler;

fn main() {
    println!("cargo:rerun-if-changed=src/seccomp/compiler.rs");
    let out =
        std::path::PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR")).join("default_seccomp.rs");
    let native = std::env::var("CARGO_CFG_TARGET_ARCH").ok().as_deref() == Some(std::env::consts::ARCH);
    let mut code = String::new();
    for (constant, profile) in [
        ("DEFAULT_FILTERS", "../policies/seccomp/default.json"),
        ("NO_NETLINK_FILTERS", "../policies/seccomp/no-netlink.json"),
    ] {
        println!("cargo:rerun-if-changed={profile}");
        if native {
            let json = std::fs::read_to_string(profile).unwrap_or_else(|e| panic!("{profile}: {e}"));
            let filters = compiler::compile_profile(&json).unwrap_or_else(|e| panic!("{profile}: {e}"));
            let body: Vec<String> = filters
                .iter()
                .map(|(_, f)| format!("&[{}]", f.iter().map(|v| format!("{v:#x}")).collect::<Vec<_>>().join(",")))
                .collect();
            code.push_str(&format!("const {constant}: Option<&[&[u64]]> = Some(&[{}]);\n", body.join(",")));
        } else {
            code.push_str(&format!("const {constant}: Option<&[&[u64]]> = None;\n"));
        }
    }
    std::fs::write(out, code).expect("write OUT_DIR/default_seccomp.rs");
}
