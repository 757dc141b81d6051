//! Federation end to end: real `reelay` processes serving ActivityPub on loopback, real HTTP
//! signatures both ways, a Mastodon-shaped peer that checks every signature and digest it gets.

use std::path::Path;
use std::time::Duration;

use reelay_contracts::v1::{self, search_client::SearchClient};
use reelay_delivery::Handler;
use reelay_harness::{
    Clients, MastodonPeer, Reelay, Spoil, actor_account, events_of, get_json, movie_ref, query_strings, temp_dir,
    user_account,
};
use serde_json::{Value, json};

const BIN: &str = env!("CARGO_BIN_EXE_reelay");

/// Retries within a second, and enough of them to outlast a peer that is down for a while.
/// The peers are on loopback, which federation reaches only when allowed.
const FAST: &[(&str, &str)] = &[
    ("REELAY_RETRY_BASE_MS", "200"),
    ("REELAY_RETRY_CAP_MS", "1000"),
    ("EVENT_QUEUE_MAX_ATTEMPTS", "60"),
    ("REELAY_FEDERATION_ALLOW_PRIVATE", "true"),
];

/// Waits until `$done` (an expression that may `.await`) holds; fails the test after 40 s.
macro_rules! wait_until {
    ($what:expr, $done:expr) => {{
        let deadline = std::time::Instant::now() + Duration::from_secs(40);
        while !($done) {
            assert!(std::time::Instant::now() < deadline, "timed out waiting until {}", $what);
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }};
}

async fn count(db: &Path, sql: &str) -> i64 {
    query_strings(db, &format!("SELECT CAST(({sql}) AS TEXT)")).await[0][0].parse().unwrap()
}

async fn log(c: &mut Clients, user: &str, title: &str, year: i32, rating: u32, body: &str) -> v1::Review {
    c.review_with_text(user, movie_ref(title, year), rating, body).await
}

async fn edit(c: &mut Clients, user: &str, review: &v1::Review, rating: u32, body: &str) {
    let request = v1::EditReviewRequest {
        actor_user_id: user.into(),
        review_id: review.review_id.clone(),
        rating,
        body: body.into(),
        ..Default::default()
    };
    c.reviews.edit_review(request).await.expect("edit a review");
}

async fn delete(c: &mut Clients, user: &str, review: &v1::Review) {
    let request = v1::DeleteReviewRequest {
        actor_user_id: user.into(),
        review_id: review.review_id.clone(),
        ..Default::default()
    };
    c.reviews.delete_review(request).await.expect("delete a review");
}

async fn hits(reelay: &Reelay, query: &str) -> Vec<v1::ReviewHit> {
    SearchClient::new(reelay.handlers_channel().await)
        .search_reviews(v1::SearchReviewsRequest { query: query.into(), page_size: 20, page_token: String::new() })
        .await
        .expect("search reviews")
        .into_inner()
        .hits
}

async fn follow(c: &mut Clients, user: &str, actor: &str) {
    let request = v1::FollowRequest { actor_user_id: user.into(), target: actor_account(actor), ..Default::default() };
    assert!(c.social.follow(request).await.unwrap().into_inner().changed);
}

/// A federation handler of this build, run in this test process against `reelay`'s write service.
fn handler(reelay: &Reelay, name: &str) -> std::sync::Arc<dyn Handler> {
    handler_reaching(reelay, name, &crate::handler_context(reelay))
}

/// `handler`, reaching the write service through `context`.
fn handler_reaching(
    reelay: &Reelay,
    name: &str,
    context: &reelay_delivery::HandlerContext,
) -> std::sync::Arc<dyn Handler> {
    let settings = reelay_federation::FederationSettings {
        public_url: Some(reelay.public_url()),
        allow_private: Some(true),
        ..Default::default()
    };
    reelay_federation::build(name, &settings, context).unwrap().handler
}

/// What a Mastodon-shaped server sends for a review: a Note carrying Reelay's film fields.
fn review_note(peer: &MastodonPeer, name: &str, n: u32, title: &str, year: i32, text: &str) -> Value {
    let actor = peer.actor(name);
    json!({
        "@context": "https://www.w3.org/ns/activitystreams",
        "id": format!("{actor}/statuses/{n}/activity"),
        "type": "Create",
        "actor": actor,
        "object": {
            "id": format!("{actor}/statuses/{n}"),
            "type": "Note",
            "attributedTo": actor,
            "content": format!("<p>{text}</p>"),
            "published": "2024-05-01T12:00:00Z",
            "to": ["https://www.w3.org/ns/activitystreams#Public"],
            "cc": [format!("{actor}/followers")],
            "film": { "type": "Movie", "name": title, "year": year },
            "relatedWith": [{ "type": "Rating", "value": 4, "best": 5 }],
        },
    })
}

/// A `Delete` of `object` by `actor`, under activity id `id`.
fn delete_activity(actor: &str, object: &str, id: &str) -> Value {
    json!({
        "@context": "https://www.w3.org/ns/activitystreams",
        "id": id,
        "type": "Delete",
        "actor": actor,
        "object": object,
    })
}

fn follow_of(peer: &MastodonPeer, name: &str, n: u32, object: &str) -> Value {
    json!({
        "@context": "https://www.w3.org/ns/activitystreams",
        "id": format!("{}/follows/{n}", peer.actor(name)),
        "type": "Follow",
        "actor": peer.actor(name),
        "object": object,
    })
}

/// A Mastodon-shaped peer and an instance with one user, ana.
async fn peer_and_ana(db: &Path) -> (MastodonPeer, Reelay, Clients, String) {
    let peer = MastodonPeer::start().await;
    let a = Reelay::start_all(BIN, db, FAST).await;
    let mut c = a.clients().await;
    let ana = c.user("ana").await;
    (peer, a, c, ana)
}

/// ana@A follows bob@B; B accepts; bob's earlier review is backfilled, and his review's log, edit
/// and delete reach A's store and search. Then bob follows ana, B is stopped while ana reviews,
/// and the delivery arrives once B is back, exactly once.
#[tokio::test]
async fn two_instances_federate() {
    let (dir_a, dir_b) = (temp_dir(), temp_dir());
    let a = Reelay::start_all(BIN, &dir_a.path().join("reelay.db"), FAST).await;
    let mut b = Reelay::start_all(BIN, &dir_b.path().join("reelay.db"), FAST).await;
    let (mut ca, mut cb) = (a.clients().await, b.clients().await);
    let ana = ca.user("ana").await;
    let bob = cb.user("bob").await;
    log(&mut cb, &bob, "Alien", 1979, 8, "The chestburster.").await;

    follow(&mut ca, &ana, &b.actor_url(&bob)).await;
    wait_until!(
        "B records ana as bob's follower",
        count(&b.database, "SELECT COUNT(*) FROM remote_followers").await == 1
    );
    wait_until!(
        "A records B's Accept",
        count(&a.database, "SELECT COUNT(*) FROM follows WHERE accepted_at IS NOT NULL").await == 1
    );
    wait_until!(
        "the backfill brings bob's earlier review to A's search",
        hits(&a, "chestburster").await.iter().any(|h| h.remote && h.rating == 8)
    );

    // Running the backfill again on the same event changes nothing.
    let accepted = events_of(&a.database, "RemoteFollowAccepted").await;
    assert_eq!(accepted.len(), 1);
    let saved_before = events_of(&a.database, "RemoteReviewSaved").await.len();
    let backfill = handler(&a, "federation-backfill");
    backfill.handle(&accepted[0]).await.unwrap();
    backfill.handle(&accepted[0]).await.unwrap();
    assert_eq!(events_of(&a.database, "RemoteReviewSaved").await.len(), saved_before);
    assert_eq!(count(&a.database, "SELECT COUNT(*) FROM remote_reviews").await, 1);

    let review = log(&mut cb, &bob, "Heat", 1995, 9, "The diner scene.").await;
    wait_until!(
        "bob's review reaches A's search",
        hits(&a, "diner").await.iter().any(|h| h.remote && h.rating == 9 && h.movie_title == "Heat")
    );
    edit(&mut cb, &bob, &review, 10, "The diner scene, again.").await;
    wait_until!("the edit reaches A", hits(&a, "again").await.iter().any(|h| h.remote && h.rating == 10));
    delete(&mut cb, &bob, &review).await;
    wait_until!("the delete reaches A", hits(&a, "diner").await.is_empty());
    let object = format!("{}/reviews/{}", b.actor_url(&bob), review.review_id);
    assert_eq!(
        count(&a.database, &format!("SELECT COUNT(*) FROM remote_reviews WHERE object_uri = '{object}'")).await,
        0
    );

    // The other way round, with B down while ana reviews.
    follow(&mut cb, &bob, &a.actor_url(&ana)).await;
    wait_until!(
        "A accepts bob",
        count(&b.database, "SELECT COUNT(*) FROM follows WHERE accepted_at IS NOT NULL").await == 1
    );
    b.stop().await;
    let ran = log(&mut ca, &ana, "Ran", 1985, 10, "A storm of arrows.").await;
    wait_until!(
        "A's delivery to B fails while B is down",
        count(
            &a.database,
            "SELECT COUNT(*) FROM processed_events WHERE handler = 'federation-delivery' AND attempts > 0"
        )
        .await
            > 0
    );
    tokio::time::sleep(Duration::from_secs(2)).await;
    b.restart().await;
    let object = format!("{}/reviews/{}", a.actor_url(&ana), ran.review_id);
    wait_until!(
        "the review arrives once B is back",
        count(&b.database, &format!("SELECT COUNT(*) FROM remote_reviews WHERE object_uri = '{object}'")).await == 1
    );
    wait_until!("B's search finds it", hits(&b, "arrows").await.iter().any(|h| h.remote));
    tokio::time::sleep(Duration::from_secs(2)).await;
    let saved: Vec<_> = events_of(&b.database, "RemoteReviewSaved")
        .await
        .into_iter()
        .filter(|e| matches!(&e.payload, Some(v1::event::Payload::RemoteReviewSaved(s)) if s.object_uri == object))
        .collect();
    assert_eq!(saved.len(), 1, "the review was saved exactly once");
    let saved_total = events_of(&b.database, "RemoteReviewSaved").await.len();
    let create = events_of(&a.database, "ActivityQueued").await;
    let create: Vec<_> = create
        .iter()
        .filter_map(|e| match &e.payload {
            Some(v1::event::Payload::ActivityQueued(q)) if q.activity_json.contains(&object) => {
                Some(q.activity_id.clone())
            }
            _ => None,
        })
        .collect();
    assert_eq!(create.len(), 1, "one delivery queued for B's one follower");

    // The delivery handler run twice more on that delivery: B takes it in once.
    let queued = events_of(&a.database, "ActivityQueued").await;
    let delivery_event = queued.iter().find(|e| e_activity_id(e) == json!(create[0])).unwrap();
    let delivery = handler(&a, "federation-delivery");
    delivery.handle(delivery_event).await.unwrap();
    delivery.handle(delivery_event).await.unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let saved_again = events_of(&b.database, "RemoteReviewSaved").await;
    assert_eq!(saved_again.len(), saved_total, "a replayed delivery changes nothing at B");
    assert_eq!(
        count(&b.database, &format!("SELECT COUNT(*) FROM remote_reviews WHERE object_uri = '{object}'")).await,
        1
    );
    assert_eq!(
        count(&b.database, &format!("SELECT COUNT(*) FROM federation_inbox WHERE activity_id = '{}'", create[0])).await,
        1
    );
}

/// A Mastodon-shaped peer finds ana by WebFinger, follows her (per-user and shared inbox),
/// gets both Accepts, then her review's Create, Update and Delete: one POST per shared inbox,
/// every one signed and digested as Mastodon checks.
#[tokio::test]
async fn a_mastodon_peer_follows_and_receives_reviews() {
    let dir = temp_dir();
    let (peer, a, mut c, ana) = peer_and_ana(&dir.path().join("reelay.db")).await;

    let webfinger = format!("{}/.well-known/webfinger?resource=acct:ana@{}", a.public_url(), a.gateway_addr);
    let (status, jrd) = get_json(&webfinger).await;
    assert_eq!(status, 200, "{jrd}");
    let actor_url = a.actor_url(&ana);
    assert!(jrd["links"].as_array().unwrap().iter().any(|l| l["rel"] == "self" && l["href"] == actor_url.as_str()));
    // The handle and the scheme in any case, and her page's URL, find her too, from a browser
    // as well (CORS); her page sends its reader to her actor.
    let host = a.gateway_addr.to_string();
    for resource in [format!("acct:Ana@{host}"), format!("ACCT:ana@{host}"), format!("{}/@ana", a.public_url())] {
        let url = format!("{}/.well-known/webfinger?resource={resource}", a.public_url());
        let (status, head, body) = reelay_harness::http_request("GET", &url, &[], b"").await;
        assert_eq!(status, 200, "{resource}: {}", String::from_utf8_lossy(&body));
        assert!(head.to_ascii_lowercase().contains("access-control-allow-origin: *"), "{resource}: {head}");
        let found: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(found["subject"], format!("acct:ana@{host}"), "{resource}");
    }
    let page = jrd["links"].as_array().unwrap().iter().find(|l| l["type"] == "text/html").unwrap()["href"].clone();
    let (status, head, _) = reelay_harness::http_request("GET", page.as_str().unwrap(), &[], b"").await;
    assert_eq!(status, 303, "{head}");
    assert!(head.contains(&format!("location: {actor_url}")), "{head}");
    assert_eq!(get_json(&format!("{}/@nobody", a.public_url())).await.0, 404);
    // An actor nobody has is a plain 404 (no key pair is made for it first).
    let unknown = format!("{}/users/{}", a.public_url(), uuid::Uuid::new_v4());
    assert_eq!(get_json(&unknown).await.0, 404);
    let (status, actor) = get_json(&actor_url).await;
    assert_eq!(status, 200);
    assert_eq!(actor["type"], "Person");
    assert_eq!(actor["preferredUsername"], "ana");
    assert!(actor["publicKey"]["publicKeyPem"].as_str().unwrap().starts_with("-----BEGIN PUBLIC KEY-----"));
    let inbox = actor["inbox"].as_str().unwrap().to_owned();
    let shared = actor["endpoints"]["sharedInbox"].as_str().unwrap().to_owned();
    let (status, nodeinfo) = get_json(&format!("{}/.well-known/nodeinfo", a.public_url())).await;
    assert_eq!(status, 200);
    let (status, nodeinfo) = get_json(nodeinfo["links"][0]["href"].as_str().unwrap()).await;
    assert_eq!((status, nodeinfo["software"]["name"].as_str()), (200, Some("reelay")));

    assert_eq!(peer.send("alice", &inbox, &follow_of(&peer, "alice", 1, &actor_url)).await, 202);
    assert_eq!(peer.send("carol", &shared, &follow_of(&peer, "carol", 1, &actor_url)).await, 202);
    wait_until!("both followers get their Accept", peer.received_of("Accept").len() == 2);
    for accept in peer.received_of("Accept") {
        assert_eq!(accept.verified, Ok(()), "{:?}", accept.activity);
        assert_eq!(accept.key_id, format!("{actor_url}#main-key"));
        assert_eq!(accept.activity["actor"], actor_url.as_str());
    }
    let mut accepted: Vec<_> =
        peer.received_of("Accept").iter().map(|r| r.activity["object"]["id"].as_str().unwrap().to_owned()).collect();
    accepted.sort();
    assert_eq!(accepted, [format!("{}/follows/1", peer.actor("alice")), format!("{}/follows/1", peer.actor("carol"))]);

    // bo has no remote follower: his review, logged just before ana's, reaches nobody and costs
    // the write service no QueueDeliveries call.
    let bo = c.user("bo").await;
    log(&mut c, &bo, "Thief", 1981, 8, "The safe.").await;
    let heat = v1::MovieRef {
        by: Some(v1::movie_ref::By::TitleYear(v1::TitleYear {
            title: "Heat".into(),
            year: 1995,
            external_id: "tmdb:949".into(),
        })),
    };
    let review = c.review_with_text(&ana, Some(heat), 9, "The diner scene.").await;
    wait_until!("the Create arrives", !peer.received_of("Create").is_empty());
    tokio::time::sleep(Duration::from_millis(1100)).await; // an edit in a later second than the log
    edit(&mut c, &ana, &review, 10, "The diner scene, again.").await;
    wait_until!("the Update arrives", !peer.received_of("Update").is_empty());

    let (status, outbox) = get_json(&format!("{actor_url}/outbox")).await;
    assert_eq!((status, outbox["totalItems"].as_u64()), (200, Some(1)));
    let (status, page) = get_json(outbox["first"].as_str().unwrap()).await;
    assert_eq!(status, 200);
    let note_id = format!("{actor_url}/reviews/{}", review.review_id);
    assert_eq!(page["orderedItems"][0]["object"]["id"], note_id.as_str());
    let create_id = format!("{note_id}/activity");
    assert_eq!(page["orderedItems"][0]["id"], create_id.as_str(), "the Create followers were sent");
    let (status, note) = get_json(&note_id).await;
    assert_eq!((status, note["film"]["name"].as_str()), (200, Some("Heat")));
    // The Create's id resolves: the activity, around the note as it is now (edited).
    let (status, served) = get_json(&create_id).await;
    assert_eq!(
        (status, served["type"].as_str(), served["id"].as_str()),
        (200, Some("Create"), Some(create_id.as_str()))
    );
    let mut bare_note = note.clone();
    bare_note.as_object_mut().unwrap().remove("@context");
    assert_eq!(served["object"], bare_note);
    assert_eq!(served["actor"], actor_url.as_str());

    delete(&mut c, &ana, &review).await;
    wait_until!("the Delete arrives", !peer.received_of("Delete").is_empty());
    tokio::time::sleep(Duration::from_millis(500)).await;

    for kind in ["Create", "Update", "Delete"] {
        let received = peer.received_of(kind);
        assert_eq!(received.len(), 1, "one {kind} for two followers on one shared inbox");
        assert_eq!(received[0].path, "/inbox", "delivered to the shared inbox");
        assert_eq!(received[0].verified, Ok(()), "{kind}");
    }
    let create = &peer.received_of("Create")[0].activity;
    let note = &create["object"];
    assert_eq!(note["type"], "Note");
    assert_eq!(note["id"], note_id.as_str());
    let content = note["content"].as_str().unwrap();
    assert!(content.contains("Heat (1995)") && content.contains("★★★★½") && content.contains(&note_id), "{content}");
    assert_eq!(note["relatedWith"][0]["value"], 4.5);
    assert_eq!(note["film"]["externalId"], "tmdb:949", "the film's external id, as the note served has it");
    let update = &peer.received_of("Update")[0].activity;
    assert_eq!(update["object"]["relatedWith"][0]["value"], 5.0);
    assert_eq!(update["object"]["film"]["externalId"], "tmdb:949");
    assert_eq!(update["object"]["published"], note["published"], "an edit keeps the note's first publication");
    assert!(
        update["object"]["updated"].as_str() > note["published"].as_str(),
        "and says when it was edited: {}",
        update["object"]
    );
    assert_eq!(peer.received_of("Delete")[0].activity["object"]["id"], note_id.as_str());
    assert_eq!(create["id"], create_id.as_str(), "named after its note, as the outbox lists it");
    let update_id =
        format!("{}/activities/{}", a.public_url(), events_of(&a.database, "ReviewEdited").await[0].event_id);
    assert_eq!(update["id"], update_id.as_str(), "an Update is named after its event");
    assert_eq!(create["actor"], actor_url.as_str(), "ana's review, not bo's");
    let logged = events_of(&a.database, "ReviewLogged").await;
    let Some(v1::event::Payload::ReviewLogged(bo_review)) = &logged[0].payload else { panic!("bo's review first") };
    assert_ne!(bo_review.user_id, ana);
    let elsewhere = format!("{actor_url}/reviews/{}/activity", bo_review.review_id);
    assert_eq!(get_json(&elsewhere).await.0, 404, "bo's review is not ana's");
    let bo_activity =
        format!("{}/users/{}/reviews/{}/activity", a.public_url(), bo_review.user_id, bo_review.review_id);
    let sql = format!("SELECT COUNT(*) FROM federation_outbox WHERE activity_id = '{bo_activity}'");
    assert_eq!(count(&a.database, &sql).await, 0, "nothing queued for bo's review");
    let queued =
        a.metrics().await.sum("reelay_grpc_requests_total", &[r#"method="/reelay.v1.Federation/QueueDeliveries""#]);
    assert_eq!(queued, 5.0, "two Accepts, then ana's Create, Update and Delete; none for bo");

    // ana blocks carol, a follower: carol's server gets a Reject of her Follow, signed by ana
    // (how a server learns its follower was removed), and carol follows ana no more.
    let carol = peer.actor("carol");
    let block = v1::BlockRequest {
        actor_user_id: ana.clone(),
        target: reelay_harness::actor_account(&carol),
        ..Default::default()
    };
    assert!(c.social.block(block).await.unwrap().into_inner().changed);
    wait_until!("carol's server is told", !peer.received_of("Reject").is_empty());
    let reject = &peer.received_of("Reject")[0];
    assert_eq!(reject.verified, Ok(()), "{:?}", reject.activity);
    assert_eq!(reject.activity["actor"], actor_url.as_str());
    assert_eq!(reject.activity["object"]["id"], format!("{carol}/follows/1"));
    assert_eq!(reject.activity["object"]["actor"], carol.as_str());
    let followers = format!("SELECT COUNT(*) FROM remote_followers WHERE actor_uri = '{carol}'");
    assert_eq!(count(&a.database, &followers).await, 0);

    // Who has followers, asked as the handler asks, and what is refused.
    let followed = |ids: Vec<String>| {
        let mut federation = c.federation.clone();
        async move { federation.users_with_followers(v1::UsersWithFollowersRequest { user_ids: ids }).await }
    };
    let answer = followed(vec![ana.clone(), bo.clone(), ana.clone()]).await.unwrap().into_inner();
    assert_eq!(answer.user_ids, vec![ana.clone()]);
    let bad = followed(vec![bo.clone(), "nope".into()]).await.unwrap_err();
    assert_eq!(bad.code(), tonic::Code::InvalidArgument);
    assert!(bad.message().starts_with("user_ids[1]"), "{}", bad.message());
    let bad = followed(vec![bo.clone(); 1001]).await.unwrap_err();
    assert_eq!(bad.code(), tonic::Code::InvalidArgument);
    assert!(bad.message().starts_with("user_ids: at most 1000 per call"), "{}", bad.message());
}

/// Everything the inbox must refuse, refused with the right status (or taken and ignored) and
/// nothing written; the same activity, sent properly, is then taken.
#[tokio::test]
async fn the_inbox_refuses_bad_input_before_writing() {
    let dir = temp_dir();
    let (peer, a, mut c, ana) = peer_and_ana(&dir.path().join("reelay.db")).await;
    let inbox = format!("{}/inbox", a.actor_url(&ana));
    // ana follows alice, so alice's reviews are worth keeping.
    follow(&mut c, &ana, &peer.actor("alice")).await;
    wait_until!("alice gets ana's Follow", !peer.received_of("Follow").is_empty());
    assert_eq!(peer.received_of("Follow")[0].verified, Ok(()));
    tokio::time::sleep(Duration::from_millis(500)).await;

    let state = || async {
        let mut state = Vec::new();
        // The outbox by its events (handlers settle its rows meanwhile), the rest whole.
        state.push(query_strings(&a.database, "SELECT event_id, event_type FROM event_queue ORDER BY id").await);
        for table in
            ["remote_reviews", "remote_followers", "federation_inbox", "remote_review_tombstones", "movies", "follows"]
        {
            state.push(query_strings(&a.database, &format!("SELECT * FROM {table}")).await);
        }
        state
    };
    let before = state().await;
    let create = review_note(&peer, "alice", 1, "Stalker", 1979, "The zone.");
    let body = create.to_string();
    let cases: Vec<(&str, u16, u16)> = vec![
        ("unsigned", 401, peer.post("alice", &inbox, body.as_bytes(), Spoil::Unsigned).await),
        ("signed with another key", 401, peer.post("alice", &inbox, body.as_bytes(), Spoil::WrongKey).await),
        ("tampered body", 401, peer.post("alice", &inbox, body.as_bytes(), Spoil::TamperedBody).await),
        ("stale date", 401, peer.post("alice", &inbox, body.as_bytes(), Spoil::StaleDate).await),
        ("signed for another server", 401, peer.post("alice", &inbox, body.as_bytes(), Spoil::OtherHost).await),
        ("5 MB body", 413, peer.post("alice", &inbox, &vec![b' '; 5 * 1024 * 1024], Spoil::None).await),
        ("malformed JSON", 400, peer.post("alice", &inbox, b"{\"type\": \"Create\",", Spoil::None).await),
        (
            "unknown user",
            404,
            peer.send(
                "alice",
                &format!("{}/users/00000000-0000-7000-8000-000000000000/inbox", a.public_url()),
                &create,
            )
            .await,
        ),
        // Taken and ignored, as Mastodon does: a server forwarding another's activity signs it
        // with its own key, and would retry a refusal for days.
        (
            "signed by someone else than the actor",
            202,
            peer.post("mallory", &inbox, body.as_bytes(), Spoil::None).await,
        ),
        // Taken and ignored: kept, a followers-only review would be searchable by everyone.
        (
            "a review addressed to followers only",
            202,
            peer.send("alice", &inbox, &{
                let mut followers_only = review_note(&peer, "alice", 8, "Stalker", 1979, "The zone.");
                followers_only["object"]["to"] = followers_only["object"]["cc"].clone();
                followers_only
            })
            .await,
        ),
        // A document elsewhere that says it is alice, with its own key.
        (
            "signed with a key of a document claiming to be the actor",
            401,
            peer.post("alice", &inbox, body.as_bytes(), Spoil::ForgedActor).await,
        ),
        // A note whose id is on another server than its author (it would squat that id).
        (
            "a review whose id is on another server",
            403,
            peer.send("alice", &inbox, &{
                let mut elsewhere = review_note(&peer, "alice", 9, "Stalker", 1979, "The zone.");
                elsewhere["object"]["id"] = json!("http://elsewhere.example/users/vera/statuses/9");
                elsewhere
            })
            .await,
        ),
        // An activity whose own id is on another server: recorded, it would make that
        // server's real activity of the same id (a Delete's predictable one) a repeat.
        (
            "an activity whose id is on another server",
            400,
            peer.send(
                "alice",
                &inbox,
                &json!({
                    "@context": "https://www.w3.org/ns/activitystreams",
                    "id": "http://elsewhere.example/users/vera/statuses/9#delete",
                    "type": "Delete",
                    "actor": peer.actor("alice"),
                    "object": format!("{}/statuses/9", peer.actor("alice")),
                }),
            )
            .await,
        ),
        (
            "an inbox of a user id of the right shape naming nobody",
            404,
            peer.send("alice", &format!("{}/users/{}/inbox", a.public_url(), "-".repeat(36)), &create).await,
        ),
        // An actor document holding a URI longer than any the write service takes (a signer
        // is cached before its signature is checked: such documents would pile up there).
        (
            "signed by an actor whose inbox is 3,000 characters",
            401,
            peer.send("long-inbox", &inbox, &review_note(&peer, "long-inbox", 1, "Stalker", 1979, "The zone.")).await,
        ),
        // A key document naming alice as its owner; alice does not publish it.
        (
            "signed with a key its owner does not publish",
            401,
            peer.post("alice", &inbox, body.as_bytes(), Spoil::ForgedKey).await,
        ),
    ];
    for (case, expected, got) in &cases {
        assert_eq!(got, expected, "{case}");
    }
    assert_eq!(state().await, before, "a refused or ignored request wrote something");

    // Taken in (202), and nothing written: activities any server may send that find nothing to
    // change (they were recorded, with a tombstone for the Delete, and nothing bounded them).
    let nothing = |kind: &str, n: u32, object: serde_json::Value| {
        json!({
            "@context": "https://www.w3.org/ns/activitystreams",
            "id": format!("{}/{kind}/{n}", peer.actor("mallory")),
            "type": kind,
            "actor": peer.actor("mallory"),
            "object": object,
        })
    };
    for (case, activity) in [
        (
            "a Delete from an actor nobody follows",
            nothing("Delete", 1, json!(format!("{}/statuses/1", peer.actor("mallory")))),
        ),
        ("an Undo of a Follow never seen", nothing("Undo", 1, json!(format!("{}/follows/404", peer.actor("mallory"))))),
        (
            "a Reject of no Follow of ours",
            nothing("Reject", 1, json!(format!("{}/activities/01a242db-0000-7000-8000-000000000000", a.public_url()))),
        ),
    ] {
        assert_eq!(peer.send("mallory", &inbox, &activity).await, 202, "{case}");
    }
    assert_eq!(state().await, before, "an activity that changed nothing was recorded");

    assert_eq!(peer.send("alice", &inbox, &create).await, 202);
    wait_until!("the proper request is taken", count(&a.database, "SELECT COUNT(*) FROM remote_reviews").await == 1);
    // A repeat of the same activity changes nothing.
    assert_eq!(peer.send("alice", &inbox, &create).await, 202);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(events_of(&a.database, "RemoteReviewSaved").await.len(), 1);

    // An Update naming another film moves the review there, and the film it leaves, named by
    // nothing else now, is deleted with its MovieDeleted.
    let stalker = query_strings(&a.database, "SELECT movie_id FROM remote_reviews").await.remove(0).remove(0);
    let mut moved = review_note(&peer, "alice", 1, "Mirror", 1975, "The zone, remembered.");
    moved["type"] = json!("Update");
    moved["id"] = json!(format!("{}/statuses/1#updates/1", peer.actor("alice")));
    assert_eq!(peer.send("alice", &inbox, &moved).await, 202);
    wait_until!(
        "the review names the other film",
        count(&a.database, &format!("SELECT COUNT(*) FROM remote_reviews WHERE movie_id != '{stalker}'")).await == 1
    );
    assert_eq!(count(&a.database, "SELECT COUNT(*) FROM movies").await, 1, "only Mirror is left");
    let deleted: Vec<String> = events_of(&a.database, "MovieDeleted")
        .await
        .into_iter()
        .filter_map(|e| match e.payload {
            Some(v1::event::Payload::MovieDeleted(d)) => Some(d.movie_id),
            _ => None,
        })
        .collect();
    assert_eq!(deleted, [stalker]);

    // Out of order: a Delete before the Create it follows (both retried by a server whose
    // deliveries failed for a while), and a Create sent again under a new activity id after
    // its Delete. Neither brings a deleted review back.
    let delete_of = |n: u32, activity: u32| {
        let note = format!("{}/statuses/{n}", peer.actor("alice"));
        json!({
            "@context": "https://www.w3.org/ns/activitystreams",
            "id": format!("{note}#delete-{activity}"),
            "type": "Delete",
            "actor": peer.actor("alice"),
            "object": { "id": note, "type": "Tombstone" },
        })
    };
    assert_eq!(peer.send("alice", &inbox, &delete_of(2, 1)).await, 202);
    assert_eq!(peer.send("alice", &inbox, &review_note(&peer, "alice", 2, "Solaris", 1972, "The sea.")).await, 202);
    assert_eq!(peer.send("alice", &inbox, &delete_of(1, 1)).await, 202);
    wait_until!("the review is deleted", count(&a.database, "SELECT COUNT(*) FROM remote_reviews").await == 0);
    let mut again = create.clone();
    again["id"] = json!(format!("{}/statuses/1/activity-again", peer.actor("alice")));
    assert_eq!(peer.send("alice", &inbox, &again).await, 202);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(count(&a.database, "SELECT COUNT(*) FROM remote_reviews").await, 0, "nothing came back");
    assert_eq!(events_of(&a.database, "RemoteReviewSaved").await.len(), 2, "the Create and the Update");
    // An Update making a kept review followers-only deletes it: search shows kept reviews to
    // everyone.
    let kept = review_note(&peer, "alice", 4, "Stalker", 1979, "Soon for followers only.");
    assert_eq!(peer.send("alice", &inbox, &kept).await, 202);
    wait_until!("the public review is kept", count(&a.database, "SELECT COUNT(*) FROM remote_reviews").await == 1);
    let mut private = kept.clone();
    private["type"] = json!("Update");
    private["id"] = json!(format!("{}/statuses/4#updates/1", peer.actor("alice")));
    private["object"]["to"] = private["object"]["cc"].clone();
    assert_eq!(peer.send("alice", &inbox, &private).await, 202);
    wait_until!(
        "the review made followers-only is deleted",
        count(&a.database, "SELECT COUNT(*) FROM remote_reviews").await == 0
    );
    // An Update that arrives before its Create (a retried Create lands late): the Create keeps
    // the edited copy.
    let mut edited = review_note(&peer, "alice", 5, "Stalker", 1979, "The zone, edited.");
    edited["type"] = json!("Update");
    edited["id"] = json!(format!("{}/statuses/5#updates/1", peer.actor("alice")));
    assert_eq!(peer.send("alice", &inbox, &edited).await, 202);
    let body = "SELECT body FROM remote_reviews WHERE object_uri LIKE '%/statuses/5'";
    wait_until!("the edited review is kept", !query_strings(&a.database, body).await.is_empty());
    let late = review_note(&peer, "alice", 5, "Stalker", 1979, "The zone, first draft.");
    assert_eq!(peer.send("alice", &inbox, &late).await, 202);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        query_strings(&a.database, body).await,
        [["The zone, edited.".to_owned()]],
        "the late Create changed it"
    );
    // Two edits arriving newest first: the older is not saved over the newer.
    let edit_at = |n: u32, at: &str, text: &str| {
        let mut edit = review_note(&peer, "alice", 5, "Stalker", 1979, text);
        edit["type"] = json!("Update");
        edit["id"] = json!(format!("{}/statuses/5#updates/{n}", peer.actor("alice")));
        edit["object"]["updated"] = json!(at);
        edit
    };
    assert_eq!(peer.send("alice", &inbox, &edit_at(3, "2024-05-03T12:00:00Z", "Third thoughts.")).await, 202);
    let third = [["Third thoughts.".to_owned()]];
    wait_until!("the newest edit is kept", query_strings(&a.database, body).await == third);
    assert_eq!(peer.send("alice", &inbox, &edit_at(2, "2024-05-02T12:00:00Z", "Second thoughts.")).await, 202);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(query_strings(&a.database, body).await, third, "an older edit replaced a newer one");
    // A Create known to be newer than the copy kept (an outbox read again after Updates were
    // refused while nobody here followed) replaces it.
    let mut newest = edit_at(4, "2024-05-04T12:00:00Z", "Fourth thoughts.");
    newest["type"] = json!("Create");
    newest["id"] = json!(format!("{}/statuses/5/activity-again", peer.actor("alice")));
    assert_eq!(peer.send("alice", &inbox, &newest).await, 202);
    let fourth = [["Fourth thoughts.".to_owned()]];
    wait_until!("the newer Create replaces the copy", query_strings(&a.database, body).await == fourth);
    // Nor can an actor delete, ahead of time, an id of another server.
    let mut elsewhere = delete_of(3, 1);
    elsewhere["object"]["id"] = json!("http://elsewhere.example/users/vera/statuses/3");
    assert_eq!(peer.send("alice", &inbox, &elsewhere).await, 403);
}

/// A remote actor that rejects a Follow (or later removes its follower: Mastodon sends the same
/// Reject) ends the follow: it is no longer pending for ever, no Undo is sent back, and following
/// again sends a new Follow. Only the followed actor can reject it.
#[tokio::test]
async fn a_rejected_follow_ends_and_can_be_asked_again() {
    let dir = temp_dir();
    let (peer, a, mut c, ana) = peer_and_ana(&dir.path().join("reelay.db")).await;
    let inbox = format!("{}/inbox", a.actor_url(&ana));
    // Typed with its scheme upper-cased: the same actor, whose Reject (naming him as his server
    // does) finds the follow.
    let typed = peer.actor("bob").replacen("http://127.0.0.1:", "HTTP://127.0.0.1:", 1);
    follow(&mut c, &ana, &typed).await;
    wait_until!("bob gets ana's Follow", peer.received_of("Follow").len() == 1);
    let targets = query_strings(&a.database, "SELECT target FROM follows").await;
    assert_eq!(targets, [[format!("actor:{}", peer.actor("bob"))]]);
    let follow_activity = peer.received_of("Follow")[0].activity.clone();
    let reject = |by: &str| {
        json!({
            "@context": "https://www.w3.org/ns/activitystreams",
            "id": format!("{}/rejects/1", peer.actor(by)),
            "type": "Reject",
            "actor": peer.actor(by),
            "object": follow_activity,
        })
    };
    let follows = || count(&a.database, "SELECT COUNT(*) FROM follows");
    assert_eq!(peer.send("carol", &inbox, &reject("carol")).await, 202);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(follows().await, 1, "someone else's Reject changes nothing");
    assert_eq!(peer.send("bob", &inbox, &reject("bob")).await, 202);
    wait_until!("the follow is gone", follows().await == 0);
    let unfollowed = events_of(&a.database, "Unfollowed").await;
    let Some(v1::event::Payload::Unfollowed(unfollowed)) = &unfollowed[0].payload else { panic!("{unfollowed:?}") };
    assert!(unfollowed.rejected && unfollowed.follower_id == ana, "{unfollowed:?}");
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(peer.received_of("Undo").is_empty(), "bob ended it: nothing is sent back");
    follow(&mut c, &ana, &peer.actor("bob")).await;
    wait_until!("following again sends a new Follow", peer.received_of("Follow").len() == 2);
    assert_ne!(peer.received_of("Follow")[1].activity["id"], follow_activity["id"]);
}

/// A follow whose Follow could not be delivered (the peer refused it, so the delivery was given
/// up) stays waiting for an Accept; following again sends the same Follow again (same id, so an
/// Accept of either delivery names the follow), at most once every 5 s, and never once accepted.
#[tokio::test]
async fn following_again_sends_a_follow_whose_delivery_was_given_up() {
    let dir = temp_dir();
    let (peer, a, mut c, ana) = peer_and_ana(&dir.path().join("reelay.db")).await;
    let given_up = "SELECT COUNT(*) FROM processed_events WHERE handler = 'federation-delivery' \
                    AND status = 'dead_lettered'";
    peer.set_inbox_status(403);
    follow(&mut c, &ana, &peer.actor("bob")).await;
    wait_until!("the refused Follow is given up", count(&a.database, given_up).await == 1);
    let first = peer.received_of("Follow")[0].activity.clone();
    peer.set_inbox_status(202);
    let again = || {
        let request = v1::FollowRequest {
            actor_user_id: ana.clone(),
            target: actor_account(&peer.actor("bob")),
            ..Default::default()
        };
        let mut social = c.social.clone();
        async move { social.follow(request).await.unwrap().into_inner().changed }
    };
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert!(!again().await, "already following: nothing changed");
    // Right after (well within 5 s of the first): not sent a third time.
    assert!(!again().await);
    let resends = || async {
        let followed = events_of(&a.database, "Followed").await;
        let resend = |e: &v1::Event| matches!(&e.payload, Some(v1::event::Payload::Followed(f)) if !f.resends_follow_event_id.is_empty());
        followed.iter().filter(|e| resend(e)).count()
    };
    assert_eq!(resends().await, 1, "one resend, not again within 5 s");
    wait_until!("the Follow is sent again", peer.received_of("Follow").len() == 2);
    let resent = peer.received_of("Follow")[1].clone();
    assert_eq!(resent.activity, first, "the same Follow, id and all");
    assert_eq!(resent.status, 202);
    assert!(resent.verified.is_ok(), "{:?}", resent.verified);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(peer.received_of("Follow").len(), 2, "nothing more was sent");

    let accept = json!({
        "@context": "https://www.w3.org/ns/activitystreams",
        "id": format!("{}/accepts/1", peer.actor("bob")),
        "type": "Accept",
        "actor": peer.actor("bob"),
        "object": first,
    });
    assert_eq!(peer.send("bob", &format!("{}/inbox", a.actor_url(&ana)), &accept).await, 202);
    let accepted = "SELECT COUNT(*) FROM follows WHERE accepted_at IS NOT NULL";
    wait_until!("the follow is accepted", count(&a.database, accepted).await == 1);
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert!(!again().await);
    tokio::time::sleep(Duration::from_millis(1000)).await;
    assert_eq!(peer.received_of("Follow").len(), 2, "an accepted follow is not asked again");
}

/// A followed actor's outbox is read page by page once it accepts; a later page that is gone
/// (404) ends the backfill with what the pages before it gave, not a dead letter.
#[tokio::test]
async fn a_backfill_ends_with_what_it_saved_at_a_page_that_is_gone() {
    let dir = temp_dir();
    let (peer, a, mut c, ana) = peer_and_ana(&dir.path().join("reelay.db")).await;
    let bob = peer.actor("bob");
    let page = json!({
        "id": format!("{bob}/outbox/0"),
        "type": "OrderedCollectionPage",
        "orderedItems": [review_note(&peer, "bob", 1, "Stalker", 1979, "The zone.")],
        "next": format!("{bob}/outbox/1"),
    });
    peer.set_outbox("bob", vec![page]);
    follow(&mut c, &ana, &bob).await;
    wait_until!("bob gets ana's Follow", peer.received_of("Follow").len() == 1);
    let accept = json!({
        "@context": "https://www.w3.org/ns/activitystreams",
        "id": format!("{bob}/accepts/1"),
        "type": "Accept",
        "actor": bob,
        "object": peer.received_of("Follow")[0].activity,
    });
    assert_eq!(peer.send("bob", &format!("{}/inbox", a.actor_url(&ana)), &accept).await, 202);
    let settled = "SELECT status FROM processed_events WHERE handler = 'federation-backfill'";
    wait_until!(
        "the backfill is settled",
        query_strings(&a.database, settled).await.iter().any(|row| row[0] != "in_progress")
    );
    assert_eq!(query_strings(&a.database, settled).await, [["done"]]);
    assert_eq!(count(&a.database, "SELECT COUNT(*) FROM remote_reviews").await, 1, "the first page's review");
}

/// Outside development, federation reaches public addresses only: a request signed with a key
/// on loopback (a keyId pointing into this network) is refused, and the key is not fetched.
#[tokio::test]
async fn a_key_on_a_private_address_is_not_fetched_outside_development() {
    let dir = temp_dir();
    let peer = MastodonPeer::start().await;
    let a = Reelay::start_all(BIN, &dir.path().join("reelay.db"), &[]).await;
    let body = follow_of(&peer, "alice", 1, &format!("{}/users/someone", a.public_url())).to_string();
    let status = peer.post("alice", &format!("{}/inbox", a.public_url()), body.as_bytes(), Spoil::None).await;
    assert_eq!(status, 401);
    wait_until!("the refusal is logged", a.log_text().contains("is not a public address"));
}

/// A redelivered event sends the same activity id; running the handlers twice on one event
/// queues and delivers the same activity; an inbox that answers 410 loses its followers and
/// gets nothing more.
#[tokio::test]
async fn redelivery_is_a_replay_and_a_gone_inbox_is_dropped() {
    let dir = temp_dir();
    let (peer, a, mut c, ana) = peer_and_ana(&dir.path().join("reelay.db")).await;
    let inbox = format!("{}/inbox", a.actor_url(&ana));
    assert_eq!(peer.send("alice", &inbox, &follow_of(&peer, "alice", 1, &a.actor_url(&ana))).await, 202);
    wait_until!("alice is accepted", !peer.received_of("Accept").is_empty());

    log(&mut c, &ana, "Heat", 1995, 9, "The diner scene.").await;
    wait_until!("the Create arrives", peer.received_of("Create").len() == 1);
    let create_id = peer.received_of("Create")[0].activity["id"].clone();

    // The activities handler, twice on the same ReviewLogged: the activity is queued once.
    let logged = events_of(&a.database, "ReviewLogged").await.remove(0);
    let activities = handler(&a, "federation");
    activities.handle(&logged).await.unwrap();
    activities.handle(&logged).await.unwrap();
    // And as the runtime calls it, a batch (here the same event twice): still queued once.
    let results = activities.handle_batch(&[&logged, &logged]).await;
    assert!(results.iter().all(Result::is_ok), "{results:?}");
    let queued = events_of(&a.database, "ActivityQueued").await;
    assert_eq!(queued.iter().filter(|e| e_activity_id(e) == create_id).count(), 1);
    // With the write service unreachable, neither the lookup of followed authors nor the event's
    // own queueing can happen: the event is left to be retried.
    let unreachable = reelay_delivery::HandlerContext {
        write: reelay_kit::client::connect_lazy(
            "http://127.0.0.1:1",
            Some(reelay_harness::TEST_TOKEN),
            Duration::from_secs(5),
        )
        .unwrap(),
        ..crate::handler_context(&a)
    };
    let offline = handler_reaching(&a, "federation", &unreachable);
    let results = offline.handle_batch(&[&logged]).await;
    assert!(matches!(results[..], [Err(reelay_delivery::HandlerError::Retryable(_))]), "{results:?}");

    // The delivery handler, twice on the same ActivityQueued: the same activity, twice.
    let delivery_event = queued.into_iter().find(|e| e_activity_id(e) == create_id).unwrap();
    let delivery = handler(&a, "federation-delivery");
    delivery.handle(&delivery_event).await.unwrap();
    delivery.handle(&delivery_event).await.unwrap();
    let creates = peer.received_of("Create");
    assert_eq!(creates.len(), 3);
    assert!(creates.iter().all(|r| r.activity["id"] == create_id && r.verified.is_ok()), "a replay, never a new id");
    assert!(creates.iter().all(|r| r.activity == creates[0].activity), "the same bytes every time");

    // 5xx, a redirect and 401 are retried until the inbox takes it; another 4xx is given up
    // at once.
    log(&mut c, &ana, "Stalker", 1979, 9, "The zone.").await;
    for status in [503, 307, 401] {
        peer.set_inbox_status(status);
        wait_until!(
            &format!("the inbox answering {status} is retried"),
            count(
                &a.database,
                &format!(
                    "SELECT COUNT(*) FROM processed_events WHERE handler = 'federation-delivery' \
                     AND status = 'retry' AND last_error LIKE '%answered {status}%'"
                )
            )
            .await
                == 1
        );
    }
    peer.set_inbox_status(202);
    wait_until!(
        "the retried delivery is taken",
        peer.received_of("Create").iter().any(|r| r.status == 202 && r.activity["object"]["film"]["name"] == "Stalker")
    );
    peer.set_inbox_status(403);
    log(&mut c, &ana, "Solaris", 1972, 8, "The ocean.").await;
    wait_until!(
        "the refused delivery is dead-lettered without a retry",
        count(
            &a.database,
            "SELECT COUNT(*) FROM processed_events WHERE handler = 'federation-delivery' AND status = 'dead_lettered' \
             AND attempts <= 1 AND last_error LIKE '%403%'"
        )
        .await
            == 1
    );

    peer.set_inbox_status(410);
    log(&mut c, &ana, "Ran", 1985, 10, "Arrows.").await;
    wait_until!(
        "the follower at the gone inbox is removed",
        count(&a.database, "SELECT COUNT(*) FROM remote_followers").await == 0
    );
    assert_eq!(events_of(&a.database, "RemoteFollowUndone").await.len(), 1);
    assert_eq!(count(&a.database, "SELECT COUNT(*) FROM processed_events WHERE status = 'dead_lettered'").await, 1);
    peer.set_inbox_status(202);
    let received = peer.received().len();
    log(&mut c, &ana, "Alien", 1979, 8, "Chestburster.").await;
    wait_until!(
        "the federation handler is done with the last review",
        count(&a.database, "SELECT COUNT(*) FROM processed_events WHERE handler = 'federation' AND status != 'done'")
            .await
            == 0
            && count(&a.database, "SELECT COUNT(*) FROM processed_events WHERE handler = 'federation'").await >= 6
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(peer.received().len(), received, "nothing more goes to a gone inbox");
}

fn e_activity_id(event: &v1::Event) -> Value {
    match &event.payload {
        Some(v1::event::Payload::ActivityQueued(q)) => json!(q.activity_id),
        _ => Value::Null,
    }
}

/// A write service alone, with one user, ana.
async fn write_service_and_ana(db: &Path) -> (Reelay, Clients, String) {
    let reelay = Reelay::start_write(BIN, db, &[]).await;
    let mut c = reelay.clients().await;
    let ana = c.user("ana").await;
    (reelay, c, ana)
}

/// An Undo changes something only when it names the Follow in force: follow f1, undo f1,
/// follow f2, then an Undo of f1 again (redelivered, or a new Undo naming it) leaves f2 alone.
#[tokio::test]
async fn an_undo_names_the_follow_it_undoes() {
    let dir = temp_dir();
    let db = dir.path().join("reelay.db");
    let (mut reelay, mut c, ana) = write_service_and_ana(&db).await;
    let actor = "https://films.example/users/carla";
    let follow = |id: &str| v1::ReceiveFollowRequest {
        actor_uri: actor.into(),
        user_id: ana.clone(),
        activity_uri: format!("https://films.example/follows/{id}"),
        inbox: format!("{actor}/inbox"),
        ..Default::default()
    };
    let undo = |undo: &str, of: &str| v1::ReceiveUndoRequest {
        actor_uri: actor.into(),
        user_id: ana.clone(),
        activity_uri: format!("https://films.example/follows/{of}"),
        received_activity_uri: format!("https://films.example/undos/{undo}"),
    };
    let f = &mut c.federation;
    assert!(f.receive_follow(follow("f1")).await.unwrap().into_inner().changed);
    assert!(f.receive_undo(undo("u1", "f1")).await.unwrap().into_inner().changed);
    assert!(f.receive_follow(follow("f2")).await.unwrap().into_inner().changed);
    assert!(!f.receive_undo(undo("u1", "f1")).await.unwrap().into_inner().changed, "a redelivered Undo of f1");
    assert!(!f.receive_undo(undo("u2", "f1")).await.unwrap().into_inner().changed, "a new Undo naming f1");
    assert!(!f.receive_undo(undo("u3", "f0")).await.unwrap().into_inner().changed, "an Undo of a Follow never seen");
    assert!(!f.receive_follow(follow("f1")).await.unwrap().into_inner().changed, "a redelivered, undone Follow");
    let in_force = query_strings(&db, "SELECT activity_uri FROM remote_followers").await;
    assert_eq!(in_force, [["https://films.example/follows/f2".to_owned()]]);
    assert_eq!(events_of(&db, "RemoteFollowUndone").await.len(), 1, "no spurious RemoteFollowUndone");
    assert_eq!(events_of(&db, "RemoteFollowReceived").await.len(), 2);
    assert!(f.receive_undo(undo("u4", "f2")).await.unwrap().into_inner().changed);
    assert_eq!(count(&db, "SELECT COUNT(*) FROM remote_followers").await, 0);
    reelay.stop().await;
}

/// A remote account deleted on its server sends a Delete of itself: every review of it kept
/// here goes (from search too, with a film only it named), it no longer follows anyone here
/// and nobody here follows it, and no review of it arriving later is saved (one held before,
/// or one never seen). Another actor of its server can neither delete it nor speak for it.
#[tokio::test]
async fn a_remote_account_deleted_on_its_server_takes_its_reviews_and_follows_with_it() {
    let dir = temp_dir();
    let (peer, a, mut c, ana) = peer_and_ana(&dir.path().join("reelay.db")).await;
    let (db, ana_actor) = (a.database.clone(), a.actor_url(&ana));
    let inbox = format!("{ana_actor}/inbox");
    // ana follows alice, so alice's reviews are kept; alice follows ana.
    follow(&mut c, &ana, &peer.actor("alice")).await;
    wait_until!("alice gets ana's Follow", !peer.received_of("Follow").is_empty());
    assert_eq!(peer.send("alice", &inbox, &follow_of(&peer, "alice", 1, &ana_actor)).await, 202);
    wait_until!("alice gets her Accept", !peer.received_of("Accept").is_empty());
    for (n, title, year) in [(1, "Stalker", 1979), (2, "Mirror", 1975)] {
        let note = review_note(&peer, "alice", n, title, year, "The zone.");
        assert_eq!(peer.send("alice", &inbox, &note).await, 202);
    }
    // ana's own review keeps Mirror; only alice names Stalker.
    log(&mut c, &ana, "Mirror", 1975, 8, "The house.").await;
    wait_until!("alice's reviews are searchable", hits(&a, "zone").await.len() == 2);
    let delete_of = |actor: &str, object: &str, n: u32| delete_activity(actor, object, &format!("{actor}#delete-{n}"));
    let alice = peer.actor("alice");
    assert_eq!(peer.send("mallory", &inbox, &delete_of(&peer.actor("mallory"), &alice, 1)).await, 202);
    let forged = delete_of(&alice, &alice, 9).to_string();
    let as_alice = peer.post("mallory", &inbox, forged.as_bytes(), Spoil::None).await;
    assert_eq!(as_alice, 202, "mallory speaking as alice is ignored");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(count(&db, "SELECT COUNT(*) FROM remote_reviews").await, 2, "mallory deleted nothing of alice");

    assert_eq!(peer.send("alice", &inbox, &delete_of(&alice, &alice, 1)).await, 202);
    wait_until!("alice's reviews are deleted", count(&db, "SELECT COUNT(*) FROM remote_reviews").await == 0);
    assert_eq!(count(&db, "SELECT COUNT(*) FROM remote_followers").await, 0, "alice follows nobody here");
    assert_eq!(count(&db, "SELECT COUNT(*) FROM follows").await, 0, "nobody here follows alice");
    assert_eq!(count(&db, "SELECT COUNT(*) FROM remote_review_tombstones").await, 2);
    let unfollowed = events_of(&db, "Unfollowed").await;
    let Some(v1::event::Payload::Unfollowed(unfollowed)) = &unfollowed[0].payload else { panic!("ana's follow ended") };
    assert!(unfollowed.rejected, "ended as a Reject ends it: no Undo goes to an account that is gone");
    let titles = query_strings(&db, "SELECT title FROM movies").await;
    assert_eq!(titles, [["Mirror".to_owned()]], "Stalker went with the only reviews naming it");
    assert_eq!(events_of(&db, "RemoteReviewDeleted").await.len(), 2);
    assert_eq!(events_of(&db, "RemoteFollowUndone").await.len(), 1);
    assert_eq!(events_of(&db, "MovieDeleted").await.len(), 1);
    wait_until!("search no longer finds them", hits(&a, "zone").await.is_empty());
    assert_eq!(hits(&a, "house").await.len(), 1, "ana's review stays");

    let mut late = review_note(&peer, "alice", 1, "Stalker", 1979, "The zone.");
    late["id"] = json!(format!("{alice}/statuses/1/activity-late"));
    assert_eq!(peer.send("alice", &inbox, &late).await, 202);
    let never_seen = review_note(&peer, "alice", 3, "Solaris", 1972, "The sea.");
    assert_eq!(peer.send("alice", &inbox, &never_seen).await, 202);
    assert_eq!(peer.send("alice", &inbox, &delete_of(&alice, &alice, 1)).await, 202);
    assert_eq!(peer.send("alice", &inbox, &delete_of(&alice, &alice, 2)).await, 202);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(count(&db, "SELECT COUNT(*) FROM remote_reviews").await, 0, "neither late Create is saved");
    assert_eq!(events_of(&db, "RemoteReviewDeleted").await.len(), 2, "the repeats wrote nothing more");
}

/// Every actor of a server can sign an activity under any id there, and a Delete of any note
/// there: mallory follows ana under the id alice's account Delete will have, and deletes alice's
/// note before it arrives. Neither touches alice: her note is kept when it comes, and her Delete,
/// under the id mallory used, takes it away.
#[tokio::test]
async fn an_actor_cannot_take_a_colleagues_activity_id_or_delete_its_note_ahead() {
    let dir = temp_dir();
    let (peer, a, mut c, ana) = peer_and_ana(&dir.path().join("reelay.db")).await;
    let (db, ana_actor) = (a.database.clone(), a.actor_url(&ana));
    let inbox = format!("{ana_actor}/inbox");
    let (alice, mallory) = (peer.actor("alice"), peer.actor("mallory"));
    for (n, actor) in [(1, &alice), (2, &mallory)] {
        follow(&mut c, &ana, actor).await;
        wait_until!("the Follow arrives", peer.received_of("Follow").len() == n);
    }
    let mut taken = follow_of(&peer, "mallory", 1, &ana_actor);
    taken["id"] = json!(format!("{alice}#delete"));
    assert_eq!(peer.send("mallory", &inbox, &taken).await, 202);
    wait_until!("mallory's Follow is accepted", peer.received_of("Accept").len() == 1);
    let ahead = delete_activity(&mallory, &format!("{alice}/statuses/1"), &format!("{mallory}#delete-ahead"));
    assert_eq!(peer.send("mallory", &inbox, &ahead).await, 202);
    let note = review_note(&peer, "alice", 1, "Stalker", 1979, "The zone.");
    assert_eq!(peer.send("alice", &inbox, &note).await, 202);
    let kept = "SELECT COUNT(*) FROM remote_reviews";
    wait_until!("alice's note is kept", count(&db, kept).await == 1);

    assert_eq!(peer.send("alice", &inbox, &delete_activity(&alice, &alice, &format!("{alice}#delete"))).await, 202);
    wait_until!("alice's account Delete took her review", count(&db, kept).await == 0);
    assert_eq!(
        query_strings(&db, "SELECT target FROM follows").await,
        [[format!("actor:{mallory}")]],
        "ana's follow of alice ended with her account"
    );
}

/// An imported diary is history: its entries are not pushed to followers, and neither is an
/// import of its reviews filling in their text (an Update of a note never sent). Its author's
/// own edit of one afterwards is news, and goes out.
#[tokio::test]
async fn an_import_filling_in_entries_sends_followers_nothing() {
    let dir = temp_dir();
    let (peer, a, mut c, ana) = peer_and_ana(&dir.path().join("reelay.db")).await;
    let ana_actor = a.actor_url(&ana);
    assert_eq!(peer.send("alice", &format!("{ana_actor}/inbox"), &follow_of(&peer, "alice", 1, &ana_actor)).await, 202);
    wait_until!("alice is accepted", peer.received_of("Accept").len() == 1);
    let header = "Date,Name,Year,Letterboxd URI,Rating,Rewatch,Review,Tags,Watched Date\n";
    let diary = format!("{header}2021-01-04,Heat,1995,https://boxd.it/d1,5,,,,2021-01-03\n");
    let reviews = format!("{header}2021-01-04,Heat,1995,https://boxd.it/d1,5,,The diner scene.,,2021-01-03\n");
    assert_eq!(c.import(&ana, diary.as_bytes()).await.unwrap().imported, 1);
    assert_eq!(c.import(&ana, reviews.as_bytes()).await.unwrap().skipped_duplicates, 1);
    let edited = events_of(&a.database, "ReviewEdited").await;
    let Some(v1::event::Payload::ReviewEdited(filled)) = &edited[0].payload else { panic!("{edited:?}") };
    assert_eq!((filled.body.as_str(), filled.source), ("The diner scene.", v1::ReviewSource::Import as i32));

    let review = c.reviews.get_review(v1::GetReviewRequest { review_id: filled.review_id.clone() }).await;
    edit(&mut c, &ana, &review.unwrap().into_inner(), 9, "The diner scene, again.").await;
    wait_until!("her own edit reaches alice", !peer.received_of("Update").is_empty());
    let updates = peer.received_of("Update");
    assert_eq!(updates.len(), 1, "only her own edit: {updates:?}");
    assert!(updates[0].activity.to_string().contains("again."), "{:?}", updates[0].activity);
    assert!(peer.received_of("Create").is_empty(), "the imported entry was never pushed");
}

/// A user following another user of the same server by actor URI (one who blocked them), or
/// themselves: the Follow delivered to this server's own inbox is refused, so neither becomes a
/// remote follower past the block or the refusal of a self-follow.
#[tokio::test]
async fn a_local_actor_followed_by_its_uri_gains_no_remote_follower() {
    let dir = temp_dir();
    let db = dir.path().join("reelay.db");
    let a = Reelay::start_all(BIN, &db, FAST).await;
    let mut c = a.clients().await;
    let (ana, ben) = (c.user("ana").await, c.user("ben").await);
    let block = v1::BlockRequest { actor_user_id: ben.clone(), target: user_account(&ana), ..Default::default() };
    c.social.block(block).await.unwrap();
    follow(&mut c, &ana, &a.actor_url(&ben)).await;
    follow(&mut c, &ana, &a.actor_url(&ana)).await;
    let settled = "SELECT COUNT(*) FROM processed_events WHERE handler = 'federation-delivery' \
                   AND status IN ('done', 'dead_lettered')";
    wait_until!("both Follows were delivered or given up", count(&db, settled).await == 2);
    assert_eq!(count(&db, "SELECT COUNT(*) FROM remote_followers").await, 0);
    assert!(a.log_text().contains("refused an activity of this server's own actor"));
}

/// An account with more reviews than one write job deletes goes in several jobs, all of it.
#[tokio::test]
async fn a_deleted_account_with_many_reviews_goes_in_several_jobs() {
    let dir = temp_dir();
    let db = dir.path().join("reelay.db");
    let (mut reelay, mut c, ana) = write_service_and_ana(&db).await;
    let actor = "https://films.example/users/carla";
    follow(&mut c, &ana, actor).await;
    for n in 0..1_001 {
        let request = v1::SaveRemoteReviewRequest {
            object_uri: format!("{actor}/statuses/{n}"),
            actor_uri: actor.into(),
            movie: movie_ref("Ran", 1985),
            rating: 8,
            body: format!("Viewing {n}."),
            ..Default::default()
        };
        c.federation.save_remote_review(request).await.expect("save a remote review");
    }
    let delete = |n: u32| v1::DeleteRemoteActorRequest {
        actor_uri: actor.into(),
        received_activity_uri: format!("{actor}#delete-{n}"),
    };
    assert!(c.federation.delete_remote_actor(delete(1)).await.unwrap().into_inner().changed);
    assert_eq!(count(&db, "SELECT COUNT(*) FROM remote_reviews").await, 0);
    assert_eq!(count(&db, "SELECT COUNT(*) FROM remote_review_tombstones").await, 1_001);
    assert_eq!(events_of(&db, "RemoteReviewDeleted").await.len(), 1_001);
    assert_eq!(events_of(&db, "MovieDeleted").await.len(), 1, "Ran, once its last review went");
    assert_eq!(count(&db, "SELECT COUNT(*) FROM follows").await, 0);
    assert!(!c.federation.delete_remote_actor(delete(1)).await.unwrap().into_inner().changed, "a repeat");
    assert!(!c.federation.delete_remote_actor(delete(2)).await.unwrap().into_inner().changed, "nothing left");
    reelay.stop().await;
}

/// A deleted account's actor answers 410 Gone at once, so a gateway that no longer holds its
/// key (here: restarted) cannot check its Delete's signature. The actor's 410, fetched again,
/// is then the proof: the actor's Delete of itself is taken, and what is kept of it goes. Nothing
/// else passes that way: another activity of it, a Delete naming a live actor, one whose id is
/// not the actor's, one signed by a key elsewhere that names the gone actor as its owner.
#[tokio::test]
async fn a_deleted_accounts_delete_is_taken_when_its_actor_already_answers_gone() {
    let dir = temp_dir();
    let (peer, mut a, mut c, ana) = peer_and_ana(&dir.path().join("reelay.db")).await;
    let inbox = format!("{}/inbox", a.actor_url(&ana));
    for (n, name) in [(1, "bob"), (2, "dave"), (3, "alice")] {
        follow(&mut c, &ana, &peer.actor(name)).await;
        wait_until!("the Follow arrives", peer.received_of("Follow").len() == n);
        let note = review_note(&peer, name, 1, "Ran", 1985, "The storm.");
        assert_eq!(peer.send(name, &inbox, &note).await, 202);
    }
    let db = a.database.clone();
    let kept = |name: &str| {
        let sql = format!("SELECT COUNT(*) FROM remote_reviews WHERE actor_uri = '{}'", peer.actor(name));
        let db = db.clone();
        async move { count(&db, &sql).await }
    };
    // A new process holds no key; then bob's and dave's accounts are deleted.
    a.restart().await;
    peer.delete_account("bob");
    peer.delete_account("dave");
    let (alice, bob, dave) = (peer.actor("alice"), peer.actor("bob"), peer.actor("dave"));
    // dave's Delete, the first thing after the restart: taken on a 410 fetched just now.
    assert_eq!(peer.send("dave", &inbox, &delete_activity(&dave, &dave, &format!("{dave}#delete"))).await, 202);
    assert_eq!(kept("dave").await, 0, "dave's review went");

    let refused: Vec<(&str, u16)> = vec![
        ("another activity", peer.send("bob", &inbox, &review_note(&peer, "bob", 2, "Ran", 1985, "Again.")).await),
        (
            "a Delete of a review",
            peer.send("bob", &inbox, &delete_activity(&bob, &format!("{bob}/statuses/1"), &format!("{bob}#d1"))).await,
        ),
        (
            "a live actor's Delete, signed with bob's key",
            peer.send("bob", &inbox, &delete_activity(&alice, &alice, &format!("{alice}#d1"))).await,
        ),
        (
            "an id not under the actor",
            peer.send("bob", &inbox, &delete_activity(&bob, &bob, &format!("{alice}/statuses/5#delete"))).await,
        ),
        ("a key elsewhere naming bob its owner", {
            let body = delete_activity(&bob, &bob, &format!("{bob}#d2")).to_string();
            peer.post("bob", &inbox, body.as_bytes(), Spoil::ForgedKey).await
        }),
    ];
    for (case, status) in refused {
        assert_eq!(status, 401, "{case}");
    }
    assert_eq!((kept("bob").await, kept("alice").await), (1, 1), "nothing of bob's or alice's went");
    assert_eq!(peer.send("bob", &inbox, &delete_activity(&bob, &bob, &format!("{bob}#delete"))).await, 202);
    assert_eq!(kept("bob").await, 0, "bob's review went");
    let follows = query_strings(&db, "SELECT target FROM follows").await;
    assert_eq!(follows, [[format!("actor:{alice}")]], "ana's follows of bob and dave ended");
    assert!(a.log_text().contains("a deleted account's Delete, its actor gone (410)"));
}

/// A Mastodon-shaped peer followed by ana, on an instance started with `env` added to [`FAST`]
/// (as many attempts as allowed): the instance, ana, the peer's inbox and a reader of
/// `federation_failing_hosts` for the peer's server (a column or expression; `None` without a
/// row).
async fn a_follower_server(
    db: &Path,
    env: &[(&'static str, &'static str)],
) -> (MastodonPeer, Reelay, Clients, String, String, impl Fn(&'static str) -> BoxedRead) {
    let peer = MastodonPeer::start().await;
    // A short deadline per request: the unavailable-after time must outlast a retry's gap
    // (the retry cap and one attempt).
    let env = [FAST, &[("EVENT_QUEUE_MAX_ATTEMPTS", "100"), ("REELAY_FEDERATION_TIMEOUT_MS", "1500")], env].concat();
    let a = Reelay::start_all(BIN, db, &env).await;
    let mut c = a.clients().await;
    let ana = c.user("ana").await;
    let ana_inbox = format!("{}/inbox", a.actor_url(&ana));
    assert_eq!(peer.send("alice", &ana_inbox, &follow_of(&peer, "alice", 1, &a.actor_url(&ana))).await, 202);
    wait_until!("alice is accepted", peer.received_of("Accept").len() == 1);
    let peer_inbox =
        query_strings(db, "SELECT COALESCE(shared_inbox, inbox) FROM remote_followers").await[0][0].clone();
    let server = reelay_activitypub::documents::server_of(&peer_inbox).expect("the inbox names a server");
    let db = db.to_owned();
    let failures = move |what: &'static str| -> BoxedRead {
        let (db, server) = (db.clone(), server.clone());
        Box::pin(async move {
            let sql = format!("SELECT ({what}) || '' FROM federation_failing_hosts WHERE host = '{server}'");
            query_strings(&db, &sql).await.first().map(|row| row[0].clone())
        })
    };
    (peer, a, c, ana, peer_inbox, failures)
}

type BoxedRead = std::pin::Pin<Box<dyn std::future::Future<Output = Option<String>> + Send>>;

/// A server that fails every delivery for REELAY_FEDERATION_UNAVAILABLE_AFTER_SECS (here 4 s)
/// is left out of fan-outs instead of collecting a dead letter for each activity; an answer
/// from it clears its failures, and so does an activity it sends, after which deliveries to
/// it resume. An activity to its one inbox (a Follow, an Accept) still goes.
#[tokio::test]
async fn a_server_failing_every_delivery_is_left_out_until_it_answers_or_speaks() {
    let dir = temp_dir();
    let db = dir.path().join("reelay.db");
    let (peer, a, mut c, ana, peer_inbox, failures) =
        a_follower_server(&db, &[("REELAY_FEDERATION_UNAVAILABLE_AFTER_SECS", "4")]).await;
    let ana_inbox = format!("{}/inbox", a.actor_url(&ana));
    let created = |film: &'static str| {
        peer.received_of("Create").iter().any(|r| r.status == 202 && r.activity["object"]["film"]["name"] == film)
    };

    // A failure is recorded against the server; the retry it answers clears it.
    peer.set_inbox_status(503);
    log(&mut c, &ana, "Heat", 1995, 9, "The diner scene.").await;
    wait_until!("the failure is recorded", failures("failures").await.is_some());
    peer.set_inbox_status(202);
    wait_until!("the retried Create is taken", created("Heat"));
    wait_until!("the server's failures are cleared by its answer", failures("failures").await.is_none());

    // Failing for longer than the setting: unavailable.
    peer.set_inbox_status(503);
    log(&mut c, &ana, "Stalker", 1979, 9, "The zone.").await;
    wait_until!(
        "the server turns unavailable",
        failures("unavailable_since IS NOT NULL").await.as_deref() == Some("1")
    );
    assert!(failures("failures").await.unwrap().parse::<u32>().unwrap() >= 2);
    let servers = a.metrics().await;
    assert_eq!(servers.value("reelay_federation_servers{state=\"unavailable\"}"), Some(1.0));
    assert_eq!(servers.value("reelay_federation_servers{state=\"failing\"}"), Some(0.0));
    let status = a.cli(&["status"], &[]).await;
    assert!(status.ok().contains("federation: 0 server(s) failing deliveries, 1 unavailable"), "{}", status.stdout);
    // A fan-out leaves its inbox out; an activity to that one inbox is still queued, marked so
    // that its answer clears the server.
    let fan_out = |n: u32| v1::QueueDeliveriesRequest {
        activity_id: format!("{}/activities/probe-{n}", a.actor_url(&ana)),
        sender_user_id: ana.clone(),
        activity_json: "{}".into(),
        audience: Some(v1::queue_deliveries_request::Audience::Followers(true)),
        live_review_id: String::new(),
    };
    let skipped = c.federation.queue_deliveries(fan_out(1)).await.unwrap().into_inner();
    assert_eq!((skipped.queued, skipped.skipped_unavailable, skipped.duplicate), (0, 1, false));
    let one = v1::QueueDeliveriesRequest {
        audience: Some(v1::queue_deliveries_request::Audience::Inbox(peer_inbox.clone())),
        ..fan_out(2)
    };
    assert_eq!(c.federation.queue_deliveries(one).await.unwrap().into_inner().queued, 1);
    let probe = events_of(&db, "ActivityQueued").await.into_iter().find_map(|e| match e.payload {
        Some(v1::event::Payload::ActivityQueued(q)) if q.activity_id.ends_with("probe-2") => Some(q),
        _ => None,
    });
    assert!(probe.expect("the one-inbox activity is queued").inbox_failing);
    // And a review's fan-out, through the federation handler: nothing queued for it.
    let outbox = |sql: &'static str| {
        let db = db.clone();
        async move { count(&db, sql).await }
    };
    let before = outbox("SELECT COUNT(*) FROM federation_outbox").await;
    log(&mut c, &ana, "Solaris", 1972, 8, "The ocean.").await;
    wait_until!(
        "the review's activity is handled",
        outbox("SELECT COUNT(*) FROM federation_outbox").await == before + 1
    );
    assert_eq!(outbox("SELECT queued FROM federation_outbox ORDER BY created_at DESC, rowid DESC LIMIT 1").await, 0);

    // The server speaks (bob follows ana from it), its inbox still failing: it is available
    // again once the gateway has taken the Follow in (a failure after that starts a new count).
    assert_eq!(peer.send("bob", &ana_inbox, &follow_of(&peer, "bob", 1, &a.actor_url(&ana))).await, 202);
    assert_ne!(failures("unavailable_since IS NOT NULL").await.as_deref(), Some("1"), "available again");
    // Answering again, it is cleared, and the next review goes.
    peer.set_inbox_status(202);
    wait_until!("the server's answers clear it", failures("failures").await.is_none());
    log(&mut c, &ana, "Ran", 1985, 10, "Arrows.").await;
    wait_until!("the next review reaches the server", created("Ran"));
    wait_until!("Stalker's retried delivery is taken too", created("Stalker"));
    assert_eq!(
        count(&db, "SELECT COUNT(*) FROM processed_events WHERE status = 'dead_lettered'").await,
        0,
        "nothing was given up"
    );
    // A Create of a review deleted since it was raised is not queued: its Delete may be gone.
    let deleted = log(&mut c, &ana, "Mirror", 1975, 8, "The house.").await;
    delete(&mut c, &ana, &deleted).await;
    let gone = v1::QueueDeliveriesRequest { live_review_id: deleted.review_id.clone(), ..fan_out(3) };
    let gone = c.federation.queue_deliveries(gone).await.unwrap().into_inner();
    assert_eq!((gone.review_gone, gone.queued, gone.skipped_unavailable), (true, 0, 0));
}

/// An unavailable server gets one delivery of a fan-out every REELAY_FEDERATION_PROBE_EVERY_SECS
/// (here 5 s), as a probe: failing, it is dropped (no retry, no dead letter) and the server stays
/// unavailable; answered (here 429: busy, but up), the server is available again, the probe is
/// retried as any delivery, and fan-outs reach the server.
#[tokio::test]
async fn an_unavailable_server_is_probed_now_and_then_until_it_is_back() {
    let dir = temp_dir();
    let db = dir.path().join("reelay.db");
    let env = [("REELAY_FEDERATION_UNAVAILABLE_AFTER_SECS", "3"), ("REELAY_FEDERATION_PROBE_EVERY_SECS", "5")];
    let (peer, _a, mut c, ana, peer_inbox, failures) = a_follower_server(&db, &env).await;
    let created = |film: &'static str, status: u16| {
        peer.received_of("Create")
            .iter()
            .filter(|r| r.status == status && r.activity["object"]["film"]["name"] == film)
            .count()
    };
    peer.set_inbox_status(503);
    // Failures half a second apart until 3 s have passed, as a delivery's retries would record
    // them: unavailable.
    let failed = || v1::RecordInboxOutcomeRequest { inbox: peer_inbox.clone(), answered: false };
    let first = std::time::Instant::now();
    loop {
        c.federation.record_inbox_outcome(failed()).await.unwrap();
        if first.elapsed() > Duration::from_millis(3100) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert_eq!(failures("unavailable_since IS NOT NULL").await.as_deref(), Some("1"));
    let fan_out = |n: u32| v1::QueueDeliveriesRequest {
        activity_id: format!("https://reelay.test/activities/fan-out-{n}"),
        sender_user_id: ana.clone(),
        activity_json: "{}".into(),
        audience: Some(v1::queue_deliveries_request::Audience::Followers(true)),
        live_review_id: String::new(),
    };
    let left_out = |r: v1::QueueDeliveriesResponse| (r.queued, r.skipped_unavailable) == (0, 1);
    assert!(left_out(c.federation.queue_deliveries(fan_out(1)).await.unwrap().into_inner()), "no probe due yet");

    // Past the probe interval, one review's delivery goes as a probe; refused, it is dropped.
    tokio::time::sleep(Duration::from_millis(5100)).await;
    log(&mut c, &ana, "Stalker", 1979, 9, "The zone.").await;
    wait_until!("the probe reaches the server", created("Stalker", 503) == 1);
    assert!(left_out(c.federation.queue_deliveries(fan_out(2)).await.unwrap().into_inner()), "one probe at a time");
    wait_until!(
        "the failed probe is done with",
        count(&db, "SELECT COUNT(*) FROM processed_events WHERE handler = 'federation-delivery' AND status != 'done'")
            .await
            == 0
    );
    assert_eq!(failures("unavailable_since IS NOT NULL").await.as_deref(), Some("1"), "still unavailable");

    // The server is back, busy: the next probe is answered 429, which finds it up (available
    // again), and is retried as any delivery until it is taken.
    peer.set_inbox_status(429);
    tokio::time::sleep(Duration::from_millis(5100)).await;
    log(&mut c, &ana, "Ran", 1985, 10, "Arrows.").await;
    wait_until!("the probe is answered", created("Ran", 429) >= 1);
    wait_until!("its answer makes the server available", failures("failures").await.is_none());
    peer.set_inbox_status(202);
    wait_until!("the probe's retry is taken", created("Ran", 202) == 1);
    log(&mut c, &ana, "Alien", 1979, 8, "Chestburster.").await;
    wait_until!("the next review reaches the server", created("Alien", 202) == 1);
    assert_eq!(created("Stalker", 503) + created("Stalker", 202), 1, "the failed probe was not retried");
    assert_eq!(count(&db, "SELECT COUNT(*) FROM processed_events WHERE status = 'dead_lettered'").await, 0);
}
