//! HTTP Signatures as Mastodon sends and checks them: draft-cavage-http-signatures-12 with
//! `algorithm="rsa-sha256"` (or `hs2019`, whose algorithm the key decides: RSA here), over
//! `(request-target) host date` and, with a body, `digest` (`Digest: SHA-256=<base64>`).
//!
//! This module builds and parses; [`crate::keys`] signs and verifies.

use base64::Engine;
use base64::engine::general_purpose::STANDARD as B64;

/// The headers Reelay signs: the request line, the host and the date, and the digest of a body.
pub const SIGNED_WITHOUT_BODY: &str = "(request-target) host date";
pub const SIGNED_WITH_BODY: &str = "(request-target) host date digest";

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SignatureError {
    #[error("the Signature header is malformed: {0}")]
    Malformed(String),
    #[error("unsupported signature algorithm {0:?}")]
    Algorithm(String),
    #[error("the signature does not cover {0}")]
    NotCovered(&'static str),
    #[error("a signed header is missing from the request: {0}")]
    MissingHeader(String),
}

/// `SHA-256=<base64 of the body's SHA-256>`, the `Digest` header of a body.
pub fn digest_header(body: &[u8]) -> String {
    format!("SHA-256={}", B64.encode(ring::digest::digest(&ring::digest::SHA256, body)))
}

/// True when a `Digest` header value carries a SHA-256 that matches `body` (other algorithms in
/// the list are ignored; one SHA-256 entry is required).
pub fn digest_matches(header: &str, body: &[u8]) -> bool {
    let expected = digest_header(body);
    let mut saw_sha256 = false;
    for entry in header.split(',').map(str::trim) {
        if let Some((algorithm, _)) = entry.split_once('=')
            && algorithm.eq_ignore_ascii_case("SHA-256")
        {
            saw_sha256 = true;
            // Compare the value exactly: base64 with its padding.
            if entry[algorithm.len()..] != expected["SHA-256".len()..] {
                return false;
            }
        }
    }
    saw_sha256
}

/// The string Reelay signs for an outgoing request.
pub fn outgoing_signing_string(method: &str, path: &str, host: &str, date: &str, digest: Option<&str>) -> String {
    let mut lines = vec![
        format!("(request-target): {} {path}", method.to_ascii_lowercase()),
        format!("host: {host}"),
        format!("date: {date}"),
    ];
    if let Some(digest) = digest {
        lines.push(format!("digest: {digest}"));
    }
    lines.join("\n")
}

/// The parameters of a `Signature` header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SignatureParams {
    pub key_id: String,
    pub algorithm: Option<String>,
    /// Lowercased, in order; `["date"]` when the header names none (the draft's default).
    pub headers: Vec<String>,
    pub signature: Vec<u8>,
    pub created: Option<i64>,
    pub expires: Option<i64>,
}

impl SignatureParams {
    /// Parses `keyId="…",algorithm="…",headers="…",signature="…"` (any order; `created` and
    /// `expires` may be bare numbers).
    pub fn parse(header: &str) -> Result<Self, SignatureError> {
        let malformed = |what: &str| SignatureError::Malformed(what.to_owned());
        let (mut key_id, mut algorithm, mut headers, mut signature, mut created, mut expires) =
            (None, None, None, None, None, None);
        let mut rest = header.trim();
        while !rest.is_empty() {
            let (name, after) = rest.split_once('=').ok_or_else(|| malformed("a parameter has no value"))?;
            let name = name.trim().to_ascii_lowercase();
            let after = after.trim_start();
            let (value, after) = if let Some(quoted) = after.strip_prefix('"') {
                let end = quoted.find('"').ok_or_else(|| malformed("an unterminated quoted value"))?;
                (&quoted[..end], &quoted[end + 1..])
            } else {
                let end = after.find(',').unwrap_or(after.len());
                (after[..end].trim(), &after[end..])
            };
            let number = |v: &str| v.parse::<i64>().map_err(|_| malformed("created/expires must be a number"));
            match name.as_str() {
                "keyid" => key_id = Some(value.to_owned()),
                "algorithm" => algorithm = Some(value.to_ascii_lowercase()),
                "headers" => headers = Some(value.split_ascii_whitespace().map(str::to_ascii_lowercase).collect()),
                "signature" => {
                    signature = Some(B64.decode(value).map_err(|_| malformed("the signature is not base64"))?)
                }
                "created" => created = Some(number(value)?),
                "expires" => expires = Some(number(value)?),
                _ => {}
            }
            rest = after.trim_start();
            if let Some(next) = rest.strip_prefix(',') {
                rest = next.trim_start();
            } else if !rest.is_empty() {
                return Err(malformed("parameters must be separated by commas"));
            }
        }
        let params = Self {
            key_id: key_id.filter(|k| !k.is_empty()).ok_or_else(|| malformed("keyId is missing"))?,
            algorithm,
            headers: headers.unwrap_or_else(|| vec!["date".to_owned()]),
            signature: signature.ok_or_else(|| malformed("signature is missing"))?,
            created,
            expires,
        };
        match params.algorithm.as_deref() {
            None | Some("rsa-sha256") | Some("hs2019") => Ok(params),
            Some(other) => Err(SignatureError::Algorithm(other.to_owned())),
        }
    }

    /// The header value for an outgoing request.
    pub fn format(key_id: &str, headers: &str, signature: &[u8]) -> String {
        format!(
            "keyId=\"{key_id}\",algorithm=\"rsa-sha256\",headers=\"{headers}\",signature=\"{}\"",
            B64.encode(signature)
        )
    }

    /// Checks that the signature covers what Mastodon requires: the request target, the host,
    /// the date (or `(created)`), and the digest when the request has a body.
    pub fn require_coverage(&self, has_body: bool) -> Result<(), SignatureError> {
        let covers = |h: &str| self.headers.iter().any(|x| x == h);
        if !covers("(request-target)") {
            return Err(SignatureError::NotCovered("(request-target)"));
        }
        if !covers("host") {
            return Err(SignatureError::NotCovered("host"));
        }
        if !covers("date") && !covers("(created)") {
            return Err(SignatureError::NotCovered("date"));
        }
        if has_body && !covers("digest") {
            return Err(SignatureError::NotCovered("digest"));
        }
        Ok(())
    }

    /// The string the signer signed, rebuilt from the request: `header` returns a header's
    /// value (several values joined with ", ").
    pub fn signing_string(
        &self,
        method: &str,
        path_and_query: &str,
        header: impl Fn(&str) -> Option<String>,
    ) -> Result<String, SignatureError> {
        let mut lines = Vec::with_capacity(self.headers.len());
        for name in &self.headers {
            let value = match name.as_str() {
                "(request-target)" => format!("{} {path_and_query}", method.to_ascii_lowercase()),
                "(created)" => self.created.ok_or(SignatureError::MissingHeader(name.clone()))?.to_string(),
                "(expires)" => self.expires.ok_or(SignatureError::MissingHeader(name.clone()))?.to_string(),
                other => header(other).ok_or_else(|| SignatureError::MissingHeader(other.to_owned()))?,
            };
            lines.push(format!("{name}: {value}"));
        }
        Ok(lines.join("\n"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_a_mastodon_signature_header() {
        let header = r#"keyId="https://mastodon.example/users/alice#main-key",algorithm="rsa-sha256",headers="(request-target) host date digest content-type",signature="c2lnbmF0dXJl""#;
        let params = SignatureParams::parse(header).unwrap();
        assert_eq!(params.key_id, "https://mastodon.example/users/alice#main-key");
        assert_eq!(params.headers, ["(request-target)", "host", "date", "digest", "content-type"]);
        assert_eq!(params.signature, b"signature");
        params.require_coverage(true).unwrap();
        let string = params
            .signing_string("POST", "/users/ana/inbox", |h| {
                Some(match h {
                    "host" => "reelay.example".into(),
                    "date" => "Tue, 07 Jun 2022 20:51:35 GMT".into(),
                    "digest" => "SHA-256=abc".into(),
                    _ => "application/activity+json".into(),
                })
            })
            .unwrap();
        assert_eq!(
            string,
            "(request-target): post /users/ana/inbox\nhost: reelay.example\ndate: Tue, 07 Jun 2022 20:51:35 GMT\n\
             digest: SHA-256=abc\ncontent-type: application/activity+json"
        );
    }

    #[test]
    fn refuses_what_mastodon_refuses() {
        assert!(matches!(SignatureParams::parse("signature=\"AAAA\""), Err(SignatureError::Malformed(_))));
        assert!(matches!(
            SignatureParams::parse(r#"keyId="k",algorithm="hmac-sha256",signature="AAAA""#),
            Err(SignatureError::Algorithm(_))
        ));
        let no_digest = SignatureParams::parse(r#"keyId="k",headers="(request-target) host date",signature="AAAA""#);
        assert_eq!(no_digest.unwrap().require_coverage(true), Err(SignatureError::NotCovered("digest")));
        let hs2019 = SignatureParams::parse(
            r#"keyId="k",algorithm="hs2019",created=1402170695,headers="(request-target) host (created) digest",signature="AAAA""#,
        )
        .unwrap();
        hs2019.require_coverage(true).unwrap();
        let string = hs2019.signing_string("post", "/inbox", |_| Some("x".into())).unwrap();
        assert_eq!(string, "(request-target): post /inbox\nhost: x\n(created): 1402170695\ndigest: x");
    }

    #[test]
    fn what_reelay_signs_verifies_as_a_receiver_rebuilds_it() {
        let key = crate::keys::generate().unwrap();
        let signer = crate::keys::SigningKey::from_pkcs8(&key.private_pkcs8_der).unwrap();
        let (date, digest) = ("Tue, 07 Jun 2022 20:51:35 GMT", digest_header(b"{}"));
        let string = outgoing_signing_string("POST", "/inbox", "m.example", date, Some(&digest));
        let header = SignatureParams::format(
            "https://r.example/users/u#main-key",
            SIGNED_WITH_BODY,
            &signer.sign(string.as_bytes()).unwrap(),
        );
        let params = SignatureParams::parse(&header).unwrap();
        params.require_coverage(true).unwrap();
        let rebuilt = params
            .signing_string("POST", "/inbox", |h| match h {
                "host" => Some("m.example".into()),
                "date" => Some(date.into()),
                "digest" => Some(digest.clone()),
                _ => None,
            })
            .unwrap();
        let public = crate::keys::PublicKey::from_pem(&key.public_key_pem).unwrap();
        assert!(public.verify(rebuilt.as_bytes(), &params.signature));
        let moved = params.signing_string("POST", "/users/u/inbox", |_| Some("m.example".into())).unwrap();
        assert!(!public.verify(moved.as_bytes(), &params.signature));
    }

    #[test]
    fn digests_compare_exactly() {
        let header = digest_header(b"{}");
        assert_eq!(header, "SHA-256=RBNvo1WzZ4oRRq0W9+hknpT7T8If536DEMBg9hyq/4o=");
        assert!(digest_matches(&header, b"{}"));
        assert!(digest_matches(&format!("MD5=abc,{header}"), b"{}"));
        assert!(!digest_matches(&header, b"{ }"));
        assert!(!digest_matches("MD5=abc", b"{}"));
    }
}
