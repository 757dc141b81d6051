//! Events as the write service raises them, for the tests of this crate.

use reelay_contracts::v1::{self, event::Payload};

/// The tests' clock starts here (2023-11-14), so their `at` values are times these events
/// could carry.
pub const EPOCH_MS: i64 = 1_700_000_000_000;

/// An event of `at` ms past [`EPOCH_MS`], as written before events carried microseconds.
pub fn event(aggregate_id: &str, at: i64, payload: Payload) -> v1::Event {
    v1::Event {
        event_id: format!("{aggregate_id}-{at}"),
        event_type: reelay_domain::events::event_type(&payload).to_owned(),
        aggregate_id: aggregate_id.to_owned(),
        occurred_at_ms: EPOCH_MS + at,
        occurred_at_us: 0,
        traceparent: String::new(),
        payload: Some(payload),
    }
}

pub fn review_logged(review_id: &str, at: i64, movie_title: &str, body: &str) -> v1::Event {
    let payload = Payload::ReviewLogged(v1::ReviewLogged {
        review_id: review_id.to_owned(),
        user_id: "user-ana".to_owned(),
        movie_id: format!("movie-{}", movie_title.to_lowercase()),
        rating: 8,
        body: body.to_owned(),
        movie_title: movie_title.to_owned(),
        movie_year: 1995,
        ..Default::default()
    });
    event(review_id, at, payload)
}

pub fn review_edited(review_id: &str, at: i64, movie_title: &str, body: &str) -> v1::Event {
    let payload = Payload::ReviewEdited(v1::ReviewEdited {
        review_id: review_id.to_owned(),
        user_id: "user-ana".to_owned(),
        movie_id: format!("movie-{}", movie_title.to_lowercase()),
        rating: 10,
        body: body.to_owned(),
        movie_title: movie_title.to_owned(),
        movie_year: 1995,
        ..Default::default()
    });
    event(review_id, at, payload)
}

pub fn review_deleted(review_id: &str, at: i64) -> v1::Event {
    let payload = Payload::ReviewDeleted(v1::ReviewDeleted {
        review_id: review_id.to_owned(),
        user_id: "user-ana".to_owned(),
        movie_id: "movie-heat".to_owned(),
    });
    event(review_id, at, payload)
}

pub fn movie_discovered(movie_id: &str, at: i64, title: &str, year: i32) -> v1::Event {
    let payload = Payload::MovieDiscovered(v1::MovieDiscovered {
        movie_id: movie_id.to_owned(),
        title: title.to_owned(),
        year,
        external_id: String::new(),
    });
    event(movie_id, at, payload)
}

pub fn movie_deleted(movie_id: &str, at: i64) -> v1::Event {
    event(movie_id, at, Payload::MovieDeleted(v1::MovieDeleted { movie_id: movie_id.to_owned() }))
}

pub fn remote_review_saved(remote_review_id: &str, at: i64, movie_title: &str, body: &str) -> v1::Event {
    let payload = Payload::RemoteReviewSaved(v1::RemoteReviewSaved {
        remote_review_id: remote_review_id.to_owned(),
        object_uri: format!("https://example.social/reviews/{remote_review_id}"),
        actor_uri: "https://example.social/users/bo".to_owned(),
        movie_id: format!("movie-{}", movie_title.to_lowercase()),
        rating: 6,
        body: body.to_owned(),
        published_at_ms: at,
        movie_title: movie_title.to_owned(),
        movie_year: 1979,
    });
    event(remote_review_id, at, payload)
}

pub fn movie_enriched(
    movie_id: &str,
    at: i64,
    title: &str,
    year: i32,
    directors: &[&str],
    genres: &[&str],
) -> v1::Event {
    let credit = |name: &&str| v1::PersonCredit {
        person_id: format!("catalog:{name}"),
        name: name.to_string(),
        role: String::new(),
    };
    let payload = Payload::MovieEnriched(v1::MovieEnriched {
        movie_id: movie_id.to_owned(),
        profile: Some(v1::MovieProfile {
            provider: "catalog".into(),
            provider_id: "wikidata:Q1".into(),
            title: title.to_owned(),
            year,
            directors: directors.iter().map(credit).collect(),
            genres: genres.iter().map(|g| g.to_string()).collect(),
            ..Default::default()
        }),
        title: title.to_owned(),
        year,
    });
    event(movie_id, at, payload)
}

pub fn remote_review_deleted(remote_review_id: &str, at: i64) -> v1::Event {
    let payload = Payload::RemoteReviewDeleted(v1::RemoteReviewDeleted {
        remote_review_id: remote_review_id.to_owned(),
        object_uri: format!("https://example.social/reviews/{remote_review_id}"),
        actor_uri: "https://example.social/users/bo".to_owned(),
        movie_id: "movie-heat".to_owned(),
    });
    event(remote_review_id, at, payload)
}

pub fn poster_synced(movie_id: &str, at: i64) -> v1::Event {
    event(movie_id, at, Payload::PosterSynced(v1::PosterSynced { movie_id: movie_id.to_owned(), ..Default::default() }))
}

/// The variants of `movie_id`'s poster, `sizes` ("w92", ...), were stored.
pub fn poster_converted(movie_id: &str, at: i64, sizes: &[&str]) -> v1::Event {
    let payload = Payload::PosterConverted(v1::PosterConverted {
        movie_id: movie_id.to_owned(),
        original_sha256: "ab".repeat(32),
        sizes: sizes.iter().map(|s| s.to_string()).collect(),
    });
    event(movie_id, at, payload)
}
