//! The opservant agent library: manifests, limit and sandbox policy, result reporting and
//! host diagnostics. The isolation engine itself is the `sandbox` crate.

pub mod doctor;
pub mod limits;
pub mod manifest;
pub mod policy;
pub mod result;
