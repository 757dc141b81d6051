//! A provider's answer brought within what the write service takes (`reelay_domain::profiles`),
//! instead of refused there: the write service refuses a profile or a batch of people outside
//! its limits for good, so one odd value from the provider (a days-long art film, a name with a
//! tab or a bidirectional isolate in it, a poster path with a space) would leave the film
//! unenriched for ever, however often enrichment is asked for again. What cannot be kept is
//! dropped (a credit with no usable name, a poster URL that is not one), what is too long is
//! cut, and each is logged.

use reelay_contracts::v1;
use reelay_domain::profiles::{
    self, MAX_BIOGRAPHY_CHARS, MAX_CREDITS, MAX_GENRES, MAX_KNOWN_FOR, MAX_KNOWN_FOR_CHARS, MAX_NAME_CHARS,
    MAX_OVERVIEW_CHARS, MAX_PLACE_CHARS, MAX_RUNTIME_MINUTES,
};
use reelay_domain::validate;

/// `profile`, within the write service's limits.
pub(crate) fn profile(mut profile: v1::MovieProfile) -> v1::MovieProfile {
    let id = profile.provider_id.clone();
    if profile.runtime_minutes > MAX_RUNTIME_MINUTES {
        tracing::info!(provider_id = %id, runtime = profile.runtime_minutes, "a runtime over {MAX_RUNTIME_MINUTES} minutes is not kept");
        profile.runtime_minutes = 0;
    }
    for (what, value) in [("title", &mut profile.title), ("IMDb id", &mut profile.imdb_id)] {
        if !value.is_empty() {
            let fitted = validate::fitted_text(value, validate::MAX_TITLE_CHARS).unwrap_or_default();
            if fitted.is_empty() {
                tracing::info!(provider_id = %id, value = %value, "the profile's {what} has nothing visible; not kept");
            }
            *value = fitted;
        }
    }
    if profile.year != 0 && validate::year("year", profile.year).is_err() {
        tracing::info!(provider_id = %id, year = profile.year, "a year out of range is not kept");
        profile.year = 0;
    }
    profile.directors = credits(&id, std::mem::take(&mut profile.directors));
    profile.cast = credits(&id, std::mem::take(&mut profile.cast));
    profile.genres.retain_mut(|genre| match validate::fitted_text(genre, MAX_NAME_CHARS) {
        Some(fitted) => {
            *genre = fitted;
            true
        }
        None => false,
    });
    if profile.genres.len() > MAX_GENRES {
        tracing::info!(provider_id = %id, genres = profile.genres.len(), "only the first {MAX_GENRES} genres are kept");
        profile.genres.truncate(MAX_GENRES);
    }
    if !profile.poster_url.is_empty() && validate::uri("poster_url", &profile.poster_url).is_err() {
        tracing::info!(provider_id = %id, poster_url = %profile.poster_url, "the poster URL is not a URI; not kept");
        profile.poster_url.clear();
    }
    if profile.overview.chars().count() > MAX_OVERVIEW_CHARS {
        profile.overview = profile.overview.chars().take(MAX_OVERVIEW_CHARS).collect();
    }
    profile
}

/// The credits with a usable person id and name (the name cleaned and cut), at most
/// [`MAX_CREDITS`].
fn credits(provider_id: &str, list: Vec<v1::PersonCredit>) -> Vec<v1::PersonCredit> {
    let listed = list.len();
    let kept: Vec<v1::PersonCredit> = list
        .into_iter()
        .filter(|credit| profiles::person_id_shaped(&credit.person_id))
        .filter_map(|mut credit| {
            credit.name = validate::fitted_text(&credit.name, MAX_NAME_CHARS)?;
            credit.role = validate::fitted_text(&credit.role, MAX_NAME_CHARS).unwrap_or_default();
            Some(credit)
        })
        .take(MAX_CREDITS)
        .collect();
    if kept.len() < listed {
        tracing::info!(
            provider_id,
            listed,
            kept = kept.len(),
            "credits without a usable id or name (or past {MAX_CREDITS}) are not kept"
        );
    }
    kept
}

/// `person`, its name cleaned and cut and the rest within bounds (a birthday not shaped as a
/// date is unknown); `None` when it has no usable id or name.
pub(crate) fn person(mut person: v1::Person) -> Option<v1::Person> {
    if !profiles::person_id_shaped(&person.person_id) {
        return None;
    }
    person.name = validate::fitted_text(&person.name, MAX_NAME_CHARS)?;
    person.biography = validate::fitted_block(&person.biography, MAX_BIOGRAPHY_CHARS);
    person.place_of_birth = validate::fitted_text(&person.place_of_birth, MAX_PLACE_CHARS).unwrap_or_default();
    if !profiles::birthday_shaped(&person.birthday) {
        person.birthday.clear();
    }
    person.known_for = std::mem::take(&mut person.known_for)
        .into_iter()
        .filter_map(|film| validate::fitted_text(&film, MAX_KNOWN_FOR_CHARS))
        .take(MAX_KNOWN_FOR)
        .collect();
    Some(person)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn credit(id: &str, name: &str) -> v1::PersonCredit {
        v1::PersonCredit { person_id: id.into(), name: name.into(), role: String::new() }
    }

    /// What the write service would refuse is cut, cleaned or dropped; the rest is as it was.
    #[test]
    fn a_profile_is_brought_within_the_write_service_s_limits() {
        let fitted = profile(v1::MovieProfile {
            provider: "tmdb".into(),
            provider_id: "tmdb:1".into(),
            runtime_minutes: 14_400,
            genres: (0..60).map(|n| format!("g{n}")).collect(),
            directors: vec![
                credit("tmdb:2", "Jakob\tFenger\u{2066}"),
                credit("tmdb:3", " \u{200b} "),
                credit("nocolon", "Rasmus Nielsen"),
            ],
            cast: (0..600)
                .map(|n| v1::PersonCredit {
                    role: "Vincent\tHanna ".into(),
                    ..credit(&format!("tmdb:{n}"), &"x".repeat(400))
                })
                .collect(),
            poster_url: "https://image.example/p/a poster.jpg".into(),
            overview: "ø".repeat(12_000),
            title: "Heat\u{7}".into(),
            imdb_id: "\u{200b}".into(),
            year: 19_950,
        });
        assert_eq!((fitted.title.as_str(), fitted.imdb_id.as_str(), fitted.year), ("Heat", "", 0));
        assert_eq!(fitted.runtime_minutes, 0);
        assert_eq!(fitted.genres.len(), MAX_GENRES);
        assert_eq!(fitted.directors, [credit("tmdb:2", "Jakob Fenger")]);
        assert_eq!(fitted.cast.len(), MAX_CREDITS);
        assert_eq!(fitted.cast[0].name.chars().count(), MAX_NAME_CHARS);
        assert_eq!(fitted.cast[0].role, "Vincent Hanna");
        assert_eq!(fitted.poster_url, "");
        assert_eq!(fitted.overview.chars().count(), MAX_OVERVIEW_CHARS);

        let kept = v1::MovieProfile {
            provider_id: "tmdb:949".into(),
            runtime_minutes: 170,
            directors: vec![credit("tmdb:638", "Michael Mann")],
            poster_url: "https://image.tmdb.org/t/p/original/heat.jpg".into(),
            overview: "A heist.".into(),
            ..Default::default()
        };
        assert_eq!(profile(kept.clone()), kept);
        assert_eq!(
            person(v1::Person { person_id: "tmdb:5".into(), name: "\u{202e}".into(), ..Default::default() }),
            None
        );
        let fitted = person(v1::Person {
            person_id: "tmdb:6".into(),
            name: "Chantal Akerman".into(),
            biography: "b".repeat(30_000),
            birthday: "1950-02-30".into(),
            place_of_birth: "Brussels\u{2028}Belgium".into(),
            known_for: vec!["t".repeat(500); 60],
            ..Default::default()
        })
        .unwrap();
        assert_eq!((fitted.biography.len(), fitted.birthday.as_str()), (MAX_BIOGRAPHY_CHARS, ""));
        assert_eq!(fitted.place_of_birth, "Brussels Belgium");
        assert_eq!((fitted.known_for.len(), fitted.known_for[0].len()), (MAX_KNOWN_FOR, MAX_KNOWN_FOR_CHARS));
    }
}
