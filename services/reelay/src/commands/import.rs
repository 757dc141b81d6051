//! `reelay import letterboxd <export.zip | file.csv> --user <id>`: brings a Letterboxd export
//! in. From the zip Letterboxd hands its users: the diary (`diary.csv`) with each review's text
//! (`reviews.csv`) attached to its diary entry, and the watchlist (`watchlist.csv`). A plain
//! CSV is imported as a diary when it has a diary's columns (`Watched Date` or `Review`), as the
//! watchlist when it is named `watchlist.csv`, and refused otherwise. Every file is checked
//! before anything is sent (errors name the file, line and column); re-importing a newer export
//! adds only what is new (diary entries are keyed by their Letterboxd URI, a film already on the
//! watchlist stays as it is, and an entry deleted in Reelay stays deleted, from migration 0133
//! on), and an entry imported before without its review text or rating gets them from a later
//! file (the diary.csv first, its reviews.csv after); what an entry has is never overwritten. A
//! row with no year (Letterboxd has some films without one) is named and left out.

use std::io::{IsTerminal, Read, Write};
use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use clap::{Args, Subcommand};
use reelay_contracts::v1::{self, integrations_client::IntegrationsClient, watchlist_client::WatchlistClient};
use reelay_domain::letterboxd;
use reelay_kit::client::ServiceChannel;

use super::{ClientArgs, MAX_INPUT_FILE_BYTES, call_failed, errln, movie_by_title, outln, read_file};

/// Diary rows per ImportDiary call (the server commits this many per transaction too), so the
/// progress bar moves as rows are written.
const ROWS_PER_CALL: usize = 250;

#[derive(Debug, Subcommand)]
pub enum ImportCommand {
    /// A Letterboxd export: the zip from Settings → Import & Export, or one of its CSV files.
    Letterboxd(LetterboxdArgs),
}

#[derive(Debug, Args)]
pub struct LetterboxdArgs {
    /// The export zip, or its diary.csv, reviews.csv or watchlist.csv.
    pub path: PathBuf,

    /// The user to import into (as `reelay users create` printed it).
    #[arg(long)]
    pub user: String,

    #[command(flatten)]
    pub client: ClientArgs,
}

/// The parts of an export Reelay imports.
#[derive(Debug, Default)]
struct Export {
    /// The diary with the reviews attached, as one CSV.
    diary: Option<Vec<u8>>,
    /// The watchlist as checked (parsed once).
    watchlist: Option<letterboxd::Parsed>,
}

pub async fn run(command: ImportCommand) -> anyhow::Result<()> {
    let ImportCommand::Letterboxd(args) = command;
    let export = read_export(&args.path)?;
    let channel = args.client.write()?;
    let mut summary = Vec::new();
    if let Some(diary) = &export.diary {
        summary.push(import_diary(channel.clone(), &args.user, diary).await?);
    }
    if let Some(watchlist) = &export.watchlist {
        let imported = import_watchlist(channel, &args.user, watchlist).await;
        // What was imported before it stays: say so.
        summary.push(imported.map_err(|e| match summary.first() {
            Some(diary) => e.context(format!("the diary was imported ({diary}); the watchlist was not finished")),
            None => e,
        })?);
    }
    outln!("imported {}: {}", args.path.display(), summary.join("; "));
    Ok(())
}

/// Reads and checks an export (zip or CSV).
fn read_export(path: &Path) -> anyhow::Result<Export> {
    let data = read_file(path)?;
    if !data.starts_with(b"PK\x03\x04") {
        let name = path.display().to_string();
        let parsed = checked(&name, &data)?;
        say_left_out(&name, &parsed, true);
        let named = path.file_name().and_then(|n| n.to_str()).unwrap_or_default().to_lowercase();
        if named == "watchlist.csv" {
            return Ok(Export { diary: None, watchlist: Some(parsed) });
        }
        // The export's other lists (watchlist, ratings, watched, likes) share the diary's first
        // columns; imported as a diary, each film on them would become a viewing.
        if !letterboxd::is_diary(&data) {
            bail!(
                "{}: no Watched Date or Review column, so not a diary (the export's watchlist, ratings and watched lists name films, not viewings): import the export's zip, its diary.csv or reviews.csv, or its watchlist.csv under that name",
                path.display()
            );
        }
        return Ok(Export { diary: Some(data), watchlist: None });
    }
    let mut archive = zip::ZipArchive::new(std::io::Cursor::new(data))
        .with_context(|| format!("{} is not a readable zip", path.display()))?;
    // At the root (or under one folder, for a re-zipped export); never deleted/ or orphaned/.
    let mut file = |name: &str| -> anyhow::Result<Option<(Vec<u8>, letterboxd::Parsed)>> {
        let wanted = |path: &str| {
            let parts: Vec<&str> = path.split('/').collect();
            parts.last() == Some(&name)
                && parts.len() <= 2
                && !parts.iter().any(|p| matches!(*p, "deleted" | "orphaned"))
        };
        let index =
            (0..archive.len()).find(|&i| archive.name_for_index(i).and_then(Result::ok).is_some_and(|n| wanted(&n)));
        let Some(index) = index else { return Ok(None) };
        let entry = archive.by_index(index).with_context(|| format!("cannot read {name} in the zip"))?;
        let bytes = read_capped(entry, MAX_INPUT_FILE_BYTES, name)?;
        let parsed = checked(name, &bytes)?;
        Ok(Some((bytes, parsed)))
    };
    let (diary, reviews, watchlist) = (file("diary.csv")?, file("reviews.csv")?, file("watchlist.csv")?);
    // Rows left out are named once each: those of the diary joined with its reviews by title
    // (its lines are neither file's), those of one file alone by line.
    let diary = match (diary, reviews) {
        (Some((diary, _)), Some((reviews, _))) => {
            let joined = letterboxd::attach_reviews(&diary, &reviews)
                .map_err(|e| anyhow::anyhow!("diary.csv with reviews.csv: {e}"))?;
            say_left_out("diary.csv with reviews.csv", &checked("diary.csv with reviews.csv", &joined)?, false);
            Some(joined)
        }
        (one, other) => {
            let name = if one.is_some() { "diary.csv" } else { "reviews.csv" };
            one.or(other).map(|(bytes, parsed)| {
                say_left_out(name, &parsed, true);
                bytes
            })
        }
    };
    let watchlist = watchlist.map(|(_, parsed)| {
        say_left_out("watchlist.csv", &parsed, true);
        parsed
    });
    if diary.is_none() && watchlist.is_none() {
        bail!("{} has no diary.csv, reviews.csv or watchlist.csv: is it a Letterboxd export?", path.display());
    }
    Ok(Export { diary, watchlist })
}

/// Reads `reader` to its end, refusing it past `cap` bytes without reading more than one byte
/// beyond (a zip entry's decompressed size is whatever its bytes make it: a zip bomb).
fn read_capped(reader: impl Read, cap: u64, name: &str) -> anyhow::Result<Vec<u8>> {
    let mut bytes = Vec::new();
    reader.take(cap + 1).read_to_end(&mut bytes).with_context(|| format!("cannot read {name} in the zip"))?;
    if bytes.len() as u64 > cap {
        bail!("{name} in the zip is over {cap} bytes once decompressed: not a Letterboxd export");
    }
    Ok(bytes)
}

/// Parses a file as the server will, so a bad row is reported with its file before anything
/// is sent.
fn checked(name: &str, data: &[u8]) -> anyhow::Result<letterboxd::Parsed> {
    letterboxd::parse(data, reelay_kit::now_ms()).map_err(|e| anyhow::anyhow!("{name}: {}: {}", e.field, e.reason))
}

/// Names on stderr the rows of `name` left out for want of a year (the first few), by `line`
/// when its lines are the file's.
fn say_left_out(name: &str, parsed: &letterboxd::Parsed, line: bool) {
    const NAMED: usize = 5;
    let left_out = &parsed.without_year;
    if left_out.is_empty() {
        return;
    }
    let mut named: Vec<String> = left_out
        .iter()
        .take(NAMED)
        .map(|r| if line { format!("line {}: {}", r.line, r.title) } else { r.title.clone() })
        .collect();
    if left_out.len() > NAMED {
        named.push(format!("{} more", left_out.len() - NAMED));
    }
    errln!(
        "{name}: {} row(s) name no year and are left out, as no film can be found without one ({})",
        left_out.len(),
        named.join("; ")
    );
}

/// The closing words on rows left out for want of a year, if any were.
fn left_out(without_year: usize) -> String {
    if without_year == 0 { String::new() } else { format!(", {without_year} left out for naming no year") }
}

async fn import_diary(channel: ServiceChannel, user: &str, diary: &[u8]) -> anyhow::Result<String> {
    let mut integrations = IntegrationsClient::new(channel);
    let mut reader = csv::Reader::from_reader(diary);
    let header = reader.byte_headers().context("diary header")?.clone();
    let records: Vec<csv::ByteRecord> =
        reader.byte_records().collect::<Result<_, _>>().context("diary rows (checked above)")?;
    let mut progress = Progress::new("diary", records.len());
    let (mut imported, mut skipped, mut discovered, mut completed, mut without_year) = (0, 0, 0, 0, 0);
    for batch in records.chunks(ROWS_PER_CALL) {
        let mut writer = csv::Writer::from_writer(Vec::new());
        writer.write_byte_record(&header)?;
        for record in batch {
            writer.write_byte_record(record)?;
        }
        let data = writer.into_inner().map_err(|e| anyhow::anyhow!("{e}"))?;
        let chunks: Vec<v1::ImportDiaryChunk> = data
            .chunks(64 * 1024)
            .enumerate()
            .map(|(i, data)| v1::ImportDiaryChunk {
                actor_user_id: if i == 0 { user.to_owned() } else { String::new() },
                data: data.to_vec(),
                request_id: String::new(),
            })
            .collect();
        let answer = match integrations.import_diary(tonic::codegen::tokio_stream::iter(chunks)).await {
            Ok(answer) => answer.into_inner(),
            Err(status) => {
                // Each call commits its rows: those sent before this one are in.
                let written = progress.done;
                progress.finish();
                let next = match status.code() {
                    tonic::Code::NotFound => "check --user (the id `reelay users create` printed)",
                    tonic::Code::InvalidArgument | tonic::Code::FailedPrecondition => {
                        "fix what the message names; running the command again then skips rows already imported"
                    }
                    tonic::Code::Unauthenticated | tonic::Code::PermissionDenied => {
                        "set the service token (REELAY_SERVICE_TOKEN or REELAY_SERVICE_TOKEN_FILE)"
                    }
                    _ => "running the same command again is safe: rows already imported are skipped",
                };
                return Err(call_failed("importing the diary", status).context(format!(
                    "{written} of {} diary rows were written before it ({imported} entries added, {skipped} already imported); {next}",
                    records.len()
                )));
            }
        };
        imported += answer.imported;
        skipped += answer.skipped_duplicates;
        discovered += answer.movies_discovered;
        completed += answer.completed;
        without_year += answer.skipped_without_year;
        progress.advance(batch.len());
    }
    progress.finish();
    let completed = if completed > 0 {
        format!(" ({completed} given the review text or rating they lacked)")
    } else {
        String::new()
    };
    Ok(format!(
        "diary: {imported} entries added, {skipped} already imported{completed}, {discovered} films new to Reelay{}",
        left_out(without_year as usize)
    ))
}

async fn import_watchlist(
    channel: ServiceChannel,
    user: &str,
    watchlist: &letterboxd::Parsed,
) -> anyhow::Result<String> {
    let (rows, without_year) = (&watchlist.rows, watchlist.without_year.len());
    let mut client = WatchlistClient::new(channel);
    // What is on the watchlist already, to tell new entries from ones that stay as they were.
    let mut before = std::collections::HashSet::new();
    let mut page_token = String::new();
    loop {
        let page = client
            .list_watchlist(v1::ListWatchlistRequest { user_id: user.to_owned(), page_size: 200, page_token })
            .await
            .map_err(|s| call_failed("reading the watchlist", s))?
            .into_inner();
        before.extend(page.entries.into_iter().map(|e| e.movie_id));
        if page.next_page_token.is_empty() {
            break;
        }
        page_token = page.next_page_token;
    }
    let mut progress = Progress::new("watchlist", rows.len());
    let (mut added, mut already) = (0, 0);
    for row in rows {
        let movie = movie_by_title(&row.title, row.year);
        let entry = client
            .add_to_watchlist(v1::AddToWatchlistRequest {
                actor_user_id: user.to_owned(),
                movie: Some(movie),
                request_id: String::new(),
            })
            .await
            .map_err(|s| {
                call_failed(&format!("watchlist.csv: line {}: adding {} ({})", row.line, row.title, row.year), s)
                    .context(format!(
                        "{added} films were added to the watchlist before it; running the same command again is safe"
                    ))
            })?
            .into_inner();
        if before.insert(entry.movie_id) {
            added += 1
        } else {
            already += 1
        }
        progress.advance(1);
    }
    progress.finish();
    Ok(format!("watchlist: {added} films added, {already} already on it{}", left_out(without_year)))
}

/// A progress bar on stderr when it is a terminal; a closing line either way.
struct Progress {
    label: &'static str,
    total: usize,
    done: usize,
    terminal: bool,
}

impl Progress {
    fn new(label: &'static str, total: usize) -> Self {
        let progress = Self { label, total, done: 0, terminal: std::io::stderr().is_terminal() };
        progress.draw();
        progress
    }

    fn advance(&mut self, by: usize) {
        self.done = (self.done + by).min(self.total);
        self.draw();
    }

    fn draw(&self) {
        if !self.terminal {
            return;
        }
        const WIDTH: usize = 30;
        let filled = (self.done * WIDTH).checked_div(self.total).unwrap_or(WIDTH);
        let mut stderr = std::io::stderr();
        let _ = write!(
            stderr,
            "\r{:<10} [{}{}] {}/{}",
            self.label,
            "#".repeat(filled),
            " ".repeat(WIDTH - filled),
            self.done,
            self.total
        );
        let _ = stderr.flush();
    }

    fn finish(self) {
        if self.terminal {
            errln!();
        } else {
            errln!("{}: {}/{} rows", self.label, self.done, self.total);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_zip_entry_is_read_up_to_the_cap() {
        assert_eq!(read_capped(std::io::repeat(7).take(10), 10, "diary.csv").unwrap().len(), 10);
        let over = read_capped(std::io::repeat(0), 10, "diary.csv").unwrap_err().to_string();
        assert!(over.contains("diary.csv in the zip is over 10 bytes"), "{over}");
    }
}
