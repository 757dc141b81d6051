//! The wrap-up card: the year's figures drawn as an SVG image (1080×1350, the portrait format
//! people share), with a month-by-month bar chart. Deterministic: the same figures draw the
//! same bytes, so redrawing on a redelivery stores an identical object.

use std::fmt::Write;

use reelay_contracts::v1;

pub const WIDTH: u32 = 1080;
pub const HEIGHT: u32 = 1350;
pub const CONTENT_TYPE: &str = "image/svg+xml";

const MONTHS: [&str; 12] = ["J", "F", "M", "A", "M", "J", "J", "A", "S", "O", "N", "D"];

/// Text made safe inside an XML element or attribute.
fn xml(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            // Not characters XML 1.0 allows (a title may hold them): the card would not parse.
            c if c.is_control() || matches!(c, '\u{FFFE}' | '\u{FFFF}') => {}
            c => out.push(c),
        }
    }
    out
}

fn stars(half_stars: f64) -> String {
    format!("{:.1}★", half_stars / 2.0)
}

/// The most characters of a name or title drawn in a list row; a longer one ends in "…".
const MAX_NAME_CHARS: usize = 40;

/// A name or title as a list row holds it: at most [`MAX_NAME_CHARS`], isolated from the
/// figures around it (a right-to-left title would otherwise take the year and rating beside it
/// into its own direction, and draw them in the wrong order). Isolates of its own (U+2066 to
/// U+2069) are dropped: one would close the isolation early, or open one left unclosed.
fn isolated(name: &str) -> String {
    let name: String = name.chars().filter(|c| !('\u{2066}'..='\u{2069}').contains(c)).collect();
    let mut short: String = name.chars().take(MAX_NAME_CHARS).collect();
    if name.chars().count() > MAX_NAME_CHARS {
        short = format!("{}…", short.trim_end());
    }
    format!("\u{2068}{short}\u{2069}")
}

/// A list column's width, and about how wide a character of its 28-pixel text is.
const COLUMN_WIDTH: usize = 400;
const CHAR_WIDTH: usize = 15;

/// The card of `year`'s `summary`.
pub fn render(year: i32, summary: &v1::WrapUpSummary) -> String {
    let mut svg = String::new();
    let _ = write!(
        svg,
        r##"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" font-family="Helvetica, Arial, sans-serif">"##
    );
    svg.push_str(r##"<rect width="100%" height="100%" fill="#14181c"/>"##);
    let _ =
        write!(svg, r##"<text x="80" y="140" font-size="72" font-weight="bold" fill="#ffffff">{year} in film</text>"##);
    let hours = f64::from(summary.minutes_watched) / 60.0;
    let figures = [
        ("films", summary.films.to_string()),
        ("hours", format!("{hours:.0}")),
        ("rewatches", summary.rewatches.to_string()),
        ("average", if summary.mean_rating > 0.0 { stars(summary.mean_rating) } else { "—".into() }),
    ];
    for (i, (label, value)) in figures.iter().enumerate() {
        let x = 80 + i as u32 * 240;
        let _ = write!(
            svg,
            r##"<text x="{x}" y="290" font-size="64" font-weight="bold" fill="#00e054" class="figure" data-label="{label}">{}</text><text x="{x}" y="330" font-size="28" fill="#9ab">{label}</text>"##,
            xml(value)
        );
    }
    // Month by month.
    let (chart_x, chart_bottom, chart_height, bar_width) = (80u32, 760u32, 300u32, 60u32);
    let max = summary.per_month.iter().copied().max().unwrap_or(0).max(1);
    svg.push_str(r##"<text x="80" y="420" font-size="32" fill="#ffffff">Month by month</text>"##);
    for (i, count) in summary.per_month.iter().enumerate() {
        let height = count * chart_height / max;
        let x = chart_x + i as u32 * (bar_width + 18);
        let _ = write!(
            svg,
            r##"<rect class="month" x="{x}" y="{}" width="{bar_width}" height="{height}" fill="#40bcf4" data-count="{count}"/><text x="{}" y="{}" font-size="24" fill="#9ab" text-anchor="middle">{}</text>"##,
            chart_bottom - height,
            x + bar_width / 2,
            chart_bottom + 34,
            MONTHS[i]
        );
    }
    let list = |svg: &mut String, title: &str, y: u32, rows: Vec<String>| {
        let _ = write!(svg, r##"<text x="80" y="{y}" font-size="32" fill="#ffffff">{}</text>"##, xml(title));
        for (i, row) in rows.iter().enumerate() {
            // A row wider than its column is drawn narrower to fit, rather than into the next
            // column or off the card.
            let fit = if row.chars().count() * CHAR_WIDTH > COLUMN_WIDTH {
                format!(r##" textLength="{COLUMN_WIDTH}" lengthAdjust="spacingAndGlyphs""##)
            } else {
                String::new()
            };
            let _ = write!(
                svg,
                r##"<text x="80" y="{}" font-size="28" fill="#ccd"{fit}>{}</text>"##,
                y + 44 + i as u32 * 38,
                xml(row)
            );
        }
    };
    let genres = summary.top_genres.iter().map(|g| format!("{} · {}", isolated(&g.name), g.count)).collect();
    list(&mut svg, "Top genres", 880, genres);
    let best = summary
        .highest_rated
        .iter()
        .take(3)
        .map(|f| format!("{} ({}) {}", isolated(&f.title), f.year, stars(f64::from(f.rating))))
        .collect();
    let directors: Vec<String> =
        summary.top_directors.iter().take(3).map(|d| format!("{} · {}", isolated(&d.name), d.count)).collect();
    list(&mut svg, "Top directors", 1110, directors);
    // Best rated on the right half, beside the genres.
    let _ = write!(svg, r##"<g transform="translate(500 0)">"##);
    list(&mut svg, "Highest rated", 880, best);
    svg.push_str("</g></svg>\n");
    svg
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_and_draws_twelve_months() {
        let summary = v1::WrapUpSummary {
            films: 2,
            per_month: vec![1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 3],
            top_genres: vec![v1::NameCount { name: "Crime & <Drama>".into(), count: 2 }],
            ..Default::default()
        };
        let svg = render(2024, &summary);
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        assert_eq!(svg.matches(r#"class="month""#).count(), 12);
        assert!(svg.contains("Crime &amp; &lt;Drama&gt;") && !svg.contains("<Drama>"));
        assert_eq!(render(2024, &summary), svg, "deterministic");
    }

    /// A title XML cannot hold is dropped of what it cannot hold; a long one is shortened and
    /// fitted to its column; a right-to-left one is isolated from its year and rating.
    #[test]
    fn titles_stay_in_their_place() {
        let film = |title: &str| v1::RatedFilm { title: title.into(), year: 1964, rating: 10, ..Default::default() };
        let long = "Dr. Strangelove or: How I Learned to Stop Worrying and Love the Bomb";
        let summary = v1::WrapUpSummary {
            highest_rated: vec![film("Noise\u{FFFF}"), film(long), film("סיפור אהבה")],
            top_directors: vec![v1::NameCount { name: "\u{2069}Kurosawa\u{2067}".into(), count: 2 }],
            ..Default::default()
        };
        let svg = render(2024, &summary);
        assert!(!svg.contains('\u{FFFF}') && svg.contains("\u{2068}Noise\u{2069} (1964)"), "{svg}");
        let shortened: String = long.chars().take(MAX_NAME_CHARS).collect();
        let row = svg.lines().flat_map(|l| l.split("<text")).find(|t| t.contains(&shortened)).unwrap();
        assert!(row.contains(&format!("{}…\u{2069} (1964) 5.0★", shortened.trim_end())), "{row}");
        assert!(row.contains(r#"textLength="400""#), "fitted to its column: {row}");
        assert!(svg.contains("\u{2068}סיפור אהבה\u{2069} (1964) 5.0★"), "{svg}");
        // A name with isolates of its own cannot end the isolation early.
        assert!(svg.contains("\u{2068}Kurosawa\u{2069} · 2"), "{svg}");
    }
}
