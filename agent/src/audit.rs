//! Audit events. Every security-relevant decision of the executor runtime (executor start and
//! end, secret grants and refusals) is recorded here as a structured `tracing` event with
//! target `opservant::audit`, which the CLI always prints to stderr. The tamper-evident,
//! hash-chained audit log of DESIGN.md §6 arrives with the agent daemon and will be fed
//! from this same function.

pub fn record(event: &str, fields: &[(&str, &str)]) {
    let fields: serde_json::Map<String, serde_json::Value> =
        fields.iter().map(|(k, v)| (k.to_string(), serde_json::Value::String(v.to_string()))).collect();
    tracing::info!(target: "opservant::audit", event, fields = %serde_json::Value::Object(fields), "audit");
}
