//! `reelay reviews log`: log a film (found by title and year, created when new) with a rating
//! and a review.

use clap::{Args, Subcommand};
use reelay_contracts::v1::{self, reviews_client::ReviewsClient};

use super::{ClientArgs, UserAndFilm, keyed_write, movie_by_title, outln, request_id_or_new};

#[derive(Debug, Subcommand)]
pub enum ReviewsCommand {
    /// Log a film you watched.
    Log(LogArgs),
}

#[derive(Debug, Args)]
pub struct LogArgs {
    #[command(flatten)]
    pub film: UserAndFilm,

    /// Stars, 0.5 to 5 in steps of 0.5; unrated when not given.
    #[arg(long, value_parser = parse_stars)]
    pub stars: Option<u32>,

    /// What you thought.
    #[arg(long, default_value = "")]
    pub review: String,

    /// When you watched it, YYYY-MM-DD.
    #[arg(long, default_value = "")]
    pub watched_on: String,

    #[arg(long)]
    pub rewatch: bool,

    /// The write's idempotency key (a new one when not given): the same command with the same
    /// key logs the film at most once, and answers with that review.
    #[arg(long)]
    pub request_id: Option<String>,

    #[command(flatten)]
    pub client: ClientArgs,
}

/// "4.5" stars → 9 half stars (Letterboxd's scale, read the same way as its exports).
fn parse_stars(text: &str) -> Result<u32, String> {
    reelay_domain::letterboxd::parse_stars(text)
        .filter(|half| *half > 0)
        .ok_or_else(|| format!("stars must be 0.5 to 5 in steps of 0.5, got {text:?}"))
}

pub async fn run(command: ReviewsCommand) -> anyhow::Result<()> {
    let ReviewsCommand::Log(args) = command;
    let reviews = ReviewsClient::new(args.client.write()?);
    let movie = movie_by_title(&args.film.movie, args.film.year);
    let request_id = request_id_or_new(args.request_id);
    let request = v1::LogReviewRequest {
        actor_user_id: args.film.user,
        movie: Some(movie),
        rating: args.stars.unwrap_or(0),
        body: args.review,
        watched_on: args.watched_on,
        rewatch: args.rewatch,
        request_id: request_id.clone(),
    };
    let logged = keyed_write("reviews log", &request_id, || {
        let (mut reviews, request) = (reviews.clone(), request.clone());
        async move { reviews.log_review(request).await }
    })
    .await?;
    let review = logged.review.unwrap_or_default();
    let new = if logged.movie_created { " (a film new to Reelay)" } else { "" };
    outln!("logged {} ({}){new}: review {}", args.film.movie, args.film.year, review.review_id);
    Ok(())
}
