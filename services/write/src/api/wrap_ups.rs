//! The WrapUps service: requesting and reading yearly wrap-ups.

use reelay_contracts::v1;
use reelay_domain::{WrapUpId, validate};
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
        if summary.per_month.len() != 12 {
            return Err(ServiceError::invalid(
                "summary.per_month",
                format!("must hold 12 months, got {}", summary.per_month.len()),
            )
            .into());
        }
        let card_key = validate::object_key("card_key", &r.card_key).map_err(ServiceError::from)?;
        if r.card_content_type.is_empty() || r.card_content_type.len() > 100 {
            return Err(ServiceError::invalid("card_content_type", "must be a media type such as image/svg+xml").into());
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
