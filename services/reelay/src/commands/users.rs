//! `reelay users create <handle>`: prints the new user's id alone on stdout (for scripts), and
//! a line for people on stderr.

use clap::{Args, Subcommand};
use reelay_contracts::v1::{self, users_client::UsersClient};

use super::{ClientArgs, call_failed};

#[derive(Debug, Subcommand)]
pub enum UsersCommand {
    /// Create a user; prints its id.
    Create(CreateArgs),
}

#[derive(Debug, Args)]
pub struct CreateArgs {
    /// 1-30 of a-z, 0-9 and '_'; unique.
    pub handle: String,

    /// The name shown to others; the handle when not given.
    #[arg(long)]
    pub name: Option<String>,

    #[command(flatten)]
    pub client: ClientArgs,
}

pub async fn run(command: UsersCommand) -> anyhow::Result<()> {
    let UsersCommand::Create(args) = command;
    let mut users = UsersClient::new(args.client.write()?);
    let user = users
        .create_user(v1::CreateUserRequest {
            display_name: args.name.unwrap_or_else(|| args.handle.clone()),
            handle: args.handle,
            request_id: String::new(),
        })
        .await
        .map_err(|s| call_failed("users create", s))?
        .into_inner();
    eprintln!("created user @{} ({})", user.handle, user.display_name);
    println!("{}", user.user_id);
    Ok(())
}
