//! The offline catalog: 17,472 films (1940–2014) from Wikidata (CC0, via bokeh-sampledata; see
//! `catalog/README.md`), embedded in the binary so `reelay run` enriches films with no key and
//! no network. It knows runtimes, genres, directors and cast, but no person ids: people are
//! keyed `catalog:<name>`, and a person's profile is the films the catalog credits them with.

use std::io::Read;
use std::sync::{Arc, OnceLock};

use reelay_contracts::v1;
use reelay_domain::validate::title_key;

use crate::provider::{MetadataProvider, MovieQuery, ProviderError};

static CATALOG_GZ: &[u8] = include_bytes!("../catalog/films.tsv.gz");

/// A piece of the catalog's text.
#[derive(Debug, Clone, Copy)]
struct Span {
    start: u32,
    len: u32,
}

/// A film: its line of the table, and the two numbers parsed once.
#[derive(Debug, Clone, Copy)]
struct Film {
    line: Span,
    year: i32,
    runtime: u32,
}

/// One person credited on one film (directing or cast).
#[derive(Debug, Clone, Copy)]
struct Credit {
    name: Span,
    film: u32,
}

/// A film's fields, borrowed from the catalog's text.
struct Fields<'a> {
    wikidata: &'a str,
    imdb: &'a str,
    title: &'a str,
    genres: &'a str,
    directors: &'a str,
    cast: &'a str,
}

/// The items of a `|`-separated list field.
fn items(field: &str) -> impl Iterator<Item = &str> {
    field.split('|').filter(|s| !s.is_empty())
}

/// The catalog, decoded once per process. It keeps the decompressed table (4 MB) and indexes
/// of positions into it, not a string per field: as maps of owned strings it took about 40 MB,
/// more than the rest of the handlers process together.
pub struct Catalog {
    text: Box<str>,
    films: Vec<Film>,
    /// Film numbers sorted by IMDb id (films without one left out), by Wikidata id, and by title
    /// key and year. Where two films share a key, the first in the table wins.
    by_imdb: Vec<u32>,
    by_wikidata: Vec<u32>,
    by_title: Vec<u32>,
    /// Every credit, sorted by name and then film: a person's films are one run of it.
    credits: Vec<Credit>,
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
        if u32::try_from(text.len()).is_err() {
            return Err(format!("catalog: {} bytes is more than its positions can address", text.len()));
        }
        let mut catalog = Catalog {
            text: text.into_boxed_str(),
            films: Vec::new(),
            by_imdb: Vec::new(),
            by_wikidata: Vec::new(),
            by_title: Vec::new(),
            credits: Vec::new(),
        };
        let text = &catalog.text;
        let span = |s: &str| Span { start: (s.as_ptr() as usize - text.as_ptr() as usize) as u32, len: s.len() as u32 };
        for line in text.lines().filter(|l| !l.starts_with('#')).skip(1) {
            let f: Vec<&str> = line.split('\t').collect();
            if f.len() != 8 {
                return Err(format!("catalog: a line has {} fields, expected 8: {line:?}", f.len()));
            }
            let film = catalog.films.len() as u32;
            catalog.films.push(Film {
                line: span(line),
                year: f[3].parse().map_err(|_| format!("catalog: bad year in {line:?}"))?,
                runtime: f[4].parse().map_err(|_| format!("catalog: bad runtime in {line:?}"))?,
            });
            catalog.credits.extend(items(f[6]).chain(items(f[7])).map(|name| Credit { name: span(name), film }));
        }
        let all = 0..catalog.films.len() as u32;
        // Stable sorts: among films with one key, table order stays, so the first wins.
        let mut by_imdb: Vec<u32> = all.clone().filter(|&i| !catalog.fields(i).imdb.is_empty()).collect();
        by_imdb.sort_by_cached_key(|&i| catalog.fields(i).imdb);
        let mut by_wikidata: Vec<u32> = all.clone().collect();
        by_wikidata.sort_by_cached_key(|&i| catalog.fields(i).wikidata);
        let mut by_title: Vec<u32> = all.collect();
        by_title.sort_by_cached_key(|&i| catalog.title_and_year(i));
        let mut credits = std::mem::take(&mut catalog.credits);
        // Name and film make the order total: an unstable sort gives the same result.
        credits.sort_unstable_by(|a, b| catalog.str(a.name).cmp(catalog.str(b.name)).then(a.film.cmp(&b.film)));
        // A person both directing and in the cast of one film is credited once.
        credits.dedup_by(|a, b| a.film == b.film && catalog.str(a.name) == catalog.str(b.name));
        credits.shrink_to_fit();
        catalog.films.shrink_to_fit();
        (catalog.by_imdb, catalog.by_wikidata, catalog.by_title, catalog.credits) =
            (by_imdb, by_wikidata, by_title, credits);
        Ok(catalog)
    }

    fn str(&self, span: Span) -> &str {
        &self.text[span.start as usize..(span.start + span.len) as usize]
    }

    fn fields(&self, film: u32) -> Fields<'_> {
        let mut f = self.str(self.films[film as usize].line).split('\t');
        let mut next = || f.next().unwrap_or_default();
        let (wikidata, imdb, title) = (next(), next(), next());
        let (_year, _runtime) = (next(), next());
        Fields { wikidata, imdb, title, genres: next(), directors: next(), cast: next() }
    }

    fn title_and_year(&self, film: u32) -> (String, i32) {
        (title_key(self.fields(film).title), self.films[film as usize].year)
    }

    /// The first film of `index` whose key (by `key`) equals `wanted`; `index` is sorted by it.
    fn lookup<K: Ord>(index: &[u32], wanted: &K, key: impl Fn(u32) -> K) -> Option<u32> {
        let at = index.partition_point(|&i| key(i) < *wanted);
        index.get(at).copied().filter(|&i| key(i) == *wanted)
    }

    /// Every film's title and year, in catalog order.
    pub fn titles(&self) -> impl Iterator<Item = (&str, i32)> {
        (0..self.films.len() as u32).map(|i| (self.fields(i).title, self.films[i as usize].year))
    }

    pub fn len(&self) -> usize {
        self.films.len()
    }

    pub fn is_empty(&self) -> bool {
        self.films.is_empty()
    }

    fn find(&self, query: &MovieQuery) -> Option<u32> {
        let by_id = query.external_id.as_deref().and_then(|id| match id.split_once(':') {
            Some(("imdb", imdb)) if !imdb.is_empty() => Self::lookup(&self.by_imdb, &imdb, |i| self.fields(i).imdb),
            Some(("wikidata", q)) => Self::lookup(&self.by_wikidata, &q, |i| self.fields(i).wikidata),
            _ => None,
        });
        by_id.or_else(|| {
            let wanted = (title_key(&query.title), query.year);
            Self::lookup(&self.by_title, &wanted, |i| self.title_and_year(i))
        })
    }

    /// The films crediting `name`, in table order.
    fn credits<'a>(&'a self, name: &'a str) -> impl Iterator<Item = u32> + 'a {
        let at = self.credits.partition_point(|c| self.str(c.name) < name);
        self.credits[at..].iter().take_while(move |c| self.str(c.name) == name).map(|c| c.film)
    }

    fn profile(&self, film: u32) -> v1::MovieProfile {
        let f = self.fields(film);
        let Film { year, runtime, .. } = self.films[film as usize];
        let credit = |name: &str| v1::PersonCredit {
            person_id: format!("catalog:{name}"),
            name: name.to_owned(),
            role: String::new(),
        };
        v1::MovieProfile {
            provider: "catalog".into(),
            provider_id: format!("wikidata:{}", f.wikidata),
            imdb_id: f.imdb.to_owned(),
            title: f.title.to_owned(),
            year,
            runtime_minutes: runtime,
            genres: items(f.genres).map(str::to_owned).collect(),
            directors: items(f.directors).map(credit).collect(),
            cast: items(f.cast).map(credit).collect(),
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
        Ok(self.find(query).map(|film| self.profile(film)))
    }

    async fn person(&self, person_id: &str) -> Result<Option<v1::Person>, ProviderError> {
        let Some(name) = person_id.strip_prefix("catalog:") else { return Ok(None) };
        let mut credits = self.credits(name).peekable();
        if credits.peek().is_none() {
            return Ok(None);
        }
        let known_for =
            credits.take(20).map(|i| format!("{} ({})", self.fields(i).title, self.films[i as usize].year)).collect();
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
        // Directing and acting in one film is one credit; the first twenty, in table order.
        let eastwood = catalog.person("catalog:Clint Eastwood").await.unwrap().unwrap().known_for;
        assert_eq!(eastwood.len(), 20);
        assert_eq!(eastwood.iter().filter(|f| *f == "Play Misty for Me (1971)").count(), 1, "{eastwood:?}");
        let mut unique = eastwood.clone();
        unique.dedup();
        assert_eq!(unique, eastwood);
    }
}
