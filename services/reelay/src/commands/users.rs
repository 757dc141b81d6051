//! `reelay users create <handle>`: prints the new user's id alone on stdout (for scripts), and
//! a line for people on stderr.

use clap::{Args, Subcommand};
use reelay_contracts::v1::{self, users_client::UsersClient};

use super::{ClientArgs, errln, keyed_write, outln, request_id_or_new};

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

    /// The write's idempotency key (a new one when not given): the same command with the same
    /// key creates the user at most once, and answers with it.
    #[arg(long)]
    pub request_id: Option<String>,

    #[command(flatten)]
    pub client: ClientArgs,
}

pub async fn run(command: UsersCommand) -> anyhow::Result<()> {
    let UsersCommand::Create(args) = command;
    let users = UsersClient::new(args.client.write()?);
    let request_id = request_id_or_new(args.request_id);
    let request = v1::CreateUserRequest {
        display_name: args.name.unwrap_or_else(|| args.handle.clone()),
        handle: args.handle,
        request_id: request_id.clone(),
    };
    let user = keyed_write("users create", &request_id, || {
        let (mut users, request) = (users.clone(), request.clone());
        async move { users.create_user(request).await }
    })
    .await?;
    errln!("created user @{} ({})", user.handle, user.display_name);
    outln!("{}", user.user_id);
    Ok(())
}
