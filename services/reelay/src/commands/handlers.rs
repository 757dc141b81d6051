//! `reelay handlers retire <name>`: forget a handler the write service no longer delivers to
//! (removed from the build, or left out of its --handler list). On the db backend its cursor
//! would hold outbox retention back for ever; its dead letters and open deliveries are
//! discarded, recorded with the operator's name (`REELAY_OPERATOR`, else `$USER`).

use clap::{Args, Subcommand};
use reelay_contracts::v1::{self, admin_client::AdminClient};
use reelay_delivery::jetstream::JetStreamConfig;

use super::{ClientArgs, call_failed, operator_name, outln};

#[derive(Debug, Subcommand)]
pub enum HandlersCommand {
    /// Forget a handler the write service no longer delivers to: its cursor, dead letters and
    /// open deliveries (`reelay status` marks such a handler "not delivered").
    Retire(RetireArgs),
}

#[derive(Debug, Args)]
pub struct RetireArgs {
    /// The handler's name.
    pub handler: String,

    /// The event stream on the nats backend, whose consumer of the handler is named in the
    /// note printed after (the command leaves it).
    #[arg(long, env = "REELAY_STREAM", default_value = "REELAY_EVENTS")]
    pub stream: String,

    #[command(flatten)]
    pub client: ClientArgs,
}

pub async fn run(command: HandlersCommand) -> anyhow::Result<()> {
    match command {
        HandlersCommand::Retire(args) => retire(args).await,
    }
}

async fn retire(args: RetireArgs) -> anyhow::Result<()> {
    let operator = operator_name()?;
    let mut admin = AdminClient::new(args.client.write()?);
    let retired = admin
        .retire_handler(v1::RetireHandlerRequest { handler: args.handler.clone(), operator })
        .await
        .map_err(|s| call_failed("handlers retire", s))?
        .into_inner();
    outln!(
        "retired {}: {} dead letter(s) and {} open deliveries discarded, its cursor dropped",
        args.handler,
        retired.dead_letters_discarded,
        retired.open_discarded
    );
    outln!("{}", consumer_left(&args.stream, &args.handler));
    Ok(())
}

/// The note on the handler's JetStream consumer, which retiring leaves, with the command that
/// removes it from the configured stream.
fn consumer_left(stream: &str, handler: &str) -> String {
    format!(
        "(on nats its JetStream consumer is left: nats consumer rm {stream} {})",
        JetStreamConfig::consumer_name(handler)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_consumer_note_names_the_configured_stream() {
        use clap::Parser;
        let parsed = crate::config::Cli::try_parse_from(["reelay", "handlers", "retire", "search", "--stream", "EV2"]);
        let Ok(crate::config::Cli { command: crate::config::Command::Handlers(HandlersCommand::Retire(args)), .. }) =
            parsed
        else {
            panic!("parsed: {parsed:?}");
        };
        assert_eq!(
            consumer_left(&args.stream, &args.handler),
            "(on nats its JetStream consumer is left: nats consumer rm EV2 handler-search)"
        );
    }
}
