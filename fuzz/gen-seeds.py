#!/usr/bin/env python3
"""Regenerate the command and audit seeds (fuzz/seeds/): commands signed with the fuzz
targets' fixed key (32 bytes of 7) at their fixed clock, and audit chains. Needs the
`cryptography` package; run from fuzz/."""
import base64, hashlib, json, os
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

NOW = "2026-04-28T12:00:00Z"
key = Ed25519PrivateKey.from_private_bytes(bytes([7] * 32))

def canon(v):
    # RFC 8785 for the ASCII strings and small integers used here.
    return json.dumps(v, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()

def signed(cmd):
    cmd = dict(cmd)
    cmd.setdefault("timestamp", NOW)
    cmd.pop("signature", None)
    cmd["signature"] = base64.b64encode(key.sign(canon(cmd))).decode()
    return cmd

def put(d, name, data):
    with open(os.path.join("seeds", d, name), "wb") as f:
        f.write(data)

ping = {"command_id": "cmd-1", "action": "ping"}
execute = {"command_id": "cmd-8821", "action": "execute", "executor": "port-scanner",
           "parameters": {"target_host": "10.0.1.5", "ports": [22, 80], "deep": {"a": [1.5, True, None]}},
           "resource_limits": {"max_memory_mb": 64}}
put("command", "signed-ping.json", canon(signed(ping)))
put("command", "signed-execute.json", json.dumps(signed(execute), indent=1).encode())
bad = signed(execute); bad["parameters"]["ports"] = [22, 80, 443]
put("command", "bad-signature.json", canon(bad))
put("command", "unsigned.json", canon(ping))
put("command", "stale.json", canon(signed({**ping, "timestamp": "2026-04-28T11:00:00Z"})))
put("command", "no-id.json", canon(signed({"action": "ping"})))
put("command", "duplicate-key.json", b'{"command_id":"a","command_id":"b","action":"ping"}')
put("command", "not-utf8.json", b'{"command_id":"\xc3\x28"}')
put("command", "deep.json", b'{"a":' + b"[" * 70 + b"]" * 70 + b"}")
put("command", "big-int.json", canon(signed({**ping, "n": 9007199254740993})))
# Found by the fuzzer: an exact double whose canonical form has rounded digits.
put("command", "rounded-big-int.json", b'{"a":[33333336303333208]}')

def chain(n, first_seq=1, prev="0" * 64, continues=None, gap=None):
    lines = []
    for i in range(n):
        rec = {"seq": first_seq + i, "ts": "2026-04-28T12:00:0%d.000000Z" % i, "host": "h", "pid": 1,
               "event": "executor_start", "fields": {"executor": "x", "i": str(i)}}
        if continues and i == 0:
            rec["continues"] = continues
        if gap and i == 0:
            rec["gap"] = gap
        rec["prev"] = prev
        line = json.dumps(rec, separators=(",", ":")).encode()
        prev = hashlib.sha256(line).hexdigest()
        lines.append(line)
    return lines

good = chain(3)
put("audit_verify", "intact.jsonl", b"\n".join(good) + b"\n")
edited = list(good); edited[1] = edited[1].replace(b'"i":"1"', b'"i":"9"')
put("audit_verify", "edited.jsonl", b"\n".join(edited) + b"\n")
put("audit_verify", "reordered.jsonl", b"\n".join([good[0], good[2], good[1]]) + b"\n")
put("audit_verify", "torn.jsonl", b"\n".join(good) + b"\n" + b'{"seq":4,"ts')
cont = chain(2, first_seq=7, prev="ab" * 32, continues={"file": "audit.jsonl.1", "seq": 6})
put("audit_verify", "continuation.jsonl", b"\n".join(cont) + b"\n")
# Recorded gaps (the log's high-water marks): a newest file set aside in a log never
# rotated, and records cut off a file's end.
put("audit_verify", "gap-genesis.jsonl",
    b"\n".join(chain(2, first_seq=4, gap={"from": 1, "to": 3, "sha256": "cd" * 32})) + b"\n")
after = chain(2, first_seq=7, prev=hashlib.sha256(good[-1]).hexdigest(), gap={"from": 4, "to": 6, "sha256": "cd" * 32})
put("audit_verify", "gap-after-cut.jsonl", b"\n".join(good + after) + b"\n")
