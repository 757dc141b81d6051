//! Storage faults injected into the real write service: strace makes its `pwrite64`, `write`,
//! `fsync` and `fdatasync` calls fail with EIO or ENOSPC while bursts of concurrent writes are
//! group-committed. Checked against what the database holds afterwards (and again after a
//! crash and restart): no write without its event or event without its write, no caller told
//! OK for a write that is not there, no write there that its caller was told failed, and writes
//! accepted again once the fault ends.

use std::collections::BTreeMap;
use std::time::Duration;

use reelay_contracts::v1;
use reelay_harness::{Clients, CuttingProxy, Reelay, ReviewLedger, Strace, eventually, movie_id_ref, temp_dir};
use tonic::Code;

const BIN: &str = env!("CARGO_BIN_EXE_reelay");

/// What a caller learned from one write.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    Ok,
    /// The service said nothing was written.
    Failed(Code),
    /// The service said it cannot know, or the call broke off.
    Unknown,
}

fn classify(status: &tonic::Status) -> Outcome {
    match status.code() {
        Code::Unavailable if status.message().starts_with("outcome unknown") => Outcome::Unknown,
        Code::Unavailable if status.message().contains("nothing was written") => Outcome::Failed(Code::Unavailable),
        Code::ResourceExhausted => Outcome::Failed(Code::ResourceExhausted),
        // The connection broke: no answer at all.
        Code::Unknown | Code::Cancelled | Code::Unavailable | Code::DeadlineExceeded => Outcome::Unknown,
        code => panic!("a storage fault must never answer {code:?}: {}", status.message()),
    }
}

/// A review body of `chars` characters that starts with `marker`: 4-byte characters, 40 KB at
/// the 10,000-character limit.
pub fn marked_body(marker: &str, chars: usize) -> String {
    let mut body = format!("{marker} ");
    body.push_str(&"𝄞".repeat(chars - body.chars().count()));
    body
}

/// `n` concurrent LogReview calls, each with its own marker; returns marker → outcome.
async fn burst(clients: &Clients, user: &str, movie: &str, tag: &str, n: usize) -> BTreeMap<String, Outcome> {
    let calls = (0..n).map(|i| {
        let mut c = clients.clone();
        let marker = format!("<{tag}-{i:03}>");
        let request = v1::LogReviewRequest {
            actor_user_id: user.to_owned(),
            movie: movie_id_ref(movie),
            rating: 7,
            body: marked_body(&marker, 10_000),
            ..Default::default()
        };
        async move {
            let outcome = match c.reviews.log_review(request).await {
                Ok(_) => Outcome::Ok,
                Err(status) => classify(&status),
            };
            (marker, outcome)
        }
    });
    futures_util::future::join_all(calls).await.into_iter().collect()
}

/// Checks what the database holds against what every caller was told.
fn check(ledger: &ReviewLedger, calls: &BTreeMap<String, Outcome>) {
    let split = ledger.split_writes();
    assert!(split.is_empty(), "writes split from their events:\n{}", split.join("\n"));
    for (marker, outcome) in calls {
        let stored = ledger.count_marked(marker);
        match outcome {
            Outcome::Ok => assert_eq!(stored, 1, "{marker} was acknowledged but {stored} copies are stored"),
            Outcome::Failed(code) => assert_eq!(stored, 0, "{marker} was refused ({code:?}) yet it is stored"),
            Outcome::Unknown => assert!(stored <= 1, "{marker} is stored {stored} times"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn storage_faults_during_group_commits_never_split_a_write_from_its_events() {
    let dir = temp_dir();
    let db = dir.path().join("reelay.db");
    let mut write = Reelay::start_write(BIN, &db, &[]).await;
    let mut c = write.clients().await;
    let user = c.user("ana").await;
    let movie = c.movie(&user, "Heat", 1995).await;

    // (system calls, errno, which calls fail, counted per thread). SQLite writes its WAL with
    // pwrite64 (two calls per page; a burst is about 5,000) and syncs it with fdatasync or fsync;
    // `write` is how the service logs and wakes its threads (an EIO on tokio's wake-up eventfd
    // is fatal: the process aborts and is restarted, which must lose nothing either).
    let faults = [
        ("pwrite64", "EIO", "1500+4001"),
        ("pwrite64", "ENOSPC", "2500+3501"),
        ("fsync,fdatasync", "EIO", "2+3"),
        ("fsync,fdatasync", "ENOSPC", "3+4"),
        ("write", "EIO", "3+17"),
    ];
    let mut calls = BTreeMap::new();
    let mut report = Vec::new();
    for (round, (syscalls, errno, when)) in faults.into_iter().enumerate() {
        let strace = Strace::inject(write.pid(), syscalls, errno, when, dir.path()).await;
        let mut round_calls = BTreeMap::new();
        for wave in 0..2 {
            round_calls.extend(burst(&c, &user, &movie, &format!("r{round}w{wave}"), 256).await);
        }
        let injected = strace.stop().await;
        let failed = round_calls.values().filter(|o| **o != Outcome::Ok).count();
        report.push(format!("{syscalls} {errno}: {injected} calls failed by injection, {failed} of 512 writes not OK"));
        assert!(injected > 0, "no {syscalls} call failed: the fault never reached the service");
        if !write.is_running() {
            // Some faults are fatal to a process; a supervisor restarts it.
            report.push("the service exited; restarted".into());
            write.restart().await;
            c = write.clients().await;
        }
        // Once the fault ends, writes are accepted again (the writer reopens its connection).
        eventually("the write service accepts writes again", Duration::from_secs(30), || {
            let mut c = c.clone();
            let (user, movie) = (user.clone(), movie.clone());
            async move { c.reviews.log_review(log(&user, &movie, &format!("<after-{round}>"))).await.is_ok() }
        })
        .await;
        calls.extend(round_calls);
    }
    eprintln!("{}", report.join("\n"));
    assert!(calls.values().any(|o| *o != Outcome::Ok), "no write was affected: the test proved nothing");

    check(&ReviewLedger::read(&db).await, &calls);
    // A crash now, and recovery from the log: still consistent, nothing acknowledged lost.
    write.kill();
    write.restart().await;
    check(&ReviewLedger::read(&db).await, &calls);
    write.stop().await;
}

fn log(user: &str, movie: &str, marker: &str) -> v1::LogReviewRequest {
    v1::LogReviewRequest {
        actor_user_id: user.to_owned(),
        movie: movie_id_ref(movie),
        rating: 5,
        body: marker.to_owned(),
        ..Default::default()
    }
}

/// A caller whose connection is cut after the write service committed retries with the same
/// request_id: it gets the first call's answer, and one review with one event exists.
#[tokio::test]
async fn a_write_retried_with_its_request_id_after_a_killed_connection_happens_once() {
    let dir = temp_dir();
    let db = dir.path().join("reelay.db");
    let mut write = Reelay::start_write(BIN, &db, &[]).await;
    let mut c = write.clients().await;
    let user = c.user("ana").await;
    let proxy = CuttingProxy::start(write.addr).await;
    let mut through_proxy = Reelay::clients_via(proxy.addr).await;
    // The connection is up (an answer came back), then the next answer is cut off.
    through_proxy.users.get_user(v1::GetUserRequest { user_id: user.clone() }).await.unwrap();
    let request = v1::LogReviewRequest {
        actor_user_id: user.clone(),
        movie: reelay_harness::movie_ref("Heat", 1995),
        rating: 9,
        body: "<once> the diner scene".into(),
        request_id: "ana-2024-heat-1".into(),
        ..Default::default()
    };
    proxy.cut_next_answer();
    let cut = through_proxy.reviews.log_review(request.clone()).await.expect_err("the answer was cut off");
    assert!(matches!(cut.code(), Code::Unavailable | Code::Unknown | Code::Cancelled), "{cut:?}");
    let first = ReviewLedger::read(&db).await;
    assert_eq!(first.count_marked("<once>"), 1, "the first call did commit");

    let retried = c.reviews.log_review(request.clone()).await.expect("the retry succeeds").into_inner();
    let review = retried.review.unwrap();
    assert!(retried.movie_created, "the retry answers exactly what the first call did");
    assert_eq!(first.reviews.get(&review.review_id).map(String::as_str), Some("<once> the diner scene"));
    // And again, after a restart: request ids are durable.
    write.restart().await;
    let mut c = write.clients().await;
    let again = c.reviews.log_review(request.clone()).await.unwrap().into_inner();
    assert_eq!(again.review.unwrap().review_id, review.review_id);
    let ledger = ReviewLedger::read(&db).await;
    assert_eq!(ledger.count_marked("<once>"), 1, "one review");
    assert_eq!(ledger.logged.get(&review.review_id), Some(&1), "one ReviewLogged");
    let discovered =
        reelay_harness::outbox_rows(&db).await.iter().filter(|r| r.event_type == "MovieDiscovered").count();
    assert_eq!(discovered, 1, "one MovieDiscovered");

    // The same key for a different request is refused, and writes nothing.
    let before = reelay_harness::table_snapshot(&db).await;
    let reused = c
        .reviews
        .log_review(v1::LogReviewRequest { body: "<other> something else".into(), ..request.clone() })
        .await
        .expect_err("a reused request_id");
    assert_eq!(reused.code(), Code::InvalidArgument);
    assert!(reused.message().starts_with("request_id:"), "{}", reused.message());
    assert_eq!(reelay_harness::table_snapshot(&db).await, before);
    // Without a key, the same request is a new review (the caller asked for no protection).
    c.reviews.log_review(v1::LogReviewRequest { request_id: String::new(), ..request.clone() }).await.unwrap();
    assert_eq!(ReviewLedger::read(&db).await.count_marked("<once>"), 2);
    // Keys are each user's own: another user's client may use the same one.
    let bob = c.user("bob").await;
    let bobs = v1::LogReviewRequest { actor_user_id: bob.clone(), body: "<bob> the harbour".into(), ..request };
    let logged = c.reviews.log_review(bobs.clone()).await.expect("bob's own key").into_inner();
    assert_ne!(logged.review.as_ref().unwrap().review_id, review.review_id);
    let replayed = c.reviews.log_review(bobs).await.unwrap().into_inner();
    assert_eq!(replayed.review.unwrap().review_id, logged.review.unwrap().review_id, "and replays his");
    assert_eq!(ReviewLedger::read(&db).await.count_marked("<bob>"), 1);

    // Other creating writes replay too: a follow, a user, an import.
    let follow = v1::FollowRequest {
        actor_user_id: user.clone(),
        target: reelay_harness::user_account(&bob),
        request_id: "follow-1".into(),
    };
    assert!(c.social.follow(follow.clone()).await.unwrap().into_inner().changed);
    assert!(c.social.follow(follow).await.unwrap().into_inner().changed, "the replay answers the first call");
    let csv = b"Date,Name,Year,Letterboxd URI,Rating,Rewatch,Tags,Watched Date\n\
                2024-01-02,Heat,1995,https://boxd.it/a,4.5,,,2024-01-01\n";
    let import = |c: &mut Clients| {
        let mut c = c.clone();
        let user = user.clone();
        async move { c.import_with_request_id(&user, csv, "import-1").await.unwrap() }
    };
    let (first, second) = (import(&mut c).await, import(&mut c).await);
    assert_eq!((first.imported, second.imported), (1, 1), "the replay answers the first import");
    assert_eq!(first.import_id, second.import_id);
    let imported = reelay_harness::outbox_rows(&db).await.iter().filter(|r| r.event_type == "DiaryImported").count();
    assert_eq!(imported, 1);
    write.stop().await;
}

/// A backlog of events at the size limit (130 reviews of 10,000 four-byte characters) built up
/// while nothing consumed, plus one oversized row from a foreign writer: the claims stay within
/// the message limit, every event is delivered, and the oversized row is dead-lettered with its
/// reason instead of blocking the rest.
async fn large_event_backlog(nats: bool) {
    let dir = temp_dir();
    let db = dir.path().join("reelay.db");
    let effects = dir.path().join("effects.db");
    let server = nats.then(|| reelay_harness::NatsServer::start(&dir.path().join("nats")));
    let mut env: Vec<(String, String)> = vec![
        ("REELAY_PROBE_DB".into(), effects.to_str().unwrap().into()),
        ("REELAY_PROBE_HANDLERS".into(), "probe-a".into()),
    ];
    if let Some(server) = &server {
        env.push(("EVENT_BUS_BACKEND".into(), "nats".into()));
        env.push(("NATS_URL".into(), server.url()));
    }
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let mut write = Reelay::start_write(BIN, &db, &env).await;
    let mut c = write.clients().await;
    let user = c.user("ana").await;
    let movie = c.review(&user, reelay_harness::movie_ref("Heat", 1995), 8).await.movie_id;
    let logs = (0..130).map(|i| {
        let mut c = c.clone();
        let request = v1::LogReviewRequest {
            actor_user_id: user.clone(),
            movie: movie_id_ref(&movie),
            rating: 8,
            body: marked_body(&format!("<big-{i}>"), 10_000),
            ..Default::default()
        };
        async move { c.reviews.log_review(request).await.expect("a review at the size limit is accepted") }
    });
    futures_util::future::join_all(logs).await;
    // A foreign writer's row (no event id) of a type the handler takes, which no claim answer
    // can hold.
    reelay_harness::insert_foreign_event(&db, "MovieDeleted", &vec![1u8; 5 * 1024 * 1024]).await;

    let mut consumers = vec![Reelay::start_handlers(BIN, &write, &dir.path().join("handlers"), &env).await];
    if nats {
        let mut spec = Reelay::spec(BIN, &dir.path().join("relay").join("unused.db"), &["relay"], &env);
        spec.env.push(("REELAY_WRITE_URL".into(), format!("http://{}", write.addr)));
        consumers.push(Reelay::start(spec).await);
    }
    let expected: Vec<String> = reelay_harness::outbox_rows(&db).await.into_iter().filter_map(|r| r.event_id).collect();
    assert!(expected.len() >= 133);
    eventually("every event of the backlog is delivered", Duration::from_secs(60), || {
        let (effects, expected) = (effects.clone(), expected.clone());
        async move {
            let (done, _) = reelay_harness::probe_records(&effects, "effects").await;
            expected.iter().all(|id| done.contains_key(&(id.clone(), "probe-a".to_owned())))
        }
    })
    .await;
    let foreign_id = reelay_harness::outbox_rows(&db).await.iter().find(|r| r.event_id.is_none()).unwrap().id;
    eventually("nothing is stuck", Duration::from_secs(10), || {
        let db = db.clone();
        async move { reelay_harness::unsettled(&db, nats, &["probe-a"]).await.is_empty() }
    })
    .await;
    // The oversized row ends dead-lettered (for the outbox on nats, for the handler on db), with
    // its reason.
    let reason_sql = if nats {
        format!("SELECT status, last_error FROM event_queue WHERE id = {foreign_id}")
    } else {
        format!(
            "SELECT status, last_error FROM processed_events WHERE event_id = 'row:{foreign_id}' AND handler = 'probe-a'"
        )
    };
    let reason = reelay_harness::query_strings(&db, &reason_sql).await;
    assert_eq!(reason[0][0], "dead_lettered");
    assert!(reason[0][1].starts_with("undeliverable"), "with a reason: {:?}", reason[0][1]);

    // Replayed as it is, it is given up again and holds nothing back: a review logged after
    // it is delivered (a replayed row too large for any answer headed every claim of the
    // handler on db, which then got nothing more).
    let (key, whose) = (format!("row:{foreign_id}"), if nats { "relay" } else { "probe-a" });
    let replayed = write.cli(&["dead-letters", "replay", &key, "--handler", whose], &[]).await;
    assert!(replayed.ok().contains("1 replayed"), "{}", replayed.stdout);
    let after = c.review(&user, reelay_harness::movie_ref("Heat", 1995), 9).await.review_id;
    let after = reelay_harness::query_strings(
        &db,
        &format!("SELECT event_id FROM event_queue WHERE aggregate_id = '{after}' AND event_type = 'ReviewLogged'"),
    )
    .await[0][0]
        .clone();
    eventually("the review logged after the replay is delivered", Duration::from_secs(30), || {
        let (effects, after) = (effects.clone(), after.clone());
        async move {
            let (done, _) = reelay_harness::probe_records(&effects, "effects").await;
            done.contains_key(&(after, "probe-a".to_owned()))
        }
    })
    .await;
    eventually("the replayed row is given up again", Duration::from_secs(10), || {
        let (db, reason_sql) = (db.clone(), reason_sql.clone());
        async move { reelay_harness::query_strings(&db, &reason_sql).await[0][0] == "dead_lettered" }
    })
    .await;
    for consumer in &mut consumers {
        assert!(!consumer.log_text().contains("message length too large"), "no claim exceeded the limit");
        consumer.stop().await;
    }
    write.stop().await;
}

#[tokio::test]
async fn a_backlog_of_maximum_size_events_is_delivered_on_the_db_backend() {
    large_event_backlog(false).await;
}

#[tokio::test]
async fn a_backlog_of_maximum_size_events_is_delivered_on_the_nats_backend() {
    large_event_backlog(true).await;
}

/// Request ids are kept for REELAY_REQUEST_ID_RETENTION_HOURS and purged after: then the same
/// key is a new request.
#[tokio::test]
async fn request_ids_are_purged_after_their_retention() {
    let dir = temp_dir();
    let db = dir.path().join("reelay.db");
    let env = [("REELAY_REQUEST_ID_RETENTION_HOURS", "0"), ("REELAY_LEDGER_PURGE_INTERVAL_MS", "100")];
    let mut write = Reelay::start_write(BIN, &db, &env).await;
    let mut c = write.clients().await;
    let request =
        v1::CreateUserRequest { handle: "ana".into(), display_name: "Ana".into(), request_id: "user-ana".into() };
    c.users.create_user(request.clone()).await.unwrap();
    eventually("the request id is purged", Duration::from_secs(10), || {
        let db = db.clone();
        async move { reelay_harness::query_strings(&db, "SELECT request_id FROM request_ids").await.is_empty() }
    })
    .await;
    // No longer a retry: a new request, which finds the handle taken.
    let status = c.users.create_user(request).await.unwrap_err();
    assert_eq!(status.code(), Code::AlreadyExists, "{status:?}");
    write.stop().await;
}

/// Every fsync fails: a commit may or may not be on disk, so the caller hears "outcome unknown"
/// (not "failed"); after a crash and recovery, a retry with the same request_id settles it: one
/// review, one event, whichever way the commit went.
#[tokio::test]
async fn a_failed_fsync_answers_outcome_unknown_and_a_retry_with_the_request_id_settles_it() {
    let dir = temp_dir();
    let db = dir.path().join("reelay.db");
    let mut write = Reelay::start_write(BIN, &db, &[]).await;
    let mut c = write.clients().await;
    let user = c.user("ana").await;
    let request = v1::LogReviewRequest {
        actor_user_id: user.clone(),
        movie: reelay_harness::movie_ref("Heat", 1995),
        rating: 9,
        body: "<fsync> the diner scene".into(),
        request_id: "fsync-1".into(),
        ..Default::default()
    };
    let strace = Strace::inject(write.pid(), "fsync,fdatasync", "EIO", "1+1", dir.path()).await;
    let status = c.reviews.log_review(request.clone()).await.expect_err("the commit's fsync fails");
    assert!(strace.stop().await > 0);
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert!(status.message().starts_with("outcome unknown"), "{}", status.message());
    assert!(write.log_text().contains("closing the write connection"), "the writer stops trusting its connection");

    write.kill();
    write.restart().await;
    let mut c = write.clients().await;
    let answer = c.reviews.log_review(request).await.expect("the retry succeeds").into_inner();
    let ledger = ReviewLedger::read(&db).await;
    assert_eq!(ledger.count_marked("<fsync>"), 1, "one review");
    assert_eq!(ledger.logged.get(&answer.review.unwrap().review_id), Some(&1), "with one event");
    assert!(ledger.split_writes().is_empty());
    write.stop().await;
}

/// A wrapper that runs `reelay` as a pod with a read-only root filesystem would: in its own
/// mount namespace, with every directory SQLite could put a temporary file in read-only
/// (`/var/tmp`, `/usr/tmp`, `/tmp`, the working directory, no `TMPDIR`). Only `dir`, holding
/// the database and the log, stays writable. The wrapper execs, so the PID is reelay's.
fn read_only_temp_dirs(dir: &std::path::Path) -> std::path::PathBuf {
    let cwd = dir.join("read-only-cwd");
    std::fs::create_dir_all(&cwd).unwrap();
    let script = dir.join("reelay-read-only-temp");
    let body = format!(
        r#"#!/bin/sh
exec unshare --mount --propagation private sh -c '
set -e
mount --bind "{dir}" "{dir}"
for d in /var/tmp /usr/tmp /tmp; do
  if [ -d "$d" ]; then mount --rbind "$d" "$d"; mount -o remount,bind,ro "$d"; fi
done
mount --bind "{cwd}" "{cwd}"
mount -o remount,bind,ro "{cwd}"
cd "{cwd}"
exec env -u TMPDIR -u SQLITE_TMPDIR "$0" "$@"' "{bin}" "$@"
"#,
        dir = dir.display(),
        cwd = cwd.display(),
        bin = BIN,
    );
    std::fs::write(&script, body).unwrap();
    std::fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    script
}

/// The write service needs no writable temporary directory (Kubernetes runs it on a read-only
/// root filesystem). SQLite journals the pages a many-row statement changes inside a
/// transaction, and by default moved that journal to a temporary file past 64 KiB: with no
/// writable directory for it, the statement failed with an I/O error. Here the outbox rows of a
/// whole Letterboxd import are claimed and completed in one call each (statements that change
/// hundreds of existing rows) with every temporary directory read-only.
#[tokio::test]
async fn large_statements_need_no_writable_temp_directory() {
    let dir = temp_dir();
    let db = dir.path().join("reelay.db");
    let wrapper = read_only_temp_dirs(dir.path());
    // On nats, where a relay claims the outbox rows (no broker is needed to write them).
    let spec = Reelay::spec(wrapper.to_str().unwrap(), &db, &["write"], &[("EVENT_BUS_BACKEND", "nats")]);
    let mut write = Reelay::start(spec).await;
    let mut c = write.clients().await;
    let ana = c.user("ana").await;
    let imported = c.import(&ana, include_bytes!("../fixtures/letterboxd-diary.csv")).await.expect("the import");
    assert!(imported.imported >= 300);
    let claimed = c
        .outbox
        .claim(v1::ClaimRequest { consumer: "test#1".into(), max_rows: 1000, ..Default::default() })
        .await
        .expect("claiming every row at once")
        .into_inner()
        .rows;
    assert!(claimed.len() > 400, "every event of the import is claimed: {}", claimed.len());
    let rows = claimed.iter().map(|r| v1::RowClaim { id: r.id, claimed_at_ms: r.claimed_at_ms, stream_sequence: 1 });
    c.outbox.complete(v1::CompleteRequest { rows: rows.collect() }).await.expect("completing every row at once");
    let open: i64 = reelay_harness::query_strings(&db, "SELECT COUNT(*) || '' FROM event_queue WHERE status != 'done'")
        .await[0][0]
        .parse()
        .unwrap();
    assert_eq!(open, 0, "every claimed row is done");
    assert!(!write.log_text().contains("disk I/O error"), "{}", write.log_text());
    write.stop().await;
}
