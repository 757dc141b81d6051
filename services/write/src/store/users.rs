//! Users: registering an account and reading it back.

use reelay_contracts::v1::{self, event::Payload};
use reelay_domain::{NewEvent, UserId};
use reelay_kit::ServiceError;
use reelay_outbox::WriteTx;
use sqlx::Row;

use super::{Result, Store, UserRow, commit_events, keyed_job};
use crate::convert;
use crate::request_ids::RequestKey;

impl Store {
    /// Registers a user (its key pair follows: see `actor_keys`).
    pub async fn create_user(&self, handle: String, display_name: String, key: Option<RequestKey>) -> Result<v1::User> {
        keyed_job!(self, "create_user", key, |tx| {
            let taken = sqlx::query("SELECT 1 FROM users WHERE handle = ?")
                .bind(handle.clone())
                .fetch_optional(tx.conn())
                .await?;
            if taken.is_some() {
                return Err(ServiceError::already_exists(format!("handle: @{handle} is taken")).into());
            }
            let user = UserRow { id: UserId::new().to_string(), handle, display_name, created_at: tx.now_ms() };
            sqlx::query("INSERT INTO users (id, handle, display_name, created_at) VALUES (?, ?, ?, ?)")
                .bind(user.id.clone())
                .bind(user.handle.clone())
                .bind(user.display_name.clone())
                .bind(user.created_at)
                .execute(tx.conn())
                .await?;
            let event = NewEvent::new(
                &user.id,
                Payload::UserRegistered(v1::UserRegistered {
                    user_id: user.id.clone(),
                    handle: user.handle.clone(),
                    display_name: user.display_name.clone(),
                }),
            );
            commit_events(tx, vec![event]).await?;
            Ok(convert::user(user))
        })
        .await
    }

    pub async fn get_user(&self, id: UserId) -> Result<UserRow> {
        sqlx::query_as("SELECT id, handle, display_name, created_at FROM users WHERE id = ?")
            .bind(id.to_string())
            .fetch_optional(&self.db.reads)
            .await?
            .ok_or_else(|| ServiceError::not_found(format_args!("user {id}")).into())
    }

    pub async fn user_by_handle(&self, handle: &str) -> Result<Option<UserId>> {
        let row = sqlx::query("SELECT id FROM users WHERE handle = ?")
            .bind(handle.to_owned())
            .fetch_optional(&self.db.reads)
            .await?;
        Ok(row.and_then(|row| UserId::parse("user_id", row.get::<&str, _>(0)).ok()))
    }
}
