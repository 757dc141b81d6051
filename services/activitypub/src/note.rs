//! Reading a remote review out of a `Note` (or `Article`/`Review`): the film it is about, its
//! rating and its text. Notes that name no film, or are not addressed to the public, are not
//! reviews Reelay can keep (search shows every kept review to everyone).

use reelay_contracts::v1;
use serde_json::Value;

use crate::PUBLIC;
use crate::documents::id_of;
use crate::time::{now_ms, parse_rfc3339};
use reelay_domain::validate::{MAX_YEAR, MIN_YEAR};

/// The longest review body kept (the write service's limit).
pub const MAX_BODY_CHARS: usize = 10_000;

/// How far ahead of this clock a note's `published` may be (another server's clock runs ahead).
const MAX_AHEAD_MS: i64 = 24 * 3600 * 1000;

#[derive(Debug, Clone, PartialEq)]
pub struct RemoteReviewNote {
    pub object_uri: String,
    pub attributed_to: String,
    pub title: String,
    pub year: i32,
    pub external_id: String,
    /// Half stars 1..=10; 0 when unrated.
    pub rating: u32,
    pub body: String,
    pub published_ms: i64,
    /// When its author last edited it: its `updated`, else its `published` (0 with neither).
    pub edited_ms: i64,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NoteError {
    /// Well-formed, but nothing Reelay keeps (no film named, another object type).
    #[error("not a film review: {0}")]
    NotAReview(String),
    /// A film review, but not addressed to the public (followers-only or direct): not kept,
    /// since search shows every kept review to everyone.
    #[error("a film review not addressed to the public (followers-only or direct)")]
    NotPublic,
    #[error("invalid review: {0}")]
    Invalid(String),
}

impl RemoteReviewNote {
    /// The write service's request to save this review. `received` names the activity that
    /// carried it (empty for a review read from an outbox); `keep_existing`: it came in a
    /// Create (see `SaveRemoteReviewRequest`).
    pub fn into_save_request(self, received: &str, keep_existing: bool) -> v1::SaveRemoteReviewRequest {
        let title_year = v1::TitleYear { title: self.title, year: self.year, external_id: self.external_id };
        v1::SaveRemoteReviewRequest {
            object_uri: self.object_uri,
            actor_uri: self.attributed_to,
            movie: Some(v1::MovieRef { by: Some(v1::movie_ref::By::TitleYear(title_year)) }),
            rating: self.rating,
            body: self.body,
            published_at_ms: self.published_ms,
            received_activity_uri: received.to_owned(),
            keep_existing,
            edited_at_ms: self.edited_ms,
        }
    }
}

pub fn read_review(object: &Value) -> Result<RemoteReviewNote, NoteError> {
    let kind = object.get("type").and_then(Value::as_str).unwrap_or_default();
    if !matches!(kind, "Note" | "Article" | "Review") {
        return Err(NoteError::NotAReview(format!("an object of type {kind:?}")));
    }
    let object_uri = id_of(object).ok_or_else(|| NoteError::Invalid("the object has no id".into()))?.to_owned();
    let attributed_to = object
        .get("attributedTo")
        .and_then(id_of)
        .ok_or_else(|| NoteError::Invalid("the object has no attributedTo".into()))?
        .to_owned();
    let film = object.get("film").ok_or_else(|| NoteError::NotAReview("it names no film".into()))?;
    if !is_public(object) {
        return Err(NoteError::NotPublic);
    }
    let title = film.get("name").and_then(Value::as_str).map(str::trim).unwrap_or_default().to_owned();
    let year = film.get("year").and_then(Value::as_i64).unwrap_or_default();
    if title.is_empty() {
        return Err(NoteError::Invalid("film.name: the film needs a name".into()));
    }
    // The write service's range: a year it would refuse is refused here, naming this field.
    if !(i64::from(MIN_YEAR)..=i64::from(MAX_YEAR)).contains(&year) {
        return Err(NoteError::Invalid(format!("film.year: must be between {MIN_YEAR} and {MAX_YEAR}, got {year}")));
    }
    let external_id = film.get("externalId").and_then(Value::as_str).unwrap_or_default().to_owned();
    let rating = object
        .get("relatedWith")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .find(|r| r.get("type").and_then(Value::as_str) == Some("Rating"))
        .and_then(|r| Some((r.get("value")?.as_f64()?, r.get("best").and_then(Value::as_f64).unwrap_or(5.0))))
        .filter(|(value, best)| *best > 0.0 && (0.0..=*best).contains(value))
        // Half stars; a rating that rounds to none (a 0 of 5) is no rating, not half a star.
        .map_or(0, |(value, best)| ((value / best * 10.0).round() as u32).min(10));
    let plain = object
        .get("source")
        .filter(|s| s.get("mediaType").and_then(Value::as_str).is_some_and(|m| m.starts_with("text/plain")))
        .and_then(|s| s.get("content"))
        .and_then(Value::as_str)
        .map(str::to_owned);
    let body = plain
        .unwrap_or_else(|| strip_html(object.get("content").and_then(Value::as_str).unwrap_or_default()))
        .chars()
        .take(MAX_BODY_CHARS)
        .collect();
    // When it was written orders it among the film's reviews: a date that is there must be
    // one, and not ahead of this clock by more than a day; a note without one (rare) is dated
    // when it arrives.
    let (published_ms, dated) = match object.get("published") {
        None | Some(Value::Null) => (now_ms(), false),
        Some(published) => (
            published
                .as_str()
                .and_then(parse_rfc3339)
                .filter(|ms| (0..=now_ms() + MAX_AHEAD_MS).contains(ms))
                .ok_or_else(|| {
                    NoteError::Invalid(format!("published: not an RFC 3339 date up to a day from now: {published}"))
                })?,
            true,
        ),
    };
    // An edit's date that is not one, or is ahead, counts as the publication's (no edit known);
    // without either, it is unknown (0), not the arrival: a late Create of an undated note
    // would otherwise count as an edit later than the Update kept.
    let known = if dated { published_ms } else { 0 };
    let edited_ms = object
        .get("updated")
        .and_then(Value::as_str)
        .and_then(parse_rfc3339)
        .filter(|ms| (known..=now_ms() + MAX_AHEAD_MS).contains(ms))
        .unwrap_or(known);
    Ok(RemoteReviewNote {
        object_uri,
        attributed_to,
        title,
        year: year as i32,
        external_id,
        rating,
        body,
        published_ms,
        edited_ms,
    })
}

/// Whether `object` is addressed to the public: the public collection among its `to` or `cc`
/// (one or a list, by id or compacted as `as:Public` or `Public`).
pub fn is_public(object: &Value) -> bool {
    let public = |v: &Value| id_of(v).is_some_and(|id| matches!(id, PUBLIC | "as:Public" | "Public"));
    ["to", "cc"].iter().filter_map(|field| object.get(*field)).any(|addressed| match addressed {
        Value::Array(list) => list.iter().any(public),
        one => public(one),
    })
}

/// Text of an HTML fragment: tags dropped, paragraphs and line breaks kept, entities decoded.
pub fn strip_html(html: &str) -> String {
    let mut text = String::with_capacity(html.len());
    let mut rest = html;
    while let Some(start) = rest.find('<') {
        text.push_str(&rest[..start]);
        let Some(end) = rest[start..].find('>') else { break };
        let tag = rest[start + 1..start + end].trim_start_matches('/').to_ascii_lowercase();
        if tag.starts_with("br") {
            text.push('\n');
        } else if tag.starts_with('p') && rest[start + 1..].starts_with('/') {
            text.push_str("\n\n");
        }
        rest = &rest[start + end + 1..];
    }
    if !rest.contains('<') {
        text.push_str(rest);
    }
    text.replace("&lt;", "<")
        .replace("&gt;", ">")
        .replace("&quot;", "\"")
        .replace("&#39;", "'")
        .replace("&amp;", "&")
        .trim()
        .to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn html_becomes_text() {
        assert_eq!(strip_html("<p>One &amp; two</p><p>three<br>four</p>"), "One & two\n\nthree\nfour");
    }

    fn note(published: Value, rating: Value, year: i64) -> Value {
        json!({
            "id": "https://m.example/users/u/statuses/1", "type": "Note", "attributedTo": "https://m.example/users/u",
            "content": "<p>Slow.</p>", "published": published, "to": [PUBLIC],
            "film": { "name": "Stalker", "year": year },
            "relatedWith": [{ "type": "Rating", "value": rating, "best": 5 }],
        })
    }

    /// Each field keeps its meaning or is refused by name: a date that is not one (or far
    /// ahead), a year the write service would refuse; a rating of nothing is unrated, and a
    /// note without a date is dated on arrival.
    #[test]
    fn fields_are_read_or_refused_by_name() {
        let read = |v: Value| read_review(&v);
        let good = read(note(json!("2026-01-02T03:04:05Z"), json!(4.5), 1979)).unwrap();
        assert_eq!((good.rating, good.published_ms, good.year), (9, 1_767_323_045_000, 1979));
        assert_eq!(read(note(json!("2026-01-02T03:04:05Z"), json!(0), 1979)).unwrap().rating, 0, "a 0 is unrated");
        assert_eq!(read(note(json!("2026-01-02T03:04:05Z"), json!("five"), 1979)).unwrap().rating, 0);
        let before = now_ms();
        let undated = read(note(Value::Null, json!(3), 1979)).unwrap();
        assert!(undated.published_ms >= before, "dated on arrival");
        assert_eq!(undated.edited_ms, 0, "its edit unknown, not its arrival");
        // Its last edit: `updated`, else (absent, not a date, before its publication) the
        // publication.
        let edited = |updated: Value| {
            let mut edited = note(json!("2026-01-02T03:04:05Z"), json!(4), 1979);
            edited["updated"] = updated;
            read(edited).unwrap().edited_ms
        };
        assert_eq!(edited(json!("2026-01-03T03:04:05Z")), 1_767_409_445_000);
        assert_eq!(good.edited_ms, good.published_ms);
        for bad in [json!("soon"), json!("2025-01-01T00:00:00Z"), json!(5)] {
            assert_eq!(edited(bad.clone()), good.published_ms, "{bad}");
        }
        for (bad, field) in [
            (note(json!(12345), json!(3), 1979), "published"),
            (note(json!("yesterday"), json!(3), 1979), "published"),
            (note(json!("9999-01-01T00:00:00Z"), json!(3), 1979), "published"),
            (note(json!("2026-01-02T03:04:05Z"), json!(3), 2150), "film.year"),
            (note(json!("2026-01-02T03:04:05Z"), json!(3), 1500), "film.year"),
        ] {
            match read(bad) {
                Err(NoteError::Invalid(reason)) => assert!(reason.starts_with(field), "{field}: {reason}"),
                other => panic!("{field}: {other:?}"),
            }
        }
    }

    /// Only a note addressed to the public is a review to keep, the public named any way
    /// ActivityPub allows; followers-only and direct notes are not.
    #[test]
    fn only_public_notes_are_reviews() {
        let addressed = |to: Value, cc: Value| {
            let mut note = note(json!("2026-01-02T03:04:05Z"), json!(4), 1979);
            note["to"] = to;
            note["cc"] = cc;
            read_review(&note)
        };
        let followers = json!("https://m.example/users/u/followers");
        for (to, cc) in [
            (json!(PUBLIC), Value::Null),
            (json!([followers]), json!([PUBLIC])),
            (json!(["as:Public"]), Value::Null),
            (json!([{ "id": "Public" }]), Value::Null),
        ] {
            assert!(addressed(to.clone(), cc.clone()).is_ok(), "{to} {cc}");
        }
        for (to, cc) in [
            (json!([followers]), Value::Null),
            (json!(["https://m.example/users/v"]), json!([])),
            (Value::Null, Value::Null),
        ] {
            assert!(matches!(addressed(to.clone(), cc.clone()), Err(NoteError::NotPublic)), "{to} {cc}");
        }
    }

    #[test]
    fn a_note_without_a_film_is_not_a_review() {
        let note = json!({ "id": "https://m.example/1", "type": "Note", "attributedTo": "https://m.example/u", "content": "hi" });
        assert!(matches!(read_review(&note), Err(NoteError::NotAReview(_))));
        let person = json!({ "id": "https://m.example/u", "type": "Person" });
        assert!(matches!(read_review(&person), Err(NoteError::NotAReview(_))));
    }
}
