//! The `Search` gRPC API: validate the request (naming the bad field), query the index, page by
//! offset.
//!
//! A page token carries the offset of the next page and a digest of the query it belongs to, so
//! a token is only accepted for the query that issued it.

use reelay_contracts::v1::{self, search_server::SearchServer};
use reelay_domain::validate;
use reelay_runtime::{GrpcServer, ServiceError};
use tonic::{Request, Response, Status};

use crate::{IndexError, SearchIndex, SearchPage};

pub const DEFAULT_PAGE_SIZE: u32 = 20;
pub const MAX_PAGE_SIZE: u32 = 100;
pub const MAX_QUERY_CHARS: usize = 500;
/// Paging stops here: every page skips its offset's hits again, so deep pages cost more and more
/// while a person refines the query long before.
const MAX_HITS: usize = 10_000;

type Reply<T> = Result<Response<T>, Status>;

/// Mounts the `Search` service on `server`, with the server's message-size limit.
pub fn mount(server: GrpcServer, index: SearchIndex) -> GrpcServer {
    let limit = server.config().max_message_bytes;
    let service =
        SearchServer::new(SearchApi { index }).max_decoding_message_size(limit).max_encoding_message_size(limit);
    server.add_service(service)
}

struct SearchApi {
    index: SearchIndex,
}

/// A validated search request.
struct PageRequest {
    query: String,
    offset: usize,
    size: usize,
}

impl PageRequest {
    /// `scope` separates the tokens of the two methods.
    fn parse(scope: &str, query: &str, page_size: u32, page_token: &str) -> Result<Self, ServiceError> {
        let query = validate::required_text("query", query, MAX_QUERY_CHARS)?;
        let size = match page_size {
            0 => DEFAULT_PAGE_SIZE,
            1..=MAX_PAGE_SIZE => page_size,
            _ => {
                return Err(ServiceError::invalid(
                    "page_size",
                    format!("must be at most {MAX_PAGE_SIZE}, got {page_size}"),
                ));
            }
        } as usize;
        let offset = if page_token.is_empty() { 0 } else { token_offset(page_token, &digest(scope, &query))? };
        Ok(Self { query, offset, size: size.min(MAX_HITS - offset) })
    }

    /// The token of the page after `page`, empty when `page` is the last one.
    fn next_token<T>(&self, scope: &str, page: &SearchPage<T>) -> String {
        let next = self.offset + page.hits.len();
        if page.hits.len() < self.size || next as u64 >= page.total_hits || next >= MAX_HITS {
            return String::new();
        }
        format!("{next}.{}", digest(scope, &self.query))
    }
}

fn token_offset(token: &str, digest: &str) -> Result<usize, ServiceError> {
    let not_ours =
        || ServiceError::invalid("page_token", format!("{token:?} is not a token this service issued for this query"));
    let (offset, token_digest) = token.split_once('.').ok_or_else(not_ours)?;
    let offset: usize = offset.parse().map_err(|_| not_ours())?;
    if token_digest != digest || offset == 0 || offset >= MAX_HITS {
        return Err(not_ours());
    }
    Ok(offset)
}

/// FNV-1a: stable across builds and processes, unlike std's hasher, so a token outlives a deploy.
fn digest(scope: &str, query: &str) -> String {
    let hash = [scope.as_bytes(), &[0], query.as_bytes()]
        .concat()
        .iter()
        .fold(0xcbf2_9ce4_8422_2325_u64, |hash, byte| (hash ^ u64::from(*byte)).wrapping_mul(0x0100_0000_01b3));
    format!("{hash:016x}")
}

fn index_failed(error: IndexError) -> ServiceError {
    tracing::error!(%error, "search failed");
    ServiceError::internal("the search failed (see the server log)")
}

#[tonic::async_trait]
impl v1::search_server::Search for SearchApi {
    async fn search_movies(&self, request: Request<v1::SearchMoviesRequest>) -> Reply<v1::SearchMoviesResponse> {
        const SCOPE: &str = "movies";
        let r = request.into_inner();
        let page = PageRequest::parse(SCOPE, &r.query, r.page_size, &r.page_token)?;
        let found = self.index.search_movies(&page.query, page.offset, page.size).await.map_err(index_failed)?;
        Ok(Response::new(v1::SearchMoviesResponse {
            next_page_token: page.next_token(SCOPE, &found),
            total_hits: found.total_hits,
            hits: found.hits,
        }))
    }

    async fn search_reviews(&self, request: Request<v1::SearchReviewsRequest>) -> Reply<v1::SearchReviewsResponse> {
        const SCOPE: &str = "reviews";
        let r = request.into_inner();
        let page = PageRequest::parse(SCOPE, &r.query, r.page_size, &r.page_token)?;
        let found = self.index.search_reviews(&page.query, page.offset, page.size).await.map_err(index_failed)?;
        Ok(Response::new(v1::SearchReviewsResponse {
            next_page_token: page.next_token(SCOPE, &found),
            total_hits: found.total_hits,
            hits: found.hits,
        }))
    }
}
