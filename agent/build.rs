//! Records the version of the Python interpreter pyo3 links (PYO3_PYTHON, pinned in
//! .cargo/config.toml) so manifests' `requirements.python` can be checked against it,
//! precompiles the embedded Python package, sets the link flags of opservant-runtime, and
//! gives both binaries their build identity (`OPSERVANT_BUILD`, see [`build_identity`]).

/// The opservant Python package embedded in `opservant-runtime`: module, file, is-package.
const EMBEDDED: &[(&str, &str, bool)] = &[
    ("opservant", "python/opservant/__init__.py", true),
    ("opservant.executor", "python/opservant/executor.py", false),
    ("opservant._lifecycle", "python/opservant/_lifecycle.py", false),
    ("opservant._runtime", "python/opservant/_runtime.py", false),
    ("opservant.testing", "python/opservant/testing.py", false),
    ("s4e_agent", "python/s4e_agent/__init__.py", true),
    ("s4e_agent.executor", "python/s4e_agent/executor.py", false),
    ("s4e_agent.testing", "python/s4e_agent/testing.py", false),
];

/// The runtime's first Python, run as `__main__` (marshalled to `OUT_DIR/bootstrap.marshal`).
const BOOTSTRAP: &str = "src/bin/opservant-runtime/bootstrap.py";

/// Compile `file` with `python` (the interpreter the runtime embeds: same bytecode magic by
/// construction) and write the marshalled code object to `target`; `name` is the file name
/// its tracebacks show, under `<opservant>/`.
fn marshal(python: &str, file: &str, name: &str, target: &std::path::Path) {
    println!("cargo:rerun-if-changed={file}");
    let status = std::process::Command::new(python)
        .args([
            "-I",
            "-c",
            "import marshal, sys; src = open(sys.argv[1], encoding='utf-8').read(); \
             code = compile(src, '<opservant>/' + sys.argv[3], 'exec', dont_inherit=True); \
             open(sys.argv[2], 'wb').write(marshal.dumps(code))",
            file,
            target.to_str().expect("utf-8 OUT_DIR"),
            name,
        ])
        .status()
        .unwrap_or_else(|e| panic!("cannot run {python}: {e}"));
    assert!(status.success(), "compiling {file} failed");
}

/// What the two binaries are built from, relative to the workspace: every file under these
/// (a missing one is left out, e.g. a crate packaged alone).
const BUILD_INPUTS: &[&str] = &[
    "Cargo.toml",
    "Cargo.lock",
    ".cargo/config.toml",
    ".cargo/pyo3-static.config",
    "policies",
    "sandbox/Cargo.toml",
    "sandbox/build.rs",
    "sandbox/src",
    "agent/Cargo.toml",
    "agent/build.rs",
    "agent/src",
    "agent/python",
];

/// `VERSION+HASH`: the package version and a 64-bit hash (std's `DefaultHasher`, fixed keys) of the
/// relative path and contents of every file of [`BUILD_INPUTS`], in path order. `opservant`
/// and `opservant-runtime` are built by this one script run, so they carry the same identity,
/// and a build from other sources carries another: the agent and its runtime check each
/// other's before they speak (`agent::app::BUILD`), so an upgraded binary beside a running
/// agent is named as such instead of failing as a malformed message. Not a security
/// measure: whoever can replace either binary owns the host.
fn build_identity(workspace: &std::path::Path) -> String {
    use std::hash::Hasher;
    fn walk(dir: &std::path::Path, files: &mut Vec<std::path::PathBuf>) {
        let Ok(entries) = std::fs::read_dir(dir) else { return };
        for entry in entries.flatten() {
            let path = entry.path();
            let name = entry.file_name();
            // Caches, packaging output and editors' files are not sources.
            let name = name.to_string_lossy();
            if name.starts_with('.')
                || name == "__pycache__"
                || name.ends_with(".egg-info")
                || name.ends_with(".pyc")
                || ["build", "dist"].contains(&name.as_ref())
            {
                continue;
            }
            match entry.file_type() {
                Ok(t) if t.is_dir() => walk(&path, files),
                Ok(t) if t.is_file() => files.push(path),
                _ => {}
            }
        }
    }
    let mut files = Vec::new();
    for input in BUILD_INPUTS {
        let path = workspace.join(input);
        if path.is_dir() {
            walk(&path, &mut files);
        } else if path.is_file() {
            files.push(path);
        }
    }
    if files.is_empty() {
        println!("cargo:warning=none of the build's sources found beside agent/: its build identity covers nothing");
    }
    files.sort();
    // Each file hashed, not its directory: a cache written beside the sources (`__pycache__`
    // by a test's Python) reruns nothing. A new source file comes with an edit to one of
    // these (its `mod`, `include_str!` or EMBEDDED entry).
    for file in &files {
        println!("cargo:rerun-if-changed={}", file.display());
    }
    // Fixed keys: the same sources give the same hash (with the same toolchain).
    let mut hash = std::hash::DefaultHasher::new();
    for file in &files {
        let relative = file.strip_prefix(workspace).unwrap_or(file);
        let contents = std::fs::read(file).unwrap_or_else(|e| panic!("cannot read {}: {e}", file.display()));
        hash.write(relative.to_string_lossy().as_bytes());
        hash.write_u8(0);
        hash.write_u64(contents.len() as u64);
        hash.write(&contents);
    }
    format!("{}+{:016x}", std::env::var("CARGO_PKG_VERSION").unwrap_or_default(), hash.finish())
}

fn main() {
    let manifest_dir =
        std::path::PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let workspace = manifest_dir.parent().unwrap_or(&manifest_dir);
    println!("cargo:rustc-env=OPSERVANT_BUILD={}", build_identity(workspace));
    println!("cargo:rerun-if-env-changed=PYO3_PYTHON");
    let python = std::env::var("PYO3_PYTHON").unwrap_or_else(|_| "python3".into());
    let out = std::process::Command::new(&python)
        .args([
            "-I",
            "-c",
            "import sys, sysconfig; print('%d.%d.%d' % sys.version_info[:3]); print(sysconfig.get_path('stdlib'))",
        ])
        .output()
        .unwrap_or_else(|e| panic!("cannot run {python}: {e}"));
    assert!(out.status.success(), "{python} failed");
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let mut lines = text.lines();
    let version = lines.next().unwrap_or_default().trim().to_string();
    let stdlib = lines.next().unwrap_or_default().trim().to_string();
    assert!(stdlib.starts_with('/'), "{python}: no standard library path");
    println!("cargo:rustc-env=OPSERVANT_EMBEDDED_PYTHON={version}");
    // The embedded interpreter's standard library: the only Python files an executor
    // sandbox shows besides the executor's own.
    println!("cargo:rustc-env=OPSERVANT_PYTHON_STDLIB={stdlib}");

    // Compile the embedded package to marshalled code objects with the very interpreter the
    // runtime embeds (same bytecode magic by construction): no compile() at every run.
    let out_dir = std::path::PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let mut table = String::from("/// Generated by build.rs: (module, marshalled code, is package).\npub const EMBEDDED: &[(&str, &[u8], bool)] = &[\n");
    for (module, file, is_pkg) in EMBEDDED {
        let target = out_dir.join(format!("{module}.marshal"));
        marshal(&python, file, file.trim_start_matches("python/"), &target);
        table.push_str(&format!("    ({module:?}, include_bytes!({:?}), {is_pkg}),\n", target.display()));
    }
    table.push_str("];\n");
    // The runtime's bootstrap too: a cold start then never compiles source (the parser's
    // first use alone costs ~0.8 ms).
    marshal(&python, BOOTSTRAP, "bootstrap.py", &out_dir.join("bootstrap.marshal"));
    std::fs::write(out_dir.join("embedded_python.rs"), table).expect("write embedded_python.rs");
    // CPython is linked statically (.cargo/pyo3-static.config): export its C API so that
    // extension modules loaded from lib-dynload (e.g. _ssl, _ctypes) resolve against it —
    // only the Py*/_Py* symbols, not the whole binary. It also needs libm.
    // Only opservant-runtime links it (the main binary never touches pyo3, so it stays free
    // of CPython's ~1.4 MB of relocated data and starts in about a millisecond).
    for pattern in ["Py*", "_Py*"] {
        println!("cargo:rustc-link-arg-bin=opservant-runtime=-Wl,--export-dynamic-symbol={pattern}");
    }
    // Not position-independent: a PIE would relocate CPython's ~1.4 MB of static data at every
    // start (hundreds of copy-on-write page faults, ~2 ms). Address randomisation of the
    // runtime's own image protects nothing here — the code it runs is arbitrary Python by
    // design, and the sandbox, not the process, is the boundary; libraries, stack and heap
    // stay randomised.
    println!("cargo:rustc-link-arg-bin=opservant-runtime=-no-pie");
    // Built-in modules of Debian's static libpython need libm, zlib and expat.
    for lib in ["m", "z", "expat"] {
        println!("cargo:rustc-link-arg-bin=opservant-runtime=-l{lib}");
    }
}
