//! Bad input over the real gRPC API: each case gets its status and a message naming the field,
//! and leaves every table byte-for-byte as it was.

use std::path::Path;
use std::time::Duration;

use futures_util::future::BoxFuture;
use reelay_contracts::v1;
use reelay_harness::{
    Clients, Reelay, actor_account, movie_id_ref, movie_ref, query_strings, table_snapshot, temp_dir, user_account,
};
use tonic::Code;

const BIN: &str = env!("CARGO_BIN_EXE_reelay");

type Call = Box<dyn FnOnce(Clients, Ids) -> BoxFuture<'static, Result<(), tonic::Status>>>;

/// Ids the cases refer to: `a` and `b` are users, `r` is a's review, `nobody` exists nowhere.
#[derive(Clone)]
struct Ids {
    a: String,
    b: String,
    r: String,
    nobody: String,
}

/// A well-formed completion of a wrap-up that does not exist, changed by `spoil`.
fn completion(x: &Ids, spoil: impl FnOnce(&mut v1::CompleteWrapUpRequest)) -> v1::CompleteWrapUpRequest {
    let mut request = v1::CompleteWrapUpRequest {
        wrap_up_id: x.nobody.clone(),
        summary: Some(v1::WrapUpSummary { per_month: vec![0; 12], rating_counts: vec![0; 11], ..Default::default() }),
        card_key: format!("wrapups/{}/card.svg", x.nobody),
        card_content_type: "image/svg+xml".into(),
        inputs_digest: String::new(),
    };
    spoil(&mut request);
    request
}

fn log(actor: &str, movie: Option<v1::MovieRef>, rating: u32, body: String, watched_on: &str) -> v1::LogReviewRequest {
    v1::LogReviewRequest {
        actor_user_id: actor.into(),
        movie,
        rating,
        body,
        watched_on: watched_on.into(),
        rewatch: false,
        ..Default::default()
    }
}

/// Thief (1981), with `external_id`.
fn thief(external_id: &str) -> Option<v1::MovieRef> {
    Some(v1::MovieRef {
        by: Some(v1::movie_ref::By::TitleYear(v1::TitleYear {
            title: "Thief".into(),
            year: 1981,
            external_id: external_id.into(),
        })),
    })
}

fn long(n: usize) -> String {
    "x".repeat(n)
}

/// Sends bytes that are not a `LogReviewRequest` to LogReview: a `CreateUserRequest` whose second
/// field, read as the `movie` message, holds the invalid tag 0x07.
async fn undecodable(c: &mut Clients, x: Ids) -> Result<tonic::Response<v1::LogReviewResponse>, tonic::Status> {
    let mut grpc = tonic::client::Grpc::new(c.channel.clone());
    grpc.ready().await.map_err(|e| tonic::Status::unknown(e.to_string()))?;
    let codec = tonic_prost::ProstCodec::<v1::CreateUserRequest, v1::LogReviewResponse>::default();
    let bytes = v1::CreateUserRequest { handle: x.a, display_name: "\u{7}".into(), ..Default::default() };
    let path = tonic::codegen::http::uri::PathAndQuery::from_static("/reelay.v1.Reviews/LogReview");
    grpc.unary(tonic::Request::new(bytes), path, codec).await
}

struct Case {
    name: &'static str,
    code: Code,
    /// Text the error message must contain (the field, for INVALID_ARGUMENT).
    mentions: &'static str,
    call: Call,
}

macro_rules! case {
    ($name:literal, $code:ident, $mentions:literal, |$c:ident, $x:ident| $call:expr) => {
        Case {
            name: $name,
            code: Code::$code,
            mentions: $mentions,
            call: Box::new(move |mut $c: Clients, $x: Ids| {
                Box::pin(async move {
                    let _ = &$x;
                    $call.await.map(drop)
                })
            }),
        }
    };
}

#[tokio::test]
async fn bad_input_is_refused_with_the_field_named_and_nothing_written() {
    let dir = temp_dir();
    let db = dir.path().join("reelay.db");
    let mut reelay = Reelay::start_write(BIN, &db, &[]).await;
    let mut c = reelay.clients().await;
    let ana = c.user("ana").await;
    let ben = c.user("ben").await;
    let review = c.review(&ana, movie_ref("Heat", 1995), 8).await;
    c.review(&ana, thief("tmdb:11524"), 7).await;
    let ids = Ids {
        a: ana.clone(),
        b: ben,
        r: review.review_id.clone(),
        nobody: "01900000-0000-7000-8000-000000000000".into(),
    };
    let cases: Vec<Case> = vec![
        case!("empty handle", InvalidArgument, "handle", |c, x| c.users.create_user(v1::CreateUserRequest {
            handle: "".into(),
            display_name: "A".into(),
            ..Default::default()
        })),
        case!("handle with spaces", InvalidArgument, "handle", |c, x| c.users.create_user(v1::CreateUserRequest {
            handle: "Ana B".into(),
            display_name: "A".into(),
            ..Default::default()
        })),
        case!("oversized display name", InvalidArgument, "display_name", |c, x| c
            .users
            .create_user(v1::CreateUserRequest { handle: "cy".into(), display_name: long(101), ..Default::default() })),
        case!("a display name of invisible characters", InvalidArgument, "display_name", |c, x| c.users.create_user(
            v1::CreateUserRequest {
                handle: "cy".into(),
                display_name: "\u{200B}\u{FEFF}".into(),
                ..Default::default()
            }
        )),
        case!("taken handle", AlreadyExists, "handle", |c, x| c.users.create_user(v1::CreateUserRequest {
            handle: "ana".into(),
            display_name: "A".into(),
            ..Default::default()
        })),
        case!("malformed user id", InvalidArgument, "user_id", |c, x| c
            .users
            .get_user(v1::GetUserRequest { user_id: "42".into() })),
        // Its refusal quotes it: cut short, else the answer's header is too large to read.
        case!("malformed user id of 20 KB", InvalidArgument, "user_id", |c, x| c
            .users
            .get_user(v1::GetUserRequest { user_id: "4".repeat(20_000) })),
        case!("unknown user", NotFound, "user", |c, x| c
            .users
            .get_user(v1::GetUserRequest { user_id: x.nobody.clone() })),
        case!("rating out of range", InvalidArgument, "rating", |c, x| c.reviews.log_review(log(
            &x.a,
            movie_ref("Ran", 1985),
            11,
            "".into(),
            ""
        ))),
        case!("oversized body", InvalidArgument, "body", |c, x| c.reviews.log_review(log(
            &x.a,
            movie_ref("Ran", 1985),
            5,
            long(10_001),
            ""
        ))),
        case!("malformed actor", InvalidArgument, "actor_user_id", |c, x| c.reviews.log_review(log(
            "me",
            movie_ref("Ran", 1985),
            5,
            "".into(),
            ""
        ))),
        case!("unknown actor", NotFound, "user", |c, x| c.reviews.log_review(log(
            &x.nobody,
            movie_ref("Ran", 1985),
            5,
            "".into(),
            ""
        ))),
        case!("missing movie", InvalidArgument, "movie", |c, x| c.reviews.log_review(log(
            &x.a,
            None,
            5,
            "".into(),
            ""
        ))),
        case!("empty title", InvalidArgument, "movie.title_year.title", |c, x| c.reviews.log_review(log(
            &x.a,
            movie_ref("  ", 1985),
            5,
            "".into(),
            ""
        ))),
        case!("year out of range", InvalidArgument, "movie.title_year.year", |c, x| c.reviews.log_review(log(
            &x.a,
            movie_ref("Ran", 1700),
            5,
            "".into(),
            ""
        ))),
        case!("impossible date", InvalidArgument, "watched_on", |c, x| c.reviews.log_review(log(
            &x.a,
            movie_ref("Ran", 1985),
            5,
            "".into(),
            "2023-02-30"
        ))),
        case!("malformed movie id", InvalidArgument, "movie.movie_id", |c, x| c.reviews.log_review(log(
            &x.a,
            movie_id_ref("m1"),
            5,
            "".into(),
            ""
        ))),
        case!("unknown movie id", NotFound, "movie", |c, x| c.reviews.log_review(log(
            &x.a,
            movie_id_ref(&x.nobody),
            5,
            "".into(),
            ""
        ))),
        case!("someone else's review", PermissionDenied, "another user", |c, x| c.reviews.edit_review(
            v1::EditReviewRequest {
                actor_user_id: x.b.clone(),
                review_id: x.r.clone(),
                rating: 1,
                ..Default::default()
            }
        )),
        case!("unknown review", NotFound, "review", |c, x| c.reviews.edit_review(v1::EditReviewRequest {
            actor_user_id: x.a.clone(),
            review_id: x.nobody.clone(),
            ..Default::default()
        })),
        case!("malformed review id", InvalidArgument, "review_id", |c, x| c.reviews.delete_review(
            v1::DeleteReviewRequest { actor_user_id: x.a.clone(), review_id: "r1".into(), ..Default::default() }
        )),
        case!("deleting someone else's review", PermissionDenied, "another user", |c, x| c.reviews.delete_review(
            v1::DeleteReviewRequest { actor_user_id: x.b.clone(), review_id: x.r.clone(), ..Default::default() }
        )),
        case!("malformed external id", InvalidArgument, "movie.external_id", |c, x| c.watchlist.add_to_watchlist(
            v1::AddToWatchlistRequest {
                actor_user_id: x.a.clone(),
                movie: Some(v1::MovieRef { by: Some(v1::movie_ref::By::ExternalId("603".into())) }),
                ..Default::default()
            }
        )),
        case!("unknown external id", NotFound, "external_id", |c, x| c.watchlist.add_to_watchlist(
            v1::AddToWatchlistRequest {
                actor_user_id: x.a.clone(),
                movie: Some(v1::MovieRef { by: Some(v1::movie_ref::By::ExternalId("tmdb:1".into())) }),
                ..Default::default()
            }
        )),
        case!("malformed watchlist movie", InvalidArgument, "movie_id", |c, x| c.watchlist.remove_from_watchlist(
            v1::RemoveFromWatchlistRequest { actor_user_id: x.a.clone(), movie_id: "x".into() }
        )),
        case!("wrap-up year out of range", InvalidArgument, "year", |c, x| c.wrap_ups.request_wrap_up(
            v1::RequestWrapUpRequest { actor_user_id: x.a.clone(), year: 3000, ..Default::default() }
        )),
        case!("malformed movie to discover", InvalidArgument, "title", |c, x| c.movies.discover_movie(
            v1::DiscoverMovieRequest {
                actor_user_id: x.a.clone(),
                title: long(301),
                year: 2000,
                external_id: String::new(),
                ..Default::default()
            }
        )),
        case!("enrichment of an unknown movie", NotFound, "movie", |c, x| c.movies.request_enrichment(
            v1::RequestEnrichmentRequest {
                actor_user_id: x.a.clone(),
                movie_id: x.nobody.clone(),
                ..Default::default()
            }
        )),
        case!("following yourself", InvalidArgument, "target", |c, x| c.social.follow(v1::FollowRequest {
            actor_user_id: x.a.clone(),
            target: user_account(&x.a),
            ..Default::default()
        })),
        case!("follow without a target", InvalidArgument, "target", |c, x| c.social.follow(v1::FollowRequest {
            actor_user_id: x.a.clone(),
            target: None,
            ..Default::default()
        })),
        case!("follow of a non-URI actor", InvalidArgument, "target.actor_uri", |c, x| c.social.follow(
            v1::FollowRequest { actor_user_id: x.a.clone(), target: actor_account("not a uri"), ..Default::default() }
        )),
        case!("follow of an unknown user", NotFound, "user", |c, x| c.social.follow(v1::FollowRequest {
            actor_user_id: x.a.clone(),
            target: user_account(&x.nobody),
            ..Default::default()
        })),
        case!("block of yourself", InvalidArgument, "target", |c, x| c.social.block(v1::BlockRequest {
            actor_user_id: x.b.clone(),
            target: user_account(&x.b),
            ..Default::default()
        })),
        case!("oversized page", InvalidArgument, "page_size", |c, x| c.reviews.list_diary(v1::ListDiaryRequest {
            user_id: x.a.clone(),
            page_size: 500,
            page_token: String::new()
        })),
        case!("forged page token", InvalidArgument, "page_token", |c, x| c.reviews.list_diary(v1::ListDiaryRequest {
            user_id: x.a.clone(),
            page_size: 10,
            page_token: "'; DROP TABLE reviews".into()
        })),
        case!("malformed CSV row", InvalidArgument, "data: line 3", |c, x| c
            .import(&x.a, b"Name,Year,Rating,Review\nAlien,1979,4,\nHeat,nineteen,4,\nRan,1985,5,\n")),
        case!("CSV rating out of range", InvalidArgument, "line 2: Rating", |c, x| c
            .import(&x.a, b"Name,Year,Rating,Watched Date\nAlien,1979,9,2021-01-02\n")),
        case!("a ratings list as a diary", InvalidArgument, "data: line 1", |c, x| c
            .import(&x.a, b"Date,Name,Year,Letterboxd URI,Rating\n2021-01-02,Alien,1979,https://boxd.it/29bA,4\n")),
        case!("CSV without a Year column", InvalidArgument, "no Year column", |c, x| c
            .import(&x.a, b"Name,Rating,Watched Date\nAlien,4,2021-01-02\n")),
        case!("import for an unknown user", NotFound, "user", |c, x| c
            .import(&x.nobody, b"Name,Year,Watched Date\nAlien,1979,2021-01-02\n")),
        case!("empty import", InvalidArgument, "actor_user_id", |c, x| c.import(&x.a, b"")),
        case!("remote review without an object URI", InvalidArgument, "object_uri", |c, x| c
            .federation
            .save_remote_review(v1::SaveRemoteReviewRequest {
                object_uri: "".into(),
                actor_uri: "https://films.example/u/c".into(),
                movie: movie_ref("Ran", 1985),
                ..Default::default()
            })),
        case!("remote review rating", InvalidArgument, "rating", |c, x| c.federation.save_remote_review(
            v1::SaveRemoteReviewRequest {
                object_uri: "https://films.example/r/1".into(),
                actor_uri: "https://films.example/u/c".into(),
                movie: movie_ref("Ran", 1985),
                rating: 20,
                ..Default::default()
            }
        )),
        case!("remote review published far ahead", InvalidArgument, "published_at_ms", |c, x| c
            .federation
            .save_remote_review(v1::SaveRemoteReviewRequest {
                object_uri: "https://films.example/r/1".into(),
                actor_uri: "https://films.example/u/c".into(),
                movie: movie_ref("Ran", 1985),
                rating: 8,
                published_at_ms: i64::MAX,
                ..Default::default()
            })),
        case!("remote actor deletion without an actor URI", InvalidArgument, "actor_uri", |c, x| c
            .federation
            .delete_remote_actor(v1::DeleteRemoteActorRequest {
                actor_uri: "".into(),
                received_activity_uri: "https://films.example/u/c#delete".into(),
            })),
        case!("remote actor deletion named by a bad activity", InvalidArgument, "received_activity_uri", |c, x| c
            .federation
            .delete_remote_actor(v1::DeleteRemoteActorRequest {
                actor_uri: "https://films.example/u/c".into(),
                received_activity_uri: "delete-1".into(),
            })),
        case!("remote follow activity", InvalidArgument, "activity_uri", |c, x| c.federation.receive_follow(
            v1::ReceiveFollowRequest {
                actor_uri: "https://films.example/u/c".into(),
                user_id: x.a.clone(),
                activity_uri: "follow-1".into(),
                ..Default::default()
            }
        )),
        case!("remote follow of an unknown user", NotFound, "user", |c, x| c.federation.receive_follow(
            v1::ReceiveFollowRequest {
                actor_uri: "https://films.example/u/c".into(),
                user_id: x.nobody.clone(),
                activity_uri: "https://films.example/a/1".into(),
                ..Default::default()
            }
        )),
        case!("watchlist add of an unknown movie id", NotFound, "movie", |c, x| c.watchlist.add_to_watchlist(
            v1::AddToWatchlistRequest {
                actor_user_id: x.a.clone(),
                movie: movie_id_ref(&x.nobody),
                ..Default::default()
            }
        )),
        case!("a local actor by a handle that is none", InvalidArgument, "handle", |c, x| c
            .federation
            .get_local_actor(v1::GetLocalActorRequest {
                by: Some(v1::get_local_actor_request::By::Handle("ana-b".into()))
            })),
        case!("the outbox of an unknown user", NotFound, "user", |c, x| c
            .federation
            .list_outbox(v1::ListOutboxRequest { user_id: x.nobody.clone(), ..Default::default() })),
        case!("an activity to the followers of an unknown user", NotFound, "user", |c, x| c
            .federation
            .queue_deliveries(v1::QueueDeliveriesRequest {
                activity_id: "https://reelay.example/activities/1".into(),
                sender_user_id: x.nobody.clone(),
                activity_json: "{}".into(),
                audience: Some(v1::queue_deliveries_request::Audience::Followers(true)),
                ..Default::default()
            })),
        case!("an activity larger than an event may be", InvalidArgument, "activity_json", |c, x| c
            .federation
            .queue_deliveries(v1::QueueDeliveriesRequest {
                activity_id: "https://reelay.example/activities/3".into(),
                sender_user_id: x.a.clone(),
                activity_json: format!("{{\"content\": \"{}\"}}", "x".repeat(1_100_000)),
                audience: Some(v1::queue_deliveries_request::Audience::Followers(true)),
                ..Default::default()
            })),
        case!("an activity about a review id that is none", InvalidArgument, "live_review_id", |c, x| c
            .federation
            .queue_deliveries(v1::QueueDeliveriesRequest {
                activity_id: "https://reelay.example/activities/2".into(),
                sender_user_id: x.a.clone(),
                activity_json: "{}".into(),
                audience: Some(v1::queue_deliveries_request::Audience::Followers(true)),
                live_review_id: "nope".into(),
            })),
        case!("a delivery outcome at an inbox that is no URL", InvalidArgument, "inbox", |c, x| c
            .federation
            .record_inbox_outcome(v1::RecordInboxOutcomeRequest {
                inbox: "mastodon.example/inbox".into(),
                answered: false
            })),
        case!("the diary of an unknown user", NotFound, "user", |c, x| c
            .reviews
            .list_diary(v1::ListDiaryRequest { user_id: x.nobody.clone(), ..Default::default() })),
        case!("the watchlist of an unknown user", NotFound, "user", |c, x| c
            .watchlist
            .list_watchlist(v1::ListWatchlistRequest { user_id: x.nobody.clone(), ..Default::default() })),
        case!("the followers of an unknown user", NotFound, "user", |c, x| c
            .social
            .list_followers(v1::ListFollowersRequest { user_id: x.nobody.clone(), ..Default::default() })),
        case!("the follows of an unknown user", NotFound, "user", |c, x| c
            .social
            .list_following(v1::ListFollowingRequest { user_id: x.nobody.clone(), ..Default::default() })),
        case!("a followers page token of 5,000 characters", InvalidArgument, "page_token", |c, x| c
            .social
            .list_followers(v1::ListFollowersRequest {
                user_id: x.a.clone(),
                page_token: format!("user:{}", "x".repeat(5_000)),
                ..Default::default()
            })),
        case!("a person's biography of 30,000 characters", InvalidArgument, "people[0].biography", |c, x| c
            .movies
            .save_people(v1::SavePeopleRequest {
                people: vec![v1::Person {
                    person_id: "tmdb:1".into(),
                    name: "Chantal Akerman".into(),
                    biography: "b".repeat(30_000),
                    ..Default::default()
                }],
            })),
        case!("a person's birthday not a date", InvalidArgument, "people[0].birthday", |c, x| c.movies.save_people(
            v1::SavePeopleRequest {
                people: vec![v1::Person {
                    person_id: "tmdb:1".into(),
                    name: "Chantal Akerman".into(),
                    birthday: "June 1950".into(),
                    ..Default::default()
                }],
            }
        )),
        case!("a person's birthday no day of the calendar", InvalidArgument, "people[0].birthday", |c, x| c
            .movies
            .save_people(v1::SavePeopleRequest {
                people: vec![v1::Person {
                    person_id: "tmdb:1".into(),
                    name: "Chantal Akerman".into(),
                    birthday: "1950-02-30".into(),
                    ..Default::default()
                }],
            })),
        case!("a person's film with a line break", InvalidArgument, "people[0].known_for[1]", |c, x| c
            .movies
            .save_people(v1::SavePeopleRequest {
                people: vec![v1::Person {
                    person_id: "tmdb:1".into(),
                    name: "Chantal Akerman".into(),
                    known_for: vec!["Jeanne Dielman (1975)".into(), "News from\nHome (1977)".into()],
                    ..Default::default()
                }],
            })),
        case!("a watch date in the future", InvalidArgument, "watched_on", |c, x| c.reviews.log_review(log(
            &x.a,
            movie_ref("Heat", 1995),
            8,
            "later".into(),
            "2099-12-31"
        ))),
        case!(
            "a film known under another id of the same provider",
            FailedPrecondition,
            "movie.title_year.external_id",
            |c, x| c.reviews.log_review(log(&x.a, thief("tmdb:999"), 8, "which Thief?".into(), ""))
        ),
        // DiscoverMovie's fields are flat, so the same conflict names its own `external_id`.
        case!("a film to discover known under another id", FailedPrecondition, "external_id: Thief", |c, x| c
            .movies
            .discover_movie(v1::DiscoverMovieRequest {
                actor_user_id: x.a.clone(),
                title: "Thief".into(),
                year: 1981,
                external_id: "tmdb:999".into(),
                ..Default::default()
            })),
        case!("a wrap-up of a year not begun", InvalidArgument, "year", |c, x| c.wrap_ups.request_wrap_up(
            v1::RequestWrapUpRequest { actor_user_id: x.a.clone(), year: 2100, ..Default::default() }
        )),
        case!("a wrap-up completed with a malformed inputs digest", InvalidArgument, "inputs_digest", |c, x| c
            .wrap_ups
            .complete_wrap_up(completion(&x, |r| r.inputs_digest = "AB".repeat(32)))),
        // A summary outside its documented shape would be stored, and every read of the
        // wrap-up fail or show nonsense; a card key or type is the handler's to get right.
        case!(
            "a wrap-up summary naming a genre of 400 characters",
            InvalidArgument,
            "summary.top_genres[0].name",
            |c, x| c.wrap_ups.complete_wrap_up(completion(&x, |r| {
                let summary = r.summary.as_mut().unwrap();
                summary.top_genres = vec![v1::NameCount { name: "g".repeat(400), count: 1 }];
            }))
        ),
        case!("a wrap-up summary with 3 rating counts", InvalidArgument, "summary.rating_counts", |c, x| c
            .wrap_ups
            .complete_wrap_up(completion(&x, |r| r.summary.as_mut().unwrap().rating_counts = vec![0; 3]))),
        case!("a wrap-up card stored under another wrap-up's key", InvalidArgument, "card_key", |c, x| c
            .wrap_ups
            .complete_wrap_up(completion(&x, |r| r.card_key = "posters/x/original".into()))),
        case!("a card content type with a line break", InvalidArgument, "card_content_type", |c, x| c
            .wrap_ups
            .complete_wrap_up(completion(&x, |r| r.card_content_type = "image/svg+xml\r\nx: y".into()))),
        case!("request_id with spaces", InvalidArgument, "request_id", |c, x| c.reviews.log_review(
            v1::LogReviewRequest {
                request_id: "my key".into(),
                ..log(&x.a, movie_ref("Heat", 1995), 8, "ok".into(), "")
            }
        )),
        case!("request_id of 129 characters", InvalidArgument, "request_id", |c, x| c.social.follow(
            v1::FollowRequest { actor_user_id: x.a.clone(), target: user_account(&x.b), request_id: long(129) }
        )),
        case!("a delivery claim for an unknown event type", InvalidArgument, "event_types", |c, x| c
            .outbox
            .claim_deliveries(v1::ClaimDeliveriesRequest {
                handler: "search".into(),
                event_types: vec!["ReviewLogged".into(), "NoSuchEvent".into()],
                owner: "test#1".into(),
                max_rows: 10,
                ..Default::default()
            })),
        case!("claims for handlers with an unknown event type", InvalidArgument, "handlers.event_types", |c, x| c
            .outbox
            .claim_deliveries_for_handlers(v1::ClaimDeliveriesForHandlersRequest {
                handlers: vec![v1::HandlerWants {
                    handler: "search".into(),
                    event_types: vec!["x".repeat(100)],
                    max_rows: 10,
                }],
                owner: "test#1".into(),
                ..Default::default()
            })),
        // An answer too small for the largest event: its rows would be given up as too
        // large for any answer (dead letters of good events, for a claimer's setting).
        case!("a delivery claim whose answers cannot hold an event", InvalidArgument, "max_bytes", |c, x| c
            .outbox
            .claim_deliveries(v1::ClaimDeliveriesRequest {
                handler: "search".into(),
                event_types: vec!["ReviewLogged".into()],
                owner: "test#1".into(),
                max_rows: 10,
                max_bytes: 1,
                ..Default::default()
            })),
        case!("an outbox claim whose answers cannot hold an event", InvalidArgument, "max_bytes", |c, x| c
            .outbox
            .claim(v1::ClaimRequest {
                consumer: "test#1".into(),
                max_rows: 10,
                max_bytes: 1000,
                ..Default::default()
            })),
        // Parked for ever, a row would never show as waiting nor as a dead letter.
        case!("an outbox row deferred to the end of time", InvalidArgument, "until_ms", |c, x| c.outbox.defer(
            v1::DeferRequest {
                rows: vec![v1::RowClaim { id: 1, claimed_at_ms: 1, ..Default::default() }],
                until_ms: i64::MAX
            }
        )),
        // A relay pointed at a write service on db would take the rows from its handlers.
        case!("a relay's claim on the db backend", FailedPrecondition, "EVENT_BUS_BACKEND=db", |c, x| c
            .outbox
            .claim(v1::ClaimRequest { consumer: "test#1".into(), max_rows: 10, ..Default::default() })),
        case!("a relay's completion on the db backend", FailedPrecondition, "EVENT_BUS_BACKEND=db", |c, x| c
            .outbox
            .complete(v1::CompleteRequest {
                rows: vec![v1::RowClaim { id: 1, claimed_at_ms: 1, stream_sequence: 1 }]
            })),
        case!("an outbox claim by a consumer named at length", InvalidArgument, "consumer", |c, x| c
            .outbox
            .claim(v1::ClaimRequest { consumer: "r".repeat(201), max_rows: 10, ..Default::default() })),
        case!("an outbox claim naming its call without a consumer", InvalidArgument, "consumer", |c, x| c
            .outbox
            .claim(v1::ClaimRequest { max_rows: 10, call_id: 7, ..Default::default() })),
        case!("an outbox claim naming 65 unanswered calls", InvalidArgument, "unanswered", |c, x| c.outbox.claim(
            v1::ClaimRequest {
                consumer: "test#1".into(),
                max_rows: 10,
                unanswered: (1..=65).collect(),
                ..Default::default()
            }
        )),
        case!("a given-up pair with a malformed event id", InvalidArgument, "given_up.key.event_id", |c, x| c
            .ledger
            .given_up(v1::LedgerGivenUpRequest {
                given_up: vec![v1::LedgerGivenUp {
                    key: Some(v1::LedgerKey { event_id: "not-an-id".into(), handler: "search".into() }),
                    attempts: 3,
                    ..Default::default()
                }],
            })),
        case!("a ledger claim without an owner", InvalidArgument, "owner", |c, x| c.ledger.claim(
            v1::LedgerClaimRequest {
                keys: vec![v1::LedgerKey { event_id: x.nobody.clone(), handler: "search".into() }],
                ..Default::default()
            }
        )),
        case!(
            "a ledger claim with an event id not written as events carry it",
            InvalidArgument,
            "keys.event_id",
            |c, x| c.ledger.claim(v1::LedgerClaimRequest {
                keys: vec![v1::LedgerKey { event_id: x.nobody.replace('-', ""), handler: "search".into() }],
                owner: "test#1".into(),
                ..Default::default()
            })
        ),
        case!(
            "a ledger claim naming a build with a malformed event type",
            InvalidArgument,
            "builds.event_types",
            |c, x| c.ledger.claim(v1::LedgerClaimRequest {
                builds: vec![v1::HandlerBuild { handler: "search".into(), event_types: vec!["No such event".into()] }],
                owner: "test#1".into(),
                ..Default::default()
            })
        ),
        case!("a ledger claim naming one handler's build twice", InvalidArgument, "builds.handler", |c, x| c
            .ledger
            .claim(v1::LedgerClaimRequest {
                builds: vec![
                    v1::HandlerBuild { handler: "search".into(), event_types: vec!["UserRegistered".into()] };
                    2
                ],
                owner: "test#1".into(),
                ..Default::default()
            })),
        case!("a ledger claim of no key and no build", InvalidArgument, "keys", |c, x| c
            .ledger
            .claim(v1::LedgerClaimRequest { owner: "test#1".into(), ..Default::default() })),
        case!("a given-up pair without deliveries", InvalidArgument, "given_up.attempts", |c, x| c.ledger.given_up(
            v1::LedgerGivenUpRequest {
                given_up: vec![v1::LedgerGivenUp {
                    key: Some(v1::LedgerKey { event_id: x.nobody.clone(), handler: "search".into() }),
                    attempts: 0,
                    ..Default::default()
                }],
            }
        )),
        case!("a given-up pair on the db backend", FailedPrecondition, "nats backend", |c, x| c.ledger.given_up(
            v1::LedgerGivenUpRequest {
                given_up: vec![v1::LedgerGivenUp {
                    key: Some(v1::LedgerKey { event_id: x.nobody.clone(), handler: "search".into() }),
                    attempts: 3,
                    ..Default::default()
                }],
            }
        )),
        case!("a message over the size limit", ResourceExhausted, "could not be read", |c, x| c
            .reviews
            .log_review(log(&x.a, movie_ref("Heat", 1995), 8, long(5 * 1024 * 1024), ""))),
        case!("a message that does not decode", InvalidArgument, "could not be read", |c, x| undecodable(&mut c, x)),
    ];

    // Creating a user wakes a background task that makes its key pair; let it finish first.
    reelay_harness::eventually("every user has a key pair", Duration::from_secs(60), || {
        let db = db.clone();
        async move {
            let counts = reelay_harness::query_strings(
                &db,
                "SELECT (SELECT COUNT(*) FROM users) || '', (SELECT COUNT(*) FROM actor_keys) || ''",
            )
            .await;
            counts[0][0] == counts[0][1]
        }
    })
    .await;
    let baseline = table_snapshot(&db).await;
    let count = cases.len();
    for case in cases {
        let status = (case.call)(c.clone(), ids.clone()).await.expect_err(case.name);
        assert_eq!(status.code(), case.code, "{}: {status:?}", case.name);
        assert!(
            status.message().contains(case.mentions),
            "{}: message {:?} should mention {:?}",
            case.name,
            status.message(),
            case.mentions
        );
        assert_eq!(table_snapshot(&db).await, baseline, "{} changed the database", case.name);
    }
    eprintln!("{count} bad-input cases refused, database unchanged");

    // An edit to the values the review has writes nothing and raises nothing.
    let same = v1::EditReviewRequest {
        actor_user_id: ana.clone(),
        review_id: review.review_id.clone(),
        rating: review.rating,
        body: review.body.clone(),
        watched_on: review.watched_on.clone(),
        rewatch: review.rewatch,
        ..Default::default()
    };
    let edited = c.reviews.edit_review(same).await.unwrap().into_inner();
    assert_eq!(edited.updated_at_ms, review.updated_at_ms);
    assert_eq!(table_snapshot(&db).await, baseline, "an edit that changes nothing wrote something");
    // An id of another provider says nothing against the film's own: the same Thief.
    let other = c.review(&ana, thief("imdb:tt0083190"), 9).await;
    let thief_id = query_strings(&db, "SELECT id FROM movies WHERE title = 'Thief'").await;
    assert_eq!(thief_id, [[other.movie_id.clone()]]);
    // One title, however it is spelled: decomposed accents and invisible characters name the
    // same film.
    let composed = c.review(&ana, movie_ref("Am\u{E9}lie", 2001), 8).await;
    for spelling in ["Ame\u{301}lie", "Am\u{E9}lie\u{200B}"] {
        let again = c.review(&ana, movie_ref(spelling, 2001), 8).await;
        assert_eq!(again.movie_id, composed.movie_id, "{spelling:?}");
    }
    let baseline = table_snapshot(&db).await;

    // Without the service token nothing is served (health checks excepted).
    let mut anonymous = Clients::new(reelay.channel_with_token(None).await);
    let status = anonymous.users.get_user(v1::GetUserRequest { user_id: ana.clone() }).await.unwrap_err();
    assert_eq!(status.code(), Code::Unauthenticated);
    let mut forged = Clients::new(reelay.channel_with_token(Some("not-the-token-at-all")).await);
    let status = forged
        .users
        .create_user(v1::CreateUserRequest { handle: "eve".into(), display_name: "Eve".into(), ..Default::default() })
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::Unauthenticated);
    // Nor can a caller without it mint metric label values: a made-up method of a mounted
    // service is refused as `unknown`.
    for n in 0..3 {
        let path = format!("/reelay.v1.Users/MadeUp{n}");
        let mut grpc = tonic::client::Grpc::new(reelay.channel_with_token(None).await);
        grpc.ready().await.unwrap();
        let codec = tonic_prost::ProstCodec::<v1::GetUserRequest, v1::GetUserRequest>::default();
        let request = tonic::Request::new(v1::GetUserRequest { user_id: ana.clone() });
        let status = grpc.unary(request, path.parse().unwrap(), codec).await.unwrap_err();
        assert_eq!(status.code(), Code::Unauthenticated);
    }
    let metrics = reelay.metrics().await;
    assert!(!metrics.0.contains("MadeUp"), "a label value from a caller without the token");
    assert!(metrics.sum("reelay_grpc_requests_total", &[r#"method="unknown""#, r#"code="16""#]) >= 3.0);
    // Five refusals are fewer lines of the log (one per 10 s: a caller without the token
    // cannot fill it; two if a window ended among them), the metric counting each.
    let refusals = reelay.log_text().matches("rejected a call without a valid service token").count();
    assert!((1..5).contains(&refusals), "{refusals} lines for 5 refusals\n{}", reelay.log_text());
    assert_eq!(table_snapshot(&db).await, baseline);
    reelay.stop().await;
}

/// A consumer task that dies (a panic) while the process runs stops the whole process with an
/// error, instead of leaving it serving, healthy to every probe, without delivering.
#[tokio::test]
async fn a_delivery_task_that_dies_stops_the_process() {
    let dir = temp_dir();
    let port = || format!("127.0.0.1:{}", reelay_harness::free_port());
    let child = tokio::process::Command::new(BIN)
        .args(["run", "--dev"])
        .env("REELAY_DATA_DIR", dir.path())
        .env("REELAY_WRITE_ADDR", port())
        .env("REELAY_HANDLERS_ADDR", port())
        .env("REELAY_MEDIA_ADDR", port())
        .env("REELAY_GATEWAY_ADDR", port())
        .env("REELAY_METRICS_ADDR", port())
        .env("REELAY_HANDLERS", "search")
        .env("REELAY_FAILPOINTS", "consumer_task_panics")
        .env("RUST_LOG", "info")
        .kill_on_drop(true)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let out = tokio::time::timeout(Duration::from_secs(60), child.wait_with_output())
        .await
        .expect("the process stops by itself")
        .unwrap();
    assert!(!out.status.success(), "{:?}", out.status);
    let log = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(log.contains("task panicked before shutdown was asked for"), "{log}");
    assert!(log.contains("stopped"), "it stops in order: {log}");
}

#[tokio::test]
async fn the_write_service_refuses_to_start_without_a_token_unless_in_dev_mode() {
    let dir = temp_dir();
    let out = std::process::Command::new(BIN)
        .args(["run", "--service", "write"])
        .env("REELAY_DATABASE", dir.path().join("r.db"))
        .env("REELAY_WRITE_ADDR", format!("127.0.0.1:{}", reelay_harness::free_port()))
        .env_remove("REELAY_SERVICE_TOKEN")
        .env_remove("REELAY_DEV")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("no service token") && stderr.contains("--dev"), "{stderr}");
    assert!(!dir.path().join("r.db").exists(), "nothing is created before the configuration is accepted");

    // So is a public URL no other server can reach: the gateway's listen address 0.0.0.0.
    let out = std::process::Command::new(BIN)
        .args(["run", "--dev"])
        .env("REELAY_DATA_DIR", dir.path())
        .env("REELAY_GATEWAY_ADDR", format!("0.0.0.0:{}", reelay_harness::free_port()))
        .env_remove("REELAY_PUBLIC_URL")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("no other server can reach") && stderr.contains("REELAY_PUBLIC_URL"), "{stderr}");

    // A write service started with `setting`: refused with exit code 2 and nothing created;
    // what it said.
    let db = dir.path().join("r.db");
    let refused = async |setting: &str, value: &str| {
        let bin = Path::new(BIN);
        let (code, stderr) = reelay_harness::refused_at_start(bin, "write", &db, dir.path(), &[(setting, value)]).await;
        assert_eq!(code, Some(2), "{setting}={value}: {stderr}");
        assert!(!db.exists(), "nothing is created before the configuration is accepted");
        stderr
    };

    // Nor a media URL no client can reach (links to cards and posters are built on it).
    let stderr = refused("REELAY_MEDIA_ADDR", "0.0.0.0:50053").await;
    assert!(stderr.contains("REELAY_MEDIA_URL is unset") && stderr.contains("0.0.0.0:50053"), "{stderr}");

    // An event limit no claim answer could carry is refused at start-up too.
    let stderr = refused("REELAY_MAX_EVENT_BYTES", "5000000").await;
    assert!(stderr.contains("REELAY_MAX_EVENT_BYTES") && stderr.contains("REELAY_GRPC_MAX_MESSAGE_BYTES"), "{stderr}");

    // And a time for servers to turn unavailable shorter than a gap between two retries, which
    // would start every server's count over at each retry.
    let stderr = refused("REELAY_FEDERATION_UNAVAILABLE_AFTER_SECS", "60").await;
    assert!(
        stderr.contains("REELAY_FEDERATION_UNAVAILABLE_AFTER_SECS (60)")
            && stderr.contains("REELAY_RETRY_CAP_MS (300000 ms)")
            && stderr.contains("REELAY_FEDERATION_TIMEOUT_MS (10000 ms)"),
        "{stderr}"
    );

    // And a TMDB URL no request could use (every film's enrichment would be retried for ever).
    let tmdb = [
        ("REELAY_ENRICHMENT_PROVIDER", "tmdb"),
        ("REELAY_ENRICHMENT_TMDB_API_KEY", "k"),
        ("REELAY_ENRICHMENT_TMDB_URL", "api.themoviedb.org/3"),
    ];
    let data = dir.path().join("tmdb");
    let (code, stderr) =
        reelay_harness::refused_at_start(Path::new(BIN), "handlers", &data.join("unused.db"), &data, &tmdb).await;
    assert_ne!(code, Some(0), "{stderr}");
    assert!(stderr.contains("REELAY_ENRICHMENT_TMDB_URL must be an http(s) URL"), "{stderr}");

    // So is a lease no worker could renew in time (or that hands every claim over at once), and
    // a timing no process could work with (every call or handler run timed out at once, the
    // writer purging or retrying without a pause): each refusal names its least value.
    for (setting, value, least) in [
        ("REELAY_LEDGER_LEASE_MS", "0", "1000"),
        ("REELAY_OUTBOX_LEASE_MS", "50", "1000"),
        ("REELAY_GRPC_TIMEOUT_MS", "0", "2000"),
        ("REELAY_HANDLER_TIMEOUT_MS", "0", "1000"),
        ("REELAY_ACK_WAIT_MS", "0", "1000"),
        ("REELAY_LEDGER_PURGE_INTERVAL_MS", "0", "100"),
        ("REELAY_RETRY_BASE_MS", "0", "10"),
        ("REELAY_RETRY_CAP_MS", "0", "10"),
        ("REELAY_FEDERATION_TIMEOUT_MS", "0", "100"),
        ("REELAY_ENRICHMENT_TIMEOUT_MS", "0", "100"),
    ] {
        let stderr = refused(setting, value).await;
        let flag = setting.trim_start_matches("REELAY_").to_lowercase().replace('_', "-");
        assert!(stderr.contains(&flag) && stderr.contains(least), "{setting}={value}: {stderr}");
    }
}

/// Settings and flags no run could use are refused before anything starts, naming what they
/// accept: a log format Reelay does not write (it was taken for text), a wait that would
/// overflow the clock (it panicked).
#[test]
fn a_log_format_or_a_wait_out_of_range_is_refused_at_once() {
    let out = std::process::Command::new(BIN).args(["status"]).env("REELAY_LOG_FORMAT", "xml").output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("log-format") && stderr.contains("json"), "{stderr}");
    let out = std::process::Command::new(BIN)
        .args(["wrap-ups", "request", "--user", "u", "--year", "2024", "--wait-secs", "18446744073709551615"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("wait-secs") && stderr.contains("86400"), "{stderr}");
}

/// A write whose event could never be delivered (over REELAY_MAX_EVENT_BYTES) is refused before
/// anything is written.
#[tokio::test]
async fn a_write_whose_event_is_too_large_to_deliver_is_refused() {
    let dir = temp_dir();
    let db = dir.path().join("reelay.db");
    let mut reelay = Reelay::start_write(BIN, &db, &[("REELAY_MAX_EVENT_BYTES", "20000")]).await;
    let mut c = reelay.clients().await;
    let ana = c.user("ana").await;
    let baseline = table_snapshot(&db).await;
    let big = "𝄞".repeat(9_000); // 36 KB, within the 10,000-character body limit
    let status = c.reviews.log_review(log(&ana, movie_ref("Heat", 1995), 8, big, "")).await.unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert!(status.message().contains("REELAY_MAX_EVENT_BYTES"), "{}", status.message());
    assert_eq!(table_snapshot(&db).await, baseline, "nothing was written");
    // A smaller one goes through.
    c.reviews.log_review(log(&ana, movie_ref("Heat", 1995), 8, long(10_000), "")).await.unwrap();
    reelay.stop().await;
}
