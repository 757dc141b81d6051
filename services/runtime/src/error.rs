//! One small set of error codes for every service, mapped to gRPC status codes in one place.
//!
//! Deliberately a subset of gRPC's codes: each one tells a caller what to do next (fix the
//! request, look elsewhere, retry later, or report a bug).

use std::fmt;

use reelay_domain::ValidationError;
use reelay_outbox::{CommitError, EnqueueError};
use tonic::{Code, Status};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorCode {
    /// The request is malformed; the message names the field.
    InvalidArgument,
    NotFound,
    AlreadyExists,
    /// The caller may not do this to that resource (e.g. edit another user's review).
    PermissionDenied,
    /// The request is valid but the current state forbids it (e.g. following someone who blocked you).
    FailedPrecondition,
    /// Out of a resource that will not come back by retrying at once (disk full).
    ResourceExhausted,
    /// Transient; retry with backoff.
    Unavailable,
    /// A bug or an unexpected fault; the details are in the server log.
    Internal,
}

impl ErrorCode {
    pub fn grpc(self) -> Code {
        match self {
            Self::InvalidArgument => Code::InvalidArgument,
            Self::NotFound => Code::NotFound,
            Self::AlreadyExists => Code::AlreadyExists,
            Self::PermissionDenied => Code::PermissionDenied,
            Self::FailedPrecondition => Code::FailedPrecondition,
            Self::ResourceExhausted => Code::ResourceExhausted,
            Self::Unavailable => Code::Unavailable,
            Self::Internal => Code::Internal,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub struct ServiceError {
    pub code: ErrorCode,
    pub message: String,
}

impl fmt::Display for ServiceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}: {}", self.code, self.message)
    }
}

impl ServiceError {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Self { code, message: message.into() }
    }

    pub fn invalid(field: &str, reason: impl fmt::Display) -> Self {
        Self::new(ErrorCode::InvalidArgument, format!("{field}: {reason}"))
    }

    /// `what` is a noun phrase with the id, e.g. `review 0190…`.
    pub fn not_found(what: impl fmt::Display) -> Self {
        Self::new(ErrorCode::NotFound, format!("{what} not found"))
    }

    pub fn already_exists(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::AlreadyExists, message)
    }

    pub fn permission_denied(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::PermissionDenied, message)
    }

    pub fn failed_precondition(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::FailedPrecondition, message)
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::Internal, message)
    }
}

impl From<ValidationError> for ServiceError {
    fn from(error: ValidationError) -> Self {
        Self::invalid(&error.field, &error.reason)
    }
}

impl From<sqlx::Error> for ServiceError {
    fn from(error: sqlx::Error) -> Self {
        classify_sqlx(&error, true)
    }
}

impl From<EnqueueError> for ServiceError {
    fn from(error: EnqueueError) -> Self {
        // The request's content makes the event too large; the same request can never succeed.
        Self::new(ErrorCode::InvalidArgument, format!("{error}; nothing was written"))
    }
}

impl From<CommitError> for ServiceError {
    fn from(error: CommitError) -> Self {
        match &error {
            // The writer logged the batch's failure once; its jobs do not repeat it.
            CommitError::Storage(inner) => classify_sqlx(inner, false),
            CommitError::RolledBack => {
                Self::new(ErrorCode::Unavailable, "a storage error rolled the write back; nothing was written, retry")
            }
            CommitError::OutcomeUnknown(_) => Self::new(
                ErrorCode::Unavailable,
                "outcome unknown: the commit failed on a storage error and may or may not have been written; \
                     retry with the same request_id to apply it at most once",
            ),
            CommitError::Recovering(fault) => Self::new(
                ErrorCode::Unavailable,
                format!("the database is recovering from a storage fault ({fault}); nothing was written, retry"),
            ),
            CommitError::Closed => Self::new(ErrorCode::Unavailable, "the service is shutting down"),
            CommitError::Panicked => Self::internal("the write failed unexpectedly; nothing was written"),
            CommitError::Failpoint(name) => {
                Self::new(ErrorCode::Unavailable, format!("failpoint {name} fired; nothing was written"))
            }
        }
    }
}

/// SQLite's primary result codes that a caller can act on.
const SQLITE_BUSY: i32 = 5;
const SQLITE_LOCKED: i32 = 6;
const SQLITE_NOMEM: i32 = 7;
const SQLITE_IOERR: i32 = 10;
const SQLITE_FULL: i32 = 13;

/// Maps a database error to what the caller can do about it; `log` says whether this is the
/// first place that sees it.
fn classify_sqlx(error: &sqlx::Error, log: bool) -> ServiceError {
    match reelay_outbox::sqlite_primary_code(error) {
        Some(SQLITE_BUSY | SQLITE_LOCKED) => {
            return ServiceError::new(ErrorCode::Unavailable, "the database is busy; retry");
        }
        Some(SQLITE_FULL) => {
            if log {
                tracing::error!(%error, "database disk is full");
            }
            return ServiceError::new(ErrorCode::ResourceExhausted, "the database disk is full; nothing was written");
        }
        Some(SQLITE_IOERR | SQLITE_NOMEM) => {
            if log {
                tracing::error!(%error, "database storage error");
            }
            return ServiceError::new(
                ErrorCode::Unavailable,
                format!("database storage error ({error}); nothing was written, retry"),
            );
        }
        _ => {}
    }
    if matches!(error, sqlx::Error::PoolTimedOut | sqlx::Error::PoolClosed | sqlx::Error::Io(_)) {
        return ServiceError::new(ErrorCode::Unavailable, format!("database unavailable: {error}"));
    }
    if log {
        tracing::error!(%error, "unexpected database error");
    }
    ServiceError::internal("unexpected database error (see the server log)")
}

impl From<ServiceError> for Status {
    fn from(error: ServiceError) -> Self {
        Status::new(error.code.grpc(), error.message)
    }
}
