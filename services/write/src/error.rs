//! The write service's error: what went wrong, kept as the error that said so (a refusal of
//! the service's own, a failed statement, a commit the writer could not make, an event too large
//! to deliver), and mapped once for the caller through [`ServiceErrorCode`].
//!
//! SQLite's faults are classified here, in the one service that touches the database: a full
//! disk is RESOURCE_EXHAUSTED, a busy database, an I/O error or an unreachable pool UNAVAILABLE
//! ("…nothing was written, retry"), anything else INTERNAL with the details in the log.

use std::fmt;

use reelay_domain::ValidationError;
use reelay_kit::{ErrorCode, ServiceError, ServiceErrorCode, grpc_status};
use reelay_outbox::{CommitError, EnqueueError};
use tonic::Status;

#[derive(Debug)]
pub enum WriteError {
    /// Refused by the service itself: bad input, a missing or forbidden thing.
    Service(ServiceError),
    /// A statement of the write job failed. Logged when it was raised, if the caller cannot act
    /// on it.
    Storage(sqlx::Error),
    /// The write did not commit, for a reason outside the job. The writer logged the batch's
    /// failure once; its jobs do not repeat it.
    Commit(CommitError),
    /// An event the write raises could never be delivered.
    Enqueue(EnqueueError),
}

impl WriteError {
    /// What the caller is told.
    pub(crate) fn answer(&self) -> ServiceError {
        match self {
            Self::Service(error) => error.clone(),
            Self::Storage(error) => storage_answer(error),
            // The request's content makes the event too large; the same request can never succeed.
            Self::Enqueue(error) => {
                ServiceError::new(ErrorCode::InvalidArgument, format!("{error}; nothing was written"))
            }
            Self::Commit(error) => commit_answer(error),
        }
    }
}

/// Logs show the code with the message the caller gets, as for [`ServiceError`].
impl fmt::Display for WriteError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.answer(), f)
    }
}

impl std::error::Error for WriteError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Service(error) => Some(error),
            Self::Storage(error) => Some(error),
            Self::Commit(error) => Some(error),
            Self::Enqueue(error) => Some(error),
        }
    }
}

impl ServiceErrorCode for WriteError {
    fn error_code(&self) -> ErrorCode {
        self.answer().code
    }

    fn client_message(&self) -> String {
        self.answer().message
    }
}

impl From<WriteError> for Status {
    fn from(error: WriteError) -> Self {
        grpc_status(&error)
    }
}

impl From<ServiceError> for WriteError {
    fn from(error: ServiceError) -> Self {
        Self::Service(error)
    }
}

impl From<ValidationError> for WriteError {
    fn from(error: ValidationError) -> Self {
        Self::Service(error.into())
    }
}

/// A statement of the job failed: this is the first place that sees the error, so a fault the
/// caller cannot act on is logged here.
impl From<sqlx::Error> for WriteError {
    fn from(error: sqlx::Error) -> Self {
        match StorageFault::of(&error) {
            StorageFault::DiskFull => tracing::error!(%error, "database disk is full"),
            StorageFault::Io => tracing::error!(%error, "database storage error"),
            StorageFault::Unexpected => tracing::error!(%error, "unexpected database error"),
            StorageFault::Busy | StorageFault::Unavailable => {}
        }
        Self::Storage(error)
    }
}

impl From<CommitError> for WriteError {
    fn from(error: CommitError) -> Self {
        Self::Commit(error)
    }
}

impl From<EnqueueError> for WriteError {
    fn from(error: EnqueueError) -> Self {
        Self::Enqueue(error)
    }
}

fn commit_answer(error: &CommitError) -> ServiceError {
    match error {
        CommitError::Storage(inner) => storage_answer(inner),
        CommitError::RolledBack => ServiceError::new(
            ErrorCode::Unavailable,
            "a storage error rolled the write back; nothing was written, retry",
        ),
        CommitError::OutcomeUnknown(_) => ServiceError::new(
            ErrorCode::Unavailable,
            "outcome unknown: the commit failed on a storage error and may or may not have been written; \
                 retry (a write that creates something: with the same request_id, to apply it at most once)",
        ),
        CommitError::Recovering(fault) => ServiceError::new(
            ErrorCode::Unavailable,
            format!("the database is recovering from a storage fault ({fault}); nothing was written, retry"),
        ),
        CommitError::Closed => ServiceError::new(ErrorCode::Unavailable, "the service is shutting down"),
        CommitError::Panicked => ServiceError::internal("the write failed unexpectedly; nothing was written"),
        CommitError::Failpoint(name) => {
            ServiceError::new(ErrorCode::Unavailable, format!("failpoint {name} fired; nothing was written"))
        }
    }
}

/// SQLite's primary result codes that a caller can act on.
const SQLITE_BUSY: i32 = 5;
const SQLITE_LOCKED: i32 = 6;
const SQLITE_NOMEM: i32 = 7;
const SQLITE_IOERR: i32 = 10;
const SQLITE_FULL: i32 = 13;

/// What a database error means for the caller.
enum StorageFault {
    /// Another writer holds the file: retry.
    Busy,
    DiskFull,
    /// An I/O error or out of memory: nothing was written; retry.
    Io,
    /// The pool or the file could not be reached: retry.
    Unavailable,
    /// Anything else: a bug, whose details go to the log.
    Unexpected,
}

impl StorageFault {
    fn of(error: &sqlx::Error) -> Self {
        match reelay_outbox::sqlite_primary_code(error) {
            Some(SQLITE_BUSY | SQLITE_LOCKED) => Self::Busy,
            Some(SQLITE_FULL) => Self::DiskFull,
            Some(SQLITE_IOERR | SQLITE_NOMEM) => Self::Io,
            _ if matches!(error, sqlx::Error::PoolTimedOut | sqlx::Error::PoolClosed | sqlx::Error::Io(_)) => {
                Self::Unavailable
            }
            _ => Self::Unexpected,
        }
    }
}

fn storage_answer(error: &sqlx::Error) -> ServiceError {
    match StorageFault::of(error) {
        StorageFault::Busy => ServiceError::new(ErrorCode::Unavailable, "the database is busy; retry"),
        StorageFault::DiskFull => {
            ServiceError::new(ErrorCode::ResourceExhausted, "the database disk is full; nothing was written")
        }
        StorageFault::Io => ServiceError::new(
            ErrorCode::Unavailable,
            format!("database storage error ({error}); nothing was written, retry"),
        ),
        StorageFault::Unavailable => {
            ServiceError::new(ErrorCode::Unavailable, format!("database unavailable: {error}"))
        }
        StorageFault::Unexpected => ServiceError::internal("unexpected database error (see the server log)"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_caller_gets_the_message_and_logs_get_the_code() {
        let error = WriteError::from(ServiceError::not_found("user 1"));
        let status = Status::from(WriteError::from(ServiceError::not_found("user 1")));
        assert_eq!((status.code(), status.message()), (tonic::Code::NotFound, "user 1 not found"));
        assert_eq!(error.to_string(), "NotFound: user 1 not found");
    }

    #[test]
    fn storage_faults_say_what_to_do() {
        let status = Status::from(WriteError::from(sqlx::Error::PoolTimedOut));
        assert_eq!(status.code(), tonic::Code::Unavailable);
        assert!(status.message().starts_with("database unavailable: "), "{}", status.message());
        let status = Status::from(WriteError::from(CommitError::RolledBack));
        assert_eq!(status.code(), tonic::Code::Unavailable);
        assert!(status.message().contains("nothing was written"), "{}", status.message());
        let status = Status::from(WriteError::from(sqlx::Error::RowNotFound));
        assert_eq!(
            (status.code(), status.message()),
            (tonic::Code::Internal, "unexpected database error (see the server log)")
        );
    }
}
