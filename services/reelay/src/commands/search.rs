//! `reelay search reviews <query>`: full-text search over reviews, served by the handlers
//! service that hosts the search handler (`REELAY_HANDLERS_URL`, else the one
//! `REELAY_HANDLERS_ADDR` implies). A review is searchable once the search handler has applied
//! its event, a moment after it was logged.

use clap::{Args, Subcommand};
use reelay_contracts::v1::{self, search_client::SearchClient};

use super::{ClientArgs, HANDLERS_SERVICE, call_failed_at, outln, url_of_addr};

#[derive(Debug, Subcommand)]
pub enum SearchCommand {
    /// Search reviews' text.
    Reviews(ReviewsArgs),
}

#[derive(Debug, Args)]
pub struct ReviewsArgs {
    /// Words to look for.
    pub query: String,

    /// At most this many hits (1..=100).
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u32).range(1..=100))]
    pub limit: u32,

    /// The handlers service hosting the search handler; defaults to
    /// `http://<REELAY_HANDLERS_ADDR>` as the services read it (an unspecified address as
    /// loopback), else http://127.0.0.1:50052.
    #[arg(long, env = "REELAY_HANDLERS_URL")]
    pub handlers_url: Option<String>,

    /// Where the handlers service listens, when it was started with REELAY_HANDLERS_ADDR (read
    /// for the default of --handlers-url only).
    #[arg(long, env = "REELAY_HANDLERS_ADDR", hide = true)]
    pub handlers_addr: Option<String>,

    #[command(flatten)]
    pub client: ClientArgs,
}

pub async fn run(command: SearchCommand) -> anyhow::Result<()> {
    let SearchCommand::Reviews(args) = command;
    let url = match &args.handlers_url {
        Some(url) => url.clone(),
        None => url_of_addr(args.handlers_addr.as_deref(), HANDLERS_SERVICE)?,
    };
    let mut search = SearchClient::new(args.client.channel_to(&url, "--handlers-url (REELAY_HANDLERS_URL)")?);
    let found = search
        .search_reviews(v1::SearchReviewsRequest {
            query: args.query,
            page_size: args.limit,
            page_token: String::new(),
        })
        .await
        .map_err(|s| call_failed_at("search reviews", s, HANDLERS_SERVICE))?
        .into_inner();
    outln!("{} review(s) found", found.total_hits);
    for hit in &found.hits {
        let stars = if hit.rating == 0 { "unrated".to_owned() } else { format!("{}★", f64::from(hit.rating) / 2.0) };
        let author = if hit.remote { hit.actor_uri.as_str() } else { hit.user_id.as_str() };
        // One line per hit: a review's own line breaks are shown as spaces.
        let body = hit.body.split_whitespace().collect::<Vec<_>>().join(" ");
        outln!("{} ({}) {stars} by {author}: {body}", hit.movie_title, hit.movie_year);
    }
    if found.total_hits > found.hits.len() as u64 {
        outln!("({} of {} shown; raise --limit, at most 100)", found.hits.len(), found.total_hits);
    }
    Ok(())
}
