//! Errors of a restore, each naming the resource.

use cr_sys::SysError;

#[derive(Debug, thiserror::Error)]
pub enum RestoreError {
    #[error(transparent)]
    Image(#[from] cr_image::ImageError),
    #[error(transparent)]
    Clone(#[from] cr_sys::clone::CloneError),
    #[error(transparent)]
    Sys(#[from] SysError),
    #[error("{what}")]
    Step {
        what: String,
        #[source]
        source: SysError,
    },
    #[error("this CPU lacks features the image uses (XCR0 bits {missing:#x} missing)")]
    CpuFeatures { missing: u64 },
    #[error("the vDSO layout of this kernel differs from the image's: {0}")]
    VdsoLayout(String),
    #[error("process {pid} of the image runs as uid {uid} or holds capabilities; only root or that user may restore it (you are uid {caller})")]
    NotYours { pid: u32, uid: u32, caller: u32 },
    #[error("image is not supported by this build: {0}")]
    Unsupported(String),
    #[error("{0} is a pre-dump (memory only, taken while the processes ran); restore the checkpoint made with --parent {0}")]
    PreDump(std::path::PathBuf),
    #[error("restored process {pid} could not be waited for")]
    Wait {
        pid: i32,
        #[source]
        source: cr_sys::Errno,
    },
}

/// Attach a description of the step to a low-level error.
pub trait StepContext<T> {
    fn step(self, what: impl FnOnce() -> String) -> Result<T, RestoreError>;
}

impl<T> StepContext<T> for Result<T, SysError> {
    fn step(self, what: impl FnOnce() -> String) -> Result<T, RestoreError> {
        self.map_err(|source| RestoreError::Step {
            what: what(),
            source,
        })
    }
}
