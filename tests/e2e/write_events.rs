//! Every state-changing call commits its domain rows and exactly its events in one transaction,
//! against the real binary and a real SQLite file.

use std::path::Path;

use reelay_contracts::v1::{self, event::Payload};
use reelay_harness::{
    OutboxRow, Reelay, actor_account, movie_id_ref, movie_ref, outbox_rows, query_strings, table_snapshot, temp_dir,
    user_account,
};
use tonic::Code;

const BIN: &str = env!("CARGO_BIN_EXE_reelay");

/// Reads the outbox rows written since the last call.
struct OutboxCursor<'a> {
    db: &'a Path,
    seen: usize,
}

impl OutboxCursor<'_> {
    async fn new_rows(&mut self) -> Vec<OutboxRow> {
        let rows = outbox_rows(self.db).await;
        let fresh = rows[self.seen..].to_vec();
        self.seen = rows.len();
        for row in &fresh {
            let envelope = row.envelope.as_ref().expect("payload decodes as an Event envelope");
            let event_id = row.event_id.as_deref().expect("enqueue_events always sets event_id");
            assert!(uuid_like(event_id), "{event_id}");
            assert_eq!(envelope.event_id, event_id);
            assert_eq!(envelope.event_type, row.event_type);
            assert_eq!(envelope.aggregate_id, row.aggregate_id);
            assert_eq!(row.status, "pending");
            assert!(envelope.occurred_at_ms > 0);
            assert!(envelope.traceparent.starts_with("00-"), "{}", envelope.traceparent);
        }
        fresh
    }

    async fn expect(&mut self, types: &[&str]) -> Vec<Payload> {
        let rows = self.new_rows().await;
        let got: Vec<&str> = rows.iter().map(|r| r.event_type.as_str()).collect();
        assert_eq!(got, types, "outbox rows written by the last call");
        rows.into_iter().map(|r| r.envelope.unwrap().payload.unwrap()).collect()
    }
}

fn uuid_like(s: &str) -> bool {
    s.len() == 36
        && s.chars()
            .enumerate()
            .all(|(i, c)| if [8, 13, 18, 23].contains(&i) { c == '-' } else { c.is_ascii_hexdigit() })
}

async fn count(db: &Path, sql: &str) -> i64 {
    query_strings(db, &format!("SELECT CAST(({sql}) AS TEXT)")).await[0][0].parse().unwrap()
}

#[tokio::test]
async fn every_covered_write_commits_its_rows_and_events_together() {
    let dir = temp_dir();
    let db = dir.path().join("reelay.db");
    let mut reelay = Reelay::start_write(BIN, &db, &[]).await;
    let mut c = reelay.clients().await;
    let mut outbox = OutboxCursor { db: &db, seen: 0 };

    // Users
    let ana = c.user("ana").await;
    let events = outbox.expect(&["UserRegistered"]).await;
    assert!(matches!(&events[0], Payload::UserRegistered(e) if e.user_id == ana && e.handle == "ana"));
    let ben = c.user("ben").await;
    outbox.expect(&["UserRegistered"]).await;

    // Movie discovery: a new movie raises MovieDiscovered; the same one again writes nothing.
    let found = c
        .movies
        .discover_movie(v1::DiscoverMovieRequest {
            actor_user_id: ana.clone(),
            title: "Alien".into(),
            year: 1979,
            external_id: "tmdb:348".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert!(found.created);
    let alien = found.movie.unwrap().movie_id;
    let events = outbox.expect(&["MovieDiscovered"]).await;
    assert!(
        matches!(&events[0], Payload::MovieDiscovered(e) if e.movie_id == alien && e.title == "Alien" && e.year == 1979 && e.external_id == "tmdb:348")
    );
    let again = c
        .movies
        .discover_movie(v1::DiscoverMovieRequest {
            actor_user_id: ben.clone(),
            title: " alien ".into(),
            year: 1979,
            external_id: String::new(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert!(!again.created);
    assert_eq!(again.movie.unwrap().movie_id, alien);
    outbox.expect(&[]).await;

    // Enrichment request
    let requested = c
        .movies
        .request_enrichment(v1::RequestEnrichmentRequest {
            actor_user_id: ana.clone(),
            movie_id: alien.clone(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let rows = outbox.new_rows().await;
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].event_type, "EnrichmentRequested");
    assert_eq!(rows[0].event_id.as_deref(), Some(requested.event_id.as_str()));

    // Enrichment saved, then the provider no longer knowing the film: the profile goes, and
    // its MovieEnriched without a profile tells the handlers; a second "not found" is nothing.
    let save =
        |outcome| v1::SaveEnrichmentRequest { movie_id: alien.clone(), outcome: Some(outcome), ..Default::default() };
    let profile = v1::MovieProfile {
        provider: "tmdb".into(),
        provider_id: "tmdb:348".into(),
        directors: vec![v1::PersonCredit {
            person_id: "tmdb:578".into(),
            name: "Ridley Scott".into(),
            ..Default::default()
        }],
        ..Default::default()
    };
    // A profile's texts are single lines within their limits: each refused, naming the field,
    // and nothing written.
    let credit =
        |name: &str, role: &str| v1::PersonCredit { person_id: "tmdb:1".into(), name: name.into(), role: role.into() };
    let refused = [
        ("profile.genres[1]", v1::MovieProfile { genres: vec!["Horror".into(), "Sci\tFi".into()], ..profile.clone() }),
        (
            "profile.directors[0].name",
            v1::MovieProfile { directors: vec![credit("\u{2066}Ridley", "")], ..profile.clone() },
        ),
        (
            "profile.cast[0].role",
            v1::MovieProfile { cast: vec![credit("Sigourney Weaver", "Rip\nley")], ..profile.clone() },
        ),
        ("profile.title", v1::MovieProfile { title: " \u{200b} ".into(), ..profile.clone() }),
        ("profile.year", v1::MovieProfile { year: 19_790, ..profile.clone() }),
        ("profile.provider_id", v1::MovieProfile { provider_id: "348".into(), ..profile.clone() }),
    ];
    for (field, bad) in refused {
        let status =
            c.movies.save_enrichment(save(v1::save_enrichment_request::Outcome::Profile(bad))).await.unwrap_err();
        assert_eq!(status.code(), tonic::Code::InvalidArgument, "{field}: {status:?}");
        assert!(status.message().starts_with(field), "{field}: {}", status.message());
    }
    let long_reason = v1::save_enrichment_request::Outcome::NotFound("x".repeat(1_001));
    let status = c.movies.save_enrichment(save(long_reason)).await.unwrap_err();
    assert!(status.message().starts_with("not_found"), "{status:?}");
    outbox.expect(&[]).await;
    c.movies.save_enrichment(save(v1::save_enrichment_request::Outcome::Profile(profile))).await.unwrap();
    outbox.expect(&["MovieEnriched"]).await;
    // One person named twice in a call (the director of two films enriched together) is saved
    // once, as first named.
    let named = |name: &str| v1::Person { person_id: "tmdb:578".into(), name: name.into(), ..Default::default() };
    let people = vec![named("Ridley Scott"), named("R. Scott")];
    let saved = c.movies.save_people(v1::SavePeopleRequest { people }).await.unwrap().into_inner();
    assert_eq!(saved.changed, 1);
    let person = c.movies.get_person(v1::GetPersonRequest { person_id: "tmdb:578".into() }).await.unwrap();
    assert_eq!(person.into_inner().name, "Ridley Scott");
    outbox.expect(&[]).await;
    for _ in 0..2 {
        c.movies.save_enrichment(save(v1::save_enrichment_request::Outcome::NotFound("gone".into()))).await.unwrap();
    }
    let cleared = outbox.expect(&["MovieEnriched"]).await;
    assert!(matches!(&cleared[0], Payload::MovieEnriched(e) if e.profile.is_none() && e.movie_id == alien));

    // Log a review of an unknown movie: the movie is created with it, both events in order.
    // The caller's trace context rides on the events.
    let traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let mut request = tonic::Request::new(v1::LogReviewRequest {
        actor_user_id: ana.clone(),
        movie: movie_ref("Heat", 1995),
        rating: 9,
        body: "The diner scene.".into(),
        watched_on: "2024-03-01".into(),
        rewatch: false,
        ..Default::default()
    });
    request.metadata_mut().insert("traceparent", traceparent.parse().unwrap());
    let logged = c.reviews.log_review(request).await.unwrap().into_inner();
    assert!(logged.movie_created);
    let heat_review = logged.review.unwrap();
    let rows = outbox.new_rows().await;
    assert_eq!(rows.iter().map(|r| r.event_type.as_str()).collect::<Vec<_>>(), ["MovieDiscovered", "ReviewLogged"]);
    for row in &rows {
        assert_eq!(row.envelope.as_ref().unwrap().traceparent, traceparent);
    }
    let Some(Payload::ReviewLogged(e)) = rows[1].envelope.clone().unwrap().payload else { panic!() };
    assert_eq!(
        (e.review_id.as_str(), e.user_id.as_str(), e.rating, e.movie_title.as_str()),
        (heat_review.review_id.as_str(), ana.as_str(), 9, "Heat")
    );
    assert_eq!(rows[1].aggregate_id, heat_review.review_id);
    assert_eq!(
        count(&db, &format!("SELECT COUNT(*) FROM reviews WHERE id = '{}' AND rating = 9", heat_review.review_id))
            .await,
        1
    );

    // A review of a known movie by id: one event.
    let alien_review = c.review(&ben, movie_id_ref(&alien), 10).await;
    outbox.expect(&["ReviewLogged"]).await;

    // Edit
    let edited = c
        .reviews
        .edit_review(v1::EditReviewRequest {
            actor_user_id: ana.clone(),
            review_id: heat_review.review_id.clone(),
            rating: 10,
            body: "Better every time.".into(),
            watched_on: "2024-03-01".into(),
            rewatch: true,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!((edited.rating, edited.rewatch), (10, true));
    let events = outbox.expect(&["ReviewEdited"]).await;
    assert!(
        matches!(&events[0], Payload::ReviewEdited(e) if e.body == "Better every time." && e.movie_title == "Heat")
    );

    // Watchlist: add (creating the movie), add again (nothing), remove, remove again (nothing).
    let entry = c
        .watchlist
        .add_to_watchlist(v1::AddToWatchlistRequest {
            actor_user_id: ana.clone(),
            movie: movie_ref("Stalker", 1979),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    outbox.expect(&["MovieDiscovered", "WatchlistItemAdded"]).await;
    c.watchlist
        .add_to_watchlist(v1::AddToWatchlistRequest {
            actor_user_id: ana.clone(),
            movie: movie_id_ref(&entry.movie_id),
            ..Default::default()
        })
        .await
        .unwrap();
    outbox.expect(&[]).await;
    assert_eq!(count(&db, "SELECT COUNT(*) FROM watchlist").await, 1);
    let removed = c
        .watchlist
        .remove_from_watchlist(v1::RemoveFromWatchlistRequest {
            actor_user_id: ana.clone(),
            movie_id: entry.movie_id.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(removed.removed);
    // Stalker had no other reference: it goes with its last watchlist entry, as with a review.
    let events = outbox.expect(&["WatchlistItemRemoved", "MovieDeleted"]).await;
    assert!(matches!(&events[1], Payload::MovieDeleted(e) if e.movie_id == entry.movie_id));
    assert_eq!(count(&db, "SELECT COUNT(*) FROM watchlist").await, 0);
    assert_eq!(count(&db, &format!("SELECT COUNT(*) FROM movies WHERE id = '{}'", entry.movie_id)).await, 0);

    // A watchlist lists in the order movies were added, page by page: a film new to Reelay
    // added before one known for long comes first.
    let zodiac = v1::AddToWatchlistRequest {
        actor_user_id: ana.clone(),
        movie: movie_ref("Zodiac", 2007),
        ..Default::default()
    };
    let zodiac = c.watchlist.add_to_watchlist(zodiac).await.unwrap().into_inner().movie_id;
    tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    let known =
        v1::AddToWatchlistRequest { actor_user_id: ana.clone(), movie: movie_id_ref(&alien), ..Default::default() };
    c.watchlist.add_to_watchlist(known).await.unwrap();
    outbox.expect(&["MovieDiscovered", "WatchlistItemAdded", "WatchlistItemAdded"]).await;
    let (mut listed, mut token) = (Vec::new(), String::new());
    loop {
        let page = v1::ListWatchlistRequest { user_id: ana.clone(), page_size: 1, page_token: token };
        let page = c.watchlist.list_watchlist(page).await.unwrap().into_inner();
        listed.extend(page.entries.into_iter().map(|e| e.movie_id));
        if page.next_page_token.is_empty() {
            break;
        }
        token = page.next_page_token;
    }
    assert_eq!(listed, [zodiac.clone(), alien.clone()], "in the order added");
    for movie in [zodiac, alien.clone()] {
        let request = v1::RemoveFromWatchlistRequest { actor_user_id: ana.clone(), movie_id: movie };
        assert!(c.watchlist.remove_from_watchlist(request).await.unwrap().into_inner().removed);
    }
    // Zodiac goes with its last reference; Alien is ben's review's film and stays.
    outbox.expect(&["WatchlistItemRemoved", "MovieDeleted", "WatchlistItemRemoved"]).await;

    // Delete: Heat has no other reference, so the movie goes with its last review.
    let deleted = c
        .reviews
        .delete_review(v1::DeleteReviewRequest {
            actor_user_id: ana.clone(),
            review_id: heat_review.review_id.clone(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert!(deleted.movie_deleted);
    let events = outbox.expect(&["ReviewDeleted", "MovieDeleted"]).await;
    assert!(matches!(&events[1], Payload::MovieDeleted(e) if e.movie_id == heat_review.movie_id));
    assert_eq!(count(&db, &format!("SELECT COUNT(*) FROM movies WHERE id = '{}'", heat_review.movie_id)).await, 0);
    // Alien is still reviewed by ben after ana's review of it goes: only ReviewDeleted.
    let ana_alien = c.review(&ana, movie_id_ref(&alien), 8).await;
    outbox.expect(&["ReviewLogged"]).await;
    let kept = c
        .reviews
        .delete_review(v1::DeleteReviewRequest {
            actor_user_id: ana.clone(),
            review_id: ana_alien.review_id,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert!(!kept.movie_deleted);
    outbox.expect(&["ReviewDeleted"]).await;

    // Wrap-up: created once, returned after.
    let wrap = c
        .wrap_ups
        .request_wrap_up(v1::RequestWrapUpRequest { actor_user_id: ben.clone(), year: 2024, ..Default::default() })
        .await
        .unwrap()
        .into_inner();
    assert!(wrap.created);
    assert_eq!(wrap.wrap_up.as_ref().unwrap().status, v1::WrapUpStatus::Generating as i32);
    outbox.expect(&["WrapUpRequested"]).await;
    let again = c
        .wrap_ups
        .request_wrap_up(v1::RequestWrapUpRequest { actor_user_id: ben.clone(), year: 2024, ..Default::default() })
        .await
        .unwrap()
        .into_inner();
    assert!(!again.created);
    outbox.expect(&[]).await;

    // Local follow / unfollow.
    let follow = v1::FollowRequest { actor_user_id: ana.clone(), target: user_account(&ben), ..Default::default() };
    assert!(c.social.follow(follow.clone()).await.unwrap().into_inner().changed);
    outbox.expect(&["Followed"]).await;
    assert!(!c.social.follow(follow).await.unwrap().into_inner().changed);
    outbox.expect(&[]).await;
    let followers = c
        .social
        .list_followers(v1::ListFollowersRequest { user_id: ben.clone(), ..Default::default() })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(followers.accounts, vec![user_account(&ana).unwrap()]);
    assert!(
        c.social
            .unfollow(v1::UnfollowRequest { actor_user_id: ana.clone(), target: user_account(&ben) })
            .await
            .unwrap()
            .into_inner()
            .changed
    );
    outbox.expect(&["Unfollowed"]).await;

    // Remote follow (outgoing) goes through the outbox like a local one.
    let remote = "https://films.example/users/carla";
    assert!(
        c.social
            .follow(v1::FollowRequest {
                actor_user_id: ana.clone(),
                target: actor_account(remote),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner()
            .changed
    );
    let events = outbox.expect(&["Followed"]).await;
    assert!(matches!(&events[0], Payload::Followed(e) if e.target == actor_account(remote)));

    // Block severs follows both ways in the same transaction.
    c.social
        .follow(v1::FollowRequest { actor_user_id: ben.clone(), target: user_account(&ana), ..Default::default() })
        .await
        .unwrap();
    c.social
        .follow(v1::FollowRequest { actor_user_id: ana.clone(), target: user_account(&ben), ..Default::default() })
        .await
        .unwrap();
    outbox.expect(&["Followed", "Followed"]).await;
    assert!(
        c.social
            .block(v1::BlockRequest { actor_user_id: ana.clone(), target: user_account(&ben), ..Default::default() })
            .await
            .unwrap()
            .into_inner()
            .changed
    );
    outbox.expect(&["Blocked", "Unfollowed", "Unfollowed"]).await;
    assert_eq!(count(&db, "SELECT COUNT(*) FROM follows WHERE target NOT LIKE 'actor:%'").await, 0);
    let refused = c
        .social
        .follow(v1::FollowRequest { actor_user_id: ben.clone(), target: user_account(&ana), ..Default::default() })
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::FailedPrecondition);
    outbox.expect(&[]).await;
    assert!(
        c.social
            .unblock(v1::UnblockRequest { actor_user_id: ana.clone(), target: user_account(&ben) })
            .await
            .unwrap()
            .into_inner()
            .changed
    );
    outbox.expect(&["Unblocked"]).await;

    // Federation: inbound follow and its undo, remote review save (idempotent per object id).
    let follow_activity = "https://films.example/activities/f-1";
    let receive = v1::ReceiveFollowRequest {
        actor_uri: remote.into(),
        user_id: ana.clone(),
        activity_uri: follow_activity.into(),
        ..Default::default()
    };
    assert!(c.federation.receive_follow(receive.clone()).await.unwrap().into_inner().changed);
    outbox.expect(&["RemoteFollowReceived"]).await;
    assert!(!c.federation.receive_follow(receive).await.unwrap().into_inner().changed);
    outbox.expect(&[]).await;
    let followers = c
        .social
        .list_followers(v1::ListFollowersRequest { user_id: ana.clone(), ..Default::default() })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(followers.accounts, vec![actor_account(remote).unwrap()]);
    let undo = v1::ReceiveUndoRequest {
        actor_uri: remote.into(),
        user_id: ana.clone(),
        activity_uri: follow_activity.into(),
        ..Default::default()
    };
    assert!(c.federation.receive_undo(undo).await.unwrap().into_inner().changed);
    outbox.expect(&["RemoteFollowUndone"]).await;

    let remote_review = v1::SaveRemoteReviewRequest {
        object_uri: "https://films.example/reviews/99".into(),
        actor_uri: remote.into(),
        movie: movie_ref("Solaris", 1972),
        rating: 8,
        body: "Slow and enormous.".into(),
        published_at_ms: 1_700_000_000_000,
        ..Default::default()
    };
    let saved = c.federation.save_remote_review(remote_review.clone()).await.unwrap().into_inner();
    assert!(saved.created && saved.changed);
    let events = outbox.expect(&["MovieDiscovered", "RemoteReviewSaved"]).await;
    assert!(
        matches!(&events[1], Payload::RemoteReviewSaved(e) if e.remote_review_id == saved.remote_review_id && e.movie_title == "Solaris")
    );
    let repeat = c.federation.save_remote_review(remote_review.clone()).await.unwrap().into_inner();
    assert!(!repeat.created && !repeat.changed);
    outbox.expect(&[]).await;
    let updated = c
        .federation
        .save_remote_review(v1::SaveRemoteReviewRequest { rating: 10, ..remote_review })
        .await
        .unwrap()
        .into_inner();
    assert!(!updated.created && updated.changed);
    assert_eq!(updated.remote_review_id, saved.remote_review_id);
    outbox.expect(&["RemoteReviewSaved"]).await;

    // Every event id is distinct, and reads see what the writes did.
    let all = outbox_rows(&db).await;
    let mut ids: Vec<_> = all.iter().map(|r| r.event_id.clone().unwrap()).collect();
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), all.len());
    let diary = c
        .reviews
        .list_diary(v1::ListDiaryRequest { user_id: ben.clone(), ..Default::default() })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(diary.reviews, vec![alien_review]);
    reelay.stop().await;
}

#[tokio::test]
async fn a_failure_before_commit_leaves_neither_rows_nor_events() {
    let dir = temp_dir();
    let db = dir.path().join("reelay.db");

    // Set up state every covered write can act on, with a normal process.
    let mut setup = Reelay::start_write(BIN, &db, &[]).await;
    let mut c = setup.clients().await;
    let ana = c.user("ana").await;
    let ben = c.user("ben").await;
    let review = c.review(&ana, movie_ref("Heat", 1995), 8).await;
    let watched = c
        .watchlist
        .add_to_watchlist(v1::AddToWatchlistRequest {
            actor_user_id: ana.clone(),
            movie: movie_ref("Ran", 1985),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    c.social
        .follow(v1::FollowRequest { actor_user_id: ana.clone(), target: user_account(&ben), ..Default::default() })
        .await
        .unwrap();
    c.social
        .block(v1::BlockRequest {
            actor_user_id: ben.clone(),
            target: actor_account("https://x.example/u/z"),
            ..Default::default()
        })
        .await
        .unwrap();
    let remote = "https://films.example/users/carla";
    let activity = "https://films.example/activities/f-1";
    c.federation
        .receive_follow(v1::ReceiveFollowRequest {
            actor_uri: remote.into(),
            user_id: ben.clone(),
            activity_uri: activity.into(),
            ..Default::default()
        })
        .await
        .unwrap();
    // Remote reviews are kept only from actors someone here follows.
    c.social
        .follow(v1::FollowRequest { actor_user_id: ana.clone(), target: actor_account(remote), ..Default::default() })
        .await
        .unwrap();
    setup.stop().await;
    let before = table_snapshot(&db).await;

    // The same database with every write job failing after its statements, before commit.
    let mut faulty = Reelay::start_write(BIN, &db, &[("REELAY_FAILPOINTS", "*")]).await;
    let mut c = faulty.clients().await;
    let csv = b"Name,Year,Letterboxd URI,Rating,Watched Date\nAlien,1979,https://boxd.it/a1,4,2021-01-02\n\
        Paprika,2006,https://boxd.it/a2,5,2021-01-03\n";
    let results: Vec<(&str, Result<(), tonic::Status>)> = vec![
        (
            "CreateUser",
            c.users
                .create_user(v1::CreateUserRequest {
                    handle: "cy".into(),
                    display_name: "Cy".into(),
                    ..Default::default()
                })
                .await
                .map(drop),
        ),
        (
            "DiscoverMovie",
            c.movies
                .discover_movie(v1::DiscoverMovieRequest {
                    actor_user_id: ana.clone(),
                    title: "Paprika".into(),
                    year: 2006,
                    external_id: String::new(),
                    ..Default::default()
                })
                .await
                .map(drop),
        ),
        (
            "RequestEnrichment",
            c.movies
                .request_enrichment(v1::RequestEnrichmentRequest {
                    actor_user_id: ana.clone(),
                    movie_id: review.movie_id.clone(),
                    ..Default::default()
                })
                .await
                .map(drop),
        ),
        (
            "LogReview",
            c.reviews
                .log_review(v1::LogReviewRequest {
                    actor_user_id: ana.clone(),
                    movie: movie_ref("Alien", 1979),
                    rating: 9,
                    ..Default::default()
                })
                .await
                .map(drop),
        ),
        (
            "EditReview",
            c.reviews
                .edit_review(v1::EditReviewRequest {
                    actor_user_id: ana.clone(),
                    review_id: review.review_id.clone(),
                    rating: 2,
                    ..Default::default()
                })
                .await
                .map(drop),
        ),
        (
            "DeleteReview",
            c.reviews
                .delete_review(v1::DeleteReviewRequest {
                    actor_user_id: ana.clone(),
                    review_id: review.review_id.clone(),
                    ..Default::default()
                })
                .await
                .map(drop),
        ),
        (
            "AddToWatchlist",
            c.watchlist
                .add_to_watchlist(v1::AddToWatchlistRequest {
                    actor_user_id: ben.clone(),
                    movie: movie_ref("Ida", 2013),
                    ..Default::default()
                })
                .await
                .map(drop),
        ),
        (
            "RemoveFromWatchlist",
            c.watchlist
                .remove_from_watchlist(v1::RemoveFromWatchlistRequest {
                    actor_user_id: ana.clone(),
                    movie_id: watched.movie_id.clone(),
                })
                .await
                .map(drop),
        ),
        (
            "RequestWrapUp",
            c.wrap_ups
                .request_wrap_up(v1::RequestWrapUpRequest {
                    actor_user_id: ana.clone(),
                    year: 2024,
                    ..Default::default()
                })
                .await
                .map(drop),
        ),
        (
            "Follow",
            c.social
                .follow(v1::FollowRequest {
                    actor_user_id: ben.clone(),
                    target: user_account(&ana),
                    ..Default::default()
                })
                .await
                .map(drop),
        ),
        (
            "Unfollow",
            c.social
                .unfollow(v1::UnfollowRequest { actor_user_id: ana.clone(), target: user_account(&ben) })
                .await
                .map(drop),
        ),
        (
            "Block",
            c.social
                .block(v1::BlockRequest {
                    actor_user_id: ana.clone(),
                    target: user_account(&ben),
                    ..Default::default()
                })
                .await
                .map(drop),
        ),
        (
            "Unblock",
            c.social
                .unblock(v1::UnblockRequest {
                    actor_user_id: ben.clone(),
                    target: actor_account("https://x.example/u/z"),
                })
                .await
                .map(drop),
        ),
        ("ImportDiary", c.import(&ana, csv).await.map(drop)),
        (
            "SaveRemoteReview",
            c.federation
                .save_remote_review(v1::SaveRemoteReviewRequest {
                    object_uri: "https://films.example/reviews/1".into(),
                    actor_uri: remote.into(),
                    movie: movie_ref("Paprika", 2006),
                    rating: 7,
                    body: "Dreams.".into(),
                    published_at_ms: 1,
                    ..Default::default()
                })
                .await
                .map(drop),
        ),
        (
            "ReceiveFollow",
            c.federation
                .receive_follow(v1::ReceiveFollowRequest {
                    actor_uri: remote.into(),
                    user_id: ana.clone(),
                    activity_uri: activity.into(),
                    ..Default::default()
                })
                .await
                .map(drop),
        ),
        (
            "ReceiveUndo",
            c.federation
                .receive_undo(v1::ReceiveUndoRequest {
                    actor_uri: remote.into(),
                    user_id: ben.clone(),
                    activity_uri: activity.into(),
                    ..Default::default()
                })
                .await
                .map(drop),
        ),
    ];
    for (call, result) in results {
        let status = result.expect_err(call);
        assert_eq!(status.code(), Code::Unavailable, "{call}: {status:?}");
        assert!(status.message().contains("failpoint"), "{call}: {status:?}");
    }
    faulty.stop().await;
    assert!(faulty.log_text().contains("failpoints armed"));
    assert_eq!(table_snapshot(&db).await, before, "a failed write left rows behind");
}

/// Concurrent reviews of known movies are logged together, several callers' in one write job
/// and one statement. Each caller still gets exactly its own outcome: an accepted review has its
/// row and exactly one `ReviewLogged` carrying its caller's trace context; a review of a missing
/// movie, by a missing user, or whose event is over the size limit is refused with its own reason
/// and leaves neither a row nor an event, whatever its batch-mates did.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_reviews_each_get_their_own_outcome_when_logged_together() {
    let dir = temp_dir();
    let db = dir.path().join("reelay.db");
    let mut reelay = Reelay::start_write(BIN, &db, &[("REELAY_MAX_EVENT_BYTES", "20000")]).await;
    let mut c = reelay.clients().await;
    let (ana, ben) = (c.user("ana").await, c.user("ben").await);
    let movie = c.review(&ana, movie_ref("Heat", 1995), 8).await.movie_id;
    let jobs_before = reelay.metrics().await.sum("reelay_writer_job_seconds_count", &["job=\"log_review\""]);
    let (missing_movie, missing_user) =
        ("0190a5c3-0000-7000-8000-000000000001", "0190a5c3-0000-7000-8000-000000000002");

    const CALLS: usize = 96;
    let mut calls = Vec::new();
    for n in 0..CALLS {
        let mut reviews = c.reviews.clone();
        let (actor, movie) = match n % 8 {
            3 => (ana.clone(), missing_movie.to_owned()),
            5 => (missing_user.to_owned(), movie.clone()),
            _ => (if n % 2 == 0 { ana.clone() } else { ben.clone() }, movie.clone()),
        };
        // 36 KB: within the body limit, but its event is over REELAY_MAX_EVENT_BYTES.
        let body = if n % 8 == 6 { format!("call {n} {}", "𝄞".repeat(9_000)) } else { format!("call {n}") };
        let traceparent = format!("00-{:032x}-00f067aa0ba902b7-01", n + 1);
        let mut request = tonic::Request::new(v1::LogReviewRequest {
            actor_user_id: actor,
            movie: movie_id_ref(&movie),
            rating: (n % 10 + 1) as u32,
            body,
            ..Default::default()
        });
        request.metadata_mut().insert("traceparent", traceparent.parse().unwrap());
        calls.push(tokio::spawn(async move { (n, traceparent, reviews.log_review(request).await) }));
    }
    let mut accepted = Vec::new();
    for call in calls {
        let (n, traceparent, result) = call.await.unwrap();
        match (n % 8, result) {
            (3, Err(status)) => {
                assert_eq!(status.code(), Code::NotFound, "call {n}: {status:?}");
                assert!(status.message().contains(missing_movie), "call {n}: {status:?}");
            }
            (5, Err(status)) => {
                assert_eq!(status.code(), Code::NotFound, "call {n}: {status:?}");
                assert!(status.message().contains(missing_user), "call {n}: {status:?}");
            }
            (6, Err(status)) => {
                assert_eq!(status.code(), Code::InvalidArgument, "call {n}: {status:?}");
                assert!(status.message().contains("REELAY_MAX_EVENT_BYTES"), "call {n}: {status:?}");
            }
            (3 | 5 | 6, Ok(answer)) => panic!("call {n} should have been refused: {answer:?}"),
            (_, Ok(answer)) => accepted.push((n, traceparent, answer.into_inner().review.unwrap())),
            (_, Err(status)) => panic!("call {n}: {status:?}"),
        }
    }
    assert_eq!(accepted.len(), CALLS / 8 * 5);

    // Exactly the accepted reviews were written, each with exactly its own event.
    let bodies = query_strings(&db, "SELECT body FROM reviews WHERE body LIKE 'call %' ORDER BY body").await;
    let mut expected: Vec<String> = accepted.iter().map(|(n, ..)| format!("call {n}")).collect();
    expected.sort();
    // Only "call <n>" of each body, so a failure does not print the 36 KB ones whole.
    let written: Vec<String> =
        bodies.iter().map(|row| row[0].split(' ').take(2).collect::<Vec<_>>().join(" ")).collect();
    assert_eq!(written, expected);
    let logged: Vec<v1::Event> = outbox_rows(&db)
        .await
        .into_iter()
        .filter(|row| row.event_type == "ReviewLogged")
        .filter_map(|row| row.envelope)
        .collect();
    assert_eq!(logged.len(), accepted.len() + 1, "one event per accepted review, and the first review's");
    for (n, traceparent, review) in &accepted {
        let events: Vec<&v1::Event> = logged.iter().filter(|e| e.aggregate_id == review.review_id).collect();
        assert_eq!(events.len(), 1, "call {n}");
        assert_eq!(&events[0].traceparent, traceparent, "call {n} carries its own trace context");
        let Some(Payload::ReviewLogged(e)) = &events[0].payload else { panic!("call {n}") };
        assert_eq!(
            (e.body.as_str(), e.rating, e.movie_title.as_str(), e.movie_year),
            (format!("call {n}").as_str(), review.rating, "Heat", 1995)
        );
        assert_eq!((review.body.as_str(), review.movie_id.as_str()), (format!("call {n}").as_str(), movie.as_str()));
    }
    // They were logged together: fewer jobs than calls.
    let jobs = reelay.metrics().await.sum("reelay_writer_job_seconds_count", &["job=\"log_review\""]) - jobs_before;
    assert!(jobs < CALLS as f64, "{jobs} log_review jobs for {CALLS} calls");

    // A review of a known movie with a request_id is logged on its own, once: the retry gets the
    // first answer and writes nothing.
    let keyed = v1::LogReviewRequest {
        actor_user_id: ben.clone(),
        movie: movie_id_ref(&movie),
        rating: 4,
        body: "keyed".into(),
        request_id: "ben-keyed-1".into(),
        ..Default::default()
    };
    let first = c.reviews.log_review(keyed.clone()).await.unwrap().into_inner();
    let retried = c.reviews.log_review(keyed).await.unwrap().into_inner();
    assert_eq!(retried, first);
    assert_eq!(count(&db, "SELECT COUNT(*) FROM reviews WHERE body = 'keyed'").await, 1);
    let review_id = first.review.unwrap().review_id;
    let events = outbox_rows(&db).await.into_iter().filter(|row| row.aggregate_id == review_id).count();
    assert_eq!(events, 1, "one ReviewLogged for the keyed review");
    reelay.stop().await;
}
