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
/// negative since_ms), a URL without a scheme (every call failed with "transport error"), a
/// REELAY_HANDLERS_ADDR that is no address (search reads it, as the other commands read
/// REELAY_WRITE_ADDR). A value refused that came from a variable names the variable too.
#[test]
fn client_settings_no_call_could_use_are_refused_at_once() {
    let dead_letters = ["dead-letters", "list"];
    // The command line, a variable set for it, and what its refusal must name.
    type Case<'a> = (Vec<&'a str>, Option<(&'a str, &'a str)>, &'a [&'a str]);
    let cases: [Case; 11] = [
        (vec!["status", "--grpc-timeout-ms", "0"], None, &["--grpc-timeout-ms", "2000"]),
        (
            vec!["status"],
            Some(("REELAY_GRPC_TIMEOUT_MS", "0")),
            &["--grpc-timeout-ms", "2000", "the environment variable REELAY_GRPC_TIMEOUT_MS"],
        ),
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
        (
            vec!["search", "reviews", "heat"],
            Some(("REELAY_HANDLERS_ADDR", "handlers:50052")),
            &["REELAY_HANDLERS_ADDR", "\"handlers:50052\"", "--handlers-url"],
        ),
    ];
    for (args, env, named) in cases {
        let mut command = std::process::Command::new(BIN);
        for name in ["REELAY_GRPC_TIMEOUT_MS", "REELAY_HANDLERS_URL", "REELAY_HANDLERS_ADDR"] {
            command.env_remove(name);
        }
        command.args(&args);
        if let Some((name, value)) = env {
            command.env(name, value);
        }
        let out = command.output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?} {env:?}: {stderr}");
        assert!(named.iter().all(|n| stderr.contains(n)), "{args:?} {env:?} names {named:?}: {stderr}");
        if env.is_none() {
            assert!(!stderr.contains("environment variable"), "typed, not from a variable: {stderr}");
        }
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

/// `reelay run` with the environment cleared but for PATH, and `env` on top, in `dir`; its
/// stderr when it exits within 30 s.
fn run_exits(dir: &Path, args: &[&str], env: &[(&str, &str)]) -> (Option<i32>, String) {
    let mut command = std::process::Command::new(BIN);
    command
        .arg("run")
        .args(args)
        .current_dir(dir)
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    let mut child = command.spawn().unwrap();
    let stderr = child.stderr.take().unwrap();
    let read = std::thread::spawn(move || std::io::read_to_string(stderr).unwrap_or_default());
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("reelay run {args:?} did not exit in 30 s: {}", read.join().unwrap());
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    (status.code(), read.join().unwrap())
}

/// A port another process holds is refused naming the listener and the setting that moves it
/// (it said "cannot listen on 127.0.0.1:8080: Address already in use", which of five?), said
/// once (it was said twice, logged and printed). REELAY_DEV takes the switch words the other
/// switches take (1, on, yes: it took only true/false), and a value it refuses names it.
#[test]
fn a_taken_port_names_its_setting_and_reelay_dev_takes_switch_words() {
    let dir = temp_dir();
    let listeners = [
        ("--write-addr", "REELAY_WRITE_ADDR", "the write service's gRPC", "1"),
        ("--handlers-addr", "REELAY_HANDLERS_ADDR", "the handlers service's gRPC", "on"),
        ("--media-addr", "REELAY_MEDIA_ADDR", "the handlers service's media route", "yes"),
        ("--gateway-addr", "REELAY_GATEWAY_ADDR", "the ActivityPub gateway", "TRUE"),
        ("--metrics-addr", "REELAY_METRICS_ADDR", "the admin HTTP port", "Y"),
    ];
    for (flag, variable, what, dev) in listeners {
        // Fresh ports each try: another test may take one of the free ones meanwhile, which
        // names another listener.
        let (code, stderr) = (0..3)
            .map(|_| {
                let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
                let taken_addr = taken.local_addr().unwrap().to_string();
                let mut args = vec!["--data-dir".to_owned(), "data".to_owned()];
                for (other, ..) in listeners {
                    let addr = if other == flag {
                        taken_addr.clone()
                    } else {
                        format!("127.0.0.1:{}", reelay_harness::free_port())
                    };
                    args.extend([other.to_owned(), addr]);
                }
                let args: Vec<&str> = args.iter().map(String::as_str).collect();
                let (code, stderr) = run_exits(dir.path(), &args, &[("REELAY_DEV", dev)]);
                let named = stderr.contains(&format!("cannot listen on {taken_addr} ({variable} / {flag}, {what}"));
                (code, stderr, named)
            })
            .find(|(_, _, named)| *named)
            .map(|(code, stderr, _)| (code, stderr))
            .unwrap_or_else(|| panic!("{flag}: never refused naming it"));
        assert_eq!(code, Some(2), "{flag}: {stderr}");
        assert!(stderr.contains("Address already in use"), "{flag}: the cause is kept: {stderr}");
        assert_eq!(stderr.matches("cannot listen on").count(), 1, "{flag}: said once: {stderr}");
        assert!(stderr.contains("development mode: no service token"), "REELAY_DEV={dev} is on: {stderr}");
    }
    // Off reads as off: the token is required.
    let (code, stderr) = run_exits(dir.path(), &["--data-dir", "data"], &[("REELAY_DEV", "off")]);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(!stderr.contains("development mode"), "{stderr}");
    assert_eq!(stderr.matches("no service token: set REELAY_SERVICE_TOKEN").count(), 1, "said once: {stderr}");
    let (code, stderr) = run_exits(dir.path(), &["--data-dir", "data"], &[("REELAY_DEV", "maybe")]);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(
        stderr.contains("'maybe' for '--dev'") && stderr.contains("the environment variable REELAY_DEV"),
        "{stderr}"
    );
}

/// A data dir this process cannot write: the write service's lock file could not be made, and
/// it said "No such file or directory" (of the read-only open it fell back to); it now says the
/// dir is not writable and which settings move it. A process that only needs an instance name
/// there warns the same way and runs on. (As root the processes run as `nobody`, for whom the
/// dir is read-only.)
#[tokio::test]
async fn a_data_dir_that_cannot_be_written_is_named_with_its_setting() {
    use std::os::unix::fs::PermissionsExt;
    use std::os::unix::process::CommandExt;
    use tokio::io::AsyncBufReadExt;
    let dir = temp_dir();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let read_only = dir.path().join("read-only");
    std::fs::create_dir(&read_only).unwrap();
    std::fs::set_permissions(&read_only, std::fs::Permissions::from_mode(0o555)).unwrap();
    // SAFETY: geteuid only reads this process's effective user id.
    let root = unsafe { libc::geteuid() } == 0;
    // `nobody` may not reach the build dir: a copy of the binary (a link) it can run.
    let bin = dir.path().join("reelay");
    std::fs::hard_link(BIN, &bin).or_else(|_| std::fs::copy(BIN, &bin).map(drop)).unwrap();
    let command = |service: &str| {
        let mut command = std::process::Command::new(&bin);
        command
            .args(["run", "--dev", "--service", service, "--data-dir", read_only.to_str().unwrap()])
            .current_dir(dir.path())
            .env_clear()
            .env("PATH", std::env::var("PATH").unwrap_or_default())
            .env("REELAY_WRITE_URL", "http://127.0.0.1:1")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        for (variable, port) in ["REELAY_WRITE_ADDR", "REELAY_METRICS_ADDR", "REELAY_GATEWAY_ADDR"]
            .map(|v| (v, reelay_harness::free_port()))
        {
            command.env(variable, format!("127.0.0.1:{port}"));
        }
        if root {
            command.uid(65534).gid(65534);
        }
        let mut command = tokio::process::Command::from(command);
        command.kill_on_drop(true);
        command
    };

    let out = tokio::time::timeout(Duration::from_secs(30), command("write").output()).await.unwrap().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    let dir_named = format!("make {} writable", read_only.display());
    assert!(stderr.contains(&dir_named) && stderr.contains("REELAY_DATA_DIR"), "{stderr}");
    assert!(stderr.contains("Permission denied") && !stderr.contains("No such file"), "{stderr}");
    assert_eq!(stderr.matches("cannot lock its database").count(), 1, "said once: {stderr}");

    // The gateway claims under an instance name, which it cannot lock there: a warning.
    let mut gateway = command("gateway").spawn().unwrap();
    let mut lines = tokio::io::BufReader::new(gateway.stderr.take().unwrap()).lines();
    let warning = tokio::time::timeout(Duration::from_secs(30), async {
        while let Some(line) = lines.next_line().await.unwrap() {
            if line.contains("cannot lock the instance name") {
                return line;
            }
        }
        panic!("the gateway exited without the warning");
    })
    .await
    .expect("the warning within 30 s");
    assert!(warning.contains("REELAY_DATA_DIR") && warning.contains("Permission denied"), "{warning}");
    assert!(!warning.contains("No such file"), "{warning}");
    assert!(gateway.try_wait().unwrap().is_none(), "it runs on: {warning}");
    gateway.kill().await.unwrap();
}

/// A client pointed at the write service that answers: output read by a reader that goes away
/// early ends quietly with the command's own status (println! panicked: "failed printing to
/// stdout: Broken pipe", exit 101); a replay or discard of ids none of which changed exits 1
/// saying so (it exited 0); a port of something else is answered with a hint at the URL's
/// variable; search finds the handlers service through REELAY_HANDLERS_ADDR.
#[tokio::test]
async fn clients_end_quietly_when_their_reader_goes_and_say_what_went_wrong() {
    let dir = temp_dir();
    let reelay = Reelay::start_all(BIN, &dir.path().join("reelay.db"), &[]).await;
    let client = |args: &[&str], env: &[(&str, String)]| {
        let mut command = tokio::process::Command::new(BIN);
        for name in ["REELAY_WRITE_URL", "REELAY_WRITE_ADDR", "REELAY_HANDLERS_URL", "REELAY_HANDLERS_ADDR"] {
            command.env_remove(name);
        }
        command
            .args(args)
            .env("REELAY_WRITE_URL", format!("http://{}", reelay.addr))
            .env("REELAY_SERVICE_TOKEN", reelay_harness::TEST_TOKEN)
            .env("REELAY_OPERATOR", "test-operator")
            .env("RUST_LOG", "warn")
            .envs(env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        command
    };
    let unknown = "00000000-0000-7000-8000-000000000000";

    // The reader gone before the command writes a line.
    for (args, code) in [
        (&["status"][..], 0),
        (&["dead-letters", "list"], 0),
        (&["users", "create", "piped"], 0),
        (&["dead-letters", "replay", unknown], 1),
    ] {
        let mut child = client(args, &[]).spawn().unwrap();
        drop(child.stdout.take());
        let out = tokio::time::timeout(Duration::from_secs(60), child.wait_with_output()).await.unwrap().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(code), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked") && !stderr.contains("Broken pipe"), "{args:?}: {stderr}");
    }
    let users = query_strings(&reelay.database, "SELECT handle FROM users").await;
    assert_eq!(users, vec![vec!["piped".to_owned()]], "the command ran to its end");

    // Ids named, none changed: exit 1, said on stderr; the summary still on stdout.
    for (verb, done) in [("replay", "replayed"), ("discard", "discarded")] {
        let out = client(&["dead-letters", verb, unknown], &[]).output().await.unwrap();
        let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert_eq!(out.status.code(), Some(1), "{verb}: {stdout}{stderr}");
        assert!(stdout.contains(&format!("0 {done}, 1 unchanged")), "{verb}: {stdout}");
        assert!(stderr.contains(&format!("nothing {done}: none of the named events")), "{verb}: {stderr}");
        assert_eq!(stderr.matches("nothing").count(), 1, "said once: {stderr}");
    }
    // --all with nothing to change is done: exit 0.
    let out = client(&["dead-letters", "replay", "--handler", "search", "--all"], &[]).output().await.unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));

    // Ports of something else: an HTTP server (the gateway, the admin port) or another gRPC
    // service (the handlers').
    for addr in [reelay.gateway_addr, reelay.metrics_addr, reelay.handlers_addr] {
        let out = client(&["status", "--write-url", &format!("http://{addr}")], &[]).output().await.unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{addr}: {stderr}");
        assert!(stderr.contains("(is REELAY_WRITE_URL the write service's gRPC address?)"), "{addr}: {stderr}");
    }

    // search reaches the handlers service at REELAY_HANDLERS_ADDR (as the services read it:
    // an unspecified address is this machine), with no REELAY_HANDLERS_URL.
    let any = format!("0.0.0.0:{}", reelay.handlers_addr.port());
    let out = client(&["search", "reviews", "heat"], &[("REELAY_HANDLERS_ADDR", any)]).output().await.unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success() && stdout.contains("0 review(s) found"), "{stdout}{stderr}");
}
