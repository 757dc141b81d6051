//! What the gateway serves to anyone: WebFinger, NodeInfo, actors, outboxes, followers and
//! review notes. Everything is read from the write service; nothing here writes.

use axum::extract::{Path, RawQuery, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Redirect, Response};
use reelay_activitypub::Urls;
use reelay_activitypub::documents::{self, Profile, Review};
use reelay_contracts::v1::{self, get_local_actor_request};
use serde_json::{Value, json};

use crate::{Gateway, activity_json, from_status, json, refuse};

/// Items per outbox page.
const OUTBOX_PAGE: u32 = 20;

fn query_param(query: &Option<String>, name: &str) -> Option<String> {
    url::form_urlencoded::parse(query.as_deref().unwrap_or_default().as_bytes())
        .find(|(key, _)| key == name)
        .map(|(_, value)| value.into_owned())
}

impl Gateway {
    /// The local actor `id` names (a user id), or the answer to give.
    pub(crate) async fn local_actor(&self, by: get_local_actor_request::By) -> Result<v1::LocalActor, Response> {
        if let get_local_actor_request::By::UserId(id) = &by
            && uuid_like(id).is_none()
        {
            return Err(refuse(StatusCode::NOT_FOUND, "no such actor"));
        }
        let mut federation = self.federation.clone();
        match federation.get_local_actor(v1::GetLocalActorRequest { by: Some(by) }).await {
            Ok(actor) => Ok(actor.into_inner()),
            Err(status) if status.code() == tonic::Code::InvalidArgument => {
                Err(refuse(StatusCode::NOT_FOUND, "no such actor"))
            }
            Err(status) => Err(from_status(&status)),
        }
    }
}

/// A UUID's hyphenated form, checked by shape (the write service parses it).
fn uuid_like(id: &str) -> Option<()> {
    (id.len() == 36 && id.chars().all(|c| c.is_ascii_hexdigit() || c == '-')).then_some(())
}

pub(crate) async fn webfinger(State(gw): State<Gateway>, RawQuery(query): RawQuery) -> Response {
    let Some(resource) = query_param(&query, "resource") else {
        return refuse(StatusCode::BAD_REQUEST, "resource is required");
    };
    let urls = &gw.config.urls;
    // The scheme and the handle in any case (handles are lower case; people type `@Ana@host`).
    let acct = resource.get(..5).filter(|scheme| scheme.eq_ignore_ascii_case("acct:")).map(|_| &resource[5..]);
    let handle = if let Some(acct) = acct {
        let Some((handle, host)) = acct.trim_start_matches('@').split_once('@') else {
            return refuse(StatusCode::BAD_REQUEST, "resource must be acct:handle@host");
        };
        if !host.eq_ignore_ascii_case(urls.host()) {
            return refuse(StatusCode::NOT_FOUND, "not a user of this instance");
        }
        handle.to_lowercase()
    } else if let Some(handle) = urls.handle_of_profile(&resource) {
        handle.to_lowercase()
    } else if let Some(user) = urls.user_of_actor(&resource) {
        match gw.local_actor(get_local_actor_request::By::UserId(user.to_owned())).await {
            Ok(actor) => actor.handle,
            Err(answer) => return answer,
        }
    } else {
        return refuse(StatusCode::NOT_FOUND, "not a user of this instance");
    };
    let actor = match gw.local_actor(get_local_actor_request::By::Handle(handle)).await {
        Ok(actor) => actor,
        Err(answer) => return answer,
    };
    let mut answer = json(
        "application/jrd+json",
        json!({
            "subject": format!("acct:{}@{}", actor.handle, urls.host()),
            "aliases": [urls.actor(&actor.user_id), urls.profile(&actor.handle)],
            "links": [
                { "rel": "self", "type": reelay_activitypub::ACTIVITY_JSON, "href": urls.actor(&actor.user_id) },
                { "rel": "http://webfinger.net/rel/profile-page", "type": "text/html", "href": urls.profile(&actor.handle) },
            ],
        }),
    );
    // RFC 7033 section 5: lookups from browsers are allowed.
    answer.headers_mut().insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, HeaderValue::from_static("*"));
    answer
}

/// A person's page (`/@handle`, the `url` of its actor and WebFinger's profile page): Reelay
/// serves no HTML, so it sends the reader to the actor document.
pub(crate) async fn profile(State(gw): State<Gateway>, Path(handle): Path<String>) -> Response {
    let Some(handle) = handle.strip_prefix('@') else { return refuse(StatusCode::NOT_FOUND, "no such page") };
    match gw.local_actor(get_local_actor_request::By::Handle(handle.to_lowercase())).await {
        Ok(actor) => Redirect::to(&gw.config.urls.actor(&actor.user_id)).into_response(),
        Err(answer) => answer,
    }
}

pub(crate) async fn nodeinfo_links(State(gw): State<Gateway>) -> Response {
    json(
        "application/json",
        json!({ "links": [{
            "rel": "http://nodeinfo.diaspora.software/ns/schema/2.0",
            "href": format!("{}/nodeinfo/2.0", gw.config.urls.base()),
        }]}),
    )
}

pub(crate) async fn nodeinfo() -> Response {
    json(
        "application/json; profile=\"http://nodeinfo.diaspora.software/ns/schema/2.0#\"",
        json!({
            "version": "2.0",
            "software": { "name": "reelay", "version": env!("CARGO_PKG_VERSION") },
            "protocols": ["activitypub"],
            "services": { "inbound": [], "outbound": [] },
            "openRegistrations": false,
            "usage": { "users": {} },
            "metadata": {},
        }),
    )
}

pub(crate) async fn actor(State(gw): State<Gateway>, Path(id): Path<String>) -> Response {
    match gw.local_actor(get_local_actor_request::By::UserId(id)).await {
        Ok(actor) => activity_json(documents::person(
            &gw.config.urls,
            &Profile {
                user_id: &actor.user_id,
                handle: &actor.handle,
                display_name: &actor.display_name,
                public_key_pem: &actor.public_key_pem,
                created_at_ms: actor.created_at_ms,
            },
        )),
        Err(answer) => answer,
    }
}

pub(crate) async fn followers(State(gw): State<Gateway>, Path(id): Path<String>) -> Response {
    match gw.local_actor(get_local_actor_request::By::UserId(id)).await {
        // The count only, as Mastodon shows it for people who hide their network.
        Ok(actor) => activity_json(documents::ordered_collection(
            &gw.config.urls.followers(&actor.user_id),
            actor.followers_count,
            None,
        )),
        Err(answer) => answer,
    }
}

fn review_of(row: &v1::OutboxReview) -> Option<Review<'_>> {
    let review = row.review.as_ref()?;
    Some(Review {
        user_id: &review.user_id,
        review_id: &review.review_id,
        movie_title: &row.movie_title,
        movie_year: row.movie_year,
        movie_external_id: &row.movie_external_id,
        rating: review.rating,
        body: &review.body,
        watched_on: &review.watched_on,
        rewatch: review.rewatch,
        published_ms: review.created_at_ms,
        updated_ms: (review.updated_at_ms > review.created_at_ms).then_some(review.updated_at_ms),
    })
}

/// The outbox: an `OrderedCollection` whose pages (`?page=true`, then `&max_id=<last review id>`)
/// list the user's reviews as `Create` activities, newest first.
pub(crate) async fn outbox(State(gw): State<Gateway>, Path(id): Path<String>, RawQuery(query): RawQuery) -> Response {
    let actor = match gw.local_actor(get_local_actor_request::By::UserId(id)).await {
        Ok(actor) => actor,
        Err(answer) => return answer,
    };
    let urls = &gw.config.urls;
    let outbox = urls.outbox(&actor.user_id);
    if query_param(&query, "page").is_none() {
        let first = format!("{outbox}?page=true");
        return activity_json(documents::ordered_collection(&outbox, actor.reviews_count, Some(first)));
    }
    let max_id = query_param(&query, "max_id").unwrap_or_default();
    let request =
        v1::ListOutboxRequest { user_id: actor.user_id.clone(), page_size: OUTBOX_PAGE, page_token: max_id.clone() };
    let page = match gw.federation.clone().list_outbox(request).await {
        Ok(page) => page.into_inner(),
        // The page token is what this route calls `max_id`.
        Err(status) if status.code() == tonic::Code::InvalidArgument => {
            return refuse(StatusCode::BAD_REQUEST, format!("max_id {max_id:?}: not a page of this outbox"));
        }
        Err(status) => return from_status(&status),
    };
    let items = page
        .reviews
        .iter()
        .filter_map(review_of)
        .map(|review| {
            let mut create = documents::create(urls, &review);
            // The collection's context covers its items.
            if let Some(create) = create.as_object_mut() {
                create.remove("@context");
            }
            create
        })
        .collect();
    let page_id =
        if max_id.is_empty() { format!("{outbox}?page=true") } else { format!("{outbox}?page=true&max_id={max_id}") };
    let next =
        (!page.next_page_token.is_empty()).then(|| format!("{outbox}?page=true&max_id={}", page.next_page_token));
    activity_json(documents::ordered_collection_page(&page_id, &outbox, items, next))
}

/// One review as a `Note`.
pub(crate) async fn note(State(gw): State<Gateway>, Path((id, review_id)): Path<(String, String)>) -> Response {
    review_document(&gw, &id, review_id, |urls, review| {
        let mut note = documents::note(urls, review);
        note["@context"] = documents::context();
        note
    })
    .await
}

/// The `Create` of one review's note, under the id followers were sent and the outbox lists.
pub(crate) async fn note_create(State(gw): State<Gateway>, Path((id, review_id)): Path<(String, String)>) -> Response {
    review_document(&gw, &id, review_id, documents::create).await
}

/// The `document` of review `review_id` of user `id` (404 when it is not theirs).
async fn review_document(
    gw: &Gateway,
    id: &str,
    review_id: String,
    document: impl Fn(&Urls, &Review<'_>) -> Value,
) -> Response {
    let row = match review_row(gw, id, review_id).await {
        Ok(row) => row,
        Err(answer) => return answer,
    };
    let Some(review) = review_of(&row) else { return refuse(StatusCode::NOT_FOUND, "no such review") };
    activity_json(document(&gw.config.urls, &review))
}

/// Review `review_id` of user `id`, with its film, as the outbox lists it.
async fn review_row(gw: &Gateway, id: &str, review_id: String) -> Result<v1::OutboxReview, Response> {
    if uuid_like(&review_id).is_none() {
        return Err(refuse(StatusCode::NOT_FOUND, "no such review"));
    }
    let review = match gw.reviews.clone().get_review(v1::GetReviewRequest { review_id }).await {
        Ok(review) => review.into_inner(),
        Err(status) => return Err(from_status(&status)),
    };
    if review.user_id != id {
        return Err(refuse(StatusCode::NOT_FOUND, "no such review"));
    }
    let movie = match gw.movies.clone().get_movie(v1::GetMovieRequest { movie_id: review.movie_id.clone() }).await {
        Ok(movie) => movie.into_inner(),
        Err(status) => return Err(from_status(&status)),
    };
    Ok(v1::OutboxReview {
        movie_title: movie.title,
        movie_year: movie.year,
        movie_external_id: movie.external_id,
        review: Some(review),
    })
}
