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

pub use api::{DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE, MAX_QUERY_CHARS, mount};
pub use handler::SearchHandler;
pub use index::{IndexError, SearchIndex, SearchPage};
