//! The query plans of the statements that run all the time over tables that grow with every
//! event (the ledger keeps each done pair for 30 days, the outbox each row for a week): each must
//! find its rows through an index, read from the bundled SQLite's `EXPLAIN QUERY PLAN`.

use sqlx::SqliteConnection;

use crate::{Database, DbConfig, deliveries, ledger, queue};

async fn plan(conn: &mut SqliteConnection, sql: &str) -> Vec<String> {
    crate::query_plan(conn, sql).await.unwrap()
}

/// Reads each statement's plan and checks every step on a table `SQLite` names as one of `tables`,
/// and that none sorts what it read when `sorts` is false.
async fn check_plans(statements: Vec<String>, tables: &[&str], sorts: bool, step_is_fine: impl Fn(&str) -> bool) {
    let dir = tempfile::tempdir().unwrap();
    let db = Database::open(&DbConfig::new(dir.path().join("plans.db"))).await.unwrap();
    let mut conn = db.reads.acquire().await.unwrap();
    for sql in statements {
        let plan = plan(&mut conn, &sql).await;
        // A step names its table as a word of its own, often the last one (`SCAN processed_events`).
        let steps: Vec<&String> =
            plan.iter().filter(|step| step.split_whitespace().any(|word| tables.contains(&word))).collect();
        assert!(!steps.is_empty(), "{sql}\n{plan:#?}");
        for step in steps {
            assert!(step_is_fine(step), "{step}\n{sql}\n{plan:#?}");
        }
        let sorted = plan.iter().any(|step| step.contains("TEMP B-TREE"));
        assert!(sorts || !sorted, "sorts what it reads: {sql}\n{plan:#?}");
    }
    drop(conn);
    db.close().await;
}

/// Every claim (in the writer), every wake of an idle claimer, Stats, the status and a restart
/// look for open deliveries: through the ledger's index of them, never by reading its done rows.
#[tokio::test]
async fn open_deliveries_are_found_through_their_index() {
    let statements = [deliveries::PEEK, deliveries::STATS, deliveries::RELEASE_DELIVERIES, queue::OLDEST_DUE_DB]
        .map(str::to_owned)
        .into_iter()
        .chain([deliveries::claim_open_sql(1), deliveries::claim_open_sql(3)])
        .collect();
    check_plans(statements, &["processed_events", "p"], true, |step| step.contains("INDEX processed_events_")).await;
}

/// Every claim and every look of an idle claimer asks for the handler's expired claims and due
/// retries: each is one range of an index, not a read of every claim the handler holds (hundreds
/// under load, none of them expired).
#[tokio::test]
async fn expired_claims_and_due_retries_are_sought() {
    let statements = vec![deliveries::PEEK.to_owned(), deliveries::claim_open_sql(1), deliveries::claim_open_sql(3)];
    check_plans(statements, &["processed_events"], true, |step| {
        step.contains("INDEX processed_events_open (handler=? AND status=? AND renewed_at<?)")
            || step.contains("INDEX processed_events_retry (handler=? AND available_at<?)")
            // The earliest retry: the first entry of the handler's range.
            || step.ends_with("INDEX processed_events_retry (handler=?)")
    })
    .await;
}

/// Retention runs once a minute in the writer: it finds what it deletes by key or through an
/// index of what is past retention, never by reading every row kept.
#[tokio::test]
async fn retention_reads_only_what_it_deletes() {
    let ledger = ledger::PURGE.map(str::to_owned).to_vec();
    check_plans(ledger, &["processed_events"], false, |step| {
        step.starts_with("SEARCH processed_events USING PRIMARY KEY")
            || step.contains("INDEX processed_events_done (processed_at<?)")
            || step.contains("INDEX processed_events_discarded (processed_at<?)")
            // The open claims and retries: few, whatever the ledger keeps.
            || step.contains("USING INDEX processed_events_open")
    })
    .await;
    // On db the walk ends at the lowest cursor's row, found by key.
    let dir = tempfile::tempdir().unwrap();
    let db = Database::open(&DbConfig::new(dir.path().join("p.db"))).await.unwrap();
    let bounded = plan(&mut db.reads.acquire().await.unwrap(), &queue::purge_finished_sql(true)).await;
    let by_key = "SEARCH event_queue USING INTEGER PRIMARY KEY (rowid<?)";
    assert!(bounded.iter().any(|step| step == by_key), "{bounded:#?}");
    db.close().await;
    let outbox = vec![queue::purge_finished_sql(true), queue::purge_finished_sql(false)];
    check_plans(outbox, &["event_queue", "q", "p", "handler_cursors"], false, |step| {
        step.starts_with("SEARCH event_queue USING INTEGER PRIMARY KEY")
            || step.starts_with("SEARCH q USING INDEX event_queue_created (created_at<?)")
            || step.starts_with("SEARCH p USING PRIMARY KEY")
            || step.starts_with("SEARCH handler_cursors")
    })
    .await;
}

/// Every scrape reads where each handler stands and the outbox's oldest due row: the rows after
/// the cursors are counted through the covering index of `(status, id)` in stretches between
/// one cursor and the next, and the first row after a cursor is found by key, never by reading
/// the backlog (once per handler, as each handler's count and oldest row once did).
#[tokio::test]
async fn standings_count_the_backlog_through_an_index() {
    let statements = vec![deliveries::STATS.to_owned(), queue::OLDEST_DUE_DB.to_owned()];
    check_plans(statements, &["event_queue", "q", "f"], true, |step| {
        step == "SEARCH q USING COVERING INDEX event_queue_status_id (status=? AND id>? AND id<?)"
            || step == "SEARCH f USING INTEGER PRIMARY KEY (rowid>?)"
            || step == "SEARCH event_queue USING INDEX event_queue_status_id (status=? AND id>?)"
    })
    .await;
}
