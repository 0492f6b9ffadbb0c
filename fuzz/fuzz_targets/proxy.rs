//! The agent's proxy (`egress_proxy`): a sandbox's request head, and the scrubbing of the
//! credentials from what the upstream answers. The input is a request head as the sandbox
//! sends it (up to its first empty line), and, whole, a stream the scrubber reads in three
//! parts (cut where its first two bytes say), with a pause between the first two. Never a
//! panic (the agent is built with `panic = "abort"`: one would end every run); a head
//! passed on is one block, that parses again to the same method, target, path, version
//! and body length (what reaches the upstream is what was judged) and holds one
//! `Proxy-Authorization`, the agent's (the client's never); a judged target is judged the same from the head
//! passed on; the scrubbed stream keeps its length and holds no credential as written.
#![no_main]

use agent::egress::{nat64_prefixes, HostPattern, NetworkPolicy};
use agent::egress_proxy::{judge, AddressRules, Request, Scrubber, Upstream};
use libfuzzer_sys::fuzz_target;

fn policy() -> NetworkPolicy {
    let p = |s: &str| HostPattern::parse(s).expect("a valid pattern");
    NetworkPolicy {
        allow: Some(vec![p("*.example.test"), p("allowed.test"), p("10.9.0.0/16"), p("2001:db8::/32")]),
        deny: vec![p("bad.example.test"), p("203.0.113.0/24")],
        ports: vec![(80, 80), (443, 443), (8000, 8100)],
        dns: true,
        bandwidth_mbps: 10,
        nat64: nat64_prefixes(&agent::config::Config::default()).expect("the default prefixes"),
    }
}

fn rules() -> AddressRules {
    AddressRules {
        deny: vec!["203.0.113.0/24".parse().expect("a network")],
        allow: vec!["10.9.0.0/16".parse().expect("a network"), "2001:db8::/32".parse().expect("a network")],
        always_denied: vec!["169.254.0.0/16".parse().expect("a network"), "127.0.0.0/8".parse().expect("a network")],
        allow_any: false,
        never: vec!["10.213.0.0/16".parse().expect("a network")],
        names: vec!["proxy.example.test".into()],
    }
}

const TOKEN: &str = "YWdlbnQ6cHIweHkvczNjcmV0";

fuzz_target!(|data: &[u8]| {
    let head_end = data.windows(4).position(|w| w == b"\r\n\r\n").unwrap_or(data.len());
    if let Ok(request) = Request::parse(&data[..head_end]) {
        let verdict = judge(&policy(), &rules(), &request.host, request.port);
        let authorization = format!("Basic {TOKEN}");
        let up = request.head_for_upstream(Some(&authorization));
        assert!(up.ends_with(b"\r\n\r\n"), "the head passed on ends with its empty line");
        let body = &up[..up.len() - 4];
        assert!(!body.windows(4).any(|w| w == b"\r\n\r\n"), "one block: {:?}", String::from_utf8_lossy(&up));
        let again = Request::parse(body).unwrap_or_else(|e| {
            panic!("the head passed on does not parse again ({e:?}): {:?}", String::from_utf8_lossy(&up))
        });
        assert_eq!(
            (&again.method, &again.host, again.port, &again.path, &again.version, again.content_length),
            (&request.method, &request.host, request.port, &request.path, &request.version, request.content_length),
            "passed on as judged"
        );
        assert_eq!(verdict, judge(&policy(), &rules(), &again.host, again.port));
        let text = String::from_utf8_lossy(&up);
        let credentials: Vec<&str> = text
            .split("\r\n")
            .filter(|l| l.split(':').next().is_some_and(|n| n.eq_ignore_ascii_case("proxy-authorization")))
            .collect();
        assert_eq!(credentials, [format!("Proxy-Authorization: {authorization}")], "{text}");
    }

    let up = Upstream::with_credentials("p:1".into(), vec![], Some(("agent".into(), "pr0xy/s3cret".into())));
    let (a, b) = match data {
        [x, y, ..] => (usize::from(*x) % (data.len() + 1), usize::from(*y) % (data.len() + 1)),
        _ => (0, 0),
    };
    let (first, second) = (a.min(b), a.max(b));
    let mut s = Scrubber::new(up.scrub.clone());
    let mut out = s.feed(&data[..first]);
    out.extend(s.pause());
    out.extend(s.feed(&data[first..second]));
    out.extend(s.feed(&data[second..]));
    out.extend(s.finish());
    assert_eq!(out.len(), data.len(), "the framing is kept");
    for form in [TOKEN.as_bytes(), b"agent:pr0xy/s3cret", b"pr0xy/s3cret"] {
        assert!(!out.windows(form.len()).any(|w| w == form), "{:?} passed on", String::from_utf8_lossy(form));
    }
});
