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
