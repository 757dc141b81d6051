//! Input rules for every field a caller can send. A violation names the field, so the gRPC layer
//! can answer `INVALID_ARGUMENT` with a message a client can act on.

use std::fmt;

/// A request field broke a rule.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub struct ValidationError {
    pub field: String,
    pub reason: String,
}

impl ValidationError {
    pub fn new(field: impl Into<String>, reason: impl Into<String>) -> Self {
        Self { field: field.into(), reason: reason.into() }
    }
}

impl fmt::Display for ValidationError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.field, self.reason)
    }
}

pub const MAX_HANDLE_CHARS: usize = 30;
pub const MAX_NAME_CHARS: usize = 100;
pub const MAX_TITLE_CHARS: usize = 300;
pub const MAX_BODY_CHARS: usize = 10_000;
pub const MAX_URI_CHARS: usize = 2_048;
pub const MAX_EXTERNAL_ID_CHARS: usize = 100;
/// The first film was shot in 1888; allow a few years of announced releases.
pub const MIN_YEAR: i32 = 1870;
pub const MAX_YEAR: i32 = 2100;
/// Ratings are half stars: 1 = ½★ … 10 = ★★★★★; 0 = unrated.
pub const MAX_RATING: u32 = 10;
/// The genres, directors and films a wrap-up's summary ranks, each (`WrapUpSummary`).
pub const WRAP_UP_TOP: usize = 5;
pub const DEFAULT_PAGE_SIZE: u32 = 50;
pub const MAX_PAGE_SIZE: u32 = 200;

fn chars(value: &str) -> usize {
    value.chars().count()
}

/// Characters that show nothing: Unicode's default-ignorable code points (zero-width spaces and
/// joiners, bidirectional marks, variation selectors, the byte order mark, tags ...) and the
/// blanks some fonts draw as nothing (Hangul fillers, the braille blank).
fn is_invisible(c: char) -> bool {
    matches!(c as u32,
        0x00AD | 0x034F | 0x061C | 0x115F | 0x1160 | 0x17B4 | 0x17B5 | 0x180B..=0x180F
        | 0x200B..=0x200F | 0x202A..=0x202E | 0x2060..=0x206F | 0x2800 | 0x3164 | 0xFE00..=0xFE0F
        | 0xFEFF | 0xFFA0 | 0xFFF0..=0xFFF8 | 0x1BCA0..=0x1BCA3 | 0x1D173..=0x1D17A | 0xE0000..=0xE0FFF)
}

/// A bidirectional embedding, override or isolate (U+202A–U+202E, U+2066–U+2069), which
/// reorders what follows it (a name that reads as another).
pub fn is_bidi_control(c: char) -> bool {
    matches!(c as u32, 0x202A..=0x202E | 0x2066..=0x2069)
}

/// A control character, or a line or paragraph separator (U+2028, U+2029: not controls, but
/// they break a line where they stand).
fn breaks_or_controls(c: char) -> bool {
    c.is_control() || matches!(c, '\u{2028}' | '\u{2029}')
}

/// A control character other than a line break or a tab: what a multi-line text may not hold.
fn control_in_block(c: char) -> bool {
    c.is_control() && !matches!(c, '\n' | '\r' | '\t')
}

fn no_control_chars(field: &str, value: &str, allow_newlines: bool) -> Result<(), ValidationError> {
    let bad = value.chars().any(|c| if allow_newlines { control_in_block(c) } else { breaks_or_controls(c) });
    if bad {
        let reason = if allow_newlines {
            "must not contain control characters"
        } else {
            "must be one line, without control characters"
        };
        return Err(ValidationError::new(field, reason));
    }
    Ok(())
}

/// A required single-line text of at most `max` characters, trimmed.
pub fn required_text(field: &str, value: &str, max: usize) -> Result<String, ValidationError> {
    use unicode_normalization::UnicodeNormalization;
    // Composed (NFC), so one name has one spelling: `e` + U+0301 is stored as `é`.
    let composed: String = value.trim().nfc().collect();
    if composed.chars().all(|c| c.is_whitespace() || is_invisible(c)) {
        return Err(ValidationError::new(field, "is required (it has no visible character)"));
    }
    if chars(&composed) > max {
        return Err(ValidationError::new(field, format!("is longer than {max} characters")));
    }
    no_control_chars(field, &composed, false)?;
    if composed.chars().any(is_bidi_control) {
        return Err(ValidationError::new(field, "must not contain bidirectional override or isolate characters"));
    }
    Ok(composed)
}

/// `value` brought within what [`required_text`] takes where dropping characters can do it:
/// control characters become spaces, bidirectional embeddings, overrides and isolates go, and
/// it is cut to `max` characters. `None` when nothing visible is left. For text from outside
/// (a metadata provider's names), where one odd character must not cost the whole record.
pub fn fitted_text(value: &str, max: usize) -> Option<String> {
    let cleaned: String =
        value.chars().filter(|c| !is_bidi_control(*c)).map(|c| if breaks_or_controls(c) { ' ' } else { c }).collect();
    let cut: String = required_text("", &cleaned, usize::MAX).ok()?.chars().take(max).collect();
    required_text("", &cut, max).ok()
}

/// `value` brought within what [`text_block`] takes: control characters other than line
/// breaks and tabs become spaces, and it is cut to `max` characters.
pub fn fitted_block(value: &str, max: usize) -> String {
    value.chars().map(|c| if control_in_block(c) { ' ' } else { c }).take(max).collect()
}

/// 1-30 characters of `a-z`, `0-9` and `_`.
pub fn handle(value: &str) -> Result<String, ValidationError> {
    const FIELD: &str = "handle";
    if value.is_empty() {
        return Err(ValidationError::new(FIELD, "is required"));
    }
    if chars(value) > MAX_HANDLE_CHARS {
        return Err(ValidationError::new(FIELD, format!("is longer than {MAX_HANDLE_CHARS} characters")));
    }
    if !value.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_') {
        return Err(ValidationError::new(FIELD, "may only contain a-z, 0-9 and '_'"));
    }
    Ok(value.to_owned())
}

pub fn display_name(value: &str) -> Result<String, ValidationError> {
    required_text("display_name", value, MAX_NAME_CHARS)
}

pub fn title(field: &str, value: &str) -> Result<String, ValidationError> {
    required_text(field, value, MAX_TITLE_CHARS)
}

/// The identity of a title: lower-cased with runs of whitespace folded to one space.
pub fn title_key(title: &str) -> String {
    use unicode_normalization::UnicodeNormalization;
    let visible: String = title.nfc().filter(|c| !is_invisible(*c)).collect();
    visible.split_whitespace().collect::<Vec<_>>().join(" ").to_lowercase()
}

pub fn year(field: &str, value: i32) -> Result<i32, ValidationError> {
    if !(MIN_YEAR..=MAX_YEAR).contains(&value) {
        return Err(ValidationError::new(field, format!("must be between {MIN_YEAR} and {MAX_YEAR}, got {value}")));
    }
    Ok(value)
}

pub fn rating(field: &str, value: u32) -> Result<u32, ValidationError> {
    if value > MAX_RATING {
        return Err(ValidationError::new(
            field,
            format!("must be 0 (unrated) or 1..={MAX_RATING} half stars, got {value}"),
        ));
    }
    Ok(value)
}

/// Review text: optional, multi-line, at most 10,000 characters; stored composed (NFC).
pub fn body(field: &str, value: &str) -> Result<String, ValidationError> {
    text_block(field, value, MAX_BODY_CHARS)
}

/// An optional multi-line text of at most `max` characters (newlines and tabs allowed, other
/// control characters not); stored composed (NFC).
pub fn text_block(field: &str, value: &str, max: usize) -> Result<String, ValidationError> {
    use unicode_normalization::UnicodeNormalization;
    // Composed (NFC), as names are: the same text has one form, and search finds its words.
    // Counted composed too: what is stored is what an edit sends back.
    let composed: String = value.nfc().collect();
    if chars(&composed) > max {
        return Err(ValidationError::new(field, format!("is longer than {max} characters")));
    }
    no_control_chars(field, &composed, true)?;
    Ok(composed)
}

/// An optional calendar date, `YYYY-MM-DD`.
pub fn date(field: &str, value: &str) -> Result<String, ValidationError> {
    if value.is_empty() {
        return Ok(String::new());
    }
    let invalid = || ValidationError::new(field, format!("must be a date as YYYY-MM-DD, got {value:?}"));
    let bytes = value.as_bytes();
    let digits_at = |range: std::ops::Range<usize>| bytes[range].iter().all(u8::is_ascii_digit);
    // Digits only: a number's parse would take a sign (`2024-+1-05`).
    if bytes.len() != 10
        || bytes[4] != b'-'
        || bytes[7] != b'-'
        || !(digits_at(0..4) && digits_at(5..7) && digits_at(8..10))
    {
        return Err(invalid());
    }
    let number = |s: &str| s.parse::<u32>().map_err(|_| invalid());
    let (y, m, d) = (number(&value[0..4])?, number(&value[5..7])?, number(&value[8..10])?);
    let leap = (y % 4 == 0 && y % 100 != 0) || y % 400 == 0;
    let days = match m {
        1 | 3 | 5 | 7 | 8 | 10 | 12 => 31,
        4 | 6 | 9 | 11 => 30,
        2 if leap => 29,
        2 => 28,
        _ => return Err(invalid()),
    };
    if d == 0 || d > days || !(MIN_YEAR as u32..=MAX_YEAR as u32).contains(&y) {
        return Err(invalid());
    }
    Ok(value.to_owned())
}

/// The calendar date (`YYYY-MM-DD`, UTC) at `ms` since the epoch.
pub fn date_at(ms: i64) -> String {
    let (y, m, d) = civil_from_days(ms.div_euclid(86_400_000));
    format!("{y:04}-{m:02}-{d:02}")
}

/// How far ahead of UTC the earliest time zone is (UTC+14): its date is the latest anywhere.
const EARLIEST_ZONE_MS: i64 = 14 * 3_600_000;

/// The latest calendar date anywhere on Earth at `now_ms` (UTC+14's), as `YYYY-MM-DD`.
pub fn latest_date(now_ms: i64) -> String {
    date_at(now_ms + EARLIEST_ZONE_MS)
}

/// The latest year anywhere on Earth at `now_ms`.
pub fn latest_year(now_ms: i64) -> i32 {
    civil_from_days((now_ms + EARLIEST_ZONE_MS).div_euclid(86_400_000)).0 as i32
}

/// When a film was watched: an optional date (see [`date`]) not after today anywhere at
/// `now_ms` (a diary entry for the future is a typo).
pub fn watch_date(field: &str, value: &str, now_ms: i64) -> Result<String, ValidationError> {
    let date = date(field, value)?;
    let latest = latest_date(now_ms);
    if date > latest {
        return Err(ValidationError::new(
            field,
            format!("must not be in the future (the latest date anywhere now is {latest}), got {value:?}"),
        ));
    }
    Ok(date)
}

/// An optional provider id such as `tmdb:603`: `scheme:value`, no spaces.
pub fn external_id(field: &str, value: &str) -> Result<Option<String>, ValidationError> {
    if value.is_empty() {
        return Ok(None);
    }
    if chars(value) > MAX_EXTERNAL_ID_CHARS {
        return Err(ValidationError::new(field, format!("is longer than {MAX_EXTERNAL_ID_CHARS} characters")));
    }
    let ok = value.split_once(':').is_some_and(|(scheme, rest)| !scheme.is_empty() && !rest.is_empty())
        && value.chars().all(|c| c.is_ascii_graphic());
    if !ok {
        return Err(ValidationError::new(field, format!("must look like scheme:value (e.g. tmdb:603), got {value:?}")));
    }
    Ok(Some(value.to_owned()))
}

/// An ActivityPub id: an absolute `https://` (or `http://`) URI without spaces, in one spelling
/// of what is case-insensitive in it: its scheme and host lower-cased, and the scheme's default
/// port dropped (`HTTPS://Mastodon.Social:443/users/Bob` is `https://mastodon.social/users/Bob`,
/// as the server itself names it), so a follow typed either way is the one its Accept names.
pub fn uri(field: &str, value: &str) -> Result<String, ValidationError> {
    if value.is_empty() {
        return Err(ValidationError::new(field, "is required"));
    }
    if chars(value) > MAX_URI_CHARS {
        return Err(ValidationError::new(field, format!("is longer than {MAX_URI_CHARS} characters")));
    }
    let parts = value.split_once("://").and_then(|(scheme, rest)| {
        let scheme = scheme.to_ascii_lowercase();
        let default_port = match scheme.as_str() {
            "https" => ":443",
            "http" => ":80",
            _ => return None,
        };
        let (authority, tail) = rest.split_at(rest.find(['/', '?', '#']).unwrap_or(rest.len()));
        let authority = authority.to_ascii_lowercase();
        let authority = authority.strip_suffix(default_port).unwrap_or(&authority).to_owned();
        Some((scheme, authority, tail))
    });
    match parts {
        Some((scheme, authority, tail)) if !authority.is_empty() && value.chars().all(|c| c.is_ascii_graphic()) => {
            Ok(format!("{scheme}://{authority}{tail}"))
        }
        _ => Err(ValidationError::new(field, format!("must be an absolute http(s) URI, got {value:?}"))),
    }
}

/// A key in object storage: a relative path of `A-Z a-z 0-9 / . _ -`, at most 500 bytes, with no
/// empty, `.` or `..` segment.
pub fn object_key(field: &str, value: &str) -> Result<String, ValidationError> {
    let charset = value.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'/' | b'.' | b'_' | b'-'));
    let segments = value.split('/').all(|seg| !seg.is_empty() && seg != "." && seg != "..");
    if value.is_empty() || value.len() > 500 || !charset || !segments {
        return Err(ValidationError::new(
            field,
            format!("must be a relative object key such as wrapups/<id>/card.svg, got {value:?}"),
        ));
    }
    Ok(value.to_owned())
}

/// The proleptic Gregorian `(year, month, day)` of a count of days since 1970-01-01 (Howard
/// Hinnant's civil-from-days).
pub fn civil_from_days(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    (yoe + era * 400 + i64::from(month <= 2), month, day)
}

/// 0 means the default page size; more than the maximum is an error rather than a silent clamp.
pub fn page_size(value: u32) -> Result<u32, ValidationError> {
    match value {
        0 => Ok(DEFAULT_PAGE_SIZE),
        1..=MAX_PAGE_SIZE => Ok(value),
        _ => Err(ValidationError::new("page_size", format!("must be at most {MAX_PAGE_SIZE}, got {value}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_rules_name_the_field() {
        assert_eq!(required_text("title", "  Alien ", 10).unwrap(), "Alien");
        assert_eq!(required_text("title", "   ", 10).unwrap_err().field, "title");
        assert!(required_text("title", "abcdefghijk", 10).unwrap_err().reason.contains("longer"));
        assert!(required_text("title", "a\u{0}b", 10).is_err());
        for blank in ["\u{200B}", " \u{FEFF}\u{2060} ", "\u{3164}", "\u{2800}"] {
            let error = required_text("display_name", blank, 10).unwrap_err();
            assert!(error.reason.contains("no visible character"), "{blank:?}: {error:?}");
        }
        assert!(required_text("display_name", "\u{202E}evil", 10).unwrap_err().reason.contains("bidirectional"));
        assert_eq!(required_text("title", "Ame\u{301}lie", 10).unwrap(), "Am\u{E9}lie");
        // A joiner inside an emoji sequence is kept: it is part of what is drawn.
        assert_eq!(required_text("display_name", "Ana \u{1F469}\u{200D}\u{1F4BB}", 10).unwrap().chars().count(), 7);
        assert!(body("body", "line one\nline two").is_ok());
        // A line or paragraph separator breaks a line without being a control character.
        assert!(required_text("display_name", "Ana\u{2028}Admin", 20).unwrap_err().reason.contains("one line"));
        assert!(body("body", "one\u{2029}two").is_ok());
        assert_eq!(fitted_text("Ana\u{2029}Admin", 20).as_deref(), Some("Ana Admin"));
        assert!(body("body", &"x".repeat(MAX_BODY_CHARS + 1)).is_err());
    }

    #[test]
    fn a_watch_date_is_not_after_today_anywhere() {
        // 2024-02-29 10:00 UTC: already 2024-03-01 in UTC+14, not yet 03-02 anywhere.
        let now = 1_709_200_800_000;
        assert_eq!(date_at(now), "2024-02-29");
        assert_eq!(latest_date(now), "2024-03-01");
        assert_eq!(latest_year(now), 2024);
        assert_eq!(latest_year(1_704_016_800_000), 2024, "2023-12-31 10:00 UTC is 2024 in UTC+14");
        assert_eq!(watch_date("watched_on", "2024-03-01", now).unwrap(), "2024-03-01");
        assert_eq!(watch_date("watched_on", "", now).unwrap(), "");
        let late = watch_date("watched_on", "2024-03-02", now).unwrap_err();
        assert_eq!(late.field, "watched_on");
        assert!(late.reason.contains("future"), "{}", late.reason);
    }

    #[test]
    fn dates_and_keys() {
        let date_of_ms = |ms: i64| civil_from_days(ms.div_euclid(86_400_000));
        assert_eq!(date_of_ms(0), (1970, 1, 1));
        assert_eq!(date_of_ms(1_709_251_199_999), (2024, 2, 29));
        assert_eq!(date_of_ms(1_735_689_600_000), (2025, 1, 1));
        assert!(object_key("k", "wrapups/abc/card.svg").is_ok());
        for bad in ["", "/abs", "a//b", "a/../b", "a b", "x/."] {
            assert!(object_key("k", bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn handles() {
        assert!(handle("ana_1").is_ok());
        assert!(handle("Ana").is_err());
        assert!(handle("").is_err());
        assert!(handle(&"a".repeat(31)).is_err());
    }

    #[test]
    fn dates() {
        assert!(date("watched_on", "2024-02-29").is_ok());
        assert!(date("watched_on", "2023-02-29").is_err());
        assert!(date("watched_on", "2023-13-01").is_err());
        assert!(date("watched_on", "23-01-01").is_err());
        for signed in ["2024-+1-05", "+024-01-05", "2024-01-+5"] {
            assert!(date("watched_on", signed).is_err(), "{signed}");
        }
        assert_eq!(date("watched_on", "").unwrap(), "");
    }

    #[test]
    fn numbers_and_ids() {
        assert!(rating("rating", 10).is_ok());
        assert_eq!(rating("rating", 11).unwrap_err().field, "rating");
        assert!(year("year", 1999).is_ok());
        assert!(year("year", 1700).is_err());
        assert_eq!(external_id("external_id", "tmdb:603").unwrap().as_deref(), Some("tmdb:603"));
        assert!(external_id("external_id", "603").is_err());
        assert!(uri("actor_uri", "https://example.social/users/ana").is_ok());
        assert!(uri("actor_uri", "ftp://x").is_err());
        for (typed, stored) in [
            ("HTTPS://Mastodon.Social:443/users/Bob", "https://mastodon.social/users/Bob"),
            ("http://Peer.Example:80?Q#F", "http://peer.example?Q#F"),
            ("https://peer.example:8443/users/a", "https://peer.example:8443/users/a"),
            ("https://[::1]:443/u", "https://[::1]/u"),
        ] {
            assert_eq!(uri("actor_uri", typed).unwrap(), stored, "{typed}");
        }
        for refused in ["https://", "https:///users/a", "https://:443/a", "https://a b/c", "mailto:a@b"] {
            assert!(uri("actor_uri", refused).is_err(), "{refused}");
        }
        assert_eq!(page_size(0).unwrap(), DEFAULT_PAGE_SIZE);
        assert!(page_size(MAX_PAGE_SIZE + 1).is_err());
        assert_eq!(title_key("  The   Thing "), "the thing");
        assert_eq!(title_key("Heat\u{200B}"), title_key("heat"));
        assert_eq!(title_key("Ame\u{301}lie"), title_key("Am\u{E9}lie"));
    }
}
