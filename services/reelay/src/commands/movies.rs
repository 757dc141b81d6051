//! `reelay movies show`: a film as Reelay knows it, with what enrichment added (runtime, genres,
//! directors, cast), or that enrichment is still to come or found nothing.

use clap::{Args, Subcommand};
use reelay_contracts::v1::{self, movies_client::MoviesClient};

use super::{ClientArgs, UserAndFilm, call_failed, outln};

#[derive(Debug, Subcommand)]
pub enum MoviesCommand {
    /// Show a film (found by title and year, created when new) and its enrichment.
    Show(ShowArgs),
}

#[derive(Debug, Args)]
pub struct ShowArgs {
    #[command(flatten)]
    pub film: UserAndFilm,

    #[command(flatten)]
    pub client: ClientArgs,
}

pub async fn run(command: MoviesCommand) -> anyhow::Result<()> {
    let MoviesCommand::Show(args) = command;
    let mut movies = MoviesClient::new(args.client.write()?);
    let discovered = movies
        .discover_movie(v1::DiscoverMovieRequest {
            actor_user_id: args.film.user,
            title: args.film.movie,
            year: args.film.year,
            ..Default::default()
        })
        .await
        .map_err(|s| call_failed("movies show", s))?
        .into_inner();
    let movie = discovered.movie.unwrap_or_default();
    outln!("{} ({}) — movie {}", movie.title, movie.year, movie.movie_id);
    match (movie.enrichment(), movie.profile) {
        (v1::EnrichmentStatus::Enriched, Some(p)) => {
            let names = |credits: &[v1::PersonCredit], n: usize| {
                credits.iter().take(n).map(|c| c.name.as_str()).collect::<Vec<_>>().join(", ")
            };
            outln!("  runtime    {} min", p.runtime_minutes);
            outln!("  genres     {}", p.genres.join(", "));
            outln!("  directed   {}", names(&p.directors, 5));
            outln!("  cast       {}", names(&p.cast, 6));
            if !p.poster_url.is_empty() {
                outln!("  poster     {}", p.poster_url);
            }
            outln!("  source     {} {}", p.provider, p.provider_id);
        }
        (v1::EnrichmentStatus::NotFound, _) => outln!("  the metadata provider does not know this film"),
        _ => outln!("  not enriched yet (a moment after it is first seen)"),
    }
    Ok(())
}
