//! The seccomp profile compiler: seccompiler's JSON format in, classic BPF out, as a
//! binary search over contiguous ranges of syscall numbers (see the parent module for why).
//!
//! Self-contained (serde, serde_json, syscalls, libc) so that the build script can include it
//! to precompile the default profile; nothing here runs inside a sandbox.

use std::collections::BTreeMap;
use std::str::FromStr;

use serde::Deserialize;

/// One classic BPF instruction (layout of `struct sock_filter`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Insn {
    pub code: u16,
    pub jt: u8,
    pub jf: u8,
    pub k: u32,
}

impl Insn {
    /// Packed as `code | jt << 16 | jf << 24 | k << 32` (how the spec carries programs).
    pub fn pack(&self) -> u64 {
        u64::from(self.code) | (u64::from(self.jt) << 16) | (u64::from(self.jf) << 24) | (u64::from(self.k) << 32)
    }

    pub fn unpack(v: u64) -> Self {
        // Truncating casts extract the fields packed by `pack`.
        Insn { code: v as u16, jt: (v >> 16) as u8, jf: (v >> 24) as u8, k: (v >> 32) as u32 }
    }
}

/// Compile profile text into its filters, in lexical order of their names.
pub fn compile_profile(json: &str) -> Result<Vec<(String, Vec<u64>)>, String> {
    let Filters(filters) = serde_json::from_str(json).map_err(|e| e.to_string())?;
    if filters.is_empty() {
        return Err("the profile has no filters".into());
    }
    let mut out = Vec::with_capacity(filters.len());
    for (name, f) in &filters {
        let prog = compile_filter(name, f)?;
        out.push((name.clone(), prog.iter().map(Insn::pack).collect()));
    }
    Ok(out)
}

// --- Profile format (seccompiler's JSON format) -------------------------------------------

/// The profile's named filters; a name given twice is an error (a map would keep the last
/// one silently, and the profile would mean something other than it reads).
struct Filters(BTreeMap<String, JsonFilter>);

impl<'de> Deserialize<'de> for Filters {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Named;
        impl<'de> serde::de::Visitor<'de> for Named {
            type Value = Filters;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("an object of named filters")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Filters, A::Error> {
                let mut filters = BTreeMap::new();
                while let Some((name, filter)) = map.next_entry::<String, JsonFilter>()? {
                    if filters.contains_key(&name) {
                        return Err(serde::de::Error::custom(format!("filter '{name}' is defined twice")));
                    }
                    filters.insert(name, filter);
                }
                Ok(Filters(filters))
            }
        }
        d.deserialize_map(Named)
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct JsonFilter {
    mismatch_action: Action,
    match_action: Action,
    filter: Vec<JsonRule>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct JsonRule {
    syscall: String,
    #[serde(default)]
    args: Option<Vec<Condition>>,
    #[serde(default)]
    #[allow(dead_code)]
    comment: Option<String>,
}

#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
enum Action {
    Allow,
    Errno(u32),
    KillThread,
    KillProcess,
    Log,
    Trace(u32),
    Trap,
}

impl Action {
    fn ret(self) -> u32 {
        match self {
            Action::Allow => libc::SECCOMP_RET_ALLOW,
            Action::Errno(e) => libc::SECCOMP_RET_ERRNO | (e & libc::SECCOMP_RET_DATA),
            Action::KillThread => libc::SECCOMP_RET_KILL_THREAD,
            Action::KillProcess => libc::SECCOMP_RET_KILL_PROCESS,
            Action::Log => libc::SECCOMP_RET_LOG,
            Action::Trace(t) => libc::SECCOMP_RET_TRACE | (t & libc::SECCOMP_RET_DATA),
            Action::Trap => libc::SECCOMP_RET_TRAP,
        }
    }
}

#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
enum ArgLen {
    Dword,
    Qword,
}

#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
enum Op {
    Eq,
    Ne,
    Gt,
    Ge,
    Lt,
    Le,
    MaskedEq(u64),
}

#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
struct Condition {
    index: u8,
    #[serde(rename = "type")]
    len: ArgLen,
    op: Op,
    val: u64,
    #[serde(default)]
    #[allow(dead_code)]
    comment: Option<String>,
}

// --- Code generation -------------------------------------------------------------------------

pub(crate) const BPF_LD_W_ABS: u16 = (libc::BPF_LD | libc::BPF_W | libc::BPF_ABS) as u16;
pub(crate) const BPF_AND_K: u16 = (libc::BPF_ALU | libc::BPF_AND | libc::BPF_K) as u16;
pub(crate) const BPF_JA: u16 = (libc::BPF_JMP | libc::BPF_JA) as u16;
pub(crate) const BPF_JEQ_K: u16 = (libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K) as u16;
pub(crate) const BPF_JGT_K: u16 = (libc::BPF_JMP | libc::BPF_JGT | libc::BPF_K) as u16;
pub(crate) const BPF_JGE_K: u16 = (libc::BPF_JMP | libc::BPF_JGE | libc::BPF_K) as u16;
pub(crate) const BPF_RET_K: u16 = (libc::BPF_RET | libc::BPF_K) as u16;

const OFF_NR: u32 = 0;
const OFF_ARCH: u32 = 4;
const OFF_ARGS: u32 = 16;

#[cfg(target_arch = "x86_64")]
pub(crate) const AUDIT_ARCH: u32 = 0xC000_003E;
#[cfg(target_arch = "aarch64")]
pub(crate) const AUDIT_ARCH: u32 = 0xC000_00B7;
#[cfg(target_arch = "riscv64")]
pub(crate) const AUDIT_ARCH: u32 = 0xC000_00F3;

type Label = usize;

/// Assembly with symbolic jump targets, resolved by [`Asm::finish`].
enum Item {
    Stmt(u16, u32),
    Jump { code: u16, k: u32, jt: Label, jf: Label },
    Ja(Label),
    Mark(Label),
}

#[derive(Default)]
struct Asm {
    items: Vec<Item>,
    labels: usize,
}

impl Asm {
    fn label(&mut self) -> Label {
        self.labels += 1;
        self.labels - 1
    }
    fn mark(&mut self, l: Label) {
        self.items.push(Item::Mark(l));
    }
    fn stmt(&mut self, code: u16, k: u32) {
        self.items.push(Item::Stmt(code, k));
    }
    fn jump(&mut self, code: u16, k: u32, jt: Label, jf: Label) {
        self.items.push(Item::Jump { code, k, jt, jf });
    }
    fn ja(&mut self, l: Label) {
        self.items.push(Item::Ja(l));
    }

    /// Resolve labels. Conditional jumps have 8-bit offsets; one that reaches too far is
    /// rewritten as a short conditional jump to two unconditional (32-bit) jumps.
    fn finish(mut self) -> Result<Vec<Insn>, String> {
        loop {
            let mut pos = vec![usize::MAX; self.labels];
            let mut n = 0usize;
            for it in &self.items {
                match it {
                    Item::Mark(l) => pos[*l] = n,
                    _ => n += 1,
                }
            }
            let mut out = Vec::with_capacity(n);
            let mut too_far = None;
            for (i, it) in self.items.iter().enumerate() {
                let here = out.len();
                let rel = |l: Label| -> Result<usize, String> {
                    let target = pos[l];
                    if target == usize::MAX || target <= here {
                        return Err("seccomp codegen: jump to an unplaced or backward label".into());
                    }
                    Ok(target - here - 1)
                };
                match it {
                    Item::Mark(_) => {}
                    Item::Stmt(code, k) => out.push(Insn { code: *code, jt: 0, jf: 0, k: *k }),
                    Item::Ja(l) => {
                        let off = u32::try_from(rel(*l)?).map_err(|_| "seccomp codegen: program too long")?;
                        out.push(Insn { code: BPF_JA, jt: 0, jf: 0, k: off });
                    }
                    Item::Jump { code, k, jt, jf } => {
                        let (t, f) = (rel(*jt)?, rel(*jf)?);
                        match (u8::try_from(t), u8::try_from(f)) {
                            (Ok(t), Ok(f)) => out.push(Insn { code: *code, jt: t, jf: f, k: *k }),
                            _ => {
                                too_far = Some(i);
                                break;
                            }
                        }
                    }
                }
            }
            match too_far {
                None => {
                    if out.len() > usize::from(u16::MAX) || out.len() > 4096 {
                        return Err(format!("seccomp filter has {} instructions (kernel limit 4096)", out.len()));
                    }
                    return Ok(out);
                }
                Some(i) => {
                    let Item::Jump { code, k, jt, jf } = self.items[i] else { unreachable!("index of a jump") };
                    let (near_t, near_f) = (self.label(), self.label());
                    self.items.splice(
                        i..=i,
                        [
                            Item::Jump { code, k, jt: near_t, jf: near_f },
                            Item::Mark(near_t),
                            Item::Ja(jt),
                            Item::Mark(near_f),
                            Item::Ja(jf),
                        ],
                    );
                }
            }
        }
    }
}

/// What one syscall number leads to.
#[derive(Debug, Clone)]
enum Segment {
    /// Every number in `lo..=hi` matches unconditionally.
    Range(u32, u32),
    /// `nr` matches when any rule (a conjunction of conditions) holds.
    Conditional(u32, Vec<Vec<Condition>>),
}

impl Segment {
    fn lo(&self) -> u32 {
        match self {
            Segment::Range(lo, _) | Segment::Conditional(lo, _) => *lo,
        }
    }
}

fn segments(rules: &BTreeMap<u32, Option<Vec<Vec<Condition>>>>) -> Vec<Segment> {
    let mut out: Vec<Segment> = Vec::new();
    for (&nr, r) in rules {
        match r {
            None => match out.last_mut() {
                Some(Segment::Range(_, hi)) if *hi + 1 == nr => *hi = nr,
                _ => out.push(Segment::Range(nr, nr)),
            },
            Some(conds) => out.push(Segment::Conditional(nr, conds.clone())),
        }
    }
    out
}

fn arg_word(index: u8, high: bool) -> u32 {
    let base = OFF_ARGS + 8 * u32::from(index);
    let high_first = cfg!(target_endian = "big");
    if high == high_first {
        base
    } else {
        base + 4
    }
}

/// Emit a test of one 32-bit word: load, mask, compare; jump to `pass` or `fail`.
fn word_test(a: &mut Asm, offset: u32, op: Op, val: u32, pass: Label, fail: Label) {
    a.stmt(BPF_LD_W_ABS, offset);
    match op {
        Op::Eq => a.jump(BPF_JEQ_K, val, pass, fail),
        Op::Ne => a.jump(BPF_JEQ_K, val, fail, pass),
        Op::Gt => a.jump(BPF_JGT_K, val, pass, fail),
        Op::Ge => a.jump(BPF_JGE_K, val, pass, fail),
        Op::Lt => a.jump(BPF_JGE_K, val, fail, pass),
        Op::Le => a.jump(BPF_JGT_K, val, fail, pass),
        Op::MaskedEq(mask) => {
            a.stmt(BPF_AND_K, mask as u32);
            a.jump(BPF_JEQ_K, val, pass, fail);
        }
    }
}

fn condition(a: &mut Asm, c: &Condition, pass: Label, fail: Label) -> Result<(), String> {
    if c.index > 5 {
        return Err(format!("argument index {} out of range 0-5", c.index));
    }
    let lo_val = c.val as u32;
    let hi_val = (c.val >> 32) as u32;
    match c.len {
        ArgLen::Dword => {
            if c.val > u64::from(u32::MAX) || matches!(c.op, Op::MaskedEq(m) if m > u64::from(u32::MAX)) {
                return Err(format!("value {} does not fit a dword", c.val));
            }
            word_test(a, arg_word(c.index, false), c.op, lo_val, pass, fail);
        }
        ArgLen::Qword => {
            let (hi, lo) = (arg_word(c.index, true), arg_word(c.index, false));
            let check_lo = a.label();
            match c.op {
                Op::Eq | Op::Ne => {
                    let (p, f) = if c.op == Op::Eq { (pass, fail) } else { (fail, pass) };
                    word_test(a, hi, Op::Eq, hi_val, check_lo, f);
                    a.mark(check_lo);
                    word_test(a, lo, Op::Eq, lo_val, p, f);
                }
                Op::MaskedEq(mask) => {
                    word_test(a, hi, Op::MaskedEq(mask >> 32), hi_val, check_lo, fail);
                    a.mark(check_lo);
                    word_test(a, lo, Op::MaskedEq(mask & 0xffff_ffff), lo_val, pass, fail);
                }
                Op::Gt | Op::Ge | Op::Lt | Op::Le => {
                    // Compare the high words; on equality the low words decide.
                    let (above, below) = match c.op {
                        Op::Gt | Op::Ge => (pass, fail),
                        _ => (fail, pass),
                    };
                    let not_above = a.label();
                    a.stmt(BPF_LD_W_ABS, hi);
                    a.jump(BPF_JGT_K, hi_val, above, not_above);
                    a.mark(not_above);
                    a.jump(BPF_JEQ_K, hi_val, check_lo, below);
                    a.mark(check_lo);
                    word_test(a, lo, c.op, lo_val, pass, fail);
                }
            }
        }
    }
    Ok(())
}

/// Binary search over `segs`; every path ends at `matched` or `mismatched`.
fn tree(a: &mut Asm, segs: &[Segment], matched: Label, mismatched: Label) -> Result<(), String> {
    match segs {
        [] => a.ja(mismatched),
        [Segment::Range(lo, hi)] => {
            let in_low = a.label();
            a.jump(BPF_JGE_K, *lo, in_low, mismatched);
            a.mark(in_low);
            a.jump(BPF_JGT_K, *hi, mismatched, matched);
        }
        [Segment::Conditional(nr, rules)] => {
            let body = a.label();
            a.jump(BPF_JEQ_K, *nr, body, mismatched);
            a.mark(body);
            for (i, rule) in rules.iter().enumerate() {
                let next_rule = if i + 1 == rules.len() { mismatched } else { a.label() };
                for (j, c) in rule.iter().enumerate() {
                    let pass = if j + 1 == rule.len() { matched } else { a.label() };
                    condition(a, c, pass, next_rule)?;
                    if j + 1 != rule.len() {
                        a.mark(pass);
                    }
                }
                if rule.is_empty() {
                    a.ja(matched);
                }
                if i + 1 != rules.len() {
                    a.mark(next_rule);
                }
            }
        }
        _ => {
            let mid = segs.len() / 2;
            let right = a.label();
            let left = a.label();
            a.jump(BPF_JGE_K, segs[mid].lo(), right, left);
            a.mark(left);
            tree(a, &segs[..mid], matched, mismatched)?;
            a.mark(right);
            tree(a, &segs[mid..], matched, mismatched)?;
        }
    }
    Ok(())
}

fn compile_filter(name: &str, f: &JsonFilter) -> Result<Vec<Insn>, String> {
    // The action's data is 16 bits: a larger errno would be cut to another one (65536 to 0,
    // "success" without the call running), and errno values stop at 4095 (MAX_ERRNO).
    for action in [f.mismatch_action, f.match_action] {
        match action {
            Action::Errno(e) if !(1..=4095).contains(&e) => {
                return Err(format!("filter '{name}': errno {e} is not an error number (1-4095)"))
            }
            Action::Trace(t) if t > 0xFFFF => return Err(format!("filter '{name}': trace data {t} is over 16 bits")),
            _ => {}
        }
    }
    // nr → None (unconditional) or the OR of its rules.
    let mut rules: BTreeMap<u32, Option<Vec<Vec<Condition>>>> = BTreeMap::new();
    for (i, r) in f.filter.iter().enumerate() {
        let nr = syscalls::Sysno::from_str(&r.syscall)
            .map_err(|_| {
                format!("filter '{name}' rule {i}: unknown system call '{}' on {}", r.syscall, std::env::consts::ARCH)
            })?
            .id() as u32;
        // seccompiler's documentation says rules are OR-ed, but its code lets conditional
        // rules replace an unconditional one for the same call; such a profile means two
        // different things, so it is refused.
        let ambiguous =
            || format!("filter '{name}': '{}' has both an unconditional rule and rules with args", r.syscall);
        match (&r.args, rules.get_mut(&nr)) {
            (None, None) => {
                rules.insert(nr, None);
            }
            (Some(conds), None) => {
                rules.insert(nr, Some(vec![conds.clone()]));
            }
            (None, Some(None)) => {}
            (Some(conds), Some(Some(list))) => list.push(conds.clone()),
            (None, Some(Some(_))) | (Some(_), Some(None)) => return Err(ambiguous()),
        }
    }
    let mut a = Asm::default();
    let (matched, mismatched) = (a.label(), a.label());
    let arch_ok = a.label();
    let kill = a.label();
    a.stmt(BPF_LD_W_ABS, OFF_ARCH);
    a.jump(BPF_JEQ_K, AUDIT_ARCH, arch_ok, kill);
    a.mark(kill);
    a.stmt(BPF_RET_K, libc::SECCOMP_RET_KILL_PROCESS);
    a.mark(arch_ok);
    a.stmt(BPF_LD_W_ABS, OFF_NR);
    tree(&mut a, &segments(&rules), matched, mismatched).map_err(|e| format!("filter '{name}': {e}"))?;
    a.mark(matched);
    a.stmt(BPF_RET_K, f.match_action.ret());
    a.mark(mismatched);
    a.stmt(BPF_RET_K, f.mismatch_action.ret());
    a.finish().map_err(|e| format!("filter '{name}': {e}"))
}
