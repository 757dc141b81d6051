//! The one place wire types and store types meet: requests become validated commands, rows
//! become responses.

use prost::Message;
use reelay_contracts::v1::{self, account, movie_ref};
use reelay_domain::{MovieId, UserId, ValidationError, validate};

use crate::store::{MovieRow, MovieSpec, ReviewFields, ReviewRow, Target, UserRow, WatchlistRow, WrapUpRow};

pub fn movie_spec(field: &str, movie: Option<v1::MovieRef>) -> Result<MovieSpec, ValidationError> {
    let by = movie.and_then(|m| m.by).ok_or_else(|| ValidationError::new(field, "is required"))?;
    Ok(match by {
        movie_ref::By::MovieId(id) => MovieSpec::Id(MovieId::parse(&format!("{field}.movie_id"), &id)?),
        movie_ref::By::ExternalId(ext) => {
            let field = format!("{field}.external_id");
            MovieSpec::ExternalId(
                validate::external_id(&field, &ext)?.ok_or_else(|| ValidationError::new(field, "is required"))?,
            )
        }
        movie_ref::By::TitleYear(ty) => title_year(&format!("{field}.title_year."), ty)?,
    })
}

/// A film named by title and year; `prefix` comes before each field's name in errors
/// (`movie.title_year.`, or nothing where the request's fields are flat).
pub fn title_year(prefix: &str, ty: v1::TitleYear) -> Result<MovieSpec, ValidationError> {
    let external_id_field = format!("{prefix}external_id");
    Ok(MovieSpec::TitleYear {
        title: validate::title(&format!("{prefix}title"), &ty.title)?,
        year: validate::year(&format!("{prefix}year"), ty.year)?,
        external_id: validate::external_id(&external_id_field, &ty.external_id)?,
        external_id_field,
    })
}

pub fn review_fields(
    rating: u32,
    body: &str,
    watched_on: &str,
    rewatch: bool,
) -> Result<ReviewFields, ValidationError> {
    Ok(ReviewFields {
        rating: validate::rating("rating", rating)?,
        body: validate::body("body", body)?,
        watched_on: validate::watch_date("watched_on", watched_on, reelay_kit::now_ms())?,
        rewatch,
    })
}

pub fn target(field: &str, account: Option<v1::Account>) -> Result<Target, ValidationError> {
    match account.and_then(|a| a.kind) {
        Some(account::Kind::UserId(id)) => Ok(Target::User(UserId::parse(&format!("{field}.user_id"), &id)?)),
        Some(account::Kind::ActorUri(uri)) => Ok(Target::Actor(validate::uri(&format!("{field}.actor_uri"), &uri)?)),
        None => Err(ValidationError::new(field, "is required (user_id or actor_uri)")),
    }
}

pub fn actor(value: &str) -> Result<UserId, ValidationError> {
    UserId::parse("actor_user_id", value)
}

/// An empty token, or a token this service issued.
pub fn page_token<T>(
    value: &str,
    parse: impl FnOnce(&str) -> Result<T, ValidationError>,
) -> Result<Option<T>, ValidationError> {
    if value.is_empty() {
        Ok(None)
    } else {
        parse(value).map(Some).map_err(|_| ValidationError::new("page_token", "is not a token this service issued"))
    }
}

pub fn user(row: UserRow) -> v1::User {
    v1::User { user_id: row.id, handle: row.handle, display_name: row.display_name, created_at_ms: row.created_at }
}

pub fn movie(row: MovieRow) -> v1::Movie {
    let enrichment = match row.enrichment.as_str() {
        "enriched" => v1::EnrichmentStatus::Enriched,
        "not_found" => v1::EnrichmentStatus::NotFound,
        _ => v1::EnrichmentStatus::Pending,
    };
    v1::Movie {
        movie_id: row.id,
        title: row.title,
        year: row.year as i32,
        external_id: row.external_id.unwrap_or_default(),
        created_at_ms: row.created_at,
        enrichment: enrichment as i32,
        // Written by this service from a valid message; an unreadable one reads as absent.
        profile: row.profile.and_then(|p| v1::MovieProfile::decode(p.as_slice()).ok()),
        enriched_at_ms: row.enriched_at.unwrap_or_default(),
        // Filled in by GetMovie from movie_posters.
        poster_sizes: Vec::new(),
        poster_source_url: String::new(),
    }
}

pub fn review(row: ReviewRow) -> v1::Review {
    let source = match row.source.as_str() {
        "import" => v1::ReviewSource::Import,
        _ => v1::ReviewSource::Local,
    };
    v1::Review {
        review_id: row.id,
        user_id: row.user_id,
        movie_id: row.movie_id,
        rating: row.rating as u32,
        body: row.body,
        watched_on: row.watched_on,
        rewatch: row.rewatch,
        source: source as i32,
        created_at_ms: row.created_at,
        updated_at_ms: row.updated_at,
    }
}

pub fn watchlist_entry(row: WatchlistRow) -> v1::WatchlistEntry {
    v1::WatchlistEntry { user_id: row.user_id, movie_id: row.movie_id, added_at_ms: row.added_at }
}

pub fn wrap_up(row: WrapUpRow) -> v1::WrapUp {
    let summary = row.summary.and_then(|s| v1::WrapUpSummary::decode(s.as_slice()).ok());
    let status = match row.status.as_str() {
        "completed" => v1::WrapUpStatus::Completed,
        _ => v1::WrapUpStatus::Generating,
    };
    v1::WrapUp {
        wrap_up_id: row.id,
        user_id: row.user_id,
        year: row.year as i32,
        status: status as i32,
        requested_at_ms: row.requested_at,
        completed_at_ms: row.completed_at.unwrap_or_default(),
        summary_json: summary.as_ref().map(summary_json).unwrap_or_default(),
        summary,
        card_key: row.card_key.unwrap_or_default(),
        card_content_type: row.card_content_type.unwrap_or_default(),
        card_url: String::new(),
        previous_wrap_up_id: row.previous_id.unwrap_or_default(),
    }
}

/// The summary as JSON (`WrapUp.summary_json`), for clients that read no protobuf.
fn summary_json(s: &v1::WrapUpSummary) -> String {
    let counts = |list: &[v1::NameCount]| -> Vec<serde_json::Value> {
        list.iter().map(|n| serde_json::json!({"name": n.name, "count": n.count})).collect()
    };
    serde_json::json!({
        "films": s.films,
        "entries": s.entries,
        "rewatches": s.rewatches,
        "minutes_watched": s.minutes_watched,
        "rating_counts": s.rating_counts,
        "mean_rating": s.mean_rating,
        "top_genres": counts(&s.top_genres),
        "top_directors": counts(&s.top_directors),
        "per_month": s.per_month,
        "highest_rated": s.highest_rated.iter().map(|f| serde_json::json!({
            "movie_id": f.movie_id, "title": f.title, "year": f.year, "rating": f.rating,
        })).collect::<Vec<_>>(),
    })
    .to_string()
}
