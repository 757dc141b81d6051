//! `reelay wrap-ups request`: ask for a year in film, wait until it is computed, and print its
//! figures and where its card is.

use std::time::{Duration, Instant};

use clap::{Args, Subcommand};
use reelay_contracts::v1::{self, wrap_ups_client::WrapUpsClient};

use super::{ClientArgs, call_failed, outln};

#[derive(Debug, Subcommand)]
pub enum WrapUpsCommand {
    /// Ask for a year's wrap-up and show it once computed. Asking again returns the same one
    /// while the year's diary is unchanged, and computes a new one once it changed.
    Request(RequestArgs),
}

#[derive(Debug, Args)]
pub struct RequestArgs {
    /// Your user id.
    #[arg(long)]
    pub user: String,

    /// The year, e.g. 2024.
    #[arg(long)]
    pub year: i32,

    /// How long to wait for the wrap-up handler, in seconds (at most a day); 0 does not wait:
    /// a wrap-up not computed yet is named with its state, and asking again shows it.
    #[arg(long, default_value_t = 60, value_parser = clap::value_parser!(u64).range(0..=86_400))]
    pub wait_secs: u64,

    #[command(flatten)]
    pub client: ClientArgs,
}

pub async fn run(command: WrapUpsCommand) -> anyhow::Result<()> {
    let WrapUpsCommand::Request(args) = command;
    let mut wrap_ups = WrapUpsClient::new(args.client.write()?);
    let requested = wrap_ups
        .request_wrap_up(v1::RequestWrapUpRequest { actor_user_id: args.user, year: args.year, ..Default::default() })
        .await
        .map_err(|s| call_failed("wrap-ups request", s))?
        .into_inner()
        .wrap_up
        .unwrap_or_default();
    let deadline = Instant::now() + Duration::from_secs(args.wait_secs);
    let wrap_up = loop {
        let current = wrap_ups
            .get_wrap_up(v1::GetWrapUpRequest { wrap_up_id: requested.wrap_up_id.clone() })
            .await
            .map_err(|s| call_failed("wrap-ups request", s))?
            .into_inner();
        if current.status() == v1::WrapUpStatus::Completed {
            break current;
        }
        if args.wait_secs == 0 {
            outln!("wrap-up {} of {}: still being generated (not waited for)", current.wrap_up_id, current.year);
            return Ok(());
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "wrap-up {} is still being generated after {} s (is a handlers service with the wrap-up \
             handler running? `reelay status` shows its backlog)",
            requested.wrap_up_id,
            args.wait_secs
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let s = wrap_up.summary.unwrap_or_default();
    outln!("{} in film — wrap-up {}", wrap_up.year, wrap_up.wrap_up_id);
    if !wrap_up.previous_wrap_up_id.is_empty() {
        outln!("  (replaces wrap-up {}: the diary changed since)", wrap_up.previous_wrap_up_id);
    }
    outln!("  {} films, {} diary entries, {} rewatches", s.films, s.entries, s.rewatches);
    outln!("  {:.1} hours watched", f64::from(s.minutes_watched) / 60.0);
    if s.mean_rating > 0.0 {
        outln!("  average rating {:.2} stars", s.mean_rating / 2.0);
    }
    let top = |list: &[v1::NameCount]| list.iter().map(|n| format!("{} ({})", n.name, n.count)).collect::<Vec<_>>();
    if !s.top_genres.is_empty() {
        outln!("  top genres     {}", top(&s.top_genres).join(", "));
    }
    if !s.top_directors.is_empty() {
        outln!("  top directors  {}", top(&s.top_directors).join(", "));
    }
    for film in &s.highest_rated {
        outln!("  ★ {:.1}  {} ({})", f64::from(film.rating) / 2.0, film.title, film.year);
    }
    let months: Vec<String> = s.per_month.iter().map(u32::to_string).collect();
    outln!("  month by month {}", months.join(" "));
    if !wrap_up.card_url.is_empty() {
        outln!("  card           {}", wrap_up.card_url);
    }
    Ok(())
}
