//! The core's one error type. Bad input names the offending field; a broken
//! invariant is a bug in the core and says which invariant.

use thiserror::Error;

use crate::request::RequestId;

#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum CoreError {
    /// An argument is out of range or inconsistent; `field` names it.
    #[error("{field}: {message}")]
    InvalidArgument {
        field: &'static str,
        message: String,
    },
    #[error("req_id: duplicate request id {0}")]
    DuplicateRequest(RequestId),
    #[error("req_id: unknown request id {0}")]
    UnknownRequest(RequestId),
    /// A call made out of order (e.g. `update` without a pending `schedule`).
    #[error("call order: {0}")]
    InvalidCallOrder(&'static str),
    /// The core's bookkeeping is inconsistent: a bug, never the caller's fault.
    #[error("invariant broken: {0}")]
    InvariantViolation(String),
}

impl CoreError {
    pub fn invalid(field: &'static str, message: impl Into<String>) -> Self {
        CoreError::InvalidArgument {
            field,
            message: message.into(),
        }
    }
}

pub type Result<T> = std::result::Result<T, CoreError>;
