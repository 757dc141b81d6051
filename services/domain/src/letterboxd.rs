//! Parsing of Letterboxd CSV exports (`diary.csv`, `reviews.csv`, `watched.csv`/`ratings.csv`),
//! and joining an export's diary with its reviews ([`attach_reviews`]).
//!
//! Columns are found by header name: `Name` and `Year` are required; `Letterboxd URI`, `Rating`
//! (0.5–5 stars), `Rewatch`, `Review` and `Watched Date` are used when present. Every row is
//! validated before anything is imported; an error names the line and column. A row with an
//! empty `Year` (Letterboxd lists films not yet dated) is left out and named, not an error: no
//! film can be found or made without its year. [`parse_diary`] takes only a diary (or its
//! reviews): the export's other lists name films, not viewings.

use crate::validate::{self, ValidationError};

/// The request field that carries the CSV bytes.
const FIELD: &str = "data";

/// Letterboxd exports are small (a heavy user has a few thousand entries); this bounds memory.
pub const MAX_ROWS: usize = 100_000;

/// One diary entry from an export.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiaryRow {
    /// 1-based line of the row in the file (the header is line 1).
    pub line: u64,
    pub title: String,
    pub year: i32,
    /// The entry's Letterboxd URI; empty when the export has none.
    pub letterboxd_uri: String,
    /// Half stars, 0 = unrated.
    pub rating: u32,
    pub rewatch: bool,
    pub body: String,
    pub watched_on: String,
}

impl DiaryRow {
    /// What identifies this entry across imports of the same export.
    pub fn import_key(&self) -> String {
        if self.letterboxd_uri.is_empty() {
            format!("letterboxd:{}|{}|{}", validate::title_key(&self.title), self.year, self.watched_on)
        } else {
            format!("letterboxd:{}", self.letterboxd_uri)
        }
    }
}

/// A row [`parse`] left out because it names no year.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WithoutYear {
    /// 1-based line of the row in the file.
    pub line: u64,
    pub title: String,
}

/// What an export holds: its entries, and the rows left out for want of a year.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Parsed {
    pub rows: Vec<DiaryRow>,
    pub without_year: Vec<WithoutYear>,
}

struct Columns {
    name: usize,
    year: usize,
    uri: Option<usize>,
    rating: Option<usize>,
    rewatch: Option<usize>,
    review: Option<usize>,
    watched: Option<usize>,
    date: Option<usize>,
}

fn error(line: u64, reason: impl std::fmt::Display) -> ValidationError {
    ValidationError::new(FIELD, format!("line {line}: {reason}"))
}

/// [`parse`] for a diary: refused, before any row is read, unless the header has a `Watched
/// Date` or a `Review` column. The export's watchlist, ratings, watched and likes lists share
/// the diary's first columns; read as a diary, each film on them would become a viewing (and a
/// film rated and in the diary, two).
pub fn parse_diary(data: &[u8], now_ms: i64) -> Result<Parsed, ValidationError> {
    if !is_diary(data) {
        return Err(error(
            1,
            "the header has no Watched Date or Review column, so this is not a diary (the export's watchlist, \
             ratings and watched lists name films, not viewings): send its diary.csv or reviews.csv",
        ));
    }
    parse(data, now_ms)
}

/// Whether the CSV's header has a `Watched Date` or a `Review` column: a diary or its reviews,
/// not one of the export's lists of films (see [`parse_diary`]).
pub fn is_diary(data: &[u8]) -> bool {
    let mut reader = csv::ReaderBuilder::new().has_headers(true).from_reader(data);
    reader.headers().is_ok_and(|headers| {
        headers.iter().any(|h| ["Watched Date", "Review"].iter().any(|c| h.trim().eq_ignore_ascii_case(c)))
    })
}

/// Parses and validates a whole export, as of `now_ms` (a watch date may not be after today
/// anywhere).
pub fn parse(data: &[u8], now_ms: i64) -> Result<Parsed, ValidationError> {
    let mut reader = csv::ReaderBuilder::new().has_headers(true).flexible(false).from_reader(data);
    let headers = reader.headers().map_err(|e| error(1, format!("unreadable header: {e}")))?.clone();
    let find = |name: &str| headers.iter().position(|h| h.trim().eq_ignore_ascii_case(name));
    let columns = Columns {
        name: find("Name").ok_or_else(|| error(1, "the header has no Name column"))?,
        year: find("Year").ok_or_else(|| error(1, "the header has no Year column"))?,
        uri: find("Letterboxd URI"),
        rating: find("Rating"),
        rewatch: find("Rewatch"),
        review: find("Review"),
        watched: find("Watched Date"),
        date: find("Date"),
    };

    let mut rows = Vec::new();
    let mut without_year = Vec::new();
    for record in reader.records() {
        let record = record.map_err(|e| {
            let line = e.position().map_or(0, |p| p.line());
            error(line, format!("malformed CSV: {e}"))
        })?;
        let line = record.position().map_or(0, |p| p.line());
        if record.iter().all(|f| f.trim().is_empty()) {
            continue;
        }
        if rows.len() + without_year.len() == MAX_ROWS {
            return Err(error(line, format!("an import holds at most {MAX_ROWS} rows")));
        }
        let get = |i: Option<usize>| i.and_then(|i| record.get(i)).unwrap_or("").trim();
        let column_error = |column: &str, e: ValidationError| error(line, format!("{column} {}", e.reason));

        let title = validate::title("Name", get(Some(columns.name))).map_err(|e| column_error("Name", e))?;
        let year_text = get(Some(columns.year));
        if year_text.is_empty() {
            without_year.push(WithoutYear { line, title });
            continue;
        }
        let year = year_text
            .parse::<i32>()
            .map_err(|_| error(line, format!("Year must be a number, got {year_text:?}")))
            .and_then(|y| validate::year("Year", y).map_err(|e| column_error("Year", e)))?;
        let rating = parse_stars(get(columns.rating)).ok_or_else(|| {
            error(line, format!("Rating must be empty or 0.5 to 5 in steps of 0.5, got {:?}", get(columns.rating)))
        })?;
        let rewatch = match get(columns.rewatch).to_ascii_lowercase().as_str() {
            "" | "no" | "false" => false,
            "yes" | "true" => true,
            other => return Err(error(line, format!("Rewatch must be Yes or empty, got {other:?}"))),
        };
        let body = validate::body("Review", get(columns.review)).map_err(|e| column_error("Review", e))?;
        // A diary row's watch date is "Watched Date"; ratings/watched exports only have "Date".
        let watched_raw = match get(columns.watched) {
            "" => get(columns.date),
            watched => watched,
        };
        let watched_on =
            validate::watch_date("Watched Date", watched_raw, now_ms).map_err(|e| column_error("Watched Date", e))?;
        let letterboxd_uri = get(columns.uri);
        if !letterboxd_uri.is_empty() {
            validate::uri("Letterboxd URI", letterboxd_uri).map_err(|e| column_error("Letterboxd URI", e))?;
        }
        rows.push(DiaryRow {
            line,
            title,
            year,
            letterboxd_uri: letterboxd_uri.to_owned(),
            rating,
            rewatch,
            body,
            watched_on,
        });
    }
    Ok(Parsed { rows, without_year })
}

/// The columns [`attach_reviews`] writes: those [`parse`] reads.
const JOINED_COLUMNS: [&str; 8] =
    ["Date", "Name", "Year", "Letterboxd URI", "Rating", "Rewatch", "Review", "Watched Date"];

/// Joins an export's `diary.csv` with its `reviews.csv` into one diary CSV: each review's text
/// is attached to the diary entry with the same `Letterboxd URI` (Letterboxd gives a review the
/// URI of the diary entry it was written for), and a review with no diary entry becomes an
/// entry of its own. Rows keep their order, diary first. Both files must parse (see [`parse`]).
pub fn attach_reviews(diary: &[u8], reviews: &[u8]) -> Result<Vec<u8>, ValidationError> {
    let read = |data: &[u8]| -> Result<Vec<Vec<(String, String)>>, ValidationError> {
        let mut reader = csv::ReaderBuilder::new().has_headers(true).flexible(false).from_reader(data);
        let headers: Vec<String> = reader
            .headers()
            .map_err(|e| error(1, format!("unreadable header: {e}")))?
            .iter()
            .map(|h| h.trim().to_owned())
            .collect();
        let mut rows = Vec::new();
        for record in reader.records() {
            let record =
                record.map_err(|e| error(e.position().map_or(0, |p| p.line()), format!("malformed CSV: {e}")))?;
            rows.push(headers.iter().cloned().zip(record.iter().map(str::to_owned)).collect());
        }
        Ok(rows)
    };
    let get = |row: &[(String, String)], column: &str| {
        row.iter().find(|(h, _)| h.eq_ignore_ascii_case(column)).map(|(_, v)| v.trim().to_owned()).unwrap_or_default()
    };
    let diary = read(diary)?;
    let reviews = read(reviews)?;
    let mut by_uri: std::collections::HashMap<String, usize> = std::collections::HashMap::new();
    for (i, review) in reviews.iter().enumerate() {
        let uri = get(review, "Letterboxd URI");
        if !uri.is_empty() {
            by_uri.insert(uri, i);
        }
    }
    let mut used = vec![false; reviews.len()];
    let mut writer = csv::Writer::from_writer(Vec::new());
    let written = |e: csv::Error| error(0, format!("cannot write the joined export: {e}"));
    writer.write_record(JOINED_COLUMNS).map_err(written)?;
    for entry in &diary {
        let review = by_uri.get(&get(entry, "Letterboxd URI")).copied();
        if let Some(i) = review {
            used[i] = true;
        }
        let record: Vec<String> = JOINED_COLUMNS
            .iter()
            .map(|c| match (*c, review) {
                ("Review", Some(i)) => get(&reviews[i], "Review"),
                (c, _) => get(entry, c),
            })
            .collect();
        writer.write_record(&record).map_err(written)?;
    }
    for (review, _) in reviews.iter().zip(&used).filter(|(_, used)| !**used) {
        let record: Vec<String> = JOINED_COLUMNS.iter().map(|c| get(review, c)).collect();
        writer.write_record(&record).map_err(written)?;
    }
    writer.into_inner().map_err(|e| error(0, format!("cannot write the joined export: {e}")))
}

/// "3.5" stars → 7 half stars; empty → 0 (unrated); `None` unless 0.5 to 5 in steps of 0.5.
pub fn parse_stars(text: &str) -> Option<u32> {
    if text.is_empty() {
        return Some(0);
    }
    let stars: f64 = text.parse().ok()?;
    let half = stars * 2.0;
    let whole = half.round();
    ((whole - half).abs() < 1e-9 && (1.0..=10.0).contains(&whole)).then_some(whole as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 2024-06-01 00:00 UTC.
    const NOW: i64 = 1_717_200_000_000;

    #[test]
    fn a_watch_date_after_today_is_refused() {
        let future = "Date,Name,Year,Letterboxd URI,Rating,Rewatch,Tags,Watched Date\n\
            2024-01-03,Alien,1979,https://boxd.it/aaa1,4.5,,,2031-05-01\n";
        let error = parse(future.as_bytes(), NOW).unwrap_err();
        assert!(error.reason.contains("line 2: Watched Date") && error.reason.contains("future"), "{error:?}");
    }

    const DIARY: &str = "Date,Name,Year,Letterboxd URI,Rating,Rewatch,Tags,Watched Date\n\
        2024-01-03,Alien,1979,https://boxd.it/aaa1,4.5,,,2024-01-02\n\
        2024-01-05,\"Crouching Tiger, Hidden Dragon\",2000,https://boxd.it/aaa2,,Yes,\"wuxia, rewatch\",2024-01-05\n";

    #[test]
    fn parses_a_diary_export() {
        let rows = parse(DIARY.as_bytes(), NOW).unwrap().rows;
        assert_eq!(rows.len(), 2);
        assert_eq!(rows[0].title, "Alien");
        assert_eq!(rows[0].rating, 9);
        assert_eq!(rows[0].watched_on, "2024-01-02");
        assert_eq!(rows[0].line, 2);
        assert_eq!(rows[1].title, "Crouching Tiger, Hidden Dragon");
        assert!(rows[1].rewatch);
        assert_eq!(rows[1].rating, 0);
        assert_eq!(rows[1].import_key(), "letterboxd:https://boxd.it/aaa2");
    }

    #[test]
    fn errors_name_line_and_column() {
        let bad = "Date,Name,Year,Letterboxd URI,Rating\n2024-01-01,Alien,1979,,4\n2024-01-01,Heat,95,,4\n";
        let err = parse(bad.as_bytes(), NOW).unwrap_err();
        assert_eq!(err.field, "data");
        assert!(err.reason.starts_with("line 3: Year"), "{err}");

        let bad = "Name,Year,Rating\nAlien,1979,7\n";
        assert!(parse(bad.as_bytes(), NOW).unwrap_err().reason.starts_with("line 2: Rating"));

        let bad = "Name,Rating\nAlien,3\n";
        assert!(parse(bad.as_bytes(), NOW).unwrap_err().reason.contains("no Year column"));

        let ragged = "Name,Year\nAlien,1979\nHeat,1995,extra\n";
        assert!(parse(ragged.as_bytes(), NOW).unwrap_err().reason.starts_with("line 3"));
    }

    /// A film Letterboxd has no year for is left out and named; the rest is read. A year that
    /// is there but wrong is still an error.
    #[test]
    fn a_row_without_a_year_is_left_out_and_named() {
        let diary = "Date,Name,Year,Letterboxd URI,Rating,Rewatch,Tags,Watched Date\n\
            2024-01-03,Alien,1979,https://boxd.it/aaa1,4.5,,,2024-01-02\n\
            2024-01-04,Untitled Project,,https://boxd.it/aaa3,3,,,2024-01-04\n";
        let parsed = parse_diary(diary.as_bytes(), NOW).unwrap();
        assert_eq!(parsed.rows.iter().map(|r| r.title.as_str()).collect::<Vec<_>>(), ["Alien"]);
        assert_eq!(parsed.without_year, [WithoutYear { line: 3, title: "Untitled Project".into() }]);
        let wrong = diary.replace("Project,,", "Project,soon,");
        assert!(parse(wrong.as_bytes(), NOW).unwrap_err().reason.starts_with("line 3: Year"));
    }

    /// Only a diary or its reviews are taken as viewings: the watchlist, ratings and watched
    /// lists are refused by their header, before any row.
    #[test]
    fn a_list_that_is_not_a_diary_is_refused_as_one() {
        let watchlist = "Date,Name,Year,Letterboxd URI\n2024-01-03,Alien,1979,https://boxd.it/29bA\n";
        let ratings = "Date,Name,Year,Letterboxd URI,Rating\n2024-01-03,Alien,1979,https://boxd.it/29bA,4\n";
        for list in [watchlist, ratings] {
            let error = parse_diary(list.as_bytes(), NOW).unwrap_err();
            assert!(
                error.field == "data" && error.reason.starts_with("line 1:") && error.reason.contains("not a diary")
            );
            assert_eq!(parse(list.as_bytes(), NOW).unwrap().rows.len(), 1, "read as a list, it is one");
        }
        assert_eq!(parse_diary(DIARY.as_bytes(), NOW).unwrap().rows.len(), 2);
        let reviews = "Date,Name,Year,Letterboxd URI,Rating,Rewatch,Review\n2024-01-03,Alien,1979,,4,,Good.\n";
        assert_eq!(parse_diary(reviews.as_bytes(), NOW).unwrap().rows.len(), 1);
    }

    #[test]
    fn reviews_join_their_diary_entries() {
        let reviews = "Date,Name,Year,Letterboxd URI,Rating,Rewatch,Review,Tags,Watched Date\n\
            2024-01-03,Alien,1979,https://boxd.it/aaa1,4.5,,\"In space, no one can hear you scream.\",,2024-01-02\n\
            2024-02-01,Heat,1995,https://boxd.it/bbb1,5,,The diner scene.,,2024-01-31\n";
        let joined = attach_reviews(DIARY.as_bytes(), reviews.as_bytes()).unwrap();
        let rows = parse(&joined, NOW).unwrap().rows;
        assert_eq!(rows.len(), 3, "two diary entries and one review without an entry");
        assert_eq!(rows[0].title, "Alien");
        assert_eq!(rows[0].body, "In space, no one can hear you scream.");
        assert_eq!(rows[0].import_key(), "letterboxd:https://boxd.it/aaa1", "the review is the diary entry");
        assert_eq!(rows[1].body, "", "no review for this entry");
        assert_eq!((rows[2].title.as_str(), rows[2].body.as_str()), ("Heat", "The diner scene."));
        assert_eq!(rows[2].watched_on, "2024-01-31");
    }

    #[test]
    fn stars() {
        assert_eq!(parse_stars("0.5"), Some(1));
        assert_eq!(parse_stars("5"), Some(10));
        assert_eq!(parse_stars("5.5"), None);
        assert_eq!(parse_stars("2.25"), None);
        assert_eq!(parse_stars("0"), None);
    }
}
