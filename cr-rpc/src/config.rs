//! TOML configuration files of the daemons and of crctl. A missing file is
//! an error only when it was named explicitly.

use crate::RpcError;
use serde::de::DeserializeOwned;
use std::path::Path;

/// Parse `path`; when `required` is false and the file does not exist, the
/// defaults.
pub fn load<T: DeserializeOwned + Default>(path: &Path, required: bool) -> Result<T, RpcError> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound && !required => return Ok(T::default()),
        Err(e) => {
            return Err(RpcError::Read {
                path: path.to_path_buf(),
                source: e,
            })
        }
    };
    toml::from_str(&text).map_err(|e| RpcError::Config {
        path: path.to_path_buf(),
        what: e.message().to_string(),
    })
}
