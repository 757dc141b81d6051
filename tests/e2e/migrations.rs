//! The upgrade of a pre-outbox database, and several processes migrating one file at once.

use std::collections::HashSet;
use std::process::Command;

use reelay_harness::{Reelay, query_strings, temp_dir};

const BIN: &str = env!("CARGO_BIN_EXE_reelay");

fn migrate(db: &std::path::Path, to: Option<i64>) -> std::process::Output {
    let mut command = Command::new(BIN);
    command.arg("migrate").env("REELAY_DATABASE", db).env("RUST_LOG", "warn");
    if let Some(version) = to {
        command.arg("--to").arg(version.to_string());
    }
    command.output().expect("run reelay migrate")
}

fn is_v4_uuid(s: &str) -> bool {
    let b = s.as_bytes();
    s.len() == 36
        && s.chars().enumerate().all(|(i, c)| {
            if [8, 13, 18, 23].contains(&i) { c == '-' } else { c.is_ascii_hexdigit() && !c.is_ascii_uppercase() }
        })
        && b[14] == b'4'
        && b"89ab".contains(&b[19])
}

#[tokio::test]
async fn upgrading_a_pre_outbox_database_backfills_a_distinct_event_id_per_row() {
    let dir = temp_dir();
    let db = dir.path().join("legacy.db");
    let out = migrate(&db, Some(2));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let columns = query_strings(&db, "SELECT name FROM pragma_table_info('event_queue')").await;
    assert!(!columns.iter().any(|c| c[0] == "event_id"), "0101 must not have run yet");

    // Legacy rows as the old DB bus wrote them, in every status.
    let legacy = 500;
    let mut conn = sqlite(&db).await;
    for i in 0..legacy {
        let status = ["pending", "processing", "done", "dead_lettered"][i % 4];
        sqlx::query("INSERT INTO event_queue (event_type, aggregate_id, payload, status, attempts, available_at, created_at) VALUES (?, ?, ?, ?, ?, ?, ?)")
            .bind("ReviewLogged")
            .bind(format!("review-{i}"))
            .bind(format!("{{\"review_id\":\"review-{i}\"}}").into_bytes())
            .bind(status)
            .bind((i % 3) as i64)
            .bind(1_600_000_000_000i64 + i as i64)
            .bind(1_600_000_000_000i64)
            .execute(&mut conn)
            .await
            .unwrap();
    }
    drop(conn);

    let out = migrate(&db, None);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));

    let rows =
        query_strings(&db, "SELECT event_id, status, aggregate_id, claimed_at FROM event_queue ORDER BY id").await;
    assert_eq!(rows.len(), legacy);
    let ids: HashSet<&str> = rows.iter().map(|r| r[0].as_str()).collect();
    assert_eq!(ids.len(), legacy, "every legacy row gets its own id");
    for row in &rows {
        assert!(is_v4_uuid(&row[0]), "not a v4 UUID: {:?}", row[0]);
        assert_eq!(row[3], "", "claimed_at starts empty");
    }
    // Data other than the new columns is untouched.
    assert_eq!(rows[7][1], "dead_lettered");
    assert_eq!(rows[7][2], "review-7");

    let ledger = query_strings(&db, "SELECT name FROM pragma_table_info('processed_events') ORDER BY cid").await;
    let ledger: Vec<&str> = ledger.iter().map(|r| r[0].as_str()).collect();
    assert_eq!(&ledger[..5], ["event_id", "handler", "status", "started_at", "processed_at"], "0101's ledger");

    // A foreign writer may still insert without an id; a repeated id is refused.
    let mut conn = sqlite(&db).await;
    for _ in 0..2 {
        sqlx::query(
            "INSERT INTO event_queue (event_type, payload, available_at, created_at) VALUES ('Foreign', x'00', 0, 0)",
        )
        .execute(&mut conn)
        .await
        .expect("NULL event_id is allowed, more than once");
    }
    let duplicate = sqlx::query("INSERT INTO event_queue (event_id, event_type, payload, available_at, created_at) VALUES (?, 'Dup', x'00', 0, 0)")
        .bind(rows[0][0].clone())
        .execute(&mut conn)
        .await;
    assert!(duplicate.is_err(), "event_id is unique when set");
}

/// Users from before 0110 get a key pair when the write service starts; a follow of a remote
/// actor from before counts as accepted.
#[tokio::test]
async fn users_from_before_keys_get_a_key_pair_at_start() {
    let dir = temp_dir();
    let db = dir.path().join("reelay.db");
    let out = migrate(&db, Some(103));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let mut conn = sqlite(&db).await;
    for (id, handle) in
        [("0190b6a0-0000-7000-8000-000000000001", "old_ana"), ("0190b6a0-0000-7000-8000-000000000002", "old_bo")]
    {
        sqlx::query("INSERT INTO users (id, handle, display_name, created_at) VALUES (?, ?, ?, 1)")
            .bind(id)
            .bind(handle)
            .bind(handle)
            .execute(&mut conn)
            .await
            .unwrap();
    }
    sqlx::query(
        "INSERT INTO follows (follower_id, target, created_at) VALUES (?, 'actor:https://films.example/u/c', 5)",
    )
    .bind("0190b6a0-0000-7000-8000-000000000001")
    .execute(&mut conn)
    .await
    .unwrap();
    drop(conn);

    let mut reelay = Reelay::start_write(BIN, &db, &[]).await;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while query_strings(&db, "SELECT user_id FROM actor_keys").await.len() < 2 {
        assert!(std::time::Instant::now() < deadline, "the old users got no key pairs");
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    let mut c = reelay.clients().await;
    let actor = c
        .federation
        .get_local_actor(reelay_contracts::v1::GetLocalActorRequest {
            by: Some(reelay_contracts::v1::get_local_actor_request::By::Handle("old_bo".into())),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(actor.public_key_pem.starts_with("-----BEGIN PUBLIC KEY-----"));
    let accepted = query_strings(&db, "SELECT CAST(accepted_at AS TEXT) FROM follows").await;
    assert_eq!(accepted, [["5".to_owned()]]);
    reelay.stop().await;
}

async fn sqlite(path: &std::path::Path) -> sqlx::SqliteConnection {
    use sqlx::ConnectOptions;
    sqlx::sqlite::SqliteConnectOptions::new()
        .filename(path)
        .busy_timeout(std::time::Duration::from_secs(5))
        .connect()
        .await
        .unwrap()
}

#[tokio::test]
async fn concurrent_migrators_of_one_fresh_file_all_succeed_and_apply_each_migration_once() {
    for round in 0..3 {
        let dir = temp_dir();
        let db = dir.path().join("race.db");
        let children: Vec<_> = (0..6)
            .map(|_| {
                Command::new(BIN)
                    .arg("migrate")
                    .env("REELAY_DATABASE", &db)
                    .env("RUST_LOG", "warn")
                    .stdout(std::process::Stdio::piped())
                    .stderr(std::process::Stdio::piped())
                    .spawn()
                    .unwrap()
            })
            .collect();
        let mut retried = 0;
        for child in children {
            let out = child.wait_with_output().unwrap();
            let log = String::from_utf8_lossy(&out.stderr).into_owned();
            assert!(out.status.success(), "round {round}: a migrator failed:\n{log}");
            retried += usize::from(log.contains("retrying"));
        }
        let applied = query_strings(
            &db,
            "SELECT CAST(version AS TEXT), CAST(success AS TEXT) FROM _sqlx_migrations ORDER BY version",
        )
        .await;
        let applied: Vec<(&str, &str)> = applied.iter().map(|r| (r[0].as_str(), r[1].as_str())).collect();
        let every: Vec<String> = reelay_outbox::MIGRATOR.iter().map(|m| m.version.to_string()).collect();
        let expected: Vec<(&str, &str)> = every.iter().map(|v| (v.as_str(), "1")).collect();
        assert_eq!(applied, expected, "round {round}: each migration applied once");
        let tables = query_strings(
            &db,
            "SELECT COUNT(*) || '' FROM sqlite_master WHERE type = 'table' AND name = 'processed_events'",
        )
        .await;
        assert_eq!(tables[0][0], "1");
        eprintln!("round {round}: {retried} of 6 migrators retried");
    }

    // And a service started on a database another process is migrating comes up.
    let dir = temp_dir();
    let db = dir.path().join("race.db");
    let migrator = Command::new(BIN).arg("migrate").env("REELAY_DATABASE", &db).spawn().unwrap();
    let mut reelay = Reelay::start_write(BIN, &db, &[]).await;
    assert!(migrator.wait_with_output().unwrap().status.success());
    reelay.stop().await;
}
