//! The search service: a tantivy index on local disk, fed by the search handler from review and
//! movie events, and the `Search` gRPC API over it.
//!
//! It owns only its index directory. It must not read or write the write service's database nor
//! call the domain API: every change it sees arrives as an event, and applying one twice, or out
//! of order, must leave the same index.

mod api;
#[cfg(test)]
mod fixtures;
mod handler;
mod index;
mod words;

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
pub use api::{DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE, MAX_QUERY_CHARS, mount};
pub use handler::SearchHandler;
pub use index::{IndexError, SearchIndex, SearchPage};
use reelay_delivery::{BuiltHandler, HandlerContext};

/// The search handler's settings.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct SearchSettings {
    /// The search handler's index directory; defaults to `<data-dir>/search`. The index is
    /// local to its process: run one replica per index.
    #[arg(id = "search_dir", long = "search-dir", env = "REELAY_SEARCH_DIR")]
    pub dir: Option<PathBuf>,
}

/// Opens the index and builds the handler, with the Search API to serve beside it.
pub fn build(settings: &SearchSettings, context: &HandlerContext) -> anyhow::Result<BuiltHandler> {
    let dir = settings.dir.clone().unwrap_or_else(|| context.data_dir.join("search"));
    let index =
        SearchIndex::open(&dir).with_context(|| format!("cannot open the search index in {}", dir.display()))?;
    let handler = Arc::new(SearchHandler::new(index.clone()));
    Ok(BuiltHandler { handler, grpc: Some(Box::new(move |server| mount(server, index))) })
}
