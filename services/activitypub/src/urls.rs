//! The ids of what this instance publishes, all under its public origin (`REELAY_PUBLIC_URL`).
//!
//! Actors are named by user id, which never changes (`/users/<uuid>`); WebFinger maps a handle
//! to it. A review's `Create` is `<note>/activity`, one per note, the id its outbox lists and
//! the gateway serves; every other activity Reelay sends is `/activities/<event id>`: the event
//! that caused it names it. Either way a redelivery of the event sends the same activity again,
//! never a new one.

use url::Url;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Urls {
    /// The origin without a trailing slash, e.g. `https://reelay.example`.
    base: String,
    /// `host[:port]`, the domain of `acct:` handles.
    host: String,
    /// The scheme's default port (`:443`, `:80`), which a `Host` header may write out.
    default_port: &'static str,
}

impl Urls {
    pub fn new(public_url: &str) -> Result<Self, String> {
        let url = Url::parse(public_url).map_err(|e| format!("REELAY_PUBLIC_URL {public_url:?} is not a URL: {e}"))?;
        if !matches!(url.scheme(), "http" | "https") || url.host_str().is_none() {
            return Err(format!("REELAY_PUBLIC_URL {public_url:?} must be an http(s) origin"));
        }
        if url.path() != "/" || url.query().is_some() {
            return Err(format!("REELAY_PUBLIC_URL {public_url:?} must be an origin, without a path"));
        }
        let host = crate::documents::host_port(&url);
        let default_port = if url.scheme() == "https" { ":443" } else { ":80" };
        // The parsed form, not the text typed: the host in lower case (and punycode), the
        // scheme's default port left out, as peers write our ids back.
        Ok(Self { base: url.as_str().trim_end_matches('/').to_owned(), host, default_port })
    }

    pub fn base(&self) -> &str {
        &self.base
    }

    pub fn host(&self) -> &str {
        &self.host
    }

    /// Whether a request's `Host` names this origin (letters' case aside, and the scheme's
    /// default port written out or not).
    pub fn is_own_host(&self, host: &str) -> bool {
        let host = host.to_ascii_lowercase();
        host.strip_suffix(self.default_port).unwrap_or(&host) == self.host
    }

    pub fn actor(&self, user_id: &str) -> String {
        format!("{}/users/{user_id}", self.base)
    }

    pub fn key_id(&self, user_id: &str) -> String {
        format!("{}#main-key", self.actor(user_id))
    }

    pub fn inbox(&self, user_id: &str) -> String {
        format!("{}/inbox", self.actor(user_id))
    }

    pub fn outbox(&self, user_id: &str) -> String {
        format!("{}/outbox", self.actor(user_id))
    }

    pub fn followers(&self, user_id: &str) -> String {
        format!("{}/followers", self.actor(user_id))
    }

    pub fn shared_inbox(&self) -> String {
        format!("{}/inbox", self.base)
    }

    /// The person's page, for people (`/@handle`).
    pub fn profile(&self, handle: &str) -> String {
        format!("{}/@{handle}", self.base)
    }

    /// The handle of one of our people's pages (`/@handle`).
    pub fn handle_of_profile<'a>(&self, page: &'a str) -> Option<&'a str> {
        page.strip_prefix(&self.base)?.strip_prefix("/@").filter(|h| !h.is_empty() && !h.contains('/'))
    }

    pub fn note(&self, user_id: &str, review_id: &str) -> String {
        format!("{}/reviews/{review_id}", self.actor(user_id))
    }

    /// The id of the `Create` of a review's note: one per note, the same in the outbox and in
    /// what followers are sent, and served (the gateway's `GET <note>/activity`).
    pub fn note_create(&self, user_id: &str, review_id: &str) -> String {
        format!("{}/activity", self.note(user_id, review_id))
    }

    /// The id of the activity the event `event_id` caused.
    pub fn activity(&self, event_id: &str) -> String {
        format!("{}/activities/{event_id}", self.base)
    }

    /// The event id an activity id of ours derives from.
    pub fn event_of_activity<'a>(&self, activity: &'a str) -> Option<&'a str> {
        activity.strip_prefix(&self.base)?.strip_prefix("/activities/").filter(|id| !id.contains('/'))
    }

    /// The user id of one of our actor ids.
    pub fn user_of_actor<'a>(&self, actor: &'a str) -> Option<&'a str> {
        actor.strip_prefix(&self.base)?.strip_prefix("/users/").filter(|id| !id.is_empty() && !id.contains('/'))
    }

    /// True when `uri` is on this instance.
    pub fn is_local(&self, uri: &str) -> bool {
        uri.strip_prefix(&self.base).is_some_and(|rest| rest.is_empty() || rest.starts_with('/'))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_own_host_is_the_public_ones() {
        let https = Urls::new("https://Reelay.example").unwrap();
        for host in ["reelay.example", "REELAY.example", "reelay.example:443"] {
            assert!(https.is_own_host(host), "{host}");
        }
        for host in ["elsewhere.example", "reelay.example:8443", "reelay.example:80", "", "reelay.example.evil"] {
            assert!(!https.is_own_host(host), "{host}");
        }
        let http = Urls::new("http://127.0.0.1:8080").unwrap();
        assert!(http.is_own_host("127.0.0.1:8080"));
        assert!(!http.is_own_host("127.0.0.1"));
        assert!(Urls::new("http://films.example").unwrap().is_own_host("films.example:80"));
    }

    /// Ids are built from the public URL as parsed, so they are the ones peers write back.
    #[test]
    fn ids_use_the_public_urls_normal_form() {
        for (typed, base, host) in [
            ("http://LocalHost:18981", "http://localhost:18981", "localhost:18981"),
            ("https://Reelay.Example:443/", "https://reelay.example", "reelay.example"),
            ("http://films.example:80", "http://films.example", "films.example"),
        ] {
            let urls = Urls::new(typed).unwrap();
            assert_eq!((urls.base(), urls.host()), (base, host), "{typed}");
            let actor = format!("{base}/users/u1");
            assert_eq!(urls.user_of_actor(&actor), Some("u1"), "{typed}");
            assert!(urls.is_local(&actor), "{typed}");
        }
    }

    #[test]
    fn ids_derive_from_the_origin_and_parse_back() {
        let urls = Urls::new("http://127.0.0.1:8080/").unwrap();
        assert_eq!(urls.host(), "127.0.0.1:8080");
        assert_eq!(urls.actor("u1"), "http://127.0.0.1:8080/users/u1");
        assert_eq!(urls.key_id("u1"), "http://127.0.0.1:8080/users/u1#main-key");
        assert_eq!(urls.user_of_actor("http://127.0.0.1:8080/users/u1"), Some("u1"));
        assert_eq!(urls.user_of_actor("http://127.0.0.1:8080/users/u1/inbox"), None);
        assert_eq!(urls.event_of_activity(&urls.activity("e1")), Some("e1"));
        assert_eq!(urls.event_of_activity("http://elsewhere/activities/e1"), None);
        assert_eq!(urls.handle_of_profile(&urls.profile("ana")), Some("ana"));
        assert_eq!(urls.handle_of_profile("http://127.0.0.1:8080/@"), None);
        assert!(Urls::new("http://reelay.example/app").is_err());
        assert!(Urls::new("ftp://reelay.example").is_err());
    }
}
