//! `reelay events explain <event_id>`: where one event is — its outbox row (and JetStream
//! sequence on nats), each handler's ledger state with times, attempts and last error, its
//! replays and the operator actions taken on it.

use clap::{Args, Subcommand};
use reelay_contracts::v1::{self, admin_client::AdminClient};

use super::{ClientArgs, call_failed, outln, utc};

#[derive(Debug, Subcommand)]
pub enum EventsCommand {
    /// Where one event is, and what each handler made of it.
    Explain(ExplainArgs),
}

#[derive(Debug, Args)]
pub struct ExplainArgs {
    /// The event id (a UUID, as logs and `dead-letters list` show it).
    pub event_id: String,

    #[command(flatten)]
    pub client: ClientArgs,
}

pub async fn run(command: EventsCommand) -> anyhow::Result<()> {
    let EventsCommand::Explain(args) = command;
    let mut admin = AdminClient::new(args.client.write()?);
    let explained = admin
        .explain_event(v1::ExplainEventRequest { event_id: args.event_id.clone() })
        .await
        .map_err(|s| call_failed("events explain", s))?
        .into_inner();
    outln!("event {} (backend: {}; times in UTC)", args.event_id, explained.backend);
    match &explained.outbox {
        Some(row) => print_row("outbox", row),
        None => outln!("outbox: no row (deleted by retention after every handler finished with it)"),
    }
    outln!("handlers:");
    for h in &explained.handlers {
        let mut line = format!("  {:<20} {}", h.handler, h.state);
        if h.attempts > 0 {
            line.push_str(&format!(", {} failed attempt(s)", h.attempts));
        }
        if h.started_at_ms > 0 {
            line.push_str(&format!(", claimed {}", utc(h.started_at_ms)));
        }
        if h.processed_at_ms > 0 {
            line.push_str(&format!(", settled {}", utc(h.processed_at_ms)));
        }
        if h.state == "retry" && h.available_at_ms > 0 {
            line.push_str(&format!(", due {}", utc(h.available_at_ms)));
        }
        if !h.owner.is_empty() {
            line.push_str(&format!(", owner {}", h.owner));
        }
        if h.replays > 0 {
            line.push_str(&format!(", replayed {}x", h.replays));
        }
        outln!("{line}");
        if !h.last_error.is_empty() {
            outln!("  {:<20} last error: {}", "", h.last_error);
        }
    }
    for replay in &explained.replays {
        print_row(&format!("replay for {}", replay.replay_handler), replay);
    }
    for a in &explained.actions {
        outln!(
            "action: {} {} for {} by {} (it had {} attempt(s); last error: {})",
            utc(a.at_ms),
            a.action,
            a.handler,
            a.operator,
            a.attempts,
            if a.last_error.is_empty() { "-" } else { &a.last_error }
        );
    }
    Ok(())
}

fn print_row(what: &str, row: &v1::OutboxRowState) {
    let mut line = format!(
        "{what}: row {} {} {} (aggregate {}), written {}",
        row.id,
        row.event_type,
        row.status,
        if row.aggregate_id.is_empty() { "-" } else { &row.aggregate_id },
        utc(row.created_at_ms)
    );
    if row.stream_sequence > 0 {
        line.push_str(&format!(", stream sequence {}", row.stream_sequence));
    }
    if row.attempts > 0 {
        line.push_str(&format!(", {} attempt(s)", row.attempts));
    }
    if !row.claimed_by.is_empty() && row.status == "processing" {
        line.push_str(&format!(", claimed by {} at {}", row.claimed_by, utc(row.claimed_at_ms)));
    }
    outln!("{line}");
    if !row.last_error.is_empty() {
        outln!("  last error: {}", row.last_error);
    }
}
