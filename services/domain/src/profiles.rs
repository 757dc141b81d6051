//! The limits of a film's profile and of the people it credits, shared by the write API (which
//! refuses what is outside them in `Movies.SaveEnrichment` and `Movies.SavePeople`) and the
//! enrichment handlers (which bring a provider's answer within them first: a provider's odd
//! entry, a days-long art film or a name with a control character in it, is not a reason to
//! leave a film unenriched for good).

/// The longest runtime taken, in minutes (a longer one is no runtime at all).
pub const MAX_RUNTIME_MINUTES: u32 = 2_000;
/// Most directors, and most cast members, one profile lists.
pub const MAX_CREDITS: usize = 500;
/// Most genres one profile lists.
pub const MAX_GENRES: usize = 50;
/// The longest overview, in characters.
pub const MAX_OVERVIEW_CHARS: usize = 10_000;
/// The longest name of a person, in characters.
pub const MAX_NAME_CHARS: usize = 300;
/// Most people one `SavePeople` call takes.
pub const MAX_PEOPLE: usize = 1_000;
/// The longest biography, in characters.
pub const MAX_BIOGRAPHY_CHARS: usize = 20_000;
/// The longest place of birth, in characters.
pub const MAX_PLACE_CHARS: usize = 300;
/// Most films a person is listed as known for, and the longest entry ("Title (year)").
pub const MAX_KNOWN_FOR: usize = 50;
pub const MAX_KNOWN_FOR_CHARS: usize = 400;

/// The longest person id, in bytes.
pub const MAX_PERSON_ID_BYTES: usize = 200;

/// Whether `id` is a person id as profiles carry it: `<provider>:<id>`, at most
/// [`MAX_PERSON_ID_BYTES`].
pub fn person_id_shaped(id: &str) -> bool {
    !id.is_empty() && id.len() <= MAX_PERSON_ID_BYTES && id.contains(':')
}

/// Whether `value` is a birthday as profiles carry it: empty, or a day of the calendar as
/// `YYYY-MM-DD` (any year: people credited in old films were born before the years reviews may
/// name).
pub fn birthday_shaped(value: &str) -> bool {
    let bytes = value.as_bytes();
    let shaped = bytes.len() == 10
        && bytes.iter().enumerate().all(|(n, b)| if n == 4 || n == 7 { *b == b'-' } else { b.is_ascii_digit() });
    if !shaped {
        return value.is_empty();
    }
    let number = |range: std::ops::Range<usize>| value[range].parse::<u32>().unwrap_or(0);
    let (year, month, day) = (number(0..4), number(5..7), number(8..10));
    let leap = year % 4 == 0 && (year % 100 != 0 || year % 400 == 0);
    let days = match month {
        1 | 3 | 5 | 7 | 8 | 10 | 12 => 31,
        4 | 6 | 9 | 11 => 30,
        2 if leap => 29,
        2 => 28,
        _ => 0,
    };
    (1..=days).contains(&day)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_birthday_is_a_day_of_the_calendar() {
        for day in ["", "1950-06-06", "1896-02-29", "2000-02-29", "0001-12-31"] {
            assert!(birthday_shaped(day), "{day}");
        }
        for not in ["June 1950", "1950-6-6", "1950-02-30", "1900-02-29", "1950-13-01", "1950-00-10", "1950-01-00"] {
            assert!(!birthday_shaped(not), "{not}");
        }
    }
}
