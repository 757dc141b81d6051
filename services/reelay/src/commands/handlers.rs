//! `reelay handlers retire <name>`: forget a handler the write service no longer delivers to
//! (removed from the build, or left out of its --handler list). On the db backend its cursor
//! would hold outbox retention back for ever; its dead letters and open deliveries are
//! discarded, recorded with the operator's name (`REELAY_OPERATOR`, else `$USER`).

use clap::{Args, Subcommand};
use reelay_contracts::v1::{self, admin_client::AdminClient};

use super::{ClientArgs, call_failed, operator_name};

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

    #[command(flatten)]
    pub client: ClientArgs,
}

pub async fn run(command: HandlersCommand) -> anyhow::Result<()> {
    match command {
        HandlersCommand::Retire(args) => retire(args).await,
    }
}

async fn retire(args: RetireArgs) -> anyhow::Result<()> {
    let mut admin = AdminClient::new(args.client.write()?);
    let retired = admin
        .retire_handler(v1::RetireHandlerRequest { handler: args.handler.clone(), operator: operator_name() })
        .await
        .map_err(|s| call_failed("handlers retire", s))?
        .into_inner();
    println!(
        "retired {}: {} dead letter(s) and {} open deliveries discarded, its cursor dropped",
        args.handler, retired.dead_letters_discarded, retired.open_discarded
    );
    println!("(on nats its JetStream consumer is left: nats consumer rm REELAY_EVENTS handler-{})", args.handler);
    Ok(())
}
