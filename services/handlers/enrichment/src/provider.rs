//! What a metadata provider answers, behind one trait: TMDB over HTTP, or the offline catalog.

use std::time::Duration;

use reelay_contracts::v1;

/// What to look a film up by: its provider id when known, else its title and year.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MovieQuery {
    /// `tmdb:949`, `imdb:tt0113277` or `wikidata:Q42198`, when the movie has one.
    pub external_id: Option<String>,
    pub title: String,
    pub year: i32,
}

impl MovieQuery {
    /// How the query reads in logs and in a "not found" record.
    pub fn describe(&self) -> String {
        match &self.external_id {
            Some(id) => format!("{id} ({} {})", self.title, self.year),
            None => format!("{:?} ({})", self.title, self.year),
        }
    }
}

/// Why a provider could not answer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProviderError {
    /// Worth retrying: a timeout, an internal error of the provider.
    #[error("{0}")]
    Retryable(String),
    /// The provider cannot answer any question now (unreachable, overloaded, out of its rate
    /// limit; `after`: when it asks to be asked again): the handler's events are held until it
    /// answers.
    #[error("{message}")]
    Unavailable { message: String, after: Option<Duration> },
    /// Retrying cannot help (a bad key, a malformed answer).
    #[error("{0}")]
    Permanent(String),
}

impl ProviderError {
    pub fn retryable(message: impl Into<String>) -> Self {
        Self::Retryable(message.into())
    }

    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::Unavailable { message: message.into(), after: None }
    }

    /// How much retrying may help: none, after a while, or once the provider is back.
    pub fn rank(&self) -> u8 {
        match self {
            Self::Permanent(_) => 0,
            Self::Retryable(_) => 1,
            Self::Unavailable { .. } => 2,
        }
    }
}

#[async_trait::async_trait]
pub trait MetadataProvider: Send + Sync + 'static {
    /// The provider's name, as profiles record it (`tmdb`, `catalog`).
    fn name(&self) -> &'static str;

    /// The film's profile, or `None` when the provider does not know it.
    async fn movie(&self, query: &MovieQuery) -> Result<Option<v1::MovieProfile>, ProviderError>;

    /// A person's profile by the id a credit carried, or `None` when unknown.
    async fn person(&self, person_id: &str) -> Result<Option<v1::Person>, ProviderError>;
}
