//! Local users' key pairs. The private key is read only to sign (by the Federation API in this
//! process); nothing returns it.

use reelay_activitypub::keys::GeneratedKey;
use reelay_domain::UserId;
use reelay_outbox::WriteTx;
use sqlx::{Row, SqliteConnection};

use super::{Result, Store, write_job};

async fn insert_actor_key(conn: &mut SqliteConnection, user_id: &str, key: &GeneratedKey, at: i64) -> Result<bool> {
    let inserted = sqlx::query(
        "INSERT OR IGNORE INTO actor_keys (user_id, private_key, public_key_pem, created_at) \
         SELECT id, ?, ?, ? FROM users WHERE id = ?",
    )
    .bind(key.private_pkcs8_der.clone())
    .bind(key.public_key_pem.clone())
    .bind(at)
    .bind(user_id.to_owned())
    .execute(conn)
    .await?
    .rows_affected();
    Ok(inserted > 0)
}

impl Store {
    /// Users created before keys existed (or whose key was not yet generated), oldest first.
    pub async fn users_without_key(&self, limit: u32) -> Result<Vec<UserId>> {
        let rows = sqlx::query(
            "SELECT id FROM users WHERE NOT EXISTS (SELECT 1 FROM actor_keys k WHERE k.user_id = users.id) \
             ORDER BY created_at LIMIT ?",
        )
        .bind(i64::from(limit))
        .fetch_all(&self.db.reads)
        .await?;
        Ok(rows.iter().filter_map(|row| UserId::parse("user_id", row.get::<&str, _>(0)).ok()).collect())
    }

    /// Stores a user's key pair unless it has one already; false when it had (or the user is
    /// gone).
    pub async fn save_actor_key(&self, user: UserId, key: GeneratedKey) -> Result<bool> {
        write_job!(self, "save_actor_key", |tx| {
            let at = tx.now_ms();
            insert_actor_key(tx.conn(), &user.to_string(), &key, at).await
        })
        .await
    }

    /// The PKCS#8 DER private key of a user, for signing.
    pub async fn private_key(&self, user: UserId) -> Result<Option<Vec<u8>>> {
        Ok(sqlx::query("SELECT private_key FROM actor_keys WHERE user_id = ?")
            .bind(user.to_string())
            .fetch_optional(&self.db.reads)
            .await?
            .map(|row| row.get(0)))
    }
}
