//! A year in film, computed from the diary entries watched that year and their films'
//! profiles. Pure: the same entries give the same figures, whoever computes them and however
//! often.

use std::collections::{BTreeMap, HashMap, HashSet};

use reelay_contracts::v1;

/// How many genres, directors and films the summary ranks (the write service takes no more).
const TOP: usize = reelay_domain::validate::WRAP_UP_TOP;

/// The figures of `entries` (one year's diary).
pub fn summarize(entries: &[v1::WrapUpEntry]) -> v1::WrapUpSummary {
    let mut summary = v1::WrapUpSummary {
        entries: entries.len() as u32,
        rating_counts: vec![0; 11],
        per_month: vec![0; 12],
        ..Default::default()
    };
    let mut films = HashSet::new();
    let mut genres: HashMap<&str, HashSet<&str>> = HashMap::new();
    let mut directors: HashMap<&str, HashSet<&str>> = HashMap::new();
    // movie id -> its best rating of the year
    let mut best: HashMap<&str, Best> = HashMap::new();
    let (mut rated, mut rating_sum) = (0u32, 0u32);
    for entry in entries {
        let Some(movie) = &entry.movie else { continue };
        films.insert(movie.movie_id.as_str());
        summary.rewatches += u32::from(entry.rewatch);
        let rating = entry.rating.min(10);
        summary.rating_counts[rating as usize] += 1;
        if rating > 0 {
            rated += 1;
            rating_sum += rating;
            let candidate = (rating, entry.watched_on.as_str(), movie.title.as_str(), movie.year);
            best.entry(&movie.movie_id)
                .and_modify(|b| {
                    if (rating, entry.watched_on.as_str()) > (b.0, b.1) {
                        *b = candidate;
                    }
                })
                .or_insert(candidate);
        }
        if let Some(month) =
            entry.watched_on.get(5..7).and_then(|m| m.parse::<usize>().ok()).filter(|m| (1..=12).contains(m))
        {
            summary.per_month[month - 1] += 1;
        }
        if let Some(profile) = &movie.profile {
            summary.minutes_watched += profile.runtime_minutes;
            for genre in &profile.genres {
                genres.entry(genre).or_default().insert(&movie.movie_id);
            }
            for director in &profile.directors {
                directors.entry(&director.name).or_default().insert(&movie.movie_id);
            }
        }
    }
    summary.films = films.len() as u32;
    summary.mean_rating = if rated == 0 { 0.0 } else { f64::from(rating_sum) / f64::from(rated) };
    summary.top_genres = top(genres);
    summary.top_directors = top(directors);
    let mut ranked: Vec<(&str, Best)> = best.into_iter().collect();
    ranked.sort_by(|a, b| b.1.0.cmp(&a.1.0).then(b.1.1.cmp(a.1.1)).then(a.1.2.cmp(b.1.2)).then(a.0.cmp(b.0)));
    summary.highest_rated = ranked
        .into_iter()
        .take(TOP)
        .map(|(id, (rating, _, title, year))| v1::RatedFilm {
            movie_id: id.to_owned(),
            title: title.to_owned(),
            year,
            rating,
        })
        .collect();
    summary
}

/// A film's best rating: (rating, the latest day it got it, title, year).
type Best<'a> = (u32, &'a str, &'a str, i32);

/// The names with the most distinct films, ties by name.
fn top(counts: HashMap<&str, HashSet<&str>>) -> Vec<v1::NameCount> {
    let ordered: BTreeMap<&str, usize> = counts.into_iter().map(|(name, films)| (name, films.len())).collect();
    let mut list: Vec<(&str, usize)> = ordered.into_iter().collect();
    list.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(b.0)));
    list.into_iter()
        .filter(|(name, _)| !name.trim().is_empty())
        .take(TOP)
        // Cut to what CompleteWrapUp takes: a name from a profile stored before enrichment
        // fitted names to the write service's limits may be longer.
        .map(|(name, count)| v1::NameCount {
            name: name.chars().take(reelay_domain::profiles::MAX_NAME_CHARS).collect(),
            count: count as u32,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(
        id: &str,
        day: &str,
        rating: u32,
        rewatch: bool,
        genres: &[&str],
        director: &str,
        minutes: u32,
    ) -> v1::WrapUpEntry {
        v1::WrapUpEntry {
            review_id: format!("r-{id}-{day}"),
            watched_on: day.into(),
            rating,
            rewatch,
            movie: Some(v1::Movie {
                movie_id: id.into(),
                title: format!("Film {id}"),
                year: 2000,
                profile: Some(v1::MovieProfile {
                    runtime_minutes: minutes,
                    genres: genres.iter().map(|g| g.to_string()).collect(),
                    directors: vec![v1::PersonCredit {
                        person_id: format!("x:{director}"),
                        name: director.into(),
                        role: String::new(),
                    }],
                    ..Default::default()
                }),
                ..Default::default()
            }),
        }
    }

    #[test]
    fn figures_of_a_small_year() {
        let entries = vec![
            entry("a", "2024-01-05", 8, false, &["Crime", "Drama"], "Mann", 170),
            entry("a", "2024-03-01", 10, true, &["Crime", "Drama"], "Mann", 170),
            entry("b", "2024-03-02", 6, false, &["Drama"], "Varda", 90),
            entry("c", "2024-12-31", 0, false, &["Comedy"], "Mann", 100),
        ];
        let s = summarize(&entries);
        assert_eq!((s.films, s.entries, s.rewatches, s.minutes_watched), (3, 4, 1, 530));
        assert_eq!(s.rating_counts, [1, 0, 0, 0, 0, 0, 1, 0, 1, 0, 1]);
        assert!((s.mean_rating - 8.0).abs() < 1e-9);
        assert_eq!(s.per_month, [1, 0, 2, 0, 0, 0, 0, 0, 0, 0, 0, 1]);
        let genres: Vec<(String, u32)> = s.top_genres.iter().map(|g| (g.name.clone(), g.count)).collect();
        assert_eq!(genres, [("Drama".to_owned(), 2), ("Comedy".into(), 1), ("Crime".into(), 1)]);
        assert_eq!(s.top_directors[0].name, "Mann");
        assert_eq!(s.top_directors[0].count, 2, "distinct films, not entries");
        let best: Vec<(&str, u32)> = s.highest_rated.iter().map(|f| (f.movie_id.as_str(), f.rating)).collect();
        assert_eq!(best, [("a", 10), ("b", 6)], "each film once, at its best; unrated films are not ranked");
    }

    #[test]
    fn an_empty_year() {
        let s = summarize(&[]);
        assert_eq!((s.films, s.entries, s.mean_rating), (0, 0, 0.0));
        assert_eq!(s.per_month, vec![0; 12]);
    }
}
