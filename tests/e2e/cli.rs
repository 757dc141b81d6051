//! The binary is all a newcomer needs: the README's first command (`run --dev`, from an empty
//! directory, on the default addresses) and then its "Trying it" block, read from README.md
//! and run as written; and the Letterboxd import of an export-shaped zip, whose re-import of a
//! newer export adds only what is new. Bad input is refused with the file, line and field;
//! client flags no call could use are refused before any call, naming the flag.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use reelay_harness::{Reelay, events_of, eventually, query_strings, run_cli, temp_dir};

const BIN: &str = env!("CARGO_BIN_EXE_reelay");
const README: &str = include_str!("../../README.md");

/// The commands of the README's "Trying it" section: its first `sh` block.
fn try_it_block() -> Vec<String> {
    let section = README.split("## Trying it").nth(1).expect("README has a \"Trying it\" section");
    let block = section.split("```sh").nth(1).and_then(|b| b.split("```").next()).expect("an sh block");
    let mut commands = Vec::new();
    let mut current = String::new();
    for line in block.lines().map(str::trim_end).filter(|l| !l.trim().is_empty() && !l.trim_start().starts_with('#')) {
        current.push_str(line.trim_end_matches('\\'));
        if line.ends_with('\\') {
            current.push(' ');
        } else {
            commands.push(std::mem::take(&mut current));
        }
    }
    commands
}

/// The newcomer's first run: `reelay run --dev` in an empty directory (the README's first
/// command, built), then the README's CLI commands exactly as written, in one shell.
#[tokio::test]
async fn a_newcomers_first_run_follows_the_readme() {
    let dir = temp_dir();
    let bin_dir = Path::new(BIN).parent().unwrap().to_owned();
    let log = std::fs::File::create(dir.path().join("reelay.log")).unwrap();
    let server = std::process::Command::new(BIN)
        .args(["run", "--dev"])
        .current_dir(dir.path())
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .unwrap();
    struct Kill(std::process::Child, PathBuf);
    impl Drop for Kill {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
            if std::thread::panicking() {
                eprintln!("--- reelay run --dev ---\n{}", std::fs::read_to_string(&self.1).unwrap_or_default());
            }
        }
    }
    let mut server = Kill(server, dir.path().join("reelay.log"));
    // The README's ports are fixed: the one answering must be this process (not a leftover or
    // another checkout's run on this machine), so the commands below reach it.
    let pid = server.0.id();
    eventually("reelay run --dev is ready on the README's ports", Duration::from_secs(30), || async {
        reelay_harness::listens_on(pid, 9464)
            && reelay_harness::listens_on(pid, 50051)
            && reelay_harness::try_http_get("127.0.0.1:9464".parse().unwrap(), "/readyz")
                .await
                .is_some_and(|(code, _)| code == 200)
    })
    .await;
    assert!(dir.path().join("data/reelay.db").exists(), "the data lives in ./data");

    let commands = try_it_block();
    assert!(commands.iter().any(|c| c.contains("reelay users create")), "{commands:?}");
    // The search is eventual (a moment after the write): the shell retries it, as a person would.
    let script: Vec<String> = commands
        .iter()
        .map(|c| {
            if c.starts_with("reelay search") {
                format!("for i in $(seq 100); do out=$({c}) && case \"$out\" in *\"1 review(s) found\"*) break;; esac; sleep 0.1; done; echo \"$out\"")
            } else {
                c.clone()
            }
        })
        .collect();
    let output = tokio::process::Command::new("bash")
        .args(["-euo", "pipefail", "-c", &script.join("\n")])
        .current_dir(dir.path())
        .env_clear()
        .env("PATH", format!("{}:{}", bin_dir.display(), std::env::var("PATH").unwrap_or_default()))
        .env("USER", "newcomer")
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "the README's commands ran\nstdout: {stdout}\nstderr: {stderr}");
    assert!(stdout.contains("1 review(s) found") && stdout.contains("The diner scene."), "search found it: {stdout}");
    assert!(stdout.contains("HANDLER") && stdout.contains("search"), "status lists the handlers: {stdout}");
    assert!(stdout.contains("Heat (1995) — movie"), "movies show names the film: {stdout}");
    assert!(stdout.contains("1 films, 1 diary entries, 0 rewatches"), "the wrap-up counts the review: {stdout}");
    assert!(stdout.contains("card           http://127.0.0.1:50053/media/wrapups/"), "and gives its card: {stdout}");
    signal_term(&server.0);
    let status = tokio::task::spawn_blocking(move || server.0.wait()).await.unwrap().unwrap();
    assert!(status.success(), "reelay run --dev stops cleanly on SIGTERM");
}

/// Client flags and settings no call could use are refused before any call (no service runs
/// here), with exit 2 and the flag or variable named: a deadline of 0 (every call was
/// cancelled), a --limit the help does not allow (0 meant 100, 5000 was the service's error), a
/// --since before 1970 (it panicked, wrapped into the future, or reached the service as a
/// negative since_ms), a URL without a scheme (every call failed with "transport error").
#[test]
fn client_settings_no_call_could_use_are_refused_at_once() {
    let dead_letters = ["dead-letters", "list"];
    // The command line, a variable set for it, and what its refusal must name.
    type Case<'a> = (Vec<&'a str>, Option<(&'a str, &'a str)>, &'a [&'a str]);
    let cases: [Case; 10] = [
        (vec!["status", "--grpc-timeout-ms", "0"], None, &["--grpc-timeout-ms", "2000"]),
        (vec!["status"], Some(("REELAY_GRPC_TIMEOUT_MS", "0")), &["--grpc-timeout-ms", "2000"]),
        ([&dead_letters[..], &["--limit", "0"]].concat(), None, &["--limit", "1000"]),
        ([&dead_letters[..], &["--limit", "5000"]].concat(), None, &["--limit", "1000"]),
        ([&dead_letters[..], &["--since", "999999999999999d"]].concat(), None, &["--since", "too long"]),
        ([&dead_letters[..], &["--since", "200000000000d"]].concat(), None, &["--since", "1970"]),
        ([&dead_letters[..], &["--since", "30000d"]].concat(), None, &["--since", "1970"]),
        (vec!["status", "--write-url", "127.0.0.1:1"], None, &["REELAY_WRITE_URL", "\"127.0.0.1:1\"", "no scheme"]),
        // Nothing listens there: every try was refused, so nothing was sent, let alone written
        // (not "whether it was written cannot be told").
        (
            vec!["users", "create", "zed", "--write-url", "http://127.0.0.1:1"],
            None,
            &["refused every connection", "nothing was written"],
        ),
        (
            vec!["search", "reviews", "heat"],
            Some(("REELAY_HANDLERS_URL", "127.0.0.1:1")),
            &["REELAY_HANDLERS_URL", "\"127.0.0.1:1\"", "no scheme"],
        ),
    ];
    for (args, env, named) in cases {
        let mut command = std::process::Command::new(BIN);
        command.args(&args).env_remove("REELAY_GRPC_TIMEOUT_MS").env_remove("REELAY_HANDLERS_URL");
        if let Some((name, value)) = env {
            command.env(name, value);
        }
        let out = command.output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?} {env:?}: {stderr}");
        assert!(named.iter().all(|n| stderr.contains(n)), "{args:?} {env:?} names {named:?}: {stderr}");
    }
}

fn signal_term(child: &std::process::Child) {
    reelay_harness::signal(child.id(), "TERM");
}

/// An export shaped like Letterboxd's: a zip of CSVs, with `deleted/` and `likes/` folders
/// Reelay does not read.
fn export_zip(path: &Path, diary: &str, reviews: &str, watchlist: &str) {
    let file = std::fs::File::create(path).unwrap();
    let mut zip = zip::ZipWriter::new(file);
    let options = zip::write::SimpleFileOptions::default().compression_method(zip::CompressionMethod::Deflated);
    for (name, text) in [
        ("profile.csv", "Date Joined,Username\n2020-01-01,ana\n"),
        ("diary.csv", diary),
        ("reviews.csv", reviews),
        ("watchlist.csv", watchlist),
        ("ratings.csv", "Date,Name,Year,Letterboxd URI,Rating\n2021-01-04,Heat,1995,https://boxd.it/f1,5\n"),
        ("watched.csv", "Date,Name,Year,Letterboxd URI\n2021-01-04,Heat,1995,https://boxd.it/f1\n"),
        (
            "deleted/diary.csv",
            "Date,Name,Year,Letterboxd URI,Rating,Rewatch,Tags,Watched Date\n2020-01-01,Gone,2000,https://boxd.it/x,,,,\n",
        ),
        ("likes/films.csv", "Date,Name,Year,Letterboxd URI\n"),
    ] {
        zip.start_file(name, options).unwrap();
        zip.write_all(text.as_bytes()).unwrap();
    }
    zip.finish().unwrap();
}

const DIARY_HEADER: &str = "Date,Name,Year,Letterboxd URI,Rating,Rewatch,Tags,Watched Date\n";
const REVIEWS_HEADER: &str = "Date,Name,Year,Letterboxd URI,Rating,Rewatch,Review,Tags,Watched Date\n";
const WATCHLIST_HEADER: &str = "Date,Name,Year,Letterboxd URI\n";

#[tokio::test]
async fn a_letterboxd_zip_brings_the_diary_with_its_reviews_and_the_watchlist() {
    let dir = temp_dir();
    let reelay = Reelay::start_all(BIN, &dir.path().join("reelay.db"), &[]).await;
    let ana = reelay.cli(&["users", "create", "ana", "--name", "Ana"], &[]).await;
    let ana = ana.ok().trim().to_owned();

    let diary = format!(
        "{DIARY_HEADER}2021-01-04,Heat,1995,https://boxd.it/d1,5,,,2021-01-03\n\
         2021-01-05,Ida,2013,https://boxd.it/d2,4.5,,35mm,2021-01-05\n\
         2021-02-01,Heat,1995,https://boxd.it/d3,4.5,Yes,,2021-02-01\n\
         2021-02-02,Untitled Project,,https://boxd.it/d7,3,,,2021-02-02\n"
    );
    let reviews = format!(
        "{REVIEWS_HEADER}2021-01-04,Heat,1995,https://boxd.it/d1,5,,\"The diner scene, again.\",,2021-01-03\n\
         2021-01-05,Ida,2013,https://boxd.it/d2,4.5,,Quiet and exact.,,2021-01-05\n\
         2021-02-02,Untitled Project,,https://boxd.it/d7,3,,Not out yet.,,2021-02-02\n"
    );
    let watchlist =
        format!("{WATCHLIST_HEADER}2021-03-01,Alien,1979,https://boxd.it/w1\n2021-03-02,Ran,1985,https://boxd.it/w2\n");
    let first = dir.path().join("letterboxd-ana-2021-03-05.zip");
    export_zip(&first, &diary, &reviews, &watchlist);
    let imported = reelay.cli(&["import", "letterboxd", first.to_str().unwrap(), "--user", &ana], &[]).await;
    let out = imported.ok();
    let said = "diary: 3 entries added, 0 already imported, 2 films new to Reelay, 1 left out for naming no year";
    assert!(out.contains(said), "{out}");
    assert!(out.contains("watchlist: 2 films added, 0 already on it"), "{out}");
    assert!(imported.stderr.contains("diary: 4/4 rows"), "progress is reported: {}", imported.stderr);
    // The entry with no year is in both files, and named once, by its title.
    let named = "diary.csv with reviews.csv: 1 row(s) name no year and are left out, as no film can be found \
                 without one (Untitled Project)";
    assert_eq!(imported.stderr.matches(named).count(), 1, "{}", imported.stderr);

    let db = &reelay.database;
    let entries = query_strings(
        db,
        "SELECT m.title, r.rating || '', r.body, r.watched_on, r.rewatch || '' FROM reviews r JOIN movies m ON m.id = r.movie_id \
         ORDER BY r.watched_on",
    )
    .await;
    assert_eq!(
        entries,
        vec![
            vec!["Heat".to_owned(), "10".into(), "The diner scene, again.".into(), "2021-01-03".into(), "0".into()],
            vec!["Ida".to_owned(), "9".into(), "Quiet and exact.".into(), "2021-01-05".into(), "0".into()],
            vec!["Heat".to_owned(), "9".into(), String::new(), "2021-02-01".into(), "1".into()],
        ],
        "each review's text is on its own diary entry (same URI); nothing from deleted/"
    );
    let on_watchlist =
        query_strings(db, "SELECT m.title FROM watchlist w JOIN movies m ON m.id = w.movie_id ORDER BY m.title").await;
    assert_eq!(on_watchlist, vec![vec!["Alien".to_owned()], vec!["Ran".to_owned()]]);

    // A newer export: one more diary entry with a review, one more film on the watchlist.
    let newer_diary = format!("{diary}2021-03-10,Alien,1979,https://boxd.it/d4,4,,,2021-03-09\n");
    let newer_reviews = format!("{reviews}2021-03-10,Alien,1979,https://boxd.it/d4,4,,In space.,,2021-03-09\n");
    let newer_watchlist = format!("{watchlist}2021-03-11,Stalker,1979,https://boxd.it/w3\n");
    let second = dir.path().join("letterboxd-ana-2021-03-12.zip");
    export_zip(&second, &newer_diary, &newer_reviews, &newer_watchlist);
    let again = reelay.cli(&["import", "letterboxd", second.to_str().unwrap(), "--user", &ana], &[]).await;
    let out = again.ok();
    assert!(out.contains("diary: 1 entries added, 3 already imported, 0 films new to Reelay"), "{out}");
    assert!(out.contains("watchlist: 1 films added, 2 already on it"), "{out}");
    let reviews = query_strings(db, "SELECT COUNT(*) || '', SUM(body != '') || '' FROM reviews").await;
    assert_eq!(reviews, vec![vec!["4".to_owned(), "3".to_owned()]]);

    // A plain CSV is a diary too; bad rows name the file, the line and the column.
    let bad = dir.path().join("bad.zip");
    export_zip(
        &bad,
        &format!("{DIARY_HEADER}2021-01-04,Heat,95,https://boxd.it/d9,5,,,2021-01-03\n"),
        REVIEWS_HEADER,
        WATCHLIST_HEADER,
    );
    let refused = reelay.cli(&["import", "letterboxd", bad.to_str().unwrap(), "--user", &ana], &[]).await;
    assert!(!refused.success && refused.stderr.contains("diary.csv: data: line 2: Year"), "{}", refused.stderr);
    // The export's other lists share the diary's first columns: one is not taken for a diary
    // (its films would become viewings), and watchlist.csv alone is imported as the watchlist.
    let ratings = dir.path().join("ratings.csv");
    std::fs::write(&ratings, "Date,Name,Year,Letterboxd URI,Rating\n2021-01-04,Ran,1985,https://boxd.it/f2,5\n")
        .unwrap();
    let refused = reelay.cli(&["import", "letterboxd", ratings.to_str().unwrap(), "--user", &ana], &[]).await;
    assert!(!refused.success && refused.stderr.contains("not a diary"), "{}", refused.stderr);
    let loose = dir.path().join("watchlist.csv");
    std::fs::write(
        &loose,
        format!(
            "{WATCHLIST_HEADER}2021-03-20,Ran,1985,https://boxd.it/w2\n2021-03-21,Ida,2013,https://boxd.it/w4\n\
             2021-03-22,Untitled Project,,https://boxd.it/w5\n"
        ),
    )
    .unwrap();
    let imported = reelay.cli(&["import", "letterboxd", loose.to_str().unwrap(), "--user", &ana], &[]).await;
    let out = imported.ok();
    let said = "watchlist: 1 films added, 1 already on it, 1 left out for naming no year";
    assert!(out.contains(said) && !out.contains("diary"), "{out}");
    // A film Letterboxd has no year for is named and left out; the rest is imported.
    let named = "watchlist.csv: 1 row(s) name no year and are left out, as no film can be found without one \
                 (line 4: Untitled Project)";
    assert_eq!(imported.stderr.matches(named).count(), 1, "named once: {}", imported.stderr);
    let reviews = query_strings(db, "SELECT COUNT(*) || '' FROM reviews").await;
    assert_eq!(reviews, vec![vec!["4".to_owned()]], "neither list became viewings");
    // The diary.csv alone first, its reviews.csv after: the entry gets its text, once.
    let alone = dir.path().join("diary.csv");
    std::fs::write(
        &alone,
        format!(
            "{DIARY_HEADER}2021-04-01,Ran,1985,https://boxd.it/d5,4,,,2021-03-31
2021-04-02,Untitled Project,,https://boxd.it/d6,,,,2021-04-02
"
        ),
    )
    .unwrap();
    let out = reelay.cli(&["import", "letterboxd", alone.to_str().unwrap(), "--user", &ana], &[]).await;
    let said = out.ok();
    assert!(said.contains("diary: 1 entries added") && said.contains(", 1 left out for naming no year"), "{said}");
    let later = dir.path().join("reviews.csv");
    std::fs::write(
        &later,
        format!(
            "{REVIEWS_HEADER}2021-04-01,Ran,1985,https://boxd.it/d5,4,,Arrows everywhere.,,2021-03-31
"
        ),
    )
    .unwrap();
    for given in ["(1 given the review text or rating they lacked)", "0 entries added, 1 already imported, "] {
        let out = reelay.cli(&["import", "letterboxd", later.to_str().unwrap(), "--user", &ana], &[]).await;
        assert!(out.ok().contains(given), "{}", out.stdout);
    }
    let ran =
        query_strings(db, "SELECT r.body FROM reviews r JOIN movies m ON m.id = r.movie_id WHERE m.title = 'Ran'")
            .await;
    assert_eq!(ran, vec![vec!["Arrows everywhere.".to_owned()]]);
    assert_eq!(events_of(db, "ReviewEdited").await.len(), 1, "one edit, raised once");
    // A call that fails says what was written before it, and that running it again is safe.
    let nobody = "00000000-0000-7000-8000-000000000000";
    let refused = reelay.cli(&["import", "letterboxd", first.to_str().unwrap(), "--user", nobody], &[]).await;
    assert!(!refused.success, "{}", refused.stderr);
    assert!(
        refused.stderr.contains("0 of 4 diary rows were written before it") && refused.stderr.contains("check --user"),
        "{}",
        refused.stderr
    );
    let not_zip = dir.path().join("notes.txt");
    std::fs::write(&not_zip, "hello").unwrap();
    let refused = reelay.cli(&["import", "letterboxd", not_zip.to_str().unwrap(), "--user", &ana], &[]).await;
    assert!(!refused.success && refused.stderr.contains("no Name column"), "{}", refused.stderr);
    let refused =
        reelay.cli(&["reviews", "log", "--user", &ana, "--movie", "Heat", "--year", "1995", "--stars", "7"], &[]).await;
    assert!(!refused.success && refused.stderr.contains("stars must be 0.5 to 5"), "{}", refused.stderr);
    let refused = reelay.cli(&["users", "create", "Not A Handle"], &[]).await;
    assert!(!refused.success && refused.stderr.contains("InvalidArgument: handle"), "{}", refused.stderr);
    assert_eq!(refused.stderr.matches("InvalidArgument: handle").count(), 1, "said once: {}", refused.stderr);
    // A write run again with its request id (as a failure whose outcome is unknown says to)
    // is written once, and answered as the first run was.
    let cy = ["users", "create", "cy", "--request-id", "cy-1"];
    let (first, again) = (reelay.cli(&cy, &[]).await, reelay.cli(&cy, &[]).await);
    assert_eq!(first.ok(), again.ok(), "the same user, not 'handle taken'");
    let log =
        ["reviews", "log", "--user", &ana, "--movie", "Ran", "--year", "1985", "--stars", "4", "--request-id", "ran-1"];
    let (first, again) = (reelay.cli(&log, &[]).await, reelay.cli(&log, &[]).await);
    assert_eq!(first.ok().replace(" (a film new to Reelay)", ""), again.ok().replace(" (a film new to Reelay)", ""));
    let ran = query_strings(
        db,
        "SELECT COUNT(*) || '' FROM reviews r JOIN movies m ON m.id = r.movie_id WHERE m.title = 'Ran'",
    )
    .await;
    assert_eq!(ran, vec![vec!["2".to_owned()]], "the imported entry and one logged");
    // --wait-secs 0 asks and does not wait: the wrap-up is named, computed or not (it always
    // failed, "still being generated after 0 s").
    let asked = reelay.cli(&["wrap-ups", "request", "--user", &ana, "--year", "2021", "--wait-secs", "0"], &[]).await;
    assert!(asked.ok().contains("wrap-up "), "{}", asked.stdout);
    let refused =
        run_cli(Path::new(BIN), &["status"], &[("REELAY_WRITE_URL".into(), format!("http://{}", reelay.addr))]).await;
    assert!(
        !refused.success && refused.stderr.contains("Unauthenticated"),
        "the token is required: {}",
        refused.stderr
    );
}
