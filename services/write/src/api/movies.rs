//! The Movies service: discovering movies, asking for enrichment, reading a movie.

use reelay_contracts::v1::{self, save_enrichment_request};
use reelay_domain::posters::{self, MAX_BYTES, MAX_VARIANT_WIDTH, MAX_VARIANTS};
use reelay_domain::profiles::{self, MAX_PEOPLE};
use reelay_domain::{MovieId, validate};
use reelay_kit::ServiceError;
use tonic::Request;

use super::{Reply, WriteApi, keyed_by_actor, ok, request_key};
use crate::convert;
use crate::store::{Enrichment, PosterRecord, PosterVariants};

#[tonic::async_trait]
impl v1::movies_server::Movies for WriteApi {
    async fn discover_movie(&self, request: Request<v1::DiscoverMovieRequest>) -> Reply<v1::DiscoverMovieResponse> {
        let mut r = request.into_inner();
        let key = keyed_by_actor("DiscoverMovie", &mut r, |r| &mut r.request_id, |r| &r.actor_user_id)?;
        let actor = convert::actor(&r.actor_user_id).map_err(ServiceError::from)?;
        let spec = convert::title_year("", v1::TitleYear { title: r.title, year: r.year, external_id: r.external_id })
            .map_err(ServiceError::from)?;
        ok(self.store.discover_movie(actor, spec, key).await?)
    }

    async fn request_enrichment(
        &self,
        request: Request<v1::RequestEnrichmentRequest>,
    ) -> Reply<v1::RequestEnrichmentResponse> {
        let mut r = request.into_inner();
        let key = keyed_by_actor("RequestEnrichment", &mut r, |r| &mut r.request_id, |r| &r.actor_user_id)?;
        let actor = convert::actor(&r.actor_user_id).map_err(ServiceError::from)?;
        let movie = MovieId::parse("movie_id", &r.movie_id).map_err(ServiceError::from)?;
        ok(self.store.request_enrichment(actor, movie, key).await?)
    }

    async fn get_movie(&self, request: Request<v1::GetMovieRequest>) -> Reply<v1::Movie> {
        let id = MovieId::parse("movie_id", &request.into_inner().movie_id).map_err(ServiceError::from)?;
        let mut movie = convert::movie(self.store.get_movie(id).await?);
        (movie.poster_sizes, movie.poster_source_url) = self.store.posters(id).await?;
        ok(movie)
    }

    async fn get_person(&self, request: Request<v1::GetPersonRequest>) -> Reply<v1::Person> {
        let id = request.into_inner().person_id;
        person_id("person_id", &id)?;
        ok(self.store.get_person(&id).await?)
    }

    async fn save_people(&self, request: Request<v1::SavePeopleRequest>) -> Reply<v1::SavePeopleResponse> {
        let people = request.into_inner().people;
        if people.is_empty() || people.len() > MAX_PEOPLE {
            return Err(ServiceError::invalid(
                "people",
                format!("must hold 1..={MAX_PEOPLE} people, got {}", people.len()),
            )
            .into());
        }
        let mut people = people;
        for (n, person) in people.iter_mut().enumerate() {
            person_id(&format!("people[{n}].person_id"), &person.person_id)?;
            // Stored as checked: trimmed and composed, as every other name is.
            person.name = validate::required_text(&format!("people[{n}].name"), &person.name, profiles::MAX_NAME_CHARS)
                .map_err(ServiceError::from)?;
            checked_person_details(n, person)?;
        }
        // One person named twice (the director of two films enriched together) is saved once,
        // as first named, and counted once.
        let mut named = std::collections::HashSet::new();
        people.retain(|person| named.insert(person.person_id.clone()));
        ok(self.store.save_people(people).await?)
    }

    async fn save_enrichment(&self, request: Request<v1::SaveEnrichmentRequest>) -> Reply<v1::SaveEnrichmentResponse> {
        let mut r = request.into_inner();
        let key = request_key("SaveEnrichment", &mut r, |r| &mut r.request_id)?;
        let movie = MovieId::parse("movie_id", &r.movie_id).map_err(ServiceError::from)?;
        let outcome = match r.outcome {
            Some(save_enrichment_request::Outcome::Profile(profile)) => Enrichment::Profile(checked_profile(profile)?),
            Some(save_enrichment_request::Outcome::NotFound(reason)) => {
                if reason.chars().count() > MAX_NOT_FOUND_CHARS {
                    return Err(ServiceError::invalid(
                        "not_found",
                        format!("is longer than {MAX_NOT_FOUND_CHARS} characters"),
                    )
                    .into());
                }
                Enrichment::NotFound(reason)
            }
            None => return Err(ServiceError::invalid("outcome", "is required (profile or not_found)").into()),
        };
        ok(self.store.save_enrichment(movie, outcome, key).await?)
    }

    async fn record_poster(&self, request: Request<v1::RecordPosterRequest>) -> Reply<v1::RecordPosterResponse> {
        let mut r = request.into_inner();
        let key = request_key("RecordPoster", &mut r, |r| &mut r.request_id)?;
        let poster = checked_poster(r)?;
        ok(self.store.record_poster(poster, key).await?)
    }

    async fn record_poster_variants(
        &self,
        request: Request<v1::RecordPosterVariantsRequest>,
    ) -> Reply<v1::RecordPosterVariantsResponse> {
        let mut r = request.into_inner();
        let key = request_key("RecordPosterVariants", &mut r, |r| &mut r.request_id)?;
        let variants = checked_variants(r)?;
        ok(self.store.record_poster_variants(variants, key).await?)
    }
}

/// A RecordPoster request, checked field by field.
fn checked_poster(r: v1::RecordPosterRequest) -> Result<PosterRecord, ServiceError> {
    let movie = MovieId::parse("movie_id", &r.movie_id).map_err(ServiceError::from)?;
    let expected_key = format!("posters/{movie}/original");
    if r.key != expected_key {
        return Err(ServiceError::invalid("key", format!("must be {expected_key:?}, got {:?}", r.key)));
    }
    if !posters::CONTENT_TYPES.contains(&r.content_type.as_str()) {
        return Err(ServiceError::invalid(
            "content_type",
            format!("must be one of {}, got {:?}", posters::CONTENT_TYPES.join(", "), r.content_type),
        ));
    }
    if r.size_bytes == 0 || r.size_bytes > MAX_BYTES {
        return Err(ServiceError::invalid("size_bytes", format!("must be 1..={MAX_BYTES}, got {}", r.size_bytes)));
    }
    sha256("sha256", &r.sha256)?;
    validate::uri("source_url", &r.source_url).map_err(ServiceError::from)?;
    Ok(PosterRecord {
        movie,
        key: r.key,
        content_type: r.content_type,
        size_bytes: r.size_bytes,
        sha256: r.sha256,
        source_url: r.source_url,
    })
}

/// A RecordPosterVariants request, checked field by field.
fn checked_variants(r: v1::RecordPosterVariantsRequest) -> Result<PosterVariants, ServiceError> {
    let movie = MovieId::parse("movie_id", &r.movie_id).map_err(ServiceError::from)?;
    sha256("original_sha256", &r.original_sha256)?;
    if r.variants.is_empty() || r.variants.len() > MAX_VARIANTS {
        return Err(ServiceError::invalid(
            "variants",
            format!("must hold 1..={MAX_VARIANTS} variants, got {}", r.variants.len()),
        ));
    }
    let mut widths = std::collections::HashSet::new();
    for (i, variant) in r.variants.iter().enumerate() {
        let field = |name: &str| format!("variants[{i}].{name}");
        if variant.width == 0 || variant.width > MAX_VARIANT_WIDTH || !widths.insert(variant.width) {
            return Err(ServiceError::invalid(
                &field("width"),
                format!("must be a distinct width of 1..={MAX_VARIANT_WIDTH} pixels, got {}", variant.width),
            ));
        }
        let expected_key = format!("posters/{movie}/w{}.webp", variant.width);
        if variant.key != expected_key {
            return Err(ServiceError::invalid(
                &field("key"),
                format!("must be {expected_key:?}, got {:?}", variant.key),
            ));
        }
        if variant.size_bytes == 0 || variant.size_bytes > MAX_BYTES {
            return Err(ServiceError::invalid(
                &field("size_bytes"),
                format!("must be 1..={MAX_BYTES}, got {}", variant.size_bytes),
            ));
        }
        sha256(&field("sha256"), &variant.sha256)?;
    }
    Ok(PosterVariants { movie, original_sha256: r.original_sha256, variants: r.variants })
}

/// A lower-case hex SHA-256 digest.
pub(super) fn sha256(field: &str, digest: &str) -> Result<(), ServiceError> {
    if digest.len() != 64 || !digest.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)) {
        return Err(ServiceError::invalid(field, format!("must be 64 lower-case hex digits, got {digest:?}")));
    }
    Ok(())
}

/// A person's profile beyond the name: its texts bounded (the biography may hold lines, the
/// place and the films are one line each; stored as checked), and the birthday a day.
fn checked_person_details(n: usize, person: &mut v1::Person) -> Result<(), ServiceError> {
    let field = |name: &str| format!("people[{n}].{name}");
    person.biography = validate::text_block(&field("biography"), &person.biography, profiles::MAX_BIOGRAPHY_CHARS)
        .map_err(ServiceError::from)?;
    if !person.place_of_birth.is_empty() {
        person.place_of_birth =
            validate::required_text(&field("place_of_birth"), &person.place_of_birth, profiles::MAX_PLACE_CHARS)
                .map_err(ServiceError::from)?;
    }
    if !profiles::birthday_shaped(&person.birthday) {
        return Err(ServiceError::invalid(
            &field("birthday"),
            format!("must be empty or a day as YYYY-MM-DD, got {:?}", person.birthday),
        ));
    }
    if person.known_for.len() > profiles::MAX_KNOWN_FOR {
        return Err(ServiceError::invalid(
            &field("known_for"),
            format!("at most {} films, got {}", profiles::MAX_KNOWN_FOR, person.known_for.len()),
        ));
    }
    for (i, film) in person.known_for.iter_mut().enumerate() {
        *film = validate::required_text(&field(&format!("known_for[{i}]")), film, profiles::MAX_KNOWN_FOR_CHARS)
            .map_err(ServiceError::from)?;
    }
    Ok(())
}

fn person_id(field: &str, id: &str) -> Result<(), ServiceError> {
    if !profiles::person_id_shaped(id) {
        return Err(ServiceError::invalid(
            field,
            format!("must be <provider>:<id> (at most {} bytes), got {id:?}", profiles::MAX_PERSON_ID_BYTES),
        ));
    }
    Ok(())
}

/// The longest reason a provider gives for not knowing a film, in characters.
const MAX_NOT_FOUND_CHARS: usize = 1_000;

/// A provider's profile, checked field by field before it is stored: its texts are single lines
/// within their limits (stored trimmed and composed, as every other name), so what reads them
/// (search keeps a film's names apart by a control character) can rely on it.
fn checked_profile(mut profile: v1::MovieProfile) -> Result<v1::MovieProfile, ServiceError> {
    let text =
        |field: &str, value: &str, max: usize| validate::required_text(field, value, max).map_err(ServiceError::from);
    if profile.provider.is_empty() || profile.provider_id.is_empty() {
        return Err(ServiceError::invalid("profile.provider", "provider and provider_id are required"));
    }
    profile.provider = text("profile.provider", &profile.provider, profiles::MAX_PERSON_ID_BYTES)?;
    person_id("profile.provider_id", &profile.provider_id)?;
    text("profile.provider_id", &profile.provider_id, profiles::MAX_PERSON_ID_BYTES)?;
    for (field, value) in [("profile.title", &mut profile.title), ("profile.imdb_id", &mut profile.imdb_id)] {
        if !value.is_empty() {
            *value = text(field, value, validate::MAX_TITLE_CHARS)?;
        }
    }
    if profile.year != 0 {
        validate::year("profile.year", profile.year).map_err(ServiceError::from)?;
    }
    if profile.runtime_minutes > profiles::MAX_RUNTIME_MINUTES {
        return Err(ServiceError::invalid(
            "profile.runtime_minutes",
            format!("{} is not a film's runtime", profile.runtime_minutes),
        ));
    }
    for (field, list) in [("profile.directors", &mut profile.directors), ("profile.cast", &mut profile.cast)] {
        if list.len() > profiles::MAX_CREDITS {
            return Err(ServiceError::invalid(
                field,
                format!("at most {} people, got {}", profiles::MAX_CREDITS, list.len()),
            ));
        }
        for (n, credit) in list.iter_mut().enumerate() {
            person_id(&format!("{field}[{n}].person_id"), &credit.person_id)?;
            credit.name = text(&format!("{field}[{n}].name"), &credit.name, profiles::MAX_NAME_CHARS)?;
            if !credit.role.is_empty() {
                credit.role = text(&format!("{field}[{n}].role"), &credit.role, profiles::MAX_NAME_CHARS)?;
            }
        }
    }
    if profile.genres.len() > profiles::MAX_GENRES {
        return Err(ServiceError::invalid("profile.genres", format!("at most {} genres", profiles::MAX_GENRES)));
    }
    for (n, genre) in profile.genres.iter_mut().enumerate() {
        *genre = text(&format!("profile.genres[{n}]"), genre, profiles::MAX_NAME_CHARS)?;
    }
    if !profile.poster_url.is_empty() {
        validate::uri("profile.poster_url", &profile.poster_url).map_err(ServiceError::from)?;
    }
    if profile.overview.chars().count() > profiles::MAX_OVERVIEW_CHARS {
        return Err(ServiceError::invalid(
            "profile.overview",
            format!("at most {} characters", profiles::MAX_OVERVIEW_CHARS),
        ));
    }
    Ok(profile)
}
