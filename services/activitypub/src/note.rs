//! Reading a remote review out of a `Note` (or `Article`/`Review`): the film it is about, its
//! rating and its text. Notes that name no film are not reviews Reelay can keep.

use reelay_contracts::v1;
use serde_json::Value;

use crate::documents::id_of;
use crate::time::parse_rfc3339;

/// The longest review body kept (the write service's limit).
pub const MAX_BODY_CHARS: usize = 10_000;

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
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NoteError {
    /// Well-formed, but nothing Reelay keeps (no film named, another object type).
    #[error("not a film review: {0}")]
    NotAReview(String),
    #[error("invalid review: {0}")]
    Invalid(String),
}

impl RemoteReviewNote {
    /// The write service's request to save this review. `received` names the activity that
    /// carried it (empty for a review read from an outbox).
    pub fn into_save_request(self, received: &str) -> v1::SaveRemoteReviewRequest {
        let title_year = v1::TitleYear { title: self.title, year: self.year, external_id: self.external_id };
        v1::SaveRemoteReviewRequest {
            object_uri: self.object_uri,
            actor_uri: self.attributed_to,
            movie: Some(v1::MovieRef { by: Some(v1::movie_ref::By::TitleYear(title_year)) }),
            rating: self.rating,
            body: self.body,
            published_at_ms: self.published_ms,
            received_activity_uri: received.to_owned(),
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
    let title = film.get("name").and_then(Value::as_str).map(str::trim).unwrap_or_default().to_owned();
    let year = film.get("year").and_then(Value::as_i64).unwrap_or_default();
    if title.is_empty() || !(1870..=2200).contains(&year) {
        return Err(NoteError::Invalid("the film needs a name and a year".into()));
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
        .map_or(0, |(value, best)| ((value / best * 10.0).round() as u32).clamp(1, 10));
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
    let published_ms = object.get("published").and_then(Value::as_str).and_then(parse_rfc3339).unwrap_or(0).max(0);
    Ok(RemoteReviewNote {
        object_uri,
        attributed_to,
        title,
        year: year as i32,
        external_id,
        rating,
        body,
        published_ms,
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

    #[test]
    fn a_note_without_a_film_is_not_a_review() {
        let note = json!({ "id": "https://m.example/1", "type": "Note", "attributedTo": "https://m.example/u", "content": "hi" });
        assert!(matches!(read_review(&note), Err(NoteError::NotAReview(_))));
        let person = json!({ "id": "https://m.example/u", "type": "Person" });
        assert!(matches!(read_review(&person), Err(NoteError::NotAReview(_))));
    }
}
