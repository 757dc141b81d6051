//! The offline catalog: 17,472 films (1940–2014) from Wikidata (CC0, via bokeh-sampledata; see
//! `catalog/README.md`), embedded in the binary so `reelay run` enriches films with no key and
//! no network. It knows runtimes, genres, directors and cast, but no person ids: people are
//! keyed `catalog:<name>`, and a person's profile is the films the catalog credits them with.

use std::collections::HashMap;
use std::io::Read;
use std::sync::{Arc, OnceLock};

use reelay_contracts::v1;
use reelay_domain::validate::title_key;

use crate::provider::{MetadataProvider, MovieQuery, ProviderError};

static CATALOG_GZ: &[u8] = include_bytes!("../catalog/films.tsv.gz");

#[derive(Debug, Clone)]
struct Film {
    wikidata: String,
    imdb: String,
    title: String,
    year: i32,
    runtime: u32,
    genres: Vec<String>,
    directors: Vec<String>,
    cast: Vec<String>,
}

/// The catalog, decoded once per process.
pub struct Catalog {
    films: Vec<Film>,
    by_imdb: HashMap<String, usize>,
    by_wikidata: HashMap<String, usize>,
    by_title: HashMap<(String, i32), usize>,
    /// person name → the films crediting them (directing first).
    credits: HashMap<String, Vec<usize>>,
}

impl Catalog {
    /// The embedded catalog.
    pub fn shared() -> Arc<Catalog> {
        static SHARED: OnceLock<Arc<Catalog>> = OnceLock::new();
        SHARED.get_or_init(|| Arc::new(Catalog::parse(CATALOG_GZ).expect("the embedded catalog is valid"))).clone()
    }

    fn parse(gz: &[u8]) -> Result<Self, String> {
        let mut text = String::new();
        flate2::read::GzDecoder::new(gz).read_to_string(&mut text).map_err(|e| format!("catalog: {e}"))?;
        let list =
            |field: &str| -> Vec<String> { field.split('|').filter(|s| !s.is_empty()).map(str::to_owned).collect() };
        let mut films = Vec::new();
        for line in text.lines().filter(|l| !l.starts_with('#')).skip(1) {
            let f: Vec<&str> = line.split('\t').collect();
            if f.len() != 8 {
                return Err(format!("catalog: a line has {} fields, expected 8: {line:?}", f.len()));
            }
            films.push(Film {
                wikidata: f[0].to_owned(),
                imdb: f[1].to_owned(),
                title: f[2].to_owned(),
                year: f[3].parse().map_err(|_| format!("catalog: bad year in {line:?}"))?,
                runtime: f[4].parse().map_err(|_| format!("catalog: bad runtime in {line:?}"))?,
                genres: list(f[5]),
                directors: list(f[6]),
                cast: list(f[7]),
            });
        }
        let mut catalog = Catalog {
            by_imdb: HashMap::new(),
            by_wikidata: HashMap::new(),
            by_title: HashMap::new(),
            credits: HashMap::new(),
            films: Vec::new(),
        };
        for (i, film) in films.iter().enumerate() {
            if !film.imdb.is_empty() {
                catalog.by_imdb.insert(film.imdb.clone(), i);
            }
            catalog.by_wikidata.insert(film.wikidata.clone(), i);
            // Two films with one title in one year: the first (by id order) wins the title.
            catalog.by_title.entry((title_key(&film.title), film.year)).or_insert(i);
            for name in film.directors.iter().chain(&film.cast) {
                let credits = catalog.credits.entry(name.clone()).or_default();
                if credits.last() != Some(&i) {
                    credits.push(i);
                }
            }
        }
        catalog.films = films;
        Ok(catalog)
    }

    /// Every film's title and year, in catalog order.
    pub fn titles(&self) -> impl Iterator<Item = (&str, i32)> {
        self.films.iter().map(|f| (f.title.as_str(), f.year))
    }

    pub fn len(&self) -> usize {
        self.films.len()
    }

    pub fn is_empty(&self) -> bool {
        self.films.is_empty()
    }

    fn find(&self, query: &MovieQuery) -> Option<&Film> {
        let by_id = query.external_id.as_deref().and_then(|id| match id.split_once(':') {
            Some(("imdb", imdb)) => self.by_imdb.get(imdb),
            Some(("wikidata", q)) => self.by_wikidata.get(q),
            _ => None,
        });
        by_id.or_else(|| self.by_title.get(&(title_key(&query.title), query.year))).map(|&i| &self.films[i])
    }

    fn profile(film: &Film) -> v1::MovieProfile {
        let credit = |name: &String| v1::PersonCredit {
            person_id: format!("catalog:{name}"),
            name: name.clone(),
            role: String::new(),
        };
        v1::MovieProfile {
            provider: "catalog".into(),
            provider_id: format!("wikidata:{}", film.wikidata),
            imdb_id: film.imdb.clone(),
            title: film.title.clone(),
            year: film.year,
            runtime_minutes: film.runtime,
            genres: film.genres.clone(),
            directors: film.directors.iter().map(credit).collect(),
            cast: film.cast.iter().map(credit).collect(),
            poster_url: String::new(),
            overview: String::new(),
        }
    }
}

#[async_trait::async_trait]
impl MetadataProvider for Catalog {
    fn name(&self) -> &'static str {
        "catalog"
    }

    async fn movie(&self, query: &MovieQuery) -> Result<Option<v1::MovieProfile>, ProviderError> {
        Ok(self.find(query).map(Catalog::profile))
    }

    async fn person(&self, person_id: &str) -> Result<Option<v1::Person>, ProviderError> {
        let Some(name) = person_id.strip_prefix("catalog:") else { return Ok(None) };
        let Some(credits) = self.credits.get(name) else { return Ok(None) };
        let known_for =
            credits.iter().take(20).map(|&i| format!("{} ({})", self.films[i].title, self.films[i].year)).collect();
        Ok(Some(v1::Person {
            person_id: person_id.to_owned(),
            name: name.to_owned(),
            known_for,
            profiled: true,
            ..Default::default()
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn query(title: &str, year: i32) -> MovieQuery {
        MovieQuery { external_id: None, title: title.into(), year }
    }

    #[tokio::test]
    async fn heat_is_a_michael_mann_film_of_170_minutes() {
        let catalog = Catalog::shared();
        assert_eq!(catalog.len(), 17_472);
        let heat = catalog.movie(&query("heat", 1995)).await.unwrap().expect("Heat (1995) is in the catalog");
        assert_eq!((heat.runtime_minutes, heat.imdb_id.as_str()), (170, "tt0113277"));
        assert_eq!(heat.directors.iter().map(|d| d.name.as_str()).collect::<Vec<_>>(), ["Michael Mann"]);
        assert!(heat.genres.contains(&"Crime".to_owned()));
        assert!(heat.cast.iter().any(|c| c.name == "Al Pacino"));
        let by_imdb = MovieQuery { external_id: Some("imdb:tt0113277".into()), title: "whatever".into(), year: 1 };
        assert_eq!(catalog.movie(&by_imdb).await.unwrap().unwrap().provider_id, heat.provider_id);
        assert!(catalog.movie(&query("Heat", 1996)).await.unwrap().is_none(), "the year matters");
        assert!(catalog.movie(&query("A Film Nobody Made", 1999)).await.unwrap().is_none());
        let mann = catalog.person("catalog:Michael Mann").await.unwrap().unwrap();
        assert!(mann.known_for.contains(&"Heat (1995)".to_owned()), "{:?}", mann.known_for);
        assert!(catalog.person("catalog:Nobody At All").await.unwrap().is_none());
    }
}
