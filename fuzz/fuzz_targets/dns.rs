//! The DNS forwarder's judgement of a sandbox's query and of upstream's reply
//! (`dns::screen_for_fuzzing`: what `answer` does around the network). The input is
//! `len (2 bytes, big-endian) | query | reply`: the query comes from the sandbox (hostile
//! by design), the reply from an upstream. Never a panic (the agent is built with
//! `panic = "abort"`: one would end every run); and a reply passed on holds, as hickory
//! reads it, no answer TTL above the allow set's longest, only addresses the policy allows
//! a DNS answer to point at, and one `found` entry per allowed A/AAAA record of the names
//! the query's CNAME chain reaches.
#![no_main]

use agent::egress::{nat64_prefixes, HostPattern, NetworkPolicy, MAX_TTL_S, MIN_TTL_S};
use hickory_proto::op::Message;
use hickory_proto::rr::RData;
use libfuzzer_sys::fuzz_target;

fn policy() -> NetworkPolicy {
    let p = |s: &str| HostPattern::parse(s).expect("a valid pattern");
    NetworkPolicy {
        allow: Some(vec![p("*.example.test"), p("allowed.test"), p("10.9.0.0/16")]),
        deny: vec![p("bad.example.test"), p("203.0.113.0/24")],
        ports: vec![],
        dns: true,
        bandwidth_mbps: 10,
        // The well-known prefix and one of the network's own, in the local-use /48.
        nat64: {
            let mut c = agent::config::Config::default();
            c.network.egress.nat64_prefixes = vec!["64:ff9b:1:2::/96".into()];
            nat64_prefixes(&c).expect("a valid prefix")
        },
    }
}

fuzz_target!(|data: &[u8]| {
    if data.len() < 2 {
        return;
    }
    let split = usize::from(u16::from_be_bytes([data[0], data[1]])).min(data.len() - 2);
    let (query, reply) = data[2..].split_at(split);
    let policy = policy();
    let Some(passed) = agent::dns::screen_for_fuzzing(query, reply, &policy) else { return };
    let parsed = Message::from_vec(&passed.reply).expect("a reply passed on parses as it did before its TTLs were lowered");
    for r in &parsed.answers {
        assert!(u64::from(r.ttl) <= MAX_TTL_S, "an answer TTL above {MAX_TTL_S} s was passed on: {}", r.ttl);
    }
    for (addr, ms) in &passed.found {
        assert!((MIN_TTL_S * 1000..=MAX_TTL_S * 1000).contains(ms), "{addr} allowed for {ms} ms");
        assert!(!policy.is_special(*addr) || policy.explicitly_allows(*addr), "{addr} is special and not allowed, yet passed");
    }
    let addresses = parsed.answers.iter().filter(|r| matches!(r.data, RData::A(_) | RData::AAAA(_))).count();
    assert!(passed.found.len() <= addresses, "more addresses allowed than the reply holds");
});
