//! `reelay dead-letters list|replay|discard`: the deliveries handlers gave up on. Replaying and
//! discarding change only what is still dead-lettered (two operators at once act once), and
//! each change is recorded with the operator's name (`REELAY_OPERATOR`, else `$USER`). Replay
//! and discard exit 0 when they changed something (or, with --all, found nothing to change), 1
//! when event ids were named and none of them changed, 2 when refused or failed.

use clap::{Args, Subcommand};
use reelay_contracts::v1::{self, admin_client::AdminClient};

use super::{ClientArgs, call_failed, operator_name, outln, parse_since, since_ms, utc};

#[derive(Debug, Subcommand)]
pub enum DeadLettersCommand {
    /// List dead letters, newest first.
    List(ListArgs),
    /// Deliver dead letters again (after fixing what made them fail), with fresh attempts.
    Replay(ActArgs),
    /// Give dead letters up for good.
    Discard(ActArgs),
}

#[derive(Debug, Args)]
pub struct ListArgs {
    /// Only this handler's (`relay`: events the relay gave up on nats, which reached no handler).
    #[arg(long)]
    pub handler: Option<String>,

    /// Only events of this type (e.g. ReviewLogged).
    #[arg(long = "type")]
    pub event_type: Option<String>,

    /// Only those given up within this long (90s, 15m, 2h, 7d).
    #[arg(long, value_parser = parse_since)]
    pub since: Option<std::time::Duration>,

    /// At most this many (1..=1000).
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub limit: u32,

    #[command(flatten)]
    pub client: ClientArgs,
}

#[derive(Debug, Args)]
pub struct ActArgs {
    /// Event ids; every handler's dead letters of them unless --handler is given.
    pub event_ids: Vec<String>,

    /// Only this handler's dead letters (required with --all; `relay`: events the relay gave
    /// up on nats, replayed to every handler).
    #[arg(long)]
    pub handler: Option<String>,

    /// Every dead letter of --handler.
    #[arg(long, requires = "handler", conflicts_with = "event_ids")]
    pub all: bool,

    #[command(flatten)]
    pub client: ClientArgs,
}

pub async fn run(command: DeadLettersCommand) -> anyhow::Result<()> {
    match command {
        DeadLettersCommand::List(args) => list(args).await,
        DeadLettersCommand::Replay(args) => act(args, true).await,
        DeadLettersCommand::Discard(args) => act(args, false).await,
    }
}

async fn list(args: ListArgs) -> anyhow::Result<()> {
    let mut admin = AdminClient::new(args.client.write()?);
    let since_ms = match args.since {
        Some(since) => {
            since_ms(reelay_kit::now_ms(), since).map_err(|e| anyhow::anyhow!("--since {}s {e}", since.as_secs()))?
        }
        None => 0,
    };
    let listed = admin
        .list_dead_letters(v1::ListDeadLettersRequest {
            handler: args.handler.unwrap_or_default(),
            event_type: args.event_type.unwrap_or_default(),
            since_ms,
            limit: args.limit,
        })
        .await
        .map_err(|s| call_failed("dead-letters list", s))?
        .into_inner();
    if listed.dead_letters.is_empty() {
        outln!("no dead letters");
        return Ok(());
    }
    outln!("{:<38} {:<16} {:<20} {:>8} {:<20} LAST ERROR", "EVENT", "HANDLER", "TYPE", "ATTEMPTS", "GIVEN UP (UTC)");
    for d in &listed.dead_letters {
        outln!(
            "{:<38} {:<16} {:<20} {:>8} {:<20} {}",
            d.event_id,
            d.handler,
            if d.event_type.is_empty() { "-" } else { &d.event_type },
            d.attempts,
            utc(d.dead_lettered_at_ms),
            d.last_error
        );
    }
    if listed.total > listed.dead_letters.len() as u64 {
        outln!("({} of {} shown; raise --limit or narrow the filters)", listed.dead_letters.len(), listed.total);
    }
    Ok(())
}

async fn act(args: ActArgs, replay: bool) -> anyhow::Result<()> {
    if !args.all && args.event_ids.is_empty() {
        anyhow::bail!("name the event ids, or pass --handler <name> --all");
    }
    let operator = operator_name()?;
    let mut admin = AdminClient::new(args.client.write()?);
    let handler = args.handler.unwrap_or_default();
    let request =
        v1::DeadLetterActionRequest { event_ids: args.event_ids, handler: handler.clone(), all: args.all, operator };
    let (verb, answer) = if replay {
        ("replayed", admin.replay_dead_letters(request).await.map_err(|s| call_failed("dead-letters replay", s))?)
    } else {
        ("discarded", admin.discard_dead_letters(request).await.map_err(|s| call_failed("dead-letters discard", s))?)
    };
    let answer = answer.into_inner();
    for k in &answer.changed {
        outln!("{verb} {} for {}", k.event_id, k.handler);
    }
    if answer.changed_total > answer.changed.len() as u64 {
        outln!("(and {} more {verb})", answer.changed_total - answer.changed.len() as u64);
    }
    for k in &answer.unchanged {
        let whom = if k.handler.is_empty() { String::new() } else { format!(" for {}", k.handler) };
        outln!("unchanged {}{whom}: not a dead letter (now)", k.event_id);
    }
    if answer.unchanged_total > answer.unchanged.len() as u64 {
        outln!("(and {} more unchanged)", answer.unchanged_total - answer.unchanged.len() as u64);
    }
    outln!("{} {verb}, {} unchanged", answer.changed_total, answer.unchanged_total);
    // Event ids named and none of them changed: a typo, or someone else acted first. A script
    // must not take that for done. (With --all, a handler with no dead letters left is.)
    if !args.all && answer.changed_total == 0 {
        let whose = if handler.is_empty() { String::new() } else { format!(" of {handler}") };
        return Err(super::Exit {
            status: 1,
            message: format!(
                "nothing {verb}: none of the named events has a dead letter{whose} now (a mistyped id, or one \
                 replayed or discarded already; `reelay dead-letters list` lists them)"
            ),
        }
        .into());
    }
    Ok(())
}
