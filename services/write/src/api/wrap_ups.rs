//! The WrapUps service: requesting and reading yearly wrap-ups.

use reelay_contracts::v1;
use reelay_domain::{WrapUpId, profiles, validate};
use reelay_kit::ServiceError;
use tonic::Request;

use super::{Reply, WriteApi, keyed_by_actor, ok};
use crate::convert;
use crate::store::{WrapUpCompletion, WrapUpRow};

#[tonic::async_trait]
impl v1::wrap_ups_server::WrapUps for WriteApi {
    async fn request_wrap_up(&self, request: Request<v1::RequestWrapUpRequest>) -> Reply<v1::RequestWrapUpResponse> {
        let mut r = request.into_inner();
        let key = keyed_by_actor("RequestWrapUp", &mut r, |r| &mut r.request_id, |r| &r.actor_user_id)?;
        let actor = convert::actor(&r.actor_user_id).map_err(ServiceError::from)?;
        let year = validate::year("year", r.year).map_err(ServiceError::from)?;
        // A year not begun anywhere yet has no diary to sum up (and its wrap-up, once made,
        // would stand for the year).
        let current = validate::latest_year(reelay_kit::now_ms());
        if year > current {
            return Err(ServiceError::invalid(
                "year",
                format!("must not be after the current year ({current}), got {year}"),
            )
            .into());
        }
        ok(self.store.request_wrap_up(actor, year, key).await?)
    }

    async fn get_wrap_up(&self, request: Request<v1::GetWrapUpRequest>) -> Reply<v1::WrapUp> {
        let id = WrapUpId::parse("wrap_up_id", &request.into_inner().wrap_up_id).map_err(ServiceError::from)?;
        ok(self.wrap_up(self.store.get_wrap_up(id).await?))
    }

    async fn get_wrap_up_inputs(&self, request: Request<v1::GetWrapUpInputsRequest>) -> Reply<v1::WrapUpInputs> {
        let id = WrapUpId::parse("wrap_up_id", &request.into_inner().wrap_up_id).map_err(ServiceError::from)?;
        let (wrap_up, entries, inputs_digest) = self.store.wrap_up_inputs(id).await?;
        let entries = entries
            .into_iter()
            .map(|e| {
                let mut movie = convert::movie(e.movie);
                // What the figures use of a profile, no more: a film's cast and overview are
                // most of its bytes, and a heavy year's answer must fit one message.
                if let Some(profile) = movie.profile.as_mut() {
                    profile.cast.clear();
                    profile.overview.clear();
                }
                v1::WrapUpEntry {
                    review_id: e.review_id,
                    watched_on: e.watched_on,
                    rating: e.rating as u32,
                    rewatch: e.rewatch,
                    movie: Some(movie),
                }
            })
            .collect();
        ok(v1::WrapUpInputs { wrap_up: Some(self.wrap_up(wrap_up)), entries, inputs_digest })
    }

    async fn complete_wrap_up(&self, request: Request<v1::CompleteWrapUpRequest>) -> Reply<v1::CompleteWrapUpResponse> {
        let r = request.into_inner();
        let id = WrapUpId::parse("wrap_up_id", &r.wrap_up_id).map_err(ServiceError::from)?;
        let summary = r.summary.ok_or_else(|| ServiceError::invalid("summary", "is required"))?;
        checked_summary(&summary)?;
        let card_key = validate::object_key("card_key", &r.card_key).map_err(ServiceError::from)?;
        let own = format!("wrapups/{id}/");
        if !card_key.starts_with(&own) {
            return Err(ServiceError::invalid("card_key", format!("must be under {own}, got {card_key:?}")).into());
        }
        if !media_type(&r.card_content_type) {
            return Err(ServiceError::invalid(
                "card_content_type",
                format!("must be a media type such as image/svg+xml, got {:?}", r.card_content_type),
            )
            .into());
        }
        if !r.inputs_digest.is_empty() {
            super::movies::sha256("inputs_digest", &r.inputs_digest)?;
        }
        let inputs_digest = (!r.inputs_digest.is_empty()).then_some(r.inputs_digest);
        let completion = WrapUpCompletion { summary, card_key, card_content_type: r.card_content_type, inputs_digest };
        let (wrap_up, changed) = self.store.complete_wrap_up(id, completion).await?;
        ok(v1::CompleteWrapUpResponse { changed, wrap_up: Some(self.wrap_up(wrap_up)) })
    }
}

/// A summary as `WrapUpSummary` documents it; a summary outside its shape would be stored,
/// and every later read of the wrap-up fail (a 2.5 MB name), or show nonsense.
fn checked_summary(summary: &v1::WrapUpSummary) -> Result<(), ServiceError> {
    let count = |field: &str, len: usize, wanted: std::ops::RangeInclusive<usize>| {
        if wanted.contains(&len) {
            Ok(())
        } else {
            Err(ServiceError::invalid(field, format!("must hold {wanted:?} values, got {len}")))
        }
    };
    count("summary.per_month", summary.per_month.len(), 12..=12)?;
    count("summary.rating_counts", summary.rating_counts.len(), 11..=11)?;
    if !(0.0..=f64::from(validate::MAX_RATING)).contains(&summary.mean_rating) {
        return Err(ServiceError::invalid(
            "summary.mean_rating",
            format!("must be 0-{} half stars, got {}", validate::MAX_RATING, summary.mean_rating),
        ));
    }
    for (field, names) in
        [("summary.top_genres", &summary.top_genres), ("summary.top_directors", &summary.top_directors)]
    {
        count(field, names.len(), 0..=validate::WRAP_UP_TOP)?;
        for (n, named) in names.iter().enumerate() {
            if named.name.is_empty() || named.name.chars().count() > profiles::MAX_NAME_CHARS {
                return Err(ServiceError::invalid(
                    &format!("{field}[{n}].name"),
                    format!("must be 1-{} characters", profiles::MAX_NAME_CHARS),
                ));
            }
        }
    }
    count("summary.highest_rated", summary.highest_rated.len(), 0..=validate::WRAP_UP_TOP)?;
    for (n, film) in summary.highest_rated.iter().enumerate() {
        let field = |name: &str| format!("summary.highest_rated[{n}].{name}");
        reelay_domain::MovieId::parse(&field("movie_id"), &film.movie_id).map_err(ServiceError::from)?;
        if film.title.is_empty() || film.title.chars().count() > validate::MAX_TITLE_CHARS {
            return Err(ServiceError::invalid(
                &field("title"),
                format!("must be 1-{} characters", validate::MAX_TITLE_CHARS),
            ));
        }
        if !(1..=validate::MAX_RATING).contains(&film.rating) {
            return Err(ServiceError::invalid(&field("rating"), format!("must be 1-{}", validate::MAX_RATING)));
        }
    }
    Ok(())
}

/// `type/subtype`, each a token (RFC 9110), at most 100 bytes: it is served as a header.
fn media_type(value: &str) -> bool {
    let token =
        |part: &str| !part.is_empty() && part.bytes().all(|b| b.is_ascii_alphanumeric() || b"!#$&^_.+-".contains(&b));
    value.len() <= 100 && value.split_once('/').is_some_and(|(kind, sub)| token(kind) && token(sub))
}

impl WriteApi {
    /// A wrap-up as callers see it: with the URL its card is served at, when the media route
    /// is configured.
    fn wrap_up(&self, row: WrapUpRow) -> v1::WrapUp {
        let mut wrap_up = convert::wrap_up(row);
        if let Some(base) = &self.media_url
            && !wrap_up.card_key.is_empty()
        {
            wrap_up.card_url = format!("{}/{}", base.trim_end_matches('/'), wrap_up.card_key);
        }
        wrap_up
    }
}
