//! Reading the JSON that the tools print (`cr_image show --json`,
//! `cr_image stats`): values of a key wherever it occurs in the document.

use serde_json::Value;

/// Every value of `key` in `doc`, depth first, in document order.
pub(crate) fn all<'v>(doc: &'v Value, key: &str) -> Vec<&'v Value> {
    let mut out = Vec::new();
    walk(doc, key, &mut out);
    out
}

fn walk<'v>(v: &'v Value, key: &str, out: &mut Vec<&'v Value>) {
    match v {
        Value::Object(m) => {
            for (k, x) in m {
                if k == key {
                    out.push(x);
                }
                walk(x, key, out);
            }
        }
        Value::Array(a) => a.iter().for_each(|x| walk(x, key, out)),
        _ => {}
    }
}

/// The first value of `key` in `doc`.
pub(crate) fn first<'v>(doc: &'v Value, key: &str) -> Option<&'v Value> {
    all(doc, key).into_iter().next()
}

/// `text` parsed, or an error naming `what` printed it.
pub(crate) fn parse(text: &str, what: &str) -> Result<Value, String> {
    serde_json::from_str(text).map_err(|e| format!("{what}: not JSON ({e}): {text}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_nested_keys_in_order() {
        let v: Value =
            serde_json::from_str(r#"{"a":1,"b":[{"a":2},{"c":{"a":3}}],"s":"x"}"#).unwrap();
        let got: Vec<u64> = all(&v, "a").iter().filter_map(|x| x.as_u64()).collect();
        assert_eq!(got, [1, 2, 3]);
        assert_eq!(first(&v, "s").and_then(Value::as_str), Some("x"));
        assert!(first(&v, "zz").is_none());
    }
}
