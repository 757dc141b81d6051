//! One small set of error codes for every service, mapped to gRPC status codes in one place.
//!
//! Deliberately a subset of gRPC's codes: each one tells a caller what to do next (fix the
//! request, look elsewhere, retry later, or report a bug). Each crate keeps its own error type
//! and implements [`ServiceErrorCode`] for it, so its gRPC edge maps it with [`grpc_status`]
//! once; [`ServiceError`] is the plain code-and-message error for refusals a service decides
//! itself. This module knows no crate's error type (no storage, no broker).

use std::fmt;

use reelay_domain::ValidationError;
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

/// An error a service can answer a call with: its code says what the caller should do next.
/// `Display` is what logs show.
pub trait ServiceErrorCode: fmt::Display {
    fn error_code(&self) -> ErrorCode;

    /// What the caller is told; the error's `Display` unless the type says otherwise.
    fn client_message(&self) -> String {
        self.to_string()
    }
}

/// Logs show the code with the message; the caller gets the code in the status instead.
impl ServiceErrorCode for ServiceError {
    fn error_code(&self) -> ErrorCode {
        self.code
    }

    fn client_message(&self) -> String {
        self.message.clone()
    }
}

/// The longest message a caller is told, in bytes. A message may quote what the caller sent
/// (a malformed id, a date), and the message travels in a header: a 20 KB quote made the
/// answer a protocol error the client could not read, instead of the refusal.
pub const MAX_CLIENT_MESSAGE_BYTES: usize = 2048;

/// The gRPC answer for `error`: its code, and the message the caller is told (cut to
/// [`MAX_CLIENT_MESSAGE_BYTES`]).
pub fn grpc_status<E: ServiceErrorCode>(error: &E) -> Status {
    let mut message = error.client_message();
    if message.len() > MAX_CLIENT_MESSAGE_BYTES {
        let mut end = MAX_CLIENT_MESSAGE_BYTES - "… (cut)".len();
        while !message.is_char_boundary(end) {
            end -= 1;
        }
        message.truncate(end);
        message.push_str("… (cut)");
    }
    Status::new(error.error_code().grpc(), message)
}

impl From<ValidationError> for ServiceError {
    fn from(error: ValidationError) -> Self {
        Self::invalid(&error.field, &error.reason)
    }
}

impl From<ServiceError> for Status {
    fn from(error: ServiceError) -> Self {
        grpc_status(&error)
    }
}
