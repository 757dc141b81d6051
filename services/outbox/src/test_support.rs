//! What the crate's tests share.

use crate::CommitError;

/// A write job's error in tests: what the writer or a statement said.
#[derive(Debug)]
#[allow(dead_code, reason = "shown by Debug when a test fails")]
pub enum TestError {
    Commit(CommitError),
    Sql(sqlx::Error),
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
