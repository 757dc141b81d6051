//! The JSON documents Reelay serves and sends. A review is a `Note` (what Mastodon shows in full)
//! whose text names the film, the rating and a link, and which also carries the structured
//! review: the film (`film`: title, year, external id), the rating as NeoDB does (`relatedWith`
//! a `Rating` with `value`/`best`/`worst`), and the plain text as `source`.

use serde_json::{Value, json};

use crate::time::{rfc3339, rfc3339_ms};
use crate::{PUBLIC, Urls};

/// Terms Reelay adds to ActivityStreams.
pub const REELAY_NS: &str = "https://reelay.dev/ns#";

pub fn context() -> Value {
    json!([
        "https://www.w3.org/ns/activitystreams",
        "https://w3id.org/security/v1",
        {
            "reelay": REELAY_NS,
            "film": "reelay:film",
            "year": "reelay:year",
            "externalId": "reelay:externalId",
            "watchedOn": "reelay:watchedOn",
            "rewatch": "reelay:rewatch",
            "Movie": "reelay:Movie",
            "relatedWith": "reelay:relatedWith",
            "withRegardTo": "reelay:withRegardTo",
            "Rating": "reelay:Rating",
            "best": "reelay:best",
            "worst": "reelay:worst",
            "value": "reelay:value"
        }
    ])
}

/// Whether two ids are on one server (scheme, host and port): what an actor may speak for. An
/// id that is not a URL is on no server.
pub fn same_origin(a: &str, b: &str) -> bool {
    match (url::Url::parse(a), url::Url::parse(b)) {
        (Ok(a), Ok(b)) => a.origin().is_tuple() && a.origin() == b.origin(),
        _ => false,
    }
}

/// The server a URL is on, as deliveries to it are counted: its host, with the port when it is
/// not the scheme's default (`mastodon.example`, `127.0.0.1:8080`). `None` for what is not a
/// URL with a host.
pub fn server_of(url: &str) -> Option<String> {
    let url = url::Url::parse(url).ok()?;
    url.host_str().is_some().then(|| host_port(&url))
}

/// A parsed URL's host, with its port when it is not the scheme's default (empty without a
/// host): the `Host` header a request to it carries.
pub fn host_port(url: &url::Url) -> String {
    let host = url.host_str().unwrap_or_default();
    match url.port() {
        Some(port) => format!("{host}:{port}"),
        None => host.to_owned(),
    }
}

/// The id of an ActivityPub reference: the string itself, or an embedded object's `id`.
pub fn id_of(value: &Value) -> Option<&str> {
    match value {
        Value::String(id) => Some(id),
        Value::Object(object) => object.get("id").and_then(Value::as_str),
        Value::Array(items) => items.first().and_then(id_of),
        _ => None,
    }
}

pub struct Profile<'a> {
    pub user_id: &'a str,
    pub handle: &'a str,
    pub display_name: &'a str,
    pub public_key_pem: &'a str,
    pub created_at_ms: i64,
}

/// A local user as a `Person`.
pub fn person(urls: &Urls, p: &Profile<'_>) -> Value {
    let actor = urls.actor(p.user_id);
    json!({
        "@context": context(),
        "id": actor,
        "type": "Person",
        "preferredUsername": p.handle,
        "name": p.display_name,
        "summary": "",
        "url": urls.profile(p.handle),
        "inbox": urls.inbox(p.user_id),
        "outbox": urls.outbox(p.user_id),
        "followers": urls.followers(p.user_id),
        "manuallyApprovesFollowers": false,
        "discoverable": true,
        "published": rfc3339(p.created_at_ms),
        "endpoints": { "sharedInbox": urls.shared_inbox() },
        "publicKey": { "id": urls.key_id(p.user_id), "owner": actor, "publicKeyPem": p.public_key_pem },
    })
}

/// A local user's review.
pub struct Review<'a> {
    pub user_id: &'a str,
    pub review_id: &'a str,
    pub movie_title: &'a str,
    pub movie_year: i32,
    pub movie_external_id: &'a str,
    /// Half stars 1..=10; 0 is unrated.
    pub rating: u32,
    pub body: &'a str,
    pub watched_on: &'a str,
    pub rewatch: bool,
    pub published_ms: i64,
    /// Set once the review was edited.
    pub updated_ms: Option<i64>,
}

/// `★★★★½` for 9 half stars.
pub fn stars(rating: u32) -> String {
    let mut stars = "★".repeat((rating / 2) as usize);
    if rating % 2 == 1 {
        stars.push('½');
    }
    stars
}

pub fn escape_html(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// The review as a `Note`.
pub fn note(urls: &Urls, r: &Review<'_>) -> Value {
    let id = urls.note(r.user_id, r.review_id);
    let film = format!("{} ({})", r.movie_title, r.movie_year);
    let mut headline = format!("Watched <a href=\"{}\">{}</a>", escape_html(&id), escape_html(&film));
    if r.rating > 0 {
        headline.push_str(&format!(" {} ({}/5)", stars(r.rating), f64::from(r.rating) / 2.0));
    }
    let mut content = format!("<p>{headline}</p>");
    for paragraph in r.body.split("\n\n").filter(|p| !p.trim().is_empty()) {
        content.push_str(&format!("<p>{}</p>", escape_html(paragraph.trim()).replace('\n', "<br>")));
    }
    let mut film_object = json!({ "type": "Movie", "name": r.movie_title, "year": r.movie_year });
    if !r.movie_external_id.is_empty() {
        film_object["externalId"] = json!(r.movie_external_id);
    }
    let mut note = json!({
        "id": id,
        "type": "Note",
        "attributedTo": urls.actor(r.user_id),
        "to": [PUBLIC],
        "cc": [urls.followers(r.user_id)],
        "published": rfc3339(r.published_ms),
        "url": id,
        "sensitive": false,
        "content": content,
        "source": { "content": r.body, "mediaType": "text/plain" },
        "film": film_object,
        "watchedOn": r.watched_on,
        "rewatch": r.rewatch,
        "tag": [],
    });
    if r.rating > 0 {
        note["relatedWith"] = json!([{
            "type": "Rating",
            "withRegardTo": film,
            "value": f64::from(r.rating) / 2.0,
            "best": 5,
            "worst": 0.5,
        }]);
    }
    if let Some(updated) = r.updated_ms {
        note["updated"] = json!(rfc3339_ms(updated));
    }
    note
}

fn activity(urls: &Urls, kind: &str, event_id: &str, user_id: &str, object: Value, to: Value, cc: Value) -> Value {
    activity_named(urls, urls.activity(event_id), kind, user_id, object, to, cc)
}

fn activity_named(urls: &Urls, id: String, kind: &str, user_id: &str, object: Value, to: Value, cc: Value) -> Value {
    json!({
        "@context": context(),
        "id": id,
        "type": kind,
        "actor": urls.actor(user_id),
        "to": to,
        "cc": cc,
        "object": object,
    })
}

/// `Create` of a review note, to the public and the author's followers. Its id is the note's
/// ([`Urls::note_create`]), not its event's: the outbox lists it and the gateway serves it under
/// that id.
pub fn create(urls: &Urls, r: &Review<'_>) -> Value {
    let id = urls.note_create(r.user_id, r.review_id);
    let (to, cc) = (json!([PUBLIC]), json!([urls.followers(r.user_id)]));
    let mut activity = activity_named(urls, id, "Create", r.user_id, note(urls, r), to, cc);
    activity["published"] = json!(rfc3339(r.published_ms));
    activity
}

/// `Update` of an edited review note (event `event_id`), to the public and the author's followers.
pub fn update(urls: &Urls, event_id: &str, r: &Review<'_>) -> Value {
    let (to, cc) = (json!([PUBLIC]), json!([urls.followers(r.user_id)]));
    let mut activity = activity(urls, "Update", event_id, r.user_id, note(urls, r), to, cc);
    activity["published"] = json!(rfc3339(r.updated_ms.unwrap_or(r.published_ms)));
    activity
}

/// `Delete` of a review note (a `Tombstone`).
pub fn delete(urls: &Urls, event_id: &str, user_id: &str, review_id: &str) -> Value {
    let tombstone = json!({ "id": urls.note(user_id, review_id), "type": "Tombstone" });
    activity(urls, "Delete", event_id, user_id, tombstone, json!([PUBLIC]), json!([urls.followers(user_id)]))
}

/// `Accept` of a remote actor's `Follow` of `user_id`.
pub fn accept(urls: &Urls, event_id: &str, user_id: &str, follower: &str, follow_id: &str) -> Value {
    answer_follow(urls, "Accept", event_id, user_id, follower, follow_id)
}

/// The `Reject` of a remote actor's `Follow` of `user_id` (its id `follow_id`): how a server
/// learns its follower was removed (here, blocked); its id derives from the `Blocked` event.
pub fn reject(urls: &Urls, event_id: &str, user_id: &str, follower: &str, follow_id: &str) -> Value {
    answer_follow(urls, "Reject", event_id, user_id, follower, follow_id)
}

fn answer_follow(urls: &Urls, kind: &str, event_id: &str, user_id: &str, follower: &str, follow_id: &str) -> Value {
    let follow = json!({ "id": follow_id, "type": "Follow", "actor": follower, "object": urls.actor(user_id) });
    activity(urls, kind, event_id, user_id, follow, json!([follower]), json!([]))
}

/// The `Follow` of a remote actor by `user_id`; its id derives from the `Followed` event.
pub fn follow(urls: &Urls, event_id: &str, user_id: &str, target: &str) -> Value {
    activity(urls, "Follow", event_id, user_id, json!(target), json!([target]), json!([]))
}

/// The `Undo` of that `Follow`.
pub fn undo_follow(urls: &Urls, event_id: &str, user_id: &str, follow_event_id: &str, target: &str) -> Value {
    let follow = json!({
        "id": urls.activity(follow_event_id),
        "type": "Follow",
        "actor": urls.actor(user_id),
        "object": target,
    });
    activity(urls, "Undo", event_id, user_id, follow, json!([target]), json!([]))
}

pub fn ordered_collection(id: &str, total: u64, first: Option<String>) -> Value {
    let mut collection = json!({ "@context": context(), "id": id, "type": "OrderedCollection", "totalItems": total });
    if let Some(first) = first {
        collection["first"] = json!(first);
    }
    collection
}

pub fn ordered_collection_page(id: &str, part_of: &str, items: Vec<Value>, next: Option<String>) -> Value {
    let mut page = json!({
        "@context": context(),
        "id": id,
        "type": "OrderedCollectionPage",
        "partOf": part_of,
        "orderedItems": items,
    });
    if let Some(next) = next {
        page["next"] = json!(next);
    }
    page
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::note::read_review;

    #[test]
    fn origins() {
        assert!(same_origin("https://a.example/users/x/statuses/1", "https://a.example/users/x"));
        assert!(same_origin("https://A.example:443/n/1", "https://a.example/users/x"), "default port, any case");
        for (a, b) in [
            ("https://b.example/n/1", "https://a.example/users/x"),
            ("http://a.example/n/1", "https://a.example/users/x"),
            ("https://a.example:8443/n/1", "https://a.example/users/x"),
            ("https://a.example.evil/n/1", "https://a.example/users/x"),
            ("urn:x:1", "urn:x:1"),
            ("not a url", "not a url"),
        ] {
            assert!(!same_origin(a, b), "{a} {b}");
        }
    }

    #[test]
    fn servers() {
        assert_eq!(server_of("https://A.example:443/users/x/inbox").as_deref(), Some("a.example"));
        assert_eq!(server_of("http://127.0.0.1:8080/inbox").as_deref(), Some("127.0.0.1:8080"));
        assert_eq!(server_of("https://[::1]:8443/inbox").as_deref(), Some("[::1]:8443"));
        assert_eq!(server_of("urn:x:1"), None);
        assert_eq!(server_of("not a url"), None);
    }

    fn review() -> Review<'static> {
        Review {
            user_id: "u1",
            review_id: "r1",
            movie_title: "Heat",
            movie_year: 1995,
            movie_external_id: "",
            rating: 9,
            body: "The <diner> scene.",
            watched_on: "",
            rewatch: false,
            published_ms: 1_000,
            updated_ms: None,
        }
    }

    #[test]
    fn a_note_names_the_film_the_rating_and_links_and_reads_back() {
        let urls = Urls::new("https://reelay.example").unwrap();
        let note = note(&urls, &review());
        let content = note["content"].as_str().unwrap();
        assert!(content.contains("Heat (1995)") && content.contains("★★★★½") && content.contains("&lt;diner&gt;"));
        assert!(content.contains("href=\"https://reelay.example/users/u1/reviews/r1\""));
        let read = read_review(&note).unwrap();
        assert_eq!((read.title.as_str(), read.year, read.rating), ("Heat", 1995, 9));
        assert_eq!(read.body, "The <diner> scene.");
        assert_eq!(read.attributed_to, "https://reelay.example/users/u1");
    }

    #[test]
    fn activity_ids_come_from_the_event_and_a_create_from_its_note() {
        let urls = Urls::new("https://reelay.example").unwrap();
        let create = create(&urls, &review());
        assert_eq!(create["id"], "https://reelay.example/users/u1/reviews/r1/activity");
        assert_eq!(create["object"]["id"], "https://reelay.example/users/u1/reviews/r1");
        assert_eq!(create, super::create(&urls, &review()));
        let update = update(&urls, "e1", &review());
        assert_eq!(update["id"], "https://reelay.example/activities/e1");
        let undo = undo_follow(&urls, "e3", "u1", "e2", "https://m.example/users/bo");
        assert_eq!(undo["object"]["id"], "https://reelay.example/activities/e2");
    }
}
