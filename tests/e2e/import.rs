//! ImportDiary of a real-shaped Letterboxd export: every row with its events, and a re-import
//! that creates no duplicates.

use std::collections::HashSet;

use reelay_contracts::v1::{self, event::Payload};
use reelay_harness::{Reelay, outbox_rows, query_strings, temp_dir};

const BIN: &str = env!("CARGO_BIN_EXE_reelay");
const DIARY: &[u8] = include_bytes!("../fixtures/letterboxd-diary.csv");

/// (title, year) pairs and row count, read independently of Reelay's parser.
fn expected() -> (usize, HashSet<(String, i32)>) {
    let mut reader = csv::Reader::from_reader(DIARY);
    let mut films = HashSet::new();
    let mut rows = 0;
    for record in reader.records() {
        let record = record.unwrap();
        films.insert((record[1].to_lowercase(), record[2].parse().unwrap()));
        rows += 1;
    }
    (rows, films)
}

#[tokio::test]
async fn a_letterboxd_export_imports_every_row_once() {
    let (rows, films) = expected();
    assert!(rows >= 300, "the fixture is a few hundred rows");
    let dir = temp_dir();
    let db = dir.path().join("reelay.db");
    let mut reelay = Reelay::start_write(BIN, &db, &[]).await;
    let mut c = reelay.clients().await;
    let ana = c.user("ana").await;
    let before = outbox_rows(&db).await.len();

    let first = c.import(&ana, DIARY).await.unwrap();
    assert_eq!(first.rows as usize, rows);
    assert_eq!(first.imported as usize, rows);
    assert_eq!(first.skipped_duplicates, 0);
    assert_eq!(first.movies_discovered as usize, films.len());

    let count = |sql: &'static str| {
        let db = db.clone();
        async move { query_strings(&db, sql).await[0][0].parse::<usize>().unwrap() }
    };
    assert_eq!(count("SELECT COUNT(*) || '' FROM reviews WHERE source = 'import'").await, rows);
    assert_eq!(count("SELECT COUNT(*) || '' FROM movies").await, films.len());
    assert_eq!(count("SELECT COUNT(DISTINCT import_key) || '' FROM reviews").await, rows);

    let events = outbox_rows(&db).await.split_off(before);
    let of_type = |t: &str| events.iter().filter(|e| e.event_type == t).count();
    assert_eq!(of_type("ReviewLogged"), rows);
    assert_eq!(of_type("MovieDiscovered"), films.len());
    assert_eq!(of_type("DiaryImported"), rows.div_ceil(250), "one summary per committed chunk");
    assert_eq!(events.len(), rows + films.len() + rows.div_ceil(250));
    let ids: HashSet<_> = events.iter().map(|e| e.event_id.clone().unwrap()).collect();
    assert_eq!(ids.len(), events.len());
    // Spot-check a row with commas and quotes, and its rating in half stars.
    let quoted = events.iter().find_map(|e| match e.envelope.clone()?.payload? {
        Payload::ReviewLogged(r) if r.movie_title == "The \"Quoted\" Title" => Some(r),
        _ => None,
    });
    let quoted = quoted.expect("the quoted title was imported");
    assert_eq!(quoted.source, v1::ReviewSource::Import as i32);
    assert_eq!(quoted.user_id, ana);
    let tiger =
        count("SELECT COUNT(*) || '' FROM movies WHERE title = 'Crouching Tiger, Hidden Dragon' AND year = 2000").await;
    assert_eq!(tiger, 1);

    // The same file again: nothing new.
    let snapshot = reelay_harness::table_snapshot(&db).await;
    let second = c.import(&ana, DIARY).await.unwrap();
    assert_eq!((second.imported, second.skipped_duplicates as usize, second.movies_discovered), (0, rows, 0));
    assert_eq!(reelay_harness::table_snapshot(&db).await, snapshot, "a re-import writes nothing");

    // An entry its user deleted stays deleted: the export imported again skips it too.
    let first_entry = format!("SELECT id FROM reviews WHERE user_id = '{ana}' ORDER BY id LIMIT 1");
    let gone = query_strings(&db, &first_entry).await[0][0].clone();
    let deleted = v1::DeleteReviewRequest { actor_user_id: ana.clone(), review_id: gone, ..Default::default() };
    c.reviews.delete_review(deleted).await.unwrap();
    let snapshot = reelay_harness::table_snapshot(&db).await;
    let third = c.import(&ana, DIARY).await.unwrap();
    assert_eq!((third.imported, third.skipped_duplicates as usize), (0, rows));
    assert_eq!(reelay_harness::table_snapshot(&db).await, snapshot, "nothing deleted comes back");

    // A row with no year is left out and counted; the rest of the file is imported.
    let undated = b"Date,Name,Year,Letterboxd URI,Rating,Rewatch,Tags,Watched Date\n\
        2021-03-01,Untitled Project,,https://boxd.it/u1,,,,2021-03-01\n\
        2021-03-02,Heat,1995,https://boxd.it/u2,4,,,2021-03-02\n";
    let some = c.import(&ana, undated).await.unwrap();
    assert_eq!((some.rows, some.imported, some.skipped_without_year), (1, 1, 1));

    // Another user importing the same export gets their own diary, sharing the movies.
    let ben = c.user("ben").await;
    let other = c.import(&ben, DIARY).await.unwrap();
    assert_eq!((other.imported as usize, other.movies_discovered), (rows, 0));
    reelay.stop().await;
}
