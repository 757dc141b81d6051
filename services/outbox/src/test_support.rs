//! What the crate's tests share.

use crate::{CommitError, EnqueueError};

/// A write job's error in tests: its own refusal, or what the writer, a statement or an enqueue
/// said.
#[derive(Debug)]
#[allow(dead_code, reason = "shown by Debug when a test fails")]
pub enum TestError {
    Refused,
    Commit(CommitError),
    Sql(sqlx::Error),
    Enqueue(EnqueueError),
}

impl From<CommitError> for TestError {
    fn from(error: CommitError) -> Self {
        Self::Commit(error)
    }
}

impl From<sqlx::Error> for TestError {
    fn from(error: sqlx::Error) -> Self {
        Self::Sql(error)
    }
}

impl From<EnqueueError> for TestError {
    fn from(error: EnqueueError) -> Self {
        Self::Enqueue(error)
    }
}
