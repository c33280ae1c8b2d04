//! The daemons' fault hooks for tests (docs/CLUSTER.md, "Test hooks"): an
//! environment variable names the step to stop at, or, as `@FILE`, a file
//! holding it (read at each point, so that a test changes it at will).

/// The step the hook `var` names now ("" for none).
pub fn wanted(var: &str) -> String {
    let v = std::env::var(var).unwrap_or_default();
    match v.strip_prefix('@') {
        Some(path) => std::fs::read_to_string(path)
            .map(|s| s.trim().to_string())
            .unwrap_or_default(),
        None => v,
    }
}
