//! End to end on the embedded default (`reelay run`: write + handlers, db backend): a review
//! logged, edited and deleted through the public API is found, updated and then gone from
//! search, with no broker anywhere.

use std::time::Duration;

use reelay_contracts::v1::{self, search_client::SearchClient};
use reelay_harness::{Reelay, movie_ref, temp_dir};

const BIN: &str = env!("CARGO_BIN_EXE_reelay");

async fn eventually<F, Fut>(what: &str, probe: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    reelay_harness::eventually(what, Duration::from_secs(20), probe).await
}

async fn review_hits(search: &mut SearchClient<reelay_harness::AuthedChannel>, query: &str) -> Vec<v1::ReviewHit> {
    search
        .search_reviews(v1::SearchReviewsRequest { query: query.into(), page_size: 20, page_token: String::new() })
        .await
        .expect("search reviews")
        .into_inner()
        .hits
}

pub async fn review_lifecycle_reaches_search(env: &[(&str, &str)]) {
    let dir = temp_dir();
    let db = dir.path().join("reelay.db");
    let mut reelay = Reelay::start_all(BIN, &db, env).await;
    let mut c = reelay.clients().await;
    let mut search = SearchClient::new(reelay.handlers_channel().await);
    let ana = c.user("ana").await;

    let review = c.review_with_text(&ana, movie_ref("Heat", 1995), 9, "The diner scene is unbearable tension.").await;
    eventually("the logged review is searchable", || {
        let mut search = search.clone();
        let id = review.review_id.clone();
        async move { review_hits(&mut search, "diner").await.iter().any(|h| h.review_id == id) }
    })
    .await;
    let hit = review_hits(&mut search, "tension").await.remove(0);
    assert_eq!(
        (hit.user_id.as_str(), hit.movie_title.as_str(), hit.rating, hit.remote),
        (ana.as_str(), "Heat", 9, false)
    );
    let movies = search
        .search_movies(v1::SearchMoviesRequest { query: "heat".into(), ..Default::default() })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(movies.hits.iter().map(|h| (h.title.as_str(), h.year)).collect::<Vec<_>>(), [("Heat", 1995)]);

    c.reviews
        .edit_review(v1::EditReviewRequest {
            actor_user_id: ana.clone(),
            review_id: review.review_id.clone(),
            rating: 10,
            body: "Rewatched: the heist holds up.".into(),
            ..Default::default()
        })
        .await
        .unwrap();
    eventually("the edit is searchable and the old text is not", || {
        let mut search = search.clone();
        async move {
            !review_hits(&mut search, "heist").await.is_empty() && review_hits(&mut search, "diner").await.is_empty()
        }
    })
    .await;
    assert_eq!(review_hits(&mut search, "heist").await[0].rating, 10);

    let deleted = c
        .reviews
        .delete_review(v1::DeleteReviewRequest {
            actor_user_id: ana.clone(),
            review_id: review.review_id.clone(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert!(deleted.movie_deleted);
    eventually("the deleted review and its orphan movie are gone from search", || {
        let mut search = search.clone();
        async move {
            let movies = search
                .search_movies(v1::SearchMoviesRequest { query: "heat".into(), ..Default::default() })
                .await
                .unwrap()
                .into_inner();
            review_hits(&mut search, "heist").await.is_empty() && movies.hits.is_empty()
        }
    })
    .await;

    // A title and a review without spaces between words are found by a word inside them.
    let spirited =
        c.review_with_text(&ana, movie_ref("千と千尋の神隠し", 2001), 10, "何度見ても新しい発見がある。").await;
    eventually("a Japanese review is found by a word inside it", || {
        let mut search = search.clone();
        async move { review_hits(&mut search, "発見").await.len() == 1 }
    })
    .await;
    assert_eq!(review_hits(&mut search, "千尋 発見").await[0].review_id, spirited.review_id);
    let movies = search
        .search_movies(v1::SearchMoviesRequest { query: "神隠し".into(), ..Default::default() })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(movies.hits.iter().map(|h| h.title.as_str()).collect::<Vec<_>>(), ["千と千尋の神隠し"]);
    reelay.stop().await;
}

#[tokio::test]
async fn review_lifecycle_reaches_search_on_the_db_backend() {
    review_lifecycle_reaches_search(&[("EVENT_BUS_BACKEND", "db")]).await;
}

#[tokio::test]
async fn review_lifecycle_reaches_search_on_the_nats_backend() {
    let dir = temp_dir();
    let nats = reelay_harness::NatsServer::start(&dir.path().join("nats"));
    let (url, monitor) = (nats.url(), nats.monitor_url());
    review_lifecycle_reaches_search(&[
        ("EVENT_BUS_BACKEND", "nats"),
        ("NATS_URL", &url),
        ("REELAY_NATS_MONITOR_URL", &monitor),
    ])
    .await;
}

/// The search index's disk fills up while reviews are logged: the write service acknowledges
/// them (its database is elsewhere), the index's commits fail part way and are rolled back, and
/// the handler holds the reviews (the index is unavailable, not they at fault) and tries again,
/// spending no attempt: the disk stays full long past the two attempts each has, and none is
/// dead-lettered. Searches keep answering from what was committed, and once space is freed
/// every acknowledged review is found, each once.
#[tokio::test]
async fn a_full_disk_under_the_search_index_loses_no_review() {
    let dir = temp_dir();
    let disk = reelay_harness::Tmpfs::mount(&dir.path().join("search"), "16m");
    let search_dir = disk.path.to_str().unwrap().to_owned();
    let db = dir.path().join("reelay.db");
    let mut reelay = Reelay::start_all(
        BIN,
        &db,
        &[
            ("EVENT_BUS_BACKEND", "db"),
            ("REELAY_SEARCH_DIR", &search_dir),
            ("REELAY_RETRY_BASE_MS", "200"),
            ("EVENT_QUEUE_MAX_ATTEMPTS", "2"),
        ],
    )
    .await;
    let mut c = reelay.clients().await;
    let mut search = SearchClient::new(reelay.handlers_channel().await);
    let ana = c.user("ana").await;
    let first = c.review_with_text(&ana, movie_ref("Heat", 1995), 9, "The diner scene.").await;
    eventually("the first review is searchable", || {
        let mut search = search.clone();
        async move { review_hits(&mut search, "diner").await.len() == 1 }
    })
    .await;

    // Full but for 16 KiB: the first commits' files start to be written, then writes fail.
    disk.fill();
    disk.free(16 * 1024);
    let mut logged = Vec::new();
    for n in 0..12 {
        // Text that does not compress to nothing, so the index's files take room.
        let prose: Vec<String> = (0..300u64).map(|w| format!("{:x}", (w + 1) * 2_654_435_761 * (n + 1))).collect();
        let text = format!("Night {n}: the waterfront shootout, word{n}. {}", prose.join(" "));
        logged.push(c.review_with_text(&ana, movie_ref("Heat", 1995), 8, &text).await.review_id);
    }
    eventually("the index's commit fails on the full disk", || {
        let failed = reelay.log_text().contains("search index batch failed");
        async move { failed }
    })
    .await;
    // Searches keep answering from what was indexed before the disk filled.
    assert_eq!(review_hits(&mut search, "diner").await[0].review_id, first.review_id);
    let held = || async {
        let metrics = reelay.metrics().await;
        metrics.value(r#"reelay_handler_events_held_for_dependency{handler="search"}"#).unwrap_or_default()
    };
    eventually("the handler holds the reviews it could not index", || async { held().await > 0.0 }).await;
    // Two attempts with a 200 ms backoff would have been spent in well under a second.
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert_eq!(reelay_harness::dead_letters(&db, false).await, 0, "an index out of disk spends no attempt");
    assert!(held().await > 0.0, "still held while the disk is full");

    disk.drain();
    eventually("every review acknowledged while the disk was full is searchable", || {
        let mut search = search.clone();
        async move { review_hits(&mut search, "waterfront").await.len() == 12 }
    })
    .await;
    eventually("the handler holds nothing once the disk has room", || async { held().await == 0.0 }).await;
    for (n, id) in logged.iter().enumerate() {
        let hits = review_hits(&mut search, &format!("word{n}")).await;
        assert_eq!(hits.iter().map(|h| h.review_id.as_str()).collect::<Vec<_>>(), [id.as_str()], "word{n}");
    }
    let after = c.review_with_text(&ana, movie_ref("Heat", 1995), 7, "The airport ending.").await;
    eventually("a review logged after the disk was freed is searchable", || {
        let mut search = search.clone();
        async move { review_hits(&mut search, "airport").await.len() == 1 }
    })
    .await;
    assert_eq!(review_hits(&mut search, "airport").await[0].review_id, after.review_id);
    reelay.stop().await;
}
