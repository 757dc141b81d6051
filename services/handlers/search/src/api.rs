//! The `Search` gRPC API: validate the request (naming the bad field), query the index, page by
//! offset.
//!
//! A page token carries the offset of the next page and a digest of the query it belongs to, so
//! a token is only accepted for the query that issued it.

use reelay_contracts::v1::{self, search_server::SearchServer};
use reelay_domain::validate;
use reelay_kit::{GrpcServer, ServiceError};
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
    let api = SearchApi { index, page_bytes: limit.saturating_sub(PAGE_MARGIN_BYTES) };
    let service = SearchServer::new(api).max_decoding_message_size(limit).max_encoding_message_size(limit);
    server.add_service(service)
}

/// Room an answer keeps under the message limit for what is not a hit (its other fields,
/// framing).
const PAGE_MARGIN_BYTES: usize = 64 * 1024;

struct SearchApi {
    index: SearchIndex,
    /// The most bytes of hits one page carries: a page of large hits (remote reviews of 10,000
    /// wide characters) is cut short, with a next token, rather than be too large to send.
    page_bytes: usize,
}

impl SearchApi {
    /// Cuts `page` to the hits that fit [`Self::page_bytes`] (at least one); whether it cut.
    fn fit<T: prost::Message>(&self, page: &mut SearchPage<T>) -> bool {
        let mut bytes = 0;
        let fits = page
            .hits
            .iter()
            .position(|hit| {
                bytes += hit.encoded_len() + 8;
                bytes > self.page_bytes
            })
            .map_or(page.hits.len(), |over| over.max(1));
        let cut = fits < page.hits.len();
        page.hits.truncate(fits);
        cut
    }
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
        // Pasted text brings tabs and line breaks (U+2028 and U+2029 among them): spaces between
        // words, like any other; and, from right-to-left text, direction marks, which say
        // nothing of the words and go.
        let spaced: String = query
            .chars()
            .filter(|&c| !validate::is_bidi_control(c))
            .map(|c| if matches!(c, '\t' | '\n' | '\r' | '\u{2028}' | '\u{2029}') { ' ' } else { c })
            .collect();
        let query = validate::required_text("query", &spaced, MAX_QUERY_CHARS)?;
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

    /// The token of the page after `page`, empty when `page` is the last one (`cut`: it holds
    /// fewer hits than asked only because more would not fit a message).
    fn next_token<T>(&self, scope: &str, page: &SearchPage<T>, cut: bool) -> String {
        let next = self.offset + page.hits.len();
        if (page.hits.len() < self.size && !cut) || next as u64 >= page.total_hits || next >= MAX_HITS {
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
        let mut found = self.index.search_movies(&page.query, page.offset, page.size).await.map_err(index_failed)?;
        let cut = self.fit(&mut found);
        Ok(Response::new(v1::SearchMoviesResponse {
            next_page_token: page.next_token(SCOPE, &found, cut),
            total_hits: found.total_hits,
            hits: found.hits,
        }))
    }

    async fn search_reviews(&self, request: Request<v1::SearchReviewsRequest>) -> Reply<v1::SearchReviewsResponse> {
        const SCOPE: &str = "reviews";
        let r = request.into_inner();
        let page = PageRequest::parse(SCOPE, &r.query, r.page_size, &r.page_token)?;
        let mut found = self.index.search_reviews(&page.query, page.offset, page.size).await.map_err(index_failed)?;
        let cut = self.fit(&mut found);
        Ok(Response::new(v1::SearchReviewsResponse {
            next_page_token: page.next_token(SCOPE, &found, cut),
            total_hits: found.total_hits,
            hits: found.hits,
        }))
    }
}

#[cfg(test)]
mod tests {
    use tonic::Code;
    use v1::search_server::Search;

    use super::*;
    use crate::fixtures::*;

    fn api(dir: &tempfile::TempDir) -> SearchApi {
        SearchApi { index: SearchIndex::open(dir.path()).unwrap(), page_bytes: 4 * 1024 * 1024 - PAGE_MARGIN_BYTES }
    }

    fn movies(query: &str, page_size: u32, page_token: &str) -> Request<v1::SearchMoviesRequest> {
        Request::new(v1::SearchMoviesRequest { query: query.into(), page_size, page_token: page_token.into() })
    }

    fn reviews(query: &str, page_size: u32, page_token: &str) -> Request<v1::SearchReviewsRequest> {
        Request::new(v1::SearchReviewsRequest { query: query.into(), page_size, page_token: page_token.into() })
    }

    /// The review ids of every page of `query`, `page_size` a page, following the tokens, each
    /// page checked by `check`; and how many pages there were.
    async fn every_page(
        api: &SearchApi,
        query: &str,
        page_size: u32,
        check: impl Fn(&v1::SearchReviewsResponse),
    ) -> (Vec<String>, usize) {
        let (mut seen, mut token, mut pages) = (Vec::new(), String::new(), 0);
        loop {
            let page = api.search_reviews(reviews(query, page_size, &token)).await.unwrap().into_inner();
            check(&page);
            seen.extend(page.hits.into_iter().map(|hit| hit.review_id));
            pages += 1;
            if page.next_page_token.is_empty() {
                return (seen, pages);
            }
            token = page.next_page_token;
        }
    }

    fn assert_invalid(status: Status, field: &str) {
        assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
        assert!(status.message().starts_with(&format!("{field}: ")), "{status:?}");
    }

    #[tokio::test]
    async fn bad_requests_name_the_field() {
        let dir = tempfile::tempdir().unwrap();
        let api = api(&dir);
        let long = "x".repeat(MAX_QUERY_CHARS + 1);
        for (query, page_size, page_token, field) in [
            ("", 0, "", "query"),
            ("   ", 0, "", "query"),
            (long.as_str(), 0, "", "query"),
            ("heat\u{7}", 0, "", "query"),
            ("heat", MAX_PAGE_SIZE + 1, "", "page_size"),
            ("heat", 0, "garbage", "page_token"),
            ("heat", 0, "20.0000000000000000", "page_token"),
            ("heat", 0, &format!("20.{}", digest("movies", "alien")), "page_token"),
            ("heat", 0, &format!("0.{}", digest("movies", "heat")), "page_token"),
            ("heat", 0, &format!("{MAX_HITS}.{}", digest("movies", "heat")), "page_token"),
        ] {
            assert_invalid(api.search_movies(movies(query, page_size, page_token)).await.unwrap_err(), field);
            assert_invalid(api.search_reviews(reviews(query, page_size, page_token)).await.unwrap_err(), field);
        }
        assert!(api.search_movies(movies(&"x".repeat(MAX_QUERY_CHARS), MAX_PAGE_SIZE, "")).await.is_ok());
        // Pasted with a tab and a line break: spaces, not refused.
        assert!(api.search_reviews(reviews("heat\tdiner\r\nscene", 0, "")).await.is_ok());
        // Line separators and direction marks from pasted right-to-left text.
        assert!(api.search_reviews(reviews("\u{202B}היט\u{202C}\u{2028}heat", 0, "")).await.is_ok());
        assert_invalid(api.search_reviews(reviews("\t\n", 0, "")).await.unwrap_err(), "query");

        // A movies token is not a reviews token for the same query.
        let token = format!("20.{}", digest("movies", "heat"));
        assert!(api.search_movies(movies("heat", 0, &token)).await.is_ok());
        assert_invalid(api.search_reviews(reviews("heat", 0, &token)).await.unwrap_err(), "page_token");
    }

    #[tokio::test]
    async fn pages_are_disjoint_and_cover_every_hit() {
        let dir = tempfile::tempdir().unwrap();
        let api = api(&dir);
        let events: Vec<_> = (0..23)
            .map(|n| review_logged(&format!("r{n:02}"), 100, "Heat", &format!("take {n} of the diner scene")))
            .collect();
        for result in api.index.apply(&events.iter().collect::<Vec<_>>()).await {
            result.unwrap();
        }

        let (mut seen, pages) = every_page(&api, " diner ", 10, |page| assert_eq!(page.total_hits, 23)).await;
        seen.sort();
        let expected: Vec<String> = (0..23).map(|n| format!("r{n:02}")).collect();
        assert_eq!((pages, seen), (3, expected));

        // The default page size, and an exactly full last page has no next page.
        let page = api.search_reviews(reviews("diner", 0, "")).await.unwrap().into_inner();
        assert_eq!(page.hits.len(), DEFAULT_PAGE_SIZE as usize);
        let page = api.search_reviews(reviews("diner", 23, "")).await.unwrap().into_inner();
        assert_eq!((page.hits.len(), page.next_page_token.as_str()), (23, ""));
    }

    /// Hits too large for one message together come over more pages than asked, each within
    /// the budget, none lost or repeated.
    #[tokio::test]
    async fn a_page_of_large_hits_is_cut_to_fit_a_message() {
        let dir = tempfile::tempdir().unwrap();
        let mut api = api(&dir);
        api.page_bytes = 100 * 1024;
        let wide = "\u{1F3AC}".repeat(10_000); // 40,000 bytes
        let events: Vec<_> =
            (0..7).map(|n| review_logged(&format!("r{n}"), 100, "Heat", &format!("diner {wide}"))).collect();
        for result in api.index.apply(&events.iter().collect::<Vec<_>>()).await {
            result.unwrap();
        }
        let (mut seen, pages) = every_page(&api, "diner", 100, |page| {
            assert!(prost::Message::encoded_len(page) <= 100 * 1024 + PAGE_MARGIN_BYTES);
            assert!(!page.hits.is_empty());
        })
        .await;
        seen.sort();
        assert_eq!(seen, (0..7).map(|n| format!("r{n}")).collect::<Vec<_>>());
        assert_eq!(pages, 4, "two 40 KB hits a page");
    }

    #[tokio::test]
    async fn no_hits_is_an_empty_last_page() {
        let dir = tempfile::tempdir().unwrap();
        let api = api(&dir);
        let page = api.search_movies(movies("heat", 0, "")).await.unwrap().into_inner();
        assert_eq!(page, v1::SearchMoviesResponse::default());
    }
}
