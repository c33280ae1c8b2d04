//! The plugin's arguments from plugstack.conf:
//!
//! ```text
//! required /usr/local/lib/libcr_spank.so cr_run=/usr/local/bin/cr_run socket=/run/cr/agent.sock
//! ```
//!
//! | argument | default | meaning |
//! | --- | --- | --- |
//! | `cr_run=PATH` | `/usr/local/bin/cr_run` | the cr_run that tasks run under |
//! | `socket=PATH` | `/run/cr/agent.sock` | the node's agent; `%n` is replaced by the node's name |
//! | `dir=PATH` | none | default of `--checkpoint-dir` (`%j`: the job id) |
//! | `cr_restart=PATH` | `/usr/local/bin/cr_restart` | what `--restart-from` runs |
//! | `signal=SIG` | `USR1` | the batch script's cr_run checkpoints the job (into its `--checkpoint-dir`) and stops it on SIG |
//! | `cr_rsh=PATH` | `/usr/local/bin/cr_rsh` | what a task of an srun step relays through to its stand-in |
//! | `srun_dir=DIR` | `/usr/local/lib/cr/srun` | a directory whose `srun` is `cr_srun`, put first on a checkpointable batch script's PATH (none there: its srun steps run as they are) |

use std::path::PathBuf;

/// Bad plugin arguments.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("plugstack.conf argument {0:?} is not KEY=VALUE")]
    NotKeyValue(String),
    #[error(
        "unknown plugstack.conf argument {0:?} (known: cr_run, cr_restart, cr_rsh, srun_dir, socket, dir, signal)"
    )]
    Unknown(String),
}

/// The plugin's configuration (see the module docs).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Config {
    pub cr_run: PathBuf,
    pub cr_restart: PathBuf,
    pub cr_rsh: PathBuf,
    /// Holds `srun`, the stand-in (`cr_srun`) of the batch script's srun.
    pub srun_dir: PathBuf,
    /// The signal on which a batch job is checkpointed and stopped.
    pub signal: String,
    /// The agent's socket, `%n` not yet replaced.
    pub socket: String,
    pub dir: Option<String>,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            cr_run: PathBuf::from("/usr/local/bin/cr_run"),
            cr_restart: PathBuf::from("/usr/local/bin/cr_restart"),
            cr_rsh: PathBuf::from("/usr/local/bin/cr_rsh"),
            srun_dir: PathBuf::from("/usr/local/lib/cr/srun"),
            signal: "USR1".into(),
            socket: "/run/cr/agent.sock".into(),
            dir: None,
        }
    }
}

impl Config {
    /// Parses the plugstack.conf arguments.
    pub fn parse(args: &[String]) -> Result<Config, ConfigError> {
        let mut c = Config::default();
        for a in args {
            let (k, v) = a
                .split_once('=')
                .ok_or_else(|| ConfigError::NotKeyValue(a.clone()))?;
            match k {
                "cr_run" => c.cr_run = PathBuf::from(v),
                "cr_restart" => c.cr_restart = PathBuf::from(v),
                "cr_rsh" => c.cr_rsh = PathBuf::from(v),
                "srun_dir" => c.srun_dir = PathBuf::from(v),
                "signal" => c.signal = v.to_string(),
                "socket" => c.socket = v.to_string(),
                "dir" => c.dir = Some(v.to_string()),
                _ => return Err(ConfigError::Unknown(a.clone())),
            }
        }
        Ok(c)
    }

    /// The agent's socket on node `node`.
    pub fn socket_of(&self, node: &str) -> PathBuf {
        PathBuf::from(self.socket.replace("%n", node))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_arguments_and_node_names() {
        let c = Config::parse(&["socket=/x/%n.sock".into(), "cr_run=/bin/cr_run".into()])
            .expect("valid");
        assert_eq!(c.socket_of("n2"), PathBuf::from("/x/n2.sock"));
        assert_eq!(c.cr_run, PathBuf::from("/bin/cr_run"));
        assert!(matches!(
            Config::parse(&["bogus".into()]),
            Err(ConfigError::NotKeyValue(_))
        ));
        assert!(matches!(
            Config::parse(&["x=1".into()]),
            Err(ConfigError::Unknown(_))
        ));
    }
}
