//! The timestamps ActivityPub carries: RFC 3339 in documents, IMF-fixdate in `Date` headers.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// `2024-05-01T12:00:00Z` for milliseconds since the epoch (UTC, whole seconds).
pub fn rfc3339(ms: i64) -> String {
    rfc3339_with(ms, false)
}

/// [`rfc3339`] with milliseconds (`2024-05-01T12:00:00.250Z`): for an edit's `updated`, so two
/// edits within a second keep their order.
pub fn rfc3339_ms(ms: i64) -> String {
    rfc3339_with(ms, true)
}

fn rfc3339_with(ms: i64, millis: bool) -> String {
    let secs = ms.div_euclid(1000);
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    let (year, month, day) = reelay_domain::validate::civil_from_days(days);
    let fraction = if millis { format!(".{:03}", ms.rem_euclid(1000)) } else { String::new() };
    format!("{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}{fraction}Z", rem / 3600, rem % 3600 / 60, rem % 60)
}

/// Milliseconds since the epoch of an RFC 3339 timestamp (`Z` or a `±hh:mm` offset, optional
/// fractional seconds); `None` when it is not one.
pub fn parse_rfc3339(value: &str) -> Option<i64> {
    let b = value.as_bytes();
    if b.len() < 20 || b[4] != b'-' || b[7] != b'-' || !matches!(b[10], b'T' | b't') || b[13] != b':' || b[16] != b':' {
        return None;
    }
    let num = |r: std::ops::Range<usize>| value.get(r)?.parse::<i64>().ok();
    let (year, month, day) = (num(0..4)?, num(5..7)?, num(8..10)?);
    let (hour, minute, second) = (num(11..13)?, num(14..16)?, num(17..19)?);
    if !(1..=12).contains(&month) || !(1..=31).contains(&day) || hour > 23 || minute > 59 || second > 60 {
        return None;
    }
    let mut rest = &value[19..];
    let mut millis = 0;
    if let Some(fraction) = rest.strip_prefix('.') {
        let digits = fraction.bytes().take_while(u8::is_ascii_digit).count();
        if digits == 0 {
            return None;
        }
        let ms: String = fraction[..digits].chars().chain("000".chars()).take(3).collect();
        millis = ms.parse::<i64>().ok()?;
        rest = &fraction[digits..];
    }
    let offset = match rest {
        "Z" | "z" => 0,
        // By bytes: the text is untrusted, and a slice inside a character would panic.
        _ if rest.len() == 6 && matches!(rest.as_bytes()[0], b'+' | b'-') && rest.as_bytes()[3] == b':' => {
            let minutes = rest.get(1..3)?.parse::<i64>().ok()? * 60 + rest.get(4..6)?.parse::<i64>().ok()?;
            if rest.as_bytes()[0] == b'+' { minutes } else { -minutes }
        }
        _ => return None,
    };
    // days_from_civil
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = if month > 2 { month - 3 } else { month + 9 };
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    Some(((days * 86_400 + hour * 3600 + minute * 60 + second - offset * 60) * 1000) + millis)
}

/// The `Date` header value for now.
pub fn http_date_now() -> String {
    httpdate::fmt_http_date(SystemTime::now())
}

/// Seconds between a `Date` header value and now (positive when the date is in the past);
/// `None` when it is not an HTTP date.
pub fn http_date_age_secs(value: &str) -> Option<i64> {
    let date = httpdate::parse_http_date(value).ok()?;
    let now = SystemTime::now();
    Some(match now.duration_since(date) {
        Ok(past) => past.as_secs() as i64,
        Err(future) => -(future.duration().as_secs() as i64),
    })
}

/// Milliseconds since the epoch, now.
pub fn now_ms() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or(Duration::ZERO).as_millis() as i64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc3339_round_trips() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(951_782_400_000), "2000-02-29T00:00:00Z");
        assert_eq!(parse_rfc3339("2000-02-29T00:00:00Z"), Some(951_782_400_000));
        assert_eq!(parse_rfc3339("2000-02-29T01:00:00.250+01:00"), Some(951_782_400_250));
        assert_eq!(parse_rfc3339(&rfc3339(1_717_000_123_000)), Some(1_717_000_123_000));
        assert_eq!(parse_rfc3339("yesterday"), None);
        let edited = rfc3339_ms(1_717_000_123_045);
        assert_eq!(edited, "2024-05-29T16:28:43.045Z");
        assert_eq!(parse_rfc3339(&edited), Some(1_717_000_123_045));
    }

    #[test]
    fn a_timestamp_with_other_characters_where_the_offset_goes_is_none() {
        // Six bytes after the seconds, but not an offset: a remote document's text, refused
        // (it used to panic, slicing inside the character).
        for value in
            ["2024-05-01T12:00:00\u{e9}1234", "2024-05-01T12:00:00+\u{e9}:12", "2024-05-01T12:00:00\u{e9}\u{e9}\u{e9}"]
        {
            assert_eq!(parse_rfc3339(value), None, "{value}");
        }
        assert_eq!(parse_rfc3339("2024-05-01T12:00:00.5\u{e9}"), None);
    }
}
